/* The request layer (rpc.h): the envelope, the method table and the
 * request lifecycle. */
#include "rpc.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "methods.h"
#include "request.h"

/* ---- the method table ----------------------------------------------------- */

/* A new method is a row here and a handler in calls.c or admin.c. */
static const struct method {
    const char *name;
    pb_method_fn *fn;
} methods[] = {
    {"hello", pb__m_hello},
    {"ops", pb__m_ops},
    {"forward", pb__m_forward},
    {"augmented_forward", pb__m_augmented},
    {"reverse", pb__m_reverse},
    {"release", pb__m_release},
    {"check", pb__m_check},
    {"stats", pb__m_stats},
    {"metrics", pb__m_metrics},
    {"drain", pb__m_drain},
    {"shutdown", pb__m_shutdown},
    {"register_buffer", pb__m_register},
    {"unregister_buffer", pb__m_unregister},
};

/* ---- setup ---------------------------------------------------------------- */

int pb_rpc_init(pb_rpc_t *r, uv_loop_t *loop, const pb_config_t *cfg, const pb_conns_t *conns,
                pb_rpc_hooks_t hooks)
{
    *r = (pb_rpc_t){.loop = loop, .cfg = cfg, .conns = conns, .hooks = hooks};
    r->self_uid = getuid();
    r->start_ms = uv_now(loop);
    int rc = pb_tapes_init(&r->tapes, cfg->max_tape_bytes, cfg->max_tape_bytes_per_uid,
                           cfg->max_device_tape_bytes);
    if (rc)
        return rc;
    pb_rpc_set_gpu_caps(r, cfg->max_device_bytes);
    if ((rc = pb_pool_init(&r->pool, loop, cfg->workers, cfg->gpu_workers, (double)cfg->gpu_lane_flops)))
        goto fail;
    int n = 0;
    for (size_t i = 0; i < sizeof methods / sizeof methods[0] && n < PB_METRICS_MAX_METHODS; i++)
        r->method_names[n++] = methods[i].name;
    pb_metrics_init(&r->metrics, r->method_names, n);
    return 0;

fail:
    pb_tapes_destroy(&r->tapes);
    return rc;
}

void pb_rpc_stop_workers(pb_rpc_t *r)
{
    pb_pool_stop(&r->pool);
}

void pb_rpc_destroy(pb_rpc_t *r)
{
    if (r->tapes.count)
        pb_log(PB_LOG_NOTICE, "freeing %zu tapes still held (%zu bytes)", r->tapes.count, r->tapes.bytes);
    pb_tapes_destroy(&r->tapes);
}

void pb_rpc_conn_closed(pb_rpc_t *rpc, pb_conn_t *c)
{
    pb_tapes_list_closed(&rpc->tapes, pb_conn_tapes(c));
}

void pb_rpc_sweep(pb_rpc_t *r)
{
    pb_tapes_sweep(&r->tapes, uv_now(r->loop));
}

/* ---- finishing ---------------------------------------------------------- */

static void unref_all(pb_tensor_t *t, int n)
{
    for (int i = 0; i < n; i++)
        if (t[i].storage)
            pb_storage_unref(t[i].storage);
}

/* r is freed right after: drop the references, skip clearing the structs. */
static void req_free(pb_req_t *r)
{
    switch (r->kind) {
    case PB_REQ_CALL:
        unref_all(r->u.call.call.in, PB_MAX_IO);
        unref_all(r->u.call.call.out, PB_MAX_IO);
        unref_all(r->u.call.tdata.saved, PB_MAX_SAVED);
        break;
    case PB_REQ_REVERSE:
        unref_all(r->u.rev.cot, PB_MAX_IO);
        unref_all(r->u.rev.grad, PB_MAX_IO + 2);
        break;
    case PB_REQ_TEXT:
        free(r->u.text.ptr);
        break;
    case PB_REQ_SIMPLE:
    case PB_REQ_RELEASE:
        break;
    }
    pb_into_clear(r->into, PB_MAX_IO + 2);
    free(r);
}

