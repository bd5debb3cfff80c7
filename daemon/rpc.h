/* The request layer: the msgpack-RPC envelope, the method table and the
 * request lifecycle (decode, dispatch, run inline or on the pool, answer,
 * free).  The server's connection callbacks hand it each framed message
 * (pb_rpc_message) and each closing connection (pb_rpc_conn_closed); it
 * tells the server above only through the hooks it was given.
 *
 * Glossary
 *   request   pb_req_t (request.h): one message being served, from
 *             decoding to reply.
 *   method    a row of the method table: a name and its handler.  The
 *             handlers live in calls.c (forward, augmented_forward,
 *             check, reverse, release) and admin.c (hello, ops, stats,
 *             metrics, drain, shutdown, register_buffer,
 *             unregister_buffer).
 *   waiter    a request touching a busy tape, queued on that tape
 *             (tape.h) so that requests on one tape run in the order they
 *             were sent.
 *   inline    a request so small (PB_INLINE_COST flops) that it runs on
 *             the loop thread: handing it to a worker would cost more than
 *             the arithmetic.
 *
 * Ownership: pb_rpc_t is embedded in the server; it owns the worker pool
 * and the tape table (pb_rpc_init starts them, pb_rpc_destroy frees them).
 * rpc.c allocates each request (calloc) and frees it in pb__req_finish,
 * after its reply is queued; a request owns its tensors, its tape data
 * until the table takes it, its into targets, and one reference on its
 * connection. */
#ifndef PB_RPC_H
#define PB_RPC_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "config.h"
#include "metrics.h"
#include "conn.h"
#include "pool.h"
#include "tape.h"

#define PB_INLINE_COST 32768.0

typedef struct pb_req pb_req_t;

/* What the server hears from the request layer. */
typedef struct pb_rpc_hooks {
    void (*stop)(void *data);         /* the shutdown method */
    void (*request_done)(void *data); /* a request was answered */
    void *data;
} pb_rpc_hooks_t;

typedef struct pb_rpc {
    uv_loop_t *loop;
    const pb_config_t *cfg;        /* the server's, changed in place by a reload */
    const pb_conns_t *conns;       /* for stats */
    pb_rpc_hooks_t hooks;
    pb_pool_t pool;
    pb_tapes_t tapes;
    uint64_t requests_served, requests_in_flight;
    const char *method_names[PB_METRICS_MAX_METHODS]; /* the method table's, for metrics */
    pb_metrics_t metrics;          /* requests by method and outcome, latencies */
    uint64_t start_ms;
    uid_t self_uid;
    /* Each GPU's device memory for requests: the cap (max_device_bytes,
     * or 7/8 of the device's memory), and the bytes the requests running
     * there reserved.  A request reserves what it may need before it is
     * queued, against the cap less the device's tapes, and is refused up
     * front when that is past it (pb__req_submit). */
    size_t gpu_cap[PB_GPU_MAX_DEVICES], gpu_reserved[PB_GPU_MAX_DEVICES];
    bool draining;                 /* admin drain: no new forward calls */
    bool stopping;                 /* the server is stopping (set by it) */
} pb_rpc_t;

/* Start the tape table and the workers: 0, or a negative PB_E* code with
 * nothing left to free. */
int pb_rpc_init(pb_rpc_t *r, uv_loop_t *loop, const pb_config_t *cfg, const pb_conns_t *conns,
                pb_rpc_hooks_t hooks);
/* Stop the workers (the loop must run once more to close their async). */
void pb_rpc_stop_workers(pb_rpc_t *r);
/* Free the tapes still held. */
void pb_rpc_destroy(pb_rpc_t *r);

/* What the server's connection callbacks call.  Serve one framed message
 * held in msg; late: it arrived after SIGTERM's drain budget and is
 * answered shutting_down. */
void pb_rpc_message(pb_rpc_t *rpc, pb_conn_t *c, pb_storage_t *msg, bool late);
/* c is closing: free its connection-scoped tapes, detach the others. */
void pb_rpc_conn_closed(pb_rpc_t *rpc, pb_conn_t *c);
/* Drop the tapes whose ttl has passed (not busy ones). */
void pb_rpc_sweep(pb_rpc_t *r);

/* ---- for the method handlers (calls.c, admin.c) --------------------------- */

/* Answer r (unless it is a notification) and free it. */
void pb__req_finish(pb_req_t *r);
/* Answer r with error rc (r->err, or rc's default text) and free it. */
void pb__req_fail(pb_req_t *r, int rc);
/* Count bytes that r holds or will send back against its connection
 * until r is answered (conn.h's reserved). */
void pb__req_reserve(pb_req_t *r, size_t bytes);
/* The caller may see every uid's figures and steer the daemon: uid 0 or
 * the daemon's own uid. */
bool pb__req_admin(const pb_req_t *r);
/* Run r's job inline when it is cheap and on the CPU, else on the pool. */
/* Run r's job on dev: inline when small and on the CPU, else on the pool;
 * on a GPU, after reserving gpu_need device bytes (refused up front with
 * resource_exhausted naming max_device_bytes when they are past its cap:
 * the job's done then runs with that error, and the job never). */
void pb__req_submit(pb_req_t *r, double cost, pb_device_t dev, size_t gpu_need);
/* Each GPU's cap: max_device_bytes, or 7/8 of its memory when 0. */
void pb_rpc_set_gpu_caps(pb_rpc_t *r, size_t max_device_bytes);
/* Give back what pb__req_submit reserved (the job's done calls it). */
void pb__req_gpu_release(pb_req_t *r, pb_device_t dev);

#endif
