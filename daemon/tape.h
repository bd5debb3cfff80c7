/* The tape table: handles to the tapes the server holds.
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
 *
 * Ownership: the table owns every tape and, through it, the tapedata's
 * tensors; pb_tapes_remove frees both.  Byte accounting (total and per
 * uid) covers held tapes and reservations made before a forward runs, so
 * concurrent forwards cannot overshoot a limit. */
#ifndef PB_TAPE_H
#define PB_TAPE_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "../kernels/op.h"

struct pb_req;
struct pb_conn;

typedef struct pb_tape {
    uint64_t handle;
    pb_tapedata_t data;
    size_t bytes;
    uid_t uid;
    bool peer_scope;
    struct pb_conn *owner;         /* creating connection; NULL once it closed */
    struct pb_tape *cprev, *cnext; /* in owner's list */
    uint64_t ttl_ms, expires_ms;
    bool busy;
    bool doomed;                   /* free when the running job ends */
    struct pb_req *wait_head, *wait_tail;
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
    pb_peer_acct_t *peers;
    size_t npeers, cappeers;
} pb_tapes_t;

int pb_tapes_init(pb_tapes_t *t, size_t max_bytes, size_t max_bytes_per_uid);
/* Free every tape (waiters must be gone) and the table. */
void pb_tapes_destroy(pb_tapes_t *t);
/* Reserve bytes for a tape of uid: PB_ERESOURCE_EXHAUSTED naming the
 * limit, or 0. */
int pb_tapes_reserve(pb_tapes_t *t, uid_t uid, size_t bytes, pb_err_t *err);
void pb_tapes_unreserve(pb_tapes_t *t, uid_t uid, size_t bytes);
/* Turn a reservation into a held tape moved from *data.  NULL on ENOMEM
 * (the reservation is dropped and data is left to the caller). */
pb_tape_t *pb_tapes_insert(pb_tapes_t *t, uid_t uid, size_t reserved, pb_tapedata_t *data);
pb_tape_t *pb_tapes_find(const pb_tapes_t *t, uint64_t handle);
void pb_tapes_remove(pb_tapes_t *t, pb_tape_t *tape);
const pb_peer_acct_t *pb_tapes_peer(const pb_tapes_t *t, uid_t uid);
/* Visit every tape; the callback may remove the tape it is given. */
void pb_tapes_foreach(pb_tapes_t *t, void (*fn)(pb_tape_t *, void *), void *ctx);

#endif