void pb__req_finish(pb_req_t *r)
{
    pb_conn_t *c = r->conn;
    pb_rpc_t *rpc = r->rpc;
    if (!r->notify && !pb_conn_closing(c)) {
        pb_out_t o;
        pb_out_init(&o);
        if (r->rc)
            pb_out_error_response(&o, r->msgid, &r->err);
        else {
            pb_out_result_header(&o, r->msgid);
            r->encode(r, &o);
        }
        pb_conn_send(c, &o);
    }
    /* A failed request is the client's business (debug), unless the
     * daemon itself failed it: out of memory or an internal error. */
    if (r->rc && r->rc != PB_EUNKNOWN_TAPE) {
        /* the daemon's own failures are always logged: no client budget */
        if (r->rc == PB_ENOMEM || r->rc == PB_EINTERNAL)
            pb_log(PB_LOG_WARNING, "connection %llu: %s %u: %s: %s", (unsigned long long)pb_conn_id(c),
                   r->notify ? "notification" : "msgid", r->msgid, pb_strerror_code(r->rc), r->err.message);
        else
            pb_conn_log(c, PB_LOG_DEBUG, "connection %llu: %s %u: %s: %s", (unsigned long long)pb_conn_id(c),
                        r->notify ? "notification" : "msgid", r->msgid, pb_strerror_code(r->rc), r->err.message);
    }
    pb_metrics_observe(&rpc->metrics, r->method, r->rc, uv_hrtime() - r->t0_ns);
    size_t reserved = r->conn_reserved;
    req_free(r);
    rpc->requests_in_flight--;
    rpc->requests_served++;
    pb_conn_request_done(c, reserved);
    pb_conn_unref(c);
    rpc->hooks.request_done(rpc->hooks.data);
}

void pb__req_fail(pb_req_t *r, int rc)
{
    if (r->err.code != rc || r->err.message[0] == 0)
        pb_err_set(&r->err, rc, NULL, "%s", pb_strerror(rc));
    r->rc = rc;
    pb__req_finish(r);
}

bool pb__req_admin(const pb_req_t *r)
{
    uid_t uid = pb_conn_uid(r->conn);
    return uid == 0 || uid == r->rpc->self_uid;
}

/* conn.c stops reading past a cap of queued and reserved bytes, so
 * replies still to come count as well as queued ones. */
void pb__req_reserve(pb_req_t *r, size_t bytes)
{
    r->conn_reserved += bytes;
    pb_conn_reserve(r->conn, bytes);
}

void pb__req_submit(pb_req_t *r, double cost, pb_device_t dev, size_t gpu_need)
{
    if (dev.kind == PB_DEV_CUDA) {
        pb_rpc_t *rpc = r->rpc;
        int g = dev.index;
        size_t held = rpc->tapes.gpu_bytes[g] + rpc->gpu_reserved[g];
        if (held > rpc->gpu_cap[g] || gpu_need > rpc->gpu_cap[g] - held) {
            pb_err_set(&r->err, PB_ERESOURCE_EXHAUSTED, "max_device_bytes",
                       "the request may need %zu bytes of cuda:%d's memory; tapes and requests running there hold "
                       "%zu of max_device_bytes %zu",
                       gpu_need, g, held, rpc->gpu_cap[g]);
            r->rc = PB_ERESOURCE_EXHAUSTED;
            r->job.done(&r->job);
            return;
        }
        rpc->gpu_reserved[g] += gpu_need;
        r->gpu_reserved = gpu_need;
    }
    if (cost < PB_INLINE_COST && dev.kind == PB_DEV_CPU) {
        r->job.run(&r->job);
        r->job.done(&r->job);
    } else {
        pb_pool_submit(&r->rpc->pool, dev, cost, &r->job);
    }
}

