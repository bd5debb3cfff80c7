/* Requests: the pb_req_t that carries one message from decoding to reply,
 * and the parsing of the params of forward, augmented_forward, check and the
 * cotangents of reverse, turned into a validated call, with the error the
 * contract asks for (code, argument, message) for anything wrong.
 *
 * Pure functions of the message and the configuration: no server state,
 * no allocation beyond the tensors they decode, so the loop thread and
 * the fuzz target (tests/fuzz) run exactly the same checks.
 *
 * Tensors may also lie in the connection's shared-memory buffers (contract
 * section 6), found through a resolver (codec.h), and results may be sent
 * into such buffers instead of the reply (pb_into_t).
 *
 * Ownership: tensors decoded into c->in[] or cot[] hold references on msg
 * (or copies, or on a buffer's mapping) and belong to the caller, also when
 * an error is returned; pb_call_clear / pb_tensor_clear drop them.  Each
 * pb_into_t with a storage holds a reference on that buffer's mapping,
 * also the caller's; pb_into_clear drops them.  A pb_req_t is allocated
 * and freed by rpc.c (see rpc.h); what its per-method part owns is said
 * there. */
#ifndef PB_REQUEST_H
#define PB_REQUEST_H

#include <msgpack.h>
#include <stdbool.h>
#include <stdint.h>

#include "../kernels/op.h"
#include "../proto/codec.h"
#include "config.h"
#include "pool.h"
#include "tape.h"

typedef enum pb_call_kind { PB_CALL_FORWARD, PB_CALL_AUGMENTED, PB_CALL_CHECK } pb_call_kind_t;

/* Where one result goes instead of the reply: into {buffer, offset}. */
typedef struct pb_into {
    pb_storage_t *storage; /* a reference on the buffer's mapping; NULL: the result goes in the reply */
    uint64_t buffer;       /* the buffer's id, for the reply */
    size_t offset;         /* byte offset of element 0 in the buffer */
    size_t room;           /* the bytes checked in the buffer: the most the result may take */
} pb_into_t;

/* What a call's params say besides the call itself. */
typedef struct pb_call_extra {
    bool peer_scope;    /* augmented_forward: scope "peer" */
    uint64_t ttl_ms;    /* augmented_forward: ttl_s, or the default */
    uint64_t seed;      /* check */
    size_t reply_bytes; /* the bytes of the outputs that go in the reply */
    pb_into_t into[PB_MAX_IO]; /* forward, augmented_forward: by output index */
} pb_call_extra_t;

/* ---- the request --------------------------------------------------------- */

struct pb_rpc;
struct pb_conn;
typedef struct pb_req pb_req_t;

/* Which part of the union a request uses: what req_free drops. */
typedef enum pb_req_kind {
    PB_REQ_SIMPLE,  /* hello, ops, stats, drain, shutdown, buffers: no tensors */
    PB_REQ_CALL,    /* forward, augmented_forward, check: u.call */
    PB_REQ_REVERSE, /* reverse: u.rev */
    PB_REQ_RELEASE, /* release: u.rel */
    PB_REQ_TEXT,    /* metrics: u.text */
} pb_req_kind_t;

struct pb_req {
    /* The common head: every method. */
    pb_job_t job;                  /* first: the pool hands it back */
    pb_tape_waiter_t wait;         /* reverse, release: queued on a busy tape */
    struct pb_rpc *rpc;
    struct pb_conn *conn;          /* a reference, dropped when answered */
    uint32_t msgid;
    bool notify;
    int method;                    /* metrics slot (rpc.h's method_names) */
    uint64_t t0_ns;                /* arrival (uv_hrtime), for the latency */
    pb_req_kind_t kind;
    void (*encode)(pb_req_t *, pb_out_t *); /* the result of a successful request */
    int rc;
    pb_err_t err;
    size_t conn_reserved;          /* counted in the connection's reserved: message, then reply */
    size_t gpu_reserved;           /* device bytes reserved on its GPU while it runs (rpc.h) */
    /* Results written into buffers instead of the reply (forward,
     * augmented_forward, reverse), by output or wrt index; into_meta is
     * what was written (dtype, shape, order; no storage), for the reply.
     * The into references are the request's. */
    pb_into_t into[PB_MAX_IO + 2];
    pb_tensor_t into_meta[PB_MAX_IO + 2];
    bool accumulate;
    union {
        /* forward, augmented_forward, check.  Owns call's tensors and
         * tdata until the tape table takes it. */
        struct pb_req_call {
            pb_call_t call;
            pb_tapedata_t tdata;
            bool peer_scope;
            uint64_t ttl_ms;
            size_t reserved;       /* tape bytes reserved in the table */
            pb_tape_t *made;       /* the tape augmented_forward created */
            uint64_t seed;         /* check */
            double max_rel, per_input[PB_MAX_IO + 2]; /* check's results */
        } call;
        /* reverse.  Owns cot and grad. */
        struct pb_req_reverse {
            uint64_t handle;
            pb_tape_t *tape;       /* while it runs on the tape */
            const pb_op_t *op;     /* the tape's op and wrt, for the reply */
            unsigned wrt;
            bool keep;
            char order;
            pb_tensor_t cot[PB_MAX_IO];
            pb_tensor_t grad[PB_MAX_IO + 2];
            pb_warnings_t warn;
        } rev;
        /* release */
        struct pb_req_release {
            uint64_t handle;
            bool released;
        } rel;
        /* register_buffer: the new id */
        uint64_t buffer;
        /* metrics: the exposition text (malloc, the request's) */
        struct {
            char *ptr;
            size_t len;
        } text;
    } u;
};
typedef struct pb_req_call pb_req_call_t;
typedef struct pb_req_reverse pb_req_reverse_t;

