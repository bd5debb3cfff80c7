#include "tape.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

/* A keyed bijection on 53 bits (xorshift-multiply rounds, each invertible
 * modulo 2^53): handles stay exact in a double, so JavaScript, Lua and
 * JSON-based clients send back the handle they were given. */
#define H_BITS 53
#define H_MASK ((UINT64_C(1) << H_BITS) - 1)
#define SERIAL_BITS 40
static uint64_t mix53(uint64_t x, uint64_t key)
{
    x = (x ^ key) & H_MASK;
    x ^= x >> 26;
    x = (x * 0xbf58476d1ce4e5b9ull) & H_MASK;
    x ^= x >> 27;
    x = (x * 0x94d049bb133111ebull) & H_MASK;
    x ^= x >> 26;
    return x;
}

int pb_tapes_init(pb_tapes_t *t, size_t max_bytes, size_t max_bytes_per_uid)
{
    memset(t, 0, sizeof *t);
    uint64_t r[2];
    if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r)
        return PB_EINTERNAL;
    t->epoch = r[0] & ((UINT64_C(1) << (H_BITS - SERIAL_BITS)) - 1);
    t->key = r[1];
    t->nbuckets = 1024;
    t->buckets = calloc(t->nbuckets, sizeof *t->buckets);
    t->max_bytes = max_bytes;
    t->max_bytes_per_uid = max_bytes_per_uid;
    return t->buckets ? 0 : PB_ENOMEM;
}

static void free_tape(pb_tape_t *tape)
{
    pb_tapedata_clear(&tape->data);
    free(tape);
}

void pb_tapes_destroy(pb_tapes_t *t)
{
    for (size_t b = 0; b < t->nbuckets; b++) {
        pb_tape_t *p = t->buckets[b];
        while (p) {
            pb_tape_t *n = p->hnext;
            free_tape(p);
            p = n;
        }
    }
    free(t->buckets);
    free(t->peers);
    memset(t, 0, sizeof *t);
}

static pb_peer_acct_t *peer(pb_tapes_t *t, uid_t uid, bool create)
{
    for (size_t i = 0; i < t->npeers; i++)
        if (t->peers[i].uid == uid)
            return &t->peers[i];
    if (!create)
        return NULL;
    if (t->npeers == t->cappeers) {
        size_t cap = t->cappeers ? 2 * t->cappeers : 8;
        pb_peer_acct_t *p = realloc(t->peers, cap * sizeof *p);
        if (p == NULL)
            return NULL;
        t->peers = p;
        t->cappeers = cap;
    }
    pb_peer_acct_t *p = &t->peers[t->npeers++];
    *p = (pb_peer_acct_t){.uid = uid};
    return p;
}

const pb_peer_acct_t *pb_tapes_peer(const pb_tapes_t *t, uid_t uid)
{
    return peer((pb_tapes_t *)t, uid, false);
}

int pb_tapes_reserve(pb_tapes_t *t, uid_t uid, size_t bytes, pb_err_t *err)
{
    pb_peer_acct_t *p = peer(t, uid, true);
    if (p == NULL)
        return pb_err_set(err, PB_ENOMEM, NULL, "out of memory");
    if (t->bytes + t->reserved + bytes > t->max_bytes || t->bytes + t->reserved + bytes < bytes)
        return pb_err_set(err, PB_ERESOURCE_EXHAUSTED, "max_tape_bytes",
                          "the tape would need %zu bytes; %zu of max_tape_bytes %zu are held", bytes,
                          t->bytes + t->reserved, t->max_bytes);
    if (p->bytes + p->reserved + bytes > t->max_bytes_per_uid)
        return pb_err_set(err, PB_ERESOURCE_EXHAUSTED, "max_tape_bytes_per_uid",
                          "the tape would need %zu bytes; uid %u holds %zu of max_tape_bytes_per_uid %zu", bytes,
                          (unsigned)uid, p->bytes + p->reserved, t->max_bytes_per_uid);
    p->reserved += bytes;
    t->reserved += bytes;
    return 0;
}

void pb_tapes_unreserve(pb_tapes_t *t, uid_t uid, size_t bytes)
{
    pb_peer_acct_t *p = peer(t, uid, false);
    if (p)
        p->reserved -= bytes;
    t->reserved -= bytes;
}

static size_t bucket(const pb_tapes_t *t, uint64_t h)
{
    return (size_t)(mix53(h, 0x5851f42d4c957f2dull) & (t->nbuckets - 1));
}

static void grow(pb_tapes_t *t)
{
    size_t nb = t->nbuckets * 2;
    pb_tape_t **b = calloc(nb, sizeof *b);
    if (b == NULL)
        return; /* longer chains, still correct */
    pb_tape_t **old = t->buckets;
    size_t on = t->nbuckets;
    t->buckets = b;
    t->nbuckets = nb;
    for (size_t i = 0; i < on; i++) {
        pb_tape_t *p = old[i];
        while (p) {
            pb_tape_t *n = p->hnext;
            size_t k = bucket(t, p->handle);
            p->hnext = b[k];
            b[k] = p;
            p = n;
        }
    }
    free(old);
}

pb_tape_t *pb_tapes_insert(pb_tapes_t *t, uid_t uid, size_t reserved, pb_tapedata_t *data)
{
    pb_tape_t *tape = calloc(1, sizeof *tape);
    pb_peer_acct_t *p = peer(t, uid, true);
    size_t bytes = pb_tapedata_bytes(data);
    pb_tapes_unreserve(t, uid, reserved);
    if (tape == NULL || p == NULL) {
        free(tape);
        return NULL;
    }
    uint64_t h;
    do {
        t->serial++;
        h = mix53((t->epoch << SERIAL_BITS) | (t->serial & ((UINT64_C(1) << SERIAL_BITS) - 1)), t->key);
    } while (h == 0 || pb_tapes_find(t, h));
    tape->handle = h;
    tape->data = *data;
    memset(data, 0, sizeof *data);
    tape->bytes = bytes;
    tape->uid = uid;
    size_t k = bucket(t, h);
    tape->hnext = t->buckets[k];
    t->buckets[k] = tape;
    t->count++;
    t->bytes += bytes;
    p->tapes++;
    p->bytes += bytes;
    if (t->count > t->nbuckets)
        grow(t);
    return tape;
}

pb_tape_t *pb_tapes_find(const pb_tapes_t *t, uint64_t handle)
{
    for (pb_tape_t *p = t->buckets[bucket(t, handle)]; p; p = p->hnext)
        if (p->handle == handle)
            return p;
    return NULL;
}

void pb_tapes_remove(pb_tapes_t *t, pb_tape_t *tape)
{
    pb_tape_t **pp = &t->buckets[bucket(t, tape->handle)];
    while (*pp && *pp != tape)
        pp = &(*pp)->hnext;
    if (*pp == NULL)
        return;
    *pp = tape->hnext;
    t->count--;
    t->bytes -= tape->bytes;
    pb_peer_acct_t *p = peer(t, tape->uid, false);
    if (p) {
        p->tapes--;
        p->bytes -= tape->bytes;
    }
    free_tape(tape);
}

void pb_tapes_foreach(pb_tapes_t *t, void (*fn)(pb_tape_t *, void *), void *ctx)
{
    for (size_t b = 0; b < t->nbuckets; b++) {
        pb_tape_t *p = t->buckets[b];
        while (p) {
            pb_tape_t *n = p->hnext;
            fn(p, ctx);
            p = n;
        }
    }
}