void pb_rpc_set_gpu_caps(pb_rpc_t *r, size_t max_device_bytes)
{
    for (int g = 0; g < pb_gpu_count(); g++) {
        pb_gpu_info_t info = {.total_bytes = 0};
        pb_gpu->info(g, &info);
        r->gpu_cap[g] = max_device_bytes ? max_device_bytes : info.total_bytes / 8 * 7;
    }
}

void pb__req_gpu_release(pb_req_t *r, pb_device_t dev)
{
    if (dev.kind == PB_DEV_CUDA)
        r->rpc->gpu_reserved[dev.index] -= r->gpu_reserved;
    r->gpu_reserved = 0;
}

/* ---- envelope ----------------------------------------------------------- */

static void reply_early_arg(pb_rpc_t *rpc, pb_conn_t *c, uint32_t msgid, int code, const char *arg, const char *fmt,
                            const char *detail)
{
    pb_err_t err;
    pb_err_set(&err, code, arg, fmt, detail);
    pb_out_t o;
    pb_out_init(&o);
    pb_out_error_response(&o, msgid, &err);
    pb_conn_send(c, &o);
    rpc->requests_served++;
    pb_metrics_observe(&rpc->metrics, rpc->metrics.nmethods, code, 0); /* no method: "other" */
}

static void reply_early(pb_rpc_t *rpc, pb_conn_t *c, uint32_t msgid, int code, const char *fmt, const char *detail)
{
    reply_early_arg(rpc, c, msgid, code, NULL, fmt, detail);
}

/* The msgid of a message [0, msgid, ...] when it is a uint32; else false
 * and *id stays 0 (the msgid of replies the daemon cannot pair). */