/* Every key of params must be one of allowed (NULL-terminated). */
int pb_request_check_keys(const msgpack_object *params, const char *const *allowed, pb_err_t *err);
/* params' "order": 'C' (absent) or 'F'. */
int pb_request_order(const msgpack_object *params, char *order, pb_err_t *err);
/* A tensor in a GPU buffer (storage s; NULL or host memory: fine) is used
 * by calls on that GPU only: else invalid_argument naming what. */
int pb_request_on_device(const pb_storage_t *s, pb_device_t dev, const char *what, pb_err_t *err);
/* params' "device" ("cpu", "cuda", "cuda:N"), dflt when absent; one this
 * daemon does not have is device_unavailable. */
int pb_request_device(const msgpack_object *params, pb_device_t dflt, pb_device_t *dev, pb_err_t *err);
/* {op, inputs, options?, device?, order?, into?, accumulate?, wrt, scope?,
 * ttl_s?, seed?} as kind allows, into c and x (both zeroed by the caller):
 * decoded (buffers through res; NULL: none), the op's validate run, the
 * into targets checked against the outputs' shapes, the size of the
 * outputs that go in the reply checked against cfg's max_message_bytes.
 * accumulate is reverse's: true here is invalid_argument. */
int pb_request_call(const pb_config_t *cfg, const msgpack_object *params, pb_storage_t *msg, const pb_resolver_t *res,
                    pb_call_kind_t kind, pb_call_t *c, pb_call_extra_t *x, pb_err_t *err);
/* cots (NULL: none) against the outputs of tape t: cot[] by output index,
 * dtype and shape checked. */
int pb_request_cotangents(const pb_tapedata_t *t, const msgpack_object *cots, pb_storage_t *msg,
                          const pb_resolver_t *res, pb_tensor_t *cot, pb_err_t *err);
/* into (NULL: absent): a map from result names to {buffer, offset}.
 * names[k] (n of them) are the names a result may have, avail the bits of
 * those that give a result here, meta[k] its dtype and shape (for the
 * truncated factorizations the untruncated shape, an upper bound); `of`
 * names them in errors ("output", "gradient").  Checked before any math:
 * every name known and available and given once, its buffer found and
 * mapped writable, the offset aligned to the element size, meta's bytes
 * within the registered size, no two targets overlapping.  out[k] by name
 * index; the references are the caller's, also on error. */
int pb_request_into(const msgpack_object *into, const pb_resolver_t *res, const char *const *names, int n,
                    unsigned avail, const pb_tensor_t *meta, const char *of, pb_into_t *out, pb_err_t *err);
/* params' accumulate (absent: false); invalid_argument unless a bool. */
int pb_request_accumulate(const msgpack_object *params, bool *acc, pb_err_t *err);
void pb_into_clear(pb_into_t *v, int n);
/* Write result t, in its own dtype, shape and order, into its target; with
 * accumulate, add it elementwise to what is there (Enzyme's shadow
 * semantics).  Runs on the worker that computed t.  0, or PB_EINTERNAL
 * when t is larger than the room that was checked. */
int pb_into_store(const pb_into_t *in, const pb_tensor_t *t, bool accumulate, pb_err_t *err);

#endif
