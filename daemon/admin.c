/* The admin and buffer methods (methods.h): hello, ops, stats, drain,
 * shutdown, register_buffer and unregister_buffer.  All answer at once, on
 * the loop thread. */
#include "buffer.h"
#include "log.h"
#include "methods.h"
#include "reply.h"
#include "rpc.h"

static void m_simple(pb_req_t *r, const msgpack_object *params, void (*enc)(pb_req_t *, pb_out_t *))
{
    static const char *const none[] = {NULL};
    int rc = pb_request_check_keys(params, none, &r->err);
    if (rc)
        return pb__req_fail(r, rc);
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

static bool admin(const pb_req_t *r)
{
    uid_t uid = pb_conn_uid(r->conn);
    return uid == 0 || uid == r->rpc->self_uid;
}

static void m_admin(pb_req_t *r, const msgpack_object *params, bool shutdown)
{
    static const char *const none[] = {NULL};
    int rc = pb_request_check_keys(params, none, &r->err);
    if (rc)
        return pb__req_fail(r, rc);
    if (!admin(r)) {
        pb_err_set(&r->err, PB_EPERMISSION_DENIED, NULL, "%s is allowed only for uid 0 and the daemon's uid %u",
                   shutdown ? "shutdown" : "drain", (unsigned)r->rpc->self_uid);
        pb_log(PB_LOG_WARNING, "connection %llu: %s refused for uid %u, pid %d (permission_denied)",
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
    static const char *const keys[] = {"size", NULL};
    pb_conn_t *c = r->conn;
    int nfds = pb_conn_msg_nfds(c);
    uint64_t size = 0;
    int rc = pb_request_check_keys(params, keys, &r->err);
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

