/* unit.tape: the tape table (daemon/tape.c): handles, epochs, limits and
 * byte accounting; and the tape lifecycle: scopes, expiry, the waiters of
 * a busy tape, and what a closing connection does to its tapes (also
 * tested end to end, e2e_daemon). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/tape.h"

#define CPU ((pb_device_t){PB_DEV_CPU, 0})

static pb_tapedata_t data_of(size_t bytes)
{
    pb_tapedata_t d;
    memset(&d, 0, sizeof d);
    uint64_t shape[1] = {bytes / 4}; /* f32: exactly bytes */
    assert_int_equal(pb_tensor_alloc(&d.saved[0], PB_F32, 1, shape, 'C', true), 0);
    return d;
}

static pb_tape_t *add(pb_tapes_t *t, uid_t uid, size_t bytes)
{
    pb_err_t err;
    if (pb_tapes_reserve(t, uid, CPU, bytes, &err))
        return NULL;
    pb_tapedata_t d = data_of(bytes);
    pb_tape_t *tape = pb_tapes_insert(t, uid, bytes, &d);
    assert_non_null(tape);
    return tape;
}

static void insert_find_remove(void **state)
{
    (void)state;
    pb_tapes_t t;
    assert_int_equal(pb_tapes_init(&t, 1 << 20, 1 << 20, SIZE_MAX), 0);
    pb_tape_t *a = add(&t, 1000, 400);
    pb_tape_t *b = add(&t, 1000, 800);
    assert_ptr_equal(pb_tapes_find(&t, a->handle), a);
    assert_ptr_equal(pb_tapes_find(&t, b->handle), b);
    assert_int_equal(t.count, 2);
    assert_int_equal(t.bytes, 1200);
    assert_int_equal(pb_tapes_peer(&t, 1000)->bytes, 1200);
    uint64_t ha = a->handle;
    pb_tapes_remove(&t, a);
    assert_null(pb_tapes_find(&t, ha));
    assert_int_equal(t.bytes, 800);
    assert_int_equal(pb_tapes_peer(&t, 1000)->tapes, 1);
    pb_tapes_destroy(&t);
}

/* Handles are never reused within a run, across many inserts and removes
 * and table growth. */
static void no_reuse(void **state)
{
    (void)state;
    pb_tapes_t t;
    assert_int_equal(pb_tapes_init(&t, SIZE_MAX / 2, SIZE_MAX / 2, SIZE_MAX), 0);
    enum { N = 20000 };
    uint64_t *seen = malloc(N * sizeof *seen);
    pb_tape_t *live[64] = {0};
    for (int i = 0; i < N; i++) {
        int slot = i % 64;
        if (live[slot])
            pb_tapes_remove(&t, live[slot]);
        live[slot] = add(&t, 1, 4);
        seen[i] = live[slot]->handle;
        assert_true(seen[i] != 0);
    }
    /* Sorted, all distinct. */
    for (int i = 1; i < N; i++)
        for (int j = i; j > 0 && seen[j - 1] > seen[j]; j--) {
            uint64_t x = seen[j];
            seen[j] = seen[j - 1];
            seen[j - 1] = x;
        }
    for (int i = 1; i < N; i++)
        assert_true(seen[i] != seen[i - 1]);
    free(seen);
    pb_tapes_destroy(&t);
}

/* Two runs (two tables) give unrelated handles: a handle of one is unknown
 * to the other even when the other holds as many tapes. */
static void epochs(void **state)
{
    (void)state;
    pb_tapes_t a, b;
    assert_int_equal(pb_tapes_init(&a, 1 << 20, 1 << 20, SIZE_MAX), 0);
    assert_int_equal(pb_tapes_init(&b, 1 << 20, 1 << 20, SIZE_MAX), 0);
    assert_true(a.epoch != b.epoch || a.key != b.key);
    uint64_t ha[100];
    for (int i = 0; i < 100; i++)
        ha[i] = add(&a, 1, 4)->handle;
    for (int i = 0; i < 100; i++)
        add(&b, 1, 4);
    for (int i = 0; i < 100; i++)
        assert_null(pb_tapes_find(&b, ha[i]));
    /* Forged neighbours of a real handle find nothing. */
    for (int i = 0; i < 100; i++) {
        assert_null(pb_tapes_find(&a, ha[i] + 1));
        assert_null(pb_tapes_find(&a, ha[i] ^ (1ull << 63)));
    }
    pb_tapes_destroy(&a);
    pb_tapes_destroy(&b);
}

