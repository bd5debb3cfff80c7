/* Tapes: the table of handles to the tapes the server holds, and their
 * lifecycle (scopes, the queue of requests waiting on a busy tape, expiry,
 * the links to the connection that created them).
 *
 * Glossary
 *   tape     the saved state of one augmented forward (pb_tapedata_t) plus
 *            its bookkeeping: owner, scope, uid, expiry, bytes.
 *   handle   the integer a client holds, in [1, 2^53 - 1] so that it is
 *            exact in a double.  It is a keyed bijection on 53 bits of
 *            (random 13-bit per-run epoch, 40-bit serial), so handles are
 *            never reused within a run, look random, and a handle from
 *            another run or a forged one finds nothing (unknown_tape).
 *   scope    connection: visible to and freed with its connection;
 *            peer: visible to every connection of the same uid, kept until
 *            used, released or expired.
 *   busy     a reverse is running on the tape; later requests that touch
 *            it wait in its queue, in the order they were sent.
 *   waiter   a request in that queue (pb_tape_waiter_t, embedded in the
 *            request): tape.c calls it back when its turn comes or the
 *            tape is gone, and never names the request layer.
 *   doomed   its connection closed while a reverse ran on it: freed when
 *            that reverse ends.
 *   list     the tapes one connection created (pb_tape_list_t, carried by
 *            the connection): connection-scoped tapes die with it.
 *
 * Ownership: the table owns every tape and, through it, the tapedata's
 * tensors; pb_tapes_remove and pb_tapes_free free both.  A tape's list
 * and waiters are not its own: it only links them.  Byte accounting (total and per
 * uid) covers held tapes and reservations made before a forward runs, so
 * concurrent forwards cannot overshoot a limit. */
#ifndef PB_TAPE_H
#define PB_TAPE_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "../cuda/gpu.h"
#include "../kernels/op.h"

struct pb_tape;

/* The tapes of one connection.  n counts them plus the augmented forwards
 * of that connection still running (each adds one tape). */
typedef struct pb_tape_list {
    struct pb_tape *head;
    size_t n;
} pb_tape_list_t;

/* A request waiting on a busy tape.  run(w, t) when its turn comes (t is
 * idle, not expired); run(w, NULL) when the tape went first (consumed,
 * released, its connection closed). */
typedef struct pb_tape_waiter {
    struct pb_tape_waiter *next;
    void (*run)(struct pb_tape_waiter *w, struct pb_tape *t);
} pb_tape_waiter_t;

typedef struct pb_tape {
    uint64_t handle;
    pb_tapedata_t data;
    size_t bytes;
    uid_t uid;
    bool peer_scope;
    pb_tape_list_t *owner;         /* creating connection's list; NULL once it closed */
    struct pb_tape *cprev, *cnext; /* in owner's list */
    uint64_t ttl_ms, expires_ms;
    bool busy;
    bool doomed;                   /* free when the running job ends */
    pb_tape_waiter_t *wait_head, *wait_tail;
    struct pb_tape *hnext;         /* hash chain */
} pb_tape_t;

typedef struct pb_peer_acct {
    uid_t uid;
    size_t tapes, bytes, reserved;
} pb_peer_acct_t;

typedef struct pb_tapes {
    pb_tape_t **buckets;
    size_t nbuckets, count;
    uint64_t epoch, key, serial;
    size_t bytes, reserved;
    size_t max_bytes, max_bytes_per_uid;
    /* The tapes held on each GPU (device memory), their bytes and bytes
     * reserved, and the cap on each GPU's tape bytes. */
    size_t gpu_tapes[PB_GPU_MAX_DEVICES], gpu_bytes[PB_GPU_MAX_DEVICES], gpu_reserved[PB_GPU_MAX_DEVICES];
    size_t max_bytes_per_device;
    pb_peer_acct_t *peers;
    size_t npeers, cappeers;
} pb_tapes_t;

int pb_tapes_init(pb_tapes_t *t, size_t max_bytes, size_t max_bytes_per_uid, size_t max_bytes_per_device);
/* Free every tape (waiters must be gone) and the table. */
void pb_tapes_destroy(pb_tapes_t *t);
/* Reserve bytes for a tape of uid on dev (a GPU's tapes count against its
 * own cap too): PB_ERESOURCE_EXHAUSTED naming the limit, or 0. */
int pb_tapes_reserve(pb_tapes_t *t, uid_t uid, pb_device_t dev, size_t bytes, pb_err_t *err);
void pb_tapes_unreserve(pb_tapes_t *t, uid_t uid, pb_device_t dev, size_t bytes);
/* Turn a reservation into a held tape moved from *data.  NULL on ENOMEM
 * (the reservation is dropped and data is left to the caller). */
pb_tape_t *pb_tapes_insert(pb_tapes_t *t, uid_t uid, size_t reserved, pb_tapedata_t *data);
pb_tape_t *pb_tapes_find(const pb_tapes_t *t, uint64_t handle);
void pb_tapes_remove(pb_tapes_t *t, pb_tape_t *tape);
const pb_peer_acct_t *pb_tapes_peer(const pb_tapes_t *t, uid_t uid);
/* Visit every tape; the callback may remove the tape it is given. */
void pb_tapes_foreach(pb_tapes_t *t, void (*fn)(pb_tape_t *, void *), void *ctx);

/* ---- lifecycle (loop thread; now: the loop's clock in ms) ---------------- */

/* The tape behind handle as a connection of uid with tape list l may see
 * it (peer scope: same uid; connection scope: same list), or NULL.  An
 * idle expired tape is freed on the way. */
pb_tape_t *pb_tapes_lookup(pb_tapes_t *t, uint64_t handle, uid_t uid, const pb_tape_list_t *l, uint64_t now);
/* Free tape and call its waiters with NULL. */
void pb_tapes_free(pb_tapes_t *t, pb_tape_t *tape);
/* Link a new tape into its connection's list (n counts it). */
void pb_tape_link(pb_tape_t *tape, pb_tape_list_t *l);
/* Neither busy nor with waiters: a request may use it now. */
bool pb_tape_idle(const pb_tape_t *tape);
/* Queue w behind the requests already waiting on tape. */
void pb_tape_wait(pb_tape_t *tape, pb_tape_waiter_t *w);
/* The reverse that made tape busy ended: free it when doomed or consumed,
 * else restart its ttl and run its waiters in order until one makes it
 * busy or frees it. */
void pb_tapes_done(pb_tapes_t *t, pb_tape_t *tape, bool consumed, uint64_t now);
/* A connection closed: free its connection-scoped tapes (doom the busy
 * ones) and detach the peer-scoped ones. */
void pb_tapes_list_closed(pb_tapes_t *t, pb_tape_list_t *l);
/* Free the idle tapes whose ttl has passed. */
void pb_tapes_sweep(pb_tapes_t *t, uint64_t now);

#endif