static bool request_msgid(const msgpack_object *m, uint32_t *id)
{
    if (m->type != MSGPACK_OBJECT_ARRAY || m->via.array.size < 2)
        return false;
    const msgpack_object *a = m->via.array.ptr;
    uint64_t v;
    if (a[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER || a[0].via.u64 != 0 || !pb__obj_uint(&a[1], &v) ||
        v > UINT32_MAX)
        return false;
    *id = (uint32_t)v;
    return true;
}

void pb_rpc_message(pb_rpc_t *rpc, pb_conn_t *c, pb_storage_t *msg, bool late)
{
    msgpack_zone *zone = pb_conn_zone(c);
    msgpack_object root;
    size_t off = 0;
    if (msgpack_unpack(msg->ptr, msg->size, &off, zone, &root) != MSGPACK_UNPACK_SUCCESS) {
        reply_early(rpc, c, 0, PB_EINVALID_REQUEST, "%s", "the message could not be decoded");
        goto out;
    }
    const msgpack_object *m = &root;
    /* [2, ...] of the wrong length is a bad notification: it has no
     * msgid to answer, so it is logged and dropped (PROTOCOL.md §5). */
    if (m->type == MSGPACK_OBJECT_ARRAY && m->via.array.size >= 1 && m->via.array.size != 3 &&
        m->via.array.ptr[0].type == MSGPACK_OBJECT_POSITIVE_INTEGER && m->via.array.ptr[0].via.u64 == 2) {
        pb_conn_log(c, PB_LOG_NOTICE,
                    "connection %llu: bad notification dropped: %u elements, not [2, method, [params]]",
                    (unsigned long long)pb_conn_id(c), (unsigned)m->via.array.size);
        goto out;
    }
    /* A request of the wrong length whose msgid can be read is answered
     * under it, so that a pipelining client can pair the error. */
    uint32_t msgid = 0;
    bool has_id = request_msgid(m, &msgid);
    const msgpack_object *a = m->type == MSGPACK_OBJECT_ARRAY ? m->via.array.ptr : NULL;
    if (a == NULL || m->via.array.size < 3 || a[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
        reply_early(rpc, c, msgid, PB_EINVALID_REQUEST, "%s",
                    "not a msgpack-RPC request [0, msgid, method, [params]] or notification [2, method, [params]]");
        goto out;
    }
    uint64_t type = a[0].via.u64;
    bool notify = type == 2;
    if (type == 0 && m->via.array.size == 4) {
        if (!has_id) {
            reply_early(rpc, c, 0, PB_EINVALID_REQUEST, "%s", "msgid must be a uint32");
            goto out;
        }
    } else if (!(notify && m->via.array.size == 3)) {
        reply_early(rpc, c, msgid, PB_EINVALID_REQUEST, "%s",
                    "not a msgpack-RPC request [0, msgid, method, [params]] or notification [2, method, [params]]");
        goto out;
    }
    const msgpack_object *meth = &a[notify ? 1 : 2], *pa = &a[notify ? 2 : 3];
    const char *bad = NULL;
    if (meth->type != MSGPACK_OBJECT_STR || !pb_utf8_valid(meth->via.str.ptr, meth->via.str.size))
        bad = "method must be a UTF-8 string";
    else if (pa->type != MSGPACK_OBJECT_ARRAY || pa->via.array.size != 1 ||
             pa->via.array.ptr[0].type != MSGPACK_OBJECT_MAP)
        bad = "params must be an array holding exactly one map";
    if (bad) {
        if (notify)
            pb_conn_log(c, PB_LOG_NOTICE, "connection %llu: bad notification dropped: %s",
                        (unsigned long long)pb_conn_id(c), bad);
        else
            reply_early(rpc, c, msgid, PB_EINVALID_REQUEST, "%s", bad);
        goto out;
    }

    /* Contract section 7: going past a limit is resource_exhausted with
     * the limit named, and nothing else is disturbed.  Notifications
     * (release) are always taken: they free, and have no reply to refuse
     * with.  What the refusals queue is bounded by the reply caps. */
    if (!notify && pb_conn_inflight(c) >= rpc->cfg->max_inflight_per_connection) {
        char why[96];
        snprintf(why, sizeof why, "%zu requests of this connection are in flight",
                 pb_conn_inflight(c));
        reply_early_arg(rpc, c, msgid, PB_ERESOURCE_EXHAUSTED, "max_inflight_per_connection",
                        "%s, the max_inflight_per_connection limit; send more once replies come", why);
        goto out;
    }
    pb_req_t *r = calloc(1, sizeof *r);
    if (r == NULL) {
        if (!notify)
            reply_early(rpc, c, msgid, PB_ENOMEM, "%s", "out of memory");
        goto out;
    }
    r->conn = c;
    r->rpc = rpc;
    r->t0_ns = uv_hrtime();
    r->msgid = msgid;
    r->notify = notify;
    pb_conn_ref(c);
    pb_conn_request_begin(c);
    rpc->requests_in_flight++;
    /* The request keeps its message (its tensors point into it) until
     * it is answered. */
    pb__req_reserve(r, msg->size);
    const struct method *found = NULL;
    for (size_t i = 0; i < sizeof methods / sizeof methods[0] && !found; i++)
        if (pb__obj_is_str(meth, methods[i].name))
            found = &methods[i];
    r->method = found ? (int)(found - methods) : rpc->metrics.nmethods;
    if (late) {
        pb_err_set(&r->err, PB_ESHUTTING_DOWN, NULL, "the daemon is shutting down");
        pb__req_fail(r, PB_ESHUTTING_DOWN);
        goto out;
    }
    if (found == NULL) {
        pb_err_set(&r->err, PB_EUNKNOWN_METHOD, "method", "unknown method '%s'",
                   pb_quote(PB_QUOTED, meth->via.str.ptr, meth->via.str.size));
        pb__req_fail(r, PB_EUNKNOWN_METHOD);
        goto out;
    }
    found->fn(r, &pa->via.array.ptr[0], msg);
out:
    msgpack_zone_clear(zone);
}