static void limits(void **state)
{
    (void)state;
    pb_tapes_t t;
    pb_err_t err;
    assert_int_equal(pb_tapes_init(&t, 1000, 600, SIZE_MAX), 0);
    assert_non_null(add(&t, 1, 400));
    /* Per uid: 400 held + 400 > 600. */
    assert_int_equal(pb_tapes_reserve(&t, 1, CPU, 400, &err), PB_ERESOURCE_EXHAUSTED);
    assert_string_equal(err.arg, "max_tape_bytes_per_uid");
    /* Another uid may: 400 + 400 <= 1000 total. */
    assert_int_equal(pb_tapes_reserve(&t, 2, CPU, 400, &err), 0);
    /* Reservations count: 800 held or reserved, 300 more is over 1000. */
    assert_int_equal(pb_tapes_reserve(&t, 3, CPU, 300, &err), PB_ERESOURCE_EXHAUSTED);
    assert_string_equal(err.arg, "max_tape_bytes");
    pb_tapes_unreserve(&t, 2, CPU, 400);
    assert_int_equal(pb_tapes_reserve(&t, 3, CPU, 300, &err), 0);
    pb_tapes_unreserve(&t, 3, CPU, 300);
    assert_int_equal(t.reserved, 0);
    /* A zero-byte tape always fits. */
    assert_int_equal(pb_tapes_reserve(&t, 1, CPU, 0, &err), 0);
    pb_tapes_unreserve(&t, 1, CPU, 0);
    pb_tapes_destroy(&t);
}

static int visited;
static void count_and_remove(pb_tape_t *tape, void *ctx)
{
    visited++;
    pb_tapes_remove(ctx, tape);
}

static void foreach_remove(void **state)
{
    (void)state;
    pb_tapes_t t;
    assert_int_equal(pb_tapes_init(&t, 1 << 30, 1 << 30, SIZE_MAX), 0);
    for (int i = 0; i < 3000; i++)
        add(&t, (uid_t)(i % 3), 8);
    visited = 0;
    pb_tapes_foreach(&t, count_and_remove, &t);
    assert_int_equal(visited, 3000);
    assert_int_equal(t.count, 0);
    assert_int_equal(t.bytes, 0);
    for (uid_t u = 0; u < 3; u++)
        assert_int_equal(pb_tapes_peer(&t, u)->bytes, 0);
    pb_tapes_destroy(&t);
}

/* A tape of uid held by the connection with list l (NULL: none), scoped
 * to it unless peer, expiring at expires. */
static pb_tape_t *held(pb_tapes_t *t, uid_t uid, pb_tape_list_t *l, bool peer, uint64_t expires)
{
    pb_tape_t *tape = add(t, uid, 8);
    tape->peer_scope = peer;
    tape->ttl_ms = 100;
    tape->expires_ms = expires;
    if (l)
        pb_tape_link(tape, l);
    return tape;
}

static void scopes_and_expiry(void **state)
{
    (void)state;
    pb_tapes_t t;
    pb_tape_list_t mine = {0}, other = {0};
    assert_int_equal(pb_tapes_init(&t, 1 << 20, 1 << 20, SIZE_MAX), 0);
    pb_tape_t *c = held(&t, 7, &mine, false, 1000);
    pb_tape_t *p = held(&t, 7, &mine, true, 1000);
    uint64_t hc = c->handle, hp = p->handle;
    assert_int_equal(mine.n, 2);
    /* Connection scope: only its own connection sees it. */
    assert_ptr_equal(pb_tapes_lookup(&t, hc, 7, &mine, 0), c);
    assert_null(pb_tapes_lookup(&t, hc, 7, &other, 0));
    /* Peer scope: any connection of the same uid, no other uid. */
    assert_ptr_equal(pb_tapes_lookup(&t, hp, 7, &other, 0), p);
    assert_null(pb_tapes_lookup(&t, hp, 8, &other, 0));
    /* A busy tape is not freed for expiring; an idle expired one is, on
     * lookup or by the sweep. */
    c->busy = true;
    assert_ptr_equal(pb_tapes_lookup(&t, hc, 7, &mine, 5000), c);
    pb_tapes_sweep(&t, 5000);
    assert_int_equal(t.count, 1);
    assert_null(pb_tapes_find(&t, hp));
    c->busy = false;
    assert_null(pb_tapes_lookup(&t, hc, 7, &mine, 5000));
    assert_int_equal(t.count, 0);
    assert_int_equal(mine.n, 0);
    assert_null(mine.head);
    pb_tapes_destroy(&t);
}

typedef struct waiter {
    pb_tape_waiter_t w; /* first */
    pb_tape_t *got;
    int calls;
    bool take;          /* make the tape busy when its turn comes */
} waiter_t;

static void on_turn(pb_tape_waiter_t *w, pb_tape_t *tape)
{
    waiter_t *x = (waiter_t *)w;
    x->calls++;
    x->got = tape;
    if (tape && x->take)
        tape->busy = true;
}

static void waiters_in_order(void **state)
{
    (void)state;
    pb_tapes_t t;
    pb_tape_list_t mine = {0};
    assert_int_equal(pb_tapes_init(&t, 1 << 20, 1 << 20, SIZE_MAX), 0);
    pb_tape_t *tape = held(&t, 7, &mine, false, 1000);
    tape->busy = true;
    waiter_t a = {.w.run = on_turn, .take = true}, b = {.w.run = on_turn, .take = true};
    pb_tape_wait(tape, &a.w);
    pb_tape_wait(tape, &b.w);
    assert_false(pb_tape_idle(tape));
    /* The running reverse kept the tape: a's turn, and a makes it busy,
     * so b waits on; the ttl restarted. */
    pb_tapes_done(&t, tape, false, 50);
    assert_int_equal(a.calls, 1);
    assert_ptr_equal(a.got, tape);
    assert_int_equal(b.calls, 0);
    assert_int_equal(tape->expires_ms, 150);
    /* a consumed it: b hears the tape is gone. */
    pb_tapes_done(&t, tape, true, 60);
    assert_int_equal(b.calls, 1);
    assert_null(b.got);
    assert_int_equal(t.count, 0);
    assert_int_equal(mine.n, 0);
    pb_tapes_destroy(&t);
}

