#include "tape.h"

#include "grow.h"
#include "offloop.h"

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

int pb_tapes_init(pb_tapes_t *t, size_t max_bytes, size_t max_bytes_per_uid, size_t max_bytes_per_device)
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
    t->max_bytes_per_device = max_bytes_per_device;
    return t->buckets ? 0 : PB_ENOMEM;
}

static void free_tape(pb_tape_t *tape)
{
    /* Its blocks were never in the connection budget: unmapped off the
     * loop (freed on it), they do not hold the buffering cap. */
    pb_offloop_uncounted(true);
    pb_tapedata_clear(&tape->data);
    pb_offloop_uncounted(false);
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
    if (!pb__grow((void **)&t->peers, t->npeers, &t->cappeers, sizeof *t->peers))
        return NULL;
    pb_peer_acct_t *p = &t->peers[t->npeers++];
    *p = (pb_peer_acct_t){.uid = uid};
    return p;
}

const pb_peer_acct_t *pb_tapes_peer(const pb_tapes_t *t, uid_t uid)
{
    return peer((pb_tapes_t *)t, uid, false);
}

/* The GPU ordinal of a tape on dev, -1 for the CPU. */
static int gpu_of(pb_device_t dev)
{
    return dev.kind == PB_DEV_CUDA ? dev.index : -1;
}

int pb_tapes_reserve(pb_tapes_t *t, uid_t uid, pb_device_t dev, size_t bytes, pb_err_t *err)
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
    int g = gpu_of(dev);
    if (g >= 0 && t->gpu_bytes[g] + t->gpu_reserved[g] + bytes > t->max_bytes_per_device)
        return pb_err_set(err, PB_ERESOURCE_EXHAUSTED, "max_device_tape_bytes",
                          "the tape would need %zu bytes; tapes on cuda:%d hold %zu of max_device_tape_bytes %zu",
                          bytes, g, t->gpu_bytes[g] + t->gpu_reserved[g], t->max_bytes_per_device);
    p->reserved += bytes;
    t->reserved += bytes;
    if (g >= 0)
        t->gpu_reserved[g] += bytes;
    return 0;
}

void pb_tapes_unreserve(pb_tapes_t *t, uid_t uid, pb_device_t dev, size_t bytes)
{
    pb_peer_acct_t *p = peer(t, uid, false);
    if (p)
        p->reserved -= bytes;
    t->reserved -= bytes;
    if (gpu_of(dev) >= 0)
        t->gpu_reserved[gpu_of(dev)] -= bytes;
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
    pb_tapes_unreserve(t, uid, data->device, reserved);
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
    int g = gpu_of(tape->data.device);
    if (g >= 0) {
        t->gpu_tapes[g]++;
        t->gpu_bytes[g] += bytes;
    }
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
    int g = gpu_of(tape->data.device);
    if (g >= 0) {
        t->gpu_tapes[g]--;
        t->gpu_bytes[g] -= tape->bytes;
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

/* ---- lifecycle ----------------------------------------------------------- */

static bool expired(const pb_tape_t *tape, uint64_t now)
{
    return now >= tape->expires_ms;
}

static void unlink_tape(pb_tape_t *tape)
{
    pb_tape_list_t *l = tape->owner;
    if (l == NULL)
        return;
    if (tape->cprev)
        tape->cprev->cnext = tape->cnext;
    else
        l->head = tape->cnext;
    if (tape->cnext)
        tape->cnext->cprev = tape->cprev;
    tape->cprev = tape->cnext = NULL;
    tape->owner = NULL;
    l->n--;
}

void pb_tape_link(pb_tape_t *tape, pb_tape_list_t *l)
{
    tape->owner = l;
    tape->cnext = l->head;
    if (l->head)
        l->head->cprev = tape;
    l->head = tape;
    l->n++;
}

bool pb_tape_idle(const pb_tape_t *tape)
{
    return !tape->busy && tape->wait_head == NULL;
}

void pb_tapes_free(pb_tapes_t *t, pb_tape_t *tape)
{
    pb_tape_waiter_t *w = tape->wait_head;
    tape->wait_head = tape->wait_tail = NULL;
    unlink_tape(tape);
    pb_tapes_remove(t, tape);
    while (w) {
        pb_tape_waiter_t *n = w->next;
        w->run(w, NULL);
        w = n;
    }
}

pb_tape_t *pb_tapes_lookup(pb_tapes_t *t, uint64_t handle, uid_t uid, const pb_tape_list_t *l, uint64_t now)
{
    pb_tape_t *tape = pb_tapes_find(t, handle);
    if (tape == NULL || tape->doomed)
        return NULL;
    if (tape->peer_scope ? tape->uid != uid : tape->owner != l)
        return NULL;
    if (pb_tape_idle(tape) && expired(tape, now)) {
        pb_tapes_free(t, tape);
        return NULL;
    }
    return tape;
}

void pb_tape_wait(pb_tape_t *tape, pb_tape_waiter_t *w)
{
    w->next = NULL;
    if (tape->wait_tail)
        tape->wait_tail->next = w;
    else
        tape->wait_head = w;
    tape->wait_tail = w;
}

void pb_tapes_done(pb_tapes_t *t, pb_tape_t *tape, bool consumed, uint64_t now)
{
    tape->busy = false;
    if (tape->doomed || consumed) {
        pb_tapes_free(t, tape);
        return;
    }
    tape->expires_ms = now + tape->ttl_ms;
    while (!tape->busy && tape->wait_head) {
        pb_tape_waiter_t *w = tape->wait_head;
        tape->wait_head = w->next;
        if (tape->wait_head == NULL)
            tape->wait_tail = NULL;
        /* Handles are never reused, so a tape the waiter freed (a release,
         * or a reverse that ran inline and consumed it) is not found. */
        uint64_t h = tape->handle;
        w->run(w, tape);
        if (pb_tapes_find(t, h) != tape)
            return;
    }
}

void pb_tapes_list_closed(pb_tapes_t *t, pb_tape_list_t *l)
{
    while (l->head) {
        pb_tape_t *tape = l->head;
        unlink_tape(tape);
        if (tape->peer_scope)
            continue;
        if (tape->busy)
            tape->doomed = true;
        else
            pb_tapes_free(t, tape);
    }
}

typedef struct sweep_ctx {
    pb_tapes_t *t;
    uint64_t now;
} sweep_ctx_t;

static void sweep_one(pb_tape_t *tape, void *ctx)
{
    sweep_ctx_t *s = ctx;
    if (pb_tape_idle(tape) && expired(tape, s->now))
        pb_tapes_free(s->t, tape);
}

void pb_tapes_sweep(pb_tapes_t *t, uint64_t now)
{
    sweep_ctx_t ctx = {t, now};
    pb_tapes_foreach(t, sweep_one, &ctx);
}
