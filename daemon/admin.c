/* The admin and buffer methods (methods.h): hello, ops, stats, metrics,
 * drain, shutdown, register_buffer and unregister_buffer.  All answer at once, on
 * the loop thread. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../kernels/par.h"
#include "buffer.h"
#include "log.h"
#include "methods.h"
#include "reply.h"
#include "rpc.h"

/* These methods take no params: any key is invalid_argument (r failed). */
static bool no_params(pb_req_t *r, const msgpack_object *params)
{
    static const char *const none[] = {NULL};
    int rc = pb_request_check_keys(params, none, &r->err);
    if (rc)
        pb__req_fail(r, rc);
    return rc == 0;
}

static void m_simple(pb_req_t *r, const msgpack_object *params, void (*enc)(pb_req_t *, pb_out_t *))
{
    if (!no_params(r, params))
        return;
    r->encode = enc;
    pb__req_finish(r);
}

void pb__m_hello(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { (void)m; m_simple(r, p, pb__enc_hello); }
void pb__m_ops(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { (void)m; m_simple(r, p, pb__enc_ops); }

void pb__m_stats(pb_req_t *r, const msgpack_object *p, pb_storage_t *m)
{
    (void)m;
    pb_rpc_sweep(r->rpc);
    m_simple(r, p, pb__enc_stats);
}

/* ---- metrics ---------------------------------------------------------- */

/* Tapes and their bytes by device (0: the CPU, 1 + i: GPU i) and scope. */
typedef struct scopes {
    size_t tapes[1 + PB_GPU_MAX_DEVICES][2], bytes[1 + PB_GPU_MAX_DEVICES][2]; /* [device][peer_scope] */
} scopes_t;

static void count_scope(pb_tape_t *t, void *ctx)
{
    scopes_t *sc = ctx;
    int d = t->data.device.kind == PB_DEV_CUDA ? 1 + t->data.device.index : 0;
    sc->tapes[d][t->peer_scope]++;
    sc->bytes[d][t->peer_scope] += t->bytes;
}

static void gauge(pb_prom_t *p, const char *name, const char *type, const char *help, double v)
{
    pb_prom_family(p, name, type, help);
    pb_prom_sample(p, name, NULL, v);
}

static void write_gauges(pb_req_t *r, pb_prom_t *p)
{
    pb_rpc_t *rpc = r->rpc;
    gauge(p, "pullbackd_requests_in_flight", "gauge", "Requests being served, this scrape not counted.",
          (double)(rpc->requests_in_flight - 1));
    scopes_t sc;
    memset(&sc, 0, sizeof sc);
    pb_tapes_foreach(&rpc->tapes, count_scope, &sc);
    static const char *const scope_names[2] = {"connection", "peer"};
    char names[1 + PB_GPU_MAX_DEVICES][16] = {"cpu"};
    int ndev = 1 + pb_gpu_count();
    for (int d = 1; d < ndev; d++)
        snprintf(names[d], sizeof names[d], "cuda:%d", d - 1);
    pb_prom_family(p, "pullbackd_tapes", "gauge", "Tapes held, by device and scope.");
    for (int d = 0; d < ndev; d++)
        for (int k = 0; k < 2; k++)
            pb_prom_sample(p, "pullbackd_tapes",
                           (pb_label_t[]){{"device", names[d]}, {"scope", scope_names[k]}, {NULL, NULL}},
                           (double)sc.tapes[d][k]);
    pb_prom_family(p, "pullbackd_tape_bytes", "gauge", "Bytes of tensor data the tapes hold, by device and scope.");
    for (int d = 0; d < ndev; d++)
        for (int k = 0; k < 2; k++)
            pb_prom_sample(p, "pullbackd_tape_bytes",
                           (pb_label_t[]){{"device", names[d]}, {"scope", scope_names[k]}, {NULL, NULL}},
                           (double)sc.bytes[d][k]);
    if (ndev > 1) {
        pb_prom_family(p, "pullbackd_device_memory_bytes", "gauge",
                       "Device memory the daemon holds on each GPU (tapes and running requests).");
        for (int d = 1; d < ndev; d++)
            pb_prom_sample(p, "pullbackd_device_memory_bytes", (pb_label_t[]){{"device", names[d]}, {NULL, NULL}},
                           (double)pb_gpu->used(d - 1));
        pb_prom_family(p, "pullbackd_device_failed", "gauge", "1 for a GPU that has failed (a sticky CUDA error).");
        for (int d = 1; d < ndev; d++)
            pb_prom_sample(p, "pullbackd_device_failed", (pb_label_t[]){{"device", names[d]}, {NULL, NULL}},
                           pb_gpu->failed(d - 1) ? 1.0 : 0.0);
    }
    gauge(p, "pullbackd_tape_bytes_limit", "gauge", "max_tape_bytes: the cap on all tapes' bytes.",
          (double)rpc->cfg->max_tape_bytes);
    size_t nbuf, buf_bytes;
    pb_shm_totals(&nbuf, &buf_bytes);
    gauge(p, "pullbackd_buffers", "gauge", "Shared-memory buffers mapped.", (double)nbuf);
    gauge(p, "pullbackd_buffer_bytes", "gauge", "Registered bytes of the shared-memory buffers mapped.",
          (double)buf_bytes);
    gauge(p, "pullbackd_connections", "gauge", "Open client connections.", (double)pb_conns_count(rpc->conns));
    gauge(p, "pullbackd_buffered_bytes", "gauge",
          "Bytes held for connections (what max_buffered_bytes caps): read buffers, requests' messages and "
          "expected replies, queued replies.",
          (double)pb_conns_held(rpc->conns));
    gauge(p, "pullbackd_read_bytes_moved_total", "counter",
          "Bytes moved between or within read buffers: a buffer grown under a message being read (it grows "
          "to each declared payload's end, moving what came before), what a read took past a big message.",
          (double)pb_conns_moved(rpc->conns));
    gauge(p, "pullbackd_workers", "gauge", "Worker threads.", (double)rpc->pool.nthreads);
    gauge(p, "pullbackd_worker_busy_seconds_total", "counter",
          "Time the workers spent on requests (their own, and pieces of others').",
          (double)pb_pool_busy_ns(&rpc->pool) / 1e9);
    unsigned long long split, helped;
    pb_par_counts(&split, &helped);
    gauge(p, "pullbackd_split_tasks_total", "counter", "Kernel steps split across idle workers.", (double)split);
    gauge(p, "pullbackd_split_pieces_helped_total", "counter", "Pieces of split steps that idle workers ran.",
          (double)helped);
    pb_mem_stats_t ms;
    pb_mem_stats(&ms);
    gauge(p, "pullbackd_memory_cached_bytes", "gauge",
          "Freed large blocks kept mapped for reuse (what memory-cache caps; idle-trim empties it).",
          (double)ms.cached_bytes);
    gauge(p, "pullbackd_memory_large_bytes", "gauge", "Large blocks mapped: in use or cached.",
          (double)ms.mapped_bytes);
    gauge(p, "pullbackd_memory_cache_hits_total", "counter", "Large blocks served from the cache.", (double)ms.hits);
    gauge(p, "pullbackd_memory_cache_misses_total", "counter", "Large blocks mapped afresh.", (double)ms.misses);
    gauge(p, "pullbackd_requests_served_total", "counter", "Requests answered since start.",
          (double)rpc->requests_served);
    gauge(p, "pullbackd_uptime_seconds", "gauge", "Seconds since the daemon started.",
          (double)(uv_now(rpc->loop) - rpc->start_ms) / 1000.0);
    if (!pb__req_admin(r))
        return; /* per-uid figures are for admins */
    static const char *const help[2] = {"Tapes held by each uid (admins only).",
                                        "Bytes of the tapes held by each uid (admins only)."};
    static const char *const name[2] = {"pullbackd_peer_tapes", "pullbackd_peer_tape_bytes"};
    for (int k = 0; k < 2; k++) {
        pb_prom_family(p, name[k], "gauge", help[k]);
        for (size_t i = 0; i < rpc->tapes.npeers; i++) {
            const pb_peer_acct_t *a = &rpc->tapes.peers[i];
            if (a->tapes == 0)
                continue;
            char uid[16];
            snprintf(uid, sizeof uid, "%u", (unsigned)a->uid);
            pb_prom_sample(p, name[k], (pb_label_t[]){{"uid", uid}, {NULL, NULL}},
                           (double)(k ? a->bytes : a->tapes));
        }
    }
}

void pb__m_metrics(pb_req_t *r, const msgpack_object *params, pb_storage_t *m)
{
    (void)m;
    if (!no_params(r, params))
        return;
    pb_rpc_sweep(r->rpc);
    pb_prom_t p;
    pb_prom_init(&p);
    pb_metrics_write(&r->rpc->metrics, &p);
    write_gauges(r, &p);
    if (p.failed) {
        pb_prom_free(&p);
        return pb__req_fail(r, PB_ENOMEM);
    }
    r->kind = PB_REQ_TEXT;
    r->u.text.ptr = p.buf;
    r->u.text.len = p.len;
    pb__req_reserve(r, p.len);
    r->encode = pb__enc_metrics;
    pb__req_finish(r);
}

static void m_admin(pb_req_t *r, const msgpack_object *params, bool shutdown)
{
    if (!no_params(r, params))
        return;
    if (!pb__req_admin(r)) {
        pb_err_set(&r->err, PB_EPERMISSION_DENIED, NULL, "%s is allowed only for uid 0 and the daemon's uid %u",
                   shutdown ? "shutdown" : "drain", (unsigned)r->rpc->self_uid);
        pb_conn_log(r->conn, PB_LOG_WARNING, "connection %llu: %s refused for uid %u, pid %d (permission_denied)",
                    (unsigned long long)pb_conn_id(r->conn), shutdown ? "shutdown" : "drain",
                    (unsigned)pb_conn_uid(r->conn), (int)pb_conn_pid(r->conn));
        return pb__req_fail(r, PB_EPERMISSION_DENIED);
    }
    r->rpc->draining = true;
    pb_log(PB_LOG_NOTICE, "%s requested by uid %u", shutdown ? "shutdown" : "drain", (unsigned)pb_conn_uid(r->conn));
    if (shutdown)
        r->rpc->hooks.stop(r->rpc->hooks.data);
    r->encode = pb__enc_admin;
    pb__req_finish(r);
}

void pb__m_drain(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { (void)m; m_admin(r, p, false); }
void pb__m_shutdown(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { (void)m; m_admin(r, p, true); }

/* ---- shared-memory buffers ---------------------------------------------- */

/* The fd came with the request's bytes (conn.c says which fds belong to
 * which message); mmap and fstat are quick enough for the loop thread. */
void pb__m_register(pb_req_t *r, const msgpack_object *params, pb_storage_t *msg)
{
    (void)msg;
    static const char *const keys[] = {"size", "device", NULL};
    pb_conn_t *c = r->conn;
    int nfds = pb_conn_claim_read_fds(c);
    uint64_t size = 0;
    pb_device_t dev;
    int rc = pb_request_check_keys(params, keys, &r->err);
    /* Host memory unless it names a GPU (contract section 6). */
    if (rc == 0)
        rc = pb_request_device(params, (pb_device_t){PB_DEV_CPU, 0}, &dev, &r->err);
    const msgpack_object *sz = pb__obj_get(params, "size");
    if (rc == 0 && (!pb__obj_uint(sz, &size) || size == 0))
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "size",
                        "size must be a positive integer: the bytes to map from the start of the file");
    if (rc == 0 && r->notify)
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, NULL,
                        "register_buffer must be a request: a notification could not learn its buffer id");
    if (rc == 0 && nfds == 0)
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, NULL,
                        "register_buffer needs a file descriptor (a memfd or shm file) sent as SCM_RIGHTS on the "
                        "same sendmsg as the request, and none came with it");
    if (rc == 0 && nfds > 1)
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, NULL,
                        "register_buffer takes one file descriptor, and %d came with it", nfds);
    if (rc)
        return pb__req_fail(r, rc);
    int fd = pb_conn_take_fd(c, 0); /* ours to close now */
    const pb_config_t *cfg = r->rpc->cfg;
    if (dev.kind == PB_DEV_CUDA)
        rc = pb_buffers_register_gpu(pb_conn_buffers(c), fd, size, dev.index, cfg->max_buffers_per_connection,
                                     cfg->max_buffer_bytes_per_connection, &r->u.buffer, &r->err);
    else
        rc = pb_buffers_register(pb_conn_buffers(c), fd, size, cfg->max_buffers_per_connection,
                                 cfg->max_buffer_bytes_per_connection, &r->u.buffer, &r->err);
    if (rc)
        return pb__req_fail(r, rc);
    r->encode = pb__enc_register;
    pb__req_finish(r);
}

void pb__m_unregister(pb_req_t *r, const msgpack_object *params, pb_storage_t *msg)
{
    (void)msg;
    static const char *const keys[] = {"buffer", NULL};
    uint64_t id = 0;
    int rc = pb_request_check_keys(params, keys, &r->err);
    if (rc == 0 && !pb__obj_handle(pb__obj_get(params, "buffer"), &id))
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "buffer", "buffer must be the id register_buffer returned");
    if (rc == 0)
        rc = pb_buffers_unregister(pb_conn_buffers(r->conn), id, &r->err);
    if (rc)
        return pb__req_fail(r, rc);
    r->encode = pb__enc_unregister;
    pb__req_finish(r);
}