static void connection_closes(void **state)
{
    (void)state;
    pb_tapes_t t;
    pb_tape_list_t mine = {0};
    assert_int_equal(pb_tapes_init(&t, 1 << 20, 1 << 20, SIZE_MAX), 0);
    pb_tape_t *idle = held(&t, 7, &mine, false, 1000);
    pb_tape_t *busy = held(&t, 7, &mine, false, 1000);
    pb_tape_t *peer = held(&t, 7, &mine, true, 1000);
    uint64_t hi = idle->handle, hb = busy->handle;
    busy->busy = true;
    waiter_t w = {.w.run = on_turn};
    pb_tape_wait(busy, &w.w);
    pb_tapes_list_closed(&t, &mine);
    assert_null(mine.head);
    assert_int_equal(mine.n, 0);
    /* The idle one is gone, the busy one doomed, the peer one kept with
     * no owner. */
    assert_null(pb_tapes_find(&t, hi));
    assert_true(busy->doomed);
    assert_null(pb_tapes_lookup(&t, hb, 7, NULL, 0));
    assert_null(peer->owner);
    assert_ptr_equal(pb_tapes_lookup(&t, peer->handle, 7, NULL, 0), peer);
    /* The doomed tape goes when its reverse ends, even if kept, and its
     * waiter hears it is gone. */
    pb_tapes_done(&t, busy, false, 0);
    assert_null(pb_tapes_find(&t, hb));
    assert_int_equal(w.calls, 1);
    assert_null(w.got);
    assert_int_equal(t.count, 1);
    pb_tapes_destroy(&t);
}

/* What a tape keeps of an input (kernels/op.h's pb_tape_keep): a heap
 * tensor by reference; a tensor that is most of a received message by a
 * reference to the message, which then lives as long as the tape; a small
 * part of a message, or shared memory, by a copy. */
static int released;
static void on_release(void *ctx)
{
    released++;
    free(ctx);
}

static pb_tensor_t view_of(pb_storage_t *s, size_t offset, uint64_t n)
{
    pb_tensor_t t = {.dtype = PB_F64, .rank = 1, .order = 'C', .shape = {n}, .offset = offset};
    t.storage = pb_storage_ref(s);
    return t;
}

static void tape_keep(void **state)
{
    (void)state;
    size_t size = 1000 * 8 + 40;
    double *msg = malloc(size);
    for (int i = 0; i < 1005; i++)
        msg[i] = i;
    released = 0;
    pb_storage_t *s = pb_storage_view(msg, size, on_release, msg);
    assert_non_null(s);
    pb_tensor_t big = view_of(s, 40, 990), small = view_of(s, 8, 100), kept_big = {0}, kept_small = {0};
    assert_int_equal(pb_tape_keep(&kept_big, &big), 0);
    assert_ptr_equal(kept_big.storage, s); /* no copy */
    assert_int_equal(pb_tape_keep(&kept_small, &small), 0);
    assert_ptr_not_equal(kept_small.storage, s); /* a copy of its own */
    assert_int_equal(kept_small.storage->kind, PB_STORAGE_HEAP);
    assert_true(((double *)pb_tensor_data(&kept_small))[0] == 1.0);
    /* The request lets its message go; the tape's reference keeps it. */
    pb_tensor_clear(&big);
    pb_tensor_clear(&small);
    pb_storage_unref(s);
    assert_int_equal(released, 0);
    assert_true(((double *)pb_tensor_data(&kept_big))[989] == 994.0);
    pb_tensor_clear(&kept_small);
    assert_int_equal(released, 0);
    pb_tensor_clear(&kept_big);
    assert_int_equal(released, 1);
    /* A heap tensor that is its whole storage: the same storage. */
    pb_tensor_t h = {0}, kh = {0};
    uint64_t shape[1] = {10};
    assert_int_equal(pb_tensor_alloc(&h, PB_F64, 1, shape, 'C', true), 0);
    assert_int_equal(pb_tape_keep(&kh, &h), 0);
    assert_ptr_equal(kh.storage, h.storage);
    pb_tensor_clear(&h);
    pb_tensor_clear(&kh);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(insert_find_remove), cmocka_unit_test(no_reuse), cmocka_unit_test(epochs),
        cmocka_unit_test(limits), cmocka_unit_test(foreach_remove),
        cmocka_unit_test(scopes_and_expiry), cmocka_unit_test(waiters_in_order),
        cmocka_unit_test(connection_closes), cmocka_unit_test(tape_keep),
    };
    return cmocka_run_group_tests_name("unit.tape", tests, NULL, NULL);
}
