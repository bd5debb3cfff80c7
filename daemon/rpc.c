#include "rpc.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../kernels/check.h"
#include "buffer.h"
#include "log.h"
#include "request.h"

#ifndef PB_VERSION
#define PB_VERSION "0"
#endif


typedef struct pb_req pb_req_t;
typedef void (*encode_fn)(pb_req_t *, pb_out_t *);

struct pb_req {
    pb_job_t job; /* first: the pool hands it back */
    pb_conn_t *conn;
    pb_server_t *srv;
    uint32_t msgid;
    bool notify;
    encode_fn encode; /* result of a successful request */
    int rc;
    pb_err_t err;
    /* forward, augmented_forward, check */
    pb_call_t call;
    pb_tapedata_t tdata;
    bool peer_scope;
    uint64_t ttl_ms;
    size_t reserved;
    pb_tape_t *made; /* the tape augmented_forward created */
    uint64_t seed;
    double max_rel, per_input[PB_MAX_IO + 2];
    /* reverse, release */
    bool is_release;
    uint64_t handle;
    pb_tape_t *tape;
    bool keep, released;
    char order;
    pb_tensor_t cot[PB_MAX_IO];
    pb_tensor_t grad[PB_MAX_IO + 2];
    pb_warnings_t warn;
    pb_req_t *wnext;
    size_t reply_bytes;   /* forward/augmented_forward: the outputs' bytes */
    size_t conn_reserved; /* counted in conn->reserved: message, then reply */
    /* into: results written into buffers instead of the reply, by output
     * index (forward) or wrt index (reverse); into_meta is what was
     * written (dtype, shape, order; no storage), for the reply. */
    pb_into_t into[PB_MAX_IO + 2];
    pb_tensor_t into_meta[PB_MAX_IO + 2];
    bool accumulate;
    /* register_buffer: the new id (in handle) */
};

static void start_reverse(pb_req_t *r, pb_tape_t *t);
static void tape_next(pb_server_t *s, pb_tape_t *t);

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
    unref_all(r->call.in, PB_MAX_IO);
    unref_all(r->call.out, PB_MAX_IO);
    unref_all(r->tdata.saved, PB_MAX_SAVED);
    unref_all(r->cot, PB_MAX_IO);
    unref_all(r->grad, PB_MAX_IO + 2);
    pb_into_clear(r->into, PB_MAX_IO + 2);
    free(r);
}

/* Answer r (unless it is a notification) and free it. */
static void finish(pb_req_t *r)
{
    pb_conn_t *c = r->conn;
    pb_server_t *s = r->srv;
    if (!r->notify && !c->closing) {
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
        bool ours = r->rc == PB_ENOMEM || r->rc == PB_EINTERNAL;
        pb_log(ours ? PB_LOG_WARNING : PB_LOG_DEBUG, "connection %llu: %s %u: %s: %s", (unsigned long long)c->id,
               r->notify ? "notification" : "msgid", r->msgid, pb_strerror_code(r->rc), r->err.message);
    }
    size_t reserved = r->conn_reserved;
    req_free(r);
    s->requests_in_flight--;
    s->requests_served++;
    pb_conn_request_done(c, reserved);
    pb_conn_unref(c);
    pb_server_maybe_finish(s);
}

static void fail(pb_req_t *r, int rc)
{
    if (r->err.code != rc || r->err.message[0] == 0)
        pb_err_set(&r->err, rc, NULL, "%s", pb_strerror(rc));
    r->rc = rc;
    finish(r);
}

/* Count bytes that r holds or will send back against its connection
 * until r is answered: conn.c stops reading past a cap of queued and
 * reserved bytes, so replies still to come count as well as queued ones. */
static void reserve_bytes(pb_req_t *r, size_t bytes)
{
    r->conn_reserved += bytes;
    r->conn->reserved += bytes;
}

/* ---- param helpers ------------------------------------------------------ */

static int get_handle(const msgpack_object *params, uint64_t *h, pb_err_t *err)
{
    const msgpack_object *o = pb__obj_get(params, "tape");
    if (o == NULL)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "tape", "missing tape (the handle from augmented_forward)");
    if (!pb__obj_handle(o, h))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "tape", "tape must be an integer handle");
    return 0;
}

/* ---- encoders ----------------------------------------------------------- */

static void enc_outputs(pb_req_t *r, pb_out_t *o)
{
    const pb_op_t *op = r->call.op;
    pb_out_str(o, "outputs");
    msgpack_pack_map(&o->pk, (size_t)op->noutputs);
    for (int i = 0; i < op->noutputs; i++) {
        pb_out_str(o, op->outputs[i]);
        if (r->into[i].storage)
            pb_out_tensor_in_buffer(o, &r->into_meta[i], r->into[i].buffer, r->into[i].offset);
        else
            pb_out_tensor(o, &r->call.out[i]);
    }
}

static void enc_forward(pb_req_t *r, pb_out_t *o)
{
    msgpack_pack_map(&o->pk, 1);
    enc_outputs(r, o);
}

static void enc_augmented(pb_req_t *r, pb_out_t *o)
{
    msgpack_pack_map(&o->pk, 3);
    enc_outputs(r, o);
    pb_out_str(o, "tape");
    msgpack_pack_uint64(&o->pk, r->made->handle);
    pb_out_str(o, "tape_bytes");
    msgpack_pack_uint64(&o->pk, r->made->bytes);
}

static void enc_reverse(pb_req_t *r, pb_out_t *o)
{
    const pb_op_t *op = r->tdata.op;
    unsigned wrt = r->tdata.wrt;
    msgpack_pack_map(&o->pk, r->warn.n ? 2 : 1);
    pb_out_str(o, "gradients");
    msgpack_pack_map(&o->pk, (size_t)__builtin_popcount(wrt));
    for (int k = 0; k < op->nwrt; k++) {
        if (!(wrt & (1u << k)))
            continue;
        pb_out_str(o, op->wrt_names[k]);
        if (r->into[k].storage)
            pb_out_tensor_in_buffer(o, &r->into_meta[k], r->into[k].buffer, r->into[k].offset);
        else
            pb_out_tensor(o, &r->grad[k]);
    }
    if (r->warn.n) {
        pb_out_str(o, "warnings");
        msgpack_pack_array(&o->pk, (size_t)r->warn.n);
        for (int i = 0; i < r->warn.n; i++)
            pb_out_str(o, r->warn.text[i]);
    }
}

static void enc_register(pb_req_t *r, pb_out_t *o)
{
    msgpack_pack_map(&o->pk, 1);
    pb_out_str(o, "buffer");
    msgpack_pack_uint64(&o->pk, r->handle);
}

static void enc_unregister(pb_req_t *r, pb_out_t *o)
{
    (void)r;
    msgpack_pack_map(&o->pk, 1);
    pb_out_str(o, "unregistered");
    msgpack_pack_true(&o->pk);
}

static void enc_release(pb_req_t *r, pb_out_t *o)
{
    msgpack_pack_map(&o->pk, 1);
    pb_out_str(o, "released");
    if (r->released)
        msgpack_pack_true(&o->pk);
    else
        msgpack_pack_false(&o->pk);
}

static void enc_check(pb_req_t *r, pb_out_t *o)
{
    const pb_op_t *op = r->call.op;
    msgpack_pack_map(&o->pk, 2);
    pb_out_str(o, "max_rel_err");
    msgpack_pack_double(&o->pk, r->max_rel);
    pb_out_str(o, "per_input");
    msgpack_pack_map(&o->pk, (size_t)__builtin_popcount(r->call.wrt));
    for (int k = 0; k < op->nwrt; k++) {
        if (!(r->call.wrt & (1u << k)))
            continue;
        pb_out_str(o, op->wrt_names[k]);
        msgpack_pack_double(&o->pk, r->per_input[k]);
    }
}

static void pack_strs(pb_out_t *o, const char *const *v, int n)
{
    msgpack_pack_array(&o->pk, (size_t)n);
    for (int i = 0; i < n; i++)
        pb_out_str(o, v[i]);
}

static void pack_dtypes(pb_out_t *o, unsigned mask)
{
    msgpack_pack_array(&o->pk, (size_t)__builtin_popcount(mask));
    for (int d = 0; d < PB_NDTYPES; d++)
        if (mask & PB_DTYPE_BIT(d))
            pb_out_str(o, pb_dtype_name((pb_dtype_t)d));
}

static void pack_devices(pb_out_t *o, unsigned mask)
{
    /* Only devices this daemon has: the CPU, for now. */
    (void)mask;
    msgpack_pack_array(&o->pk, 1);
    pb_out_str(o, "cpu");
}

static void enc_hello(pb_req_t *r, pb_out_t *o)
{
    const pb_config_t *cfg = &r->srv->cfg;
    msgpack_pack_map(&o->pk, 5);
    pb_out_str(o, "protocol");
    msgpack_pack_int(&o->pk, 1);
    pb_out_str(o, "version");
    pb_out_str(o, PB_VERSION);
    pb_out_str(o, "devices");
    pack_devices(o, 1);
    pb_out_str(o, "dtypes");
    pack_dtypes(o, PB_DTYPES_ALL);
    pb_out_str(o, "limits");
    pb_config_limit_t lim[PB_CONFIG_MAX_LIMITS];
    int n = pb_config_limits(cfg, lim);
    msgpack_pack_map(&o->pk, (size_t)n);
    for (int i = 0; i < n; i++) {
        pb_out_str(o, lim[i].name);
        msgpack_pack_uint64(&o->pk, lim[i].value);
    }
}

static const char *const opt_type_names[] = {"str", "bool", "int", "float", "scalar", "axes", "axes2", "str"};

static void enc_ops(pb_req_t *r, pb_out_t *o)
{
    (void)r;
    msgpack_pack_map(&o->pk, 1);
    pb_out_str(o, "ops");
    msgpack_pack_map(&o->pk, (size_t)pb_nops);
    for (int i = 0; i < pb_nops; i++) {
        const pb_op_t *op = pb_ops[i];
        pb_out_str(o, op->name);
        msgpack_pack_map(&o->pk, 6);
        pb_out_str(o, "inputs");
        msgpack_pack_map(&o->pk, (size_t)op->ninputs);
        for (int k = 0; k < op->ninputs; k++) {
            pb_out_str(o, op->inputs[k].name);
            msgpack_pack_map(&o->pk, 1);
            pb_out_str(o, "required");
            if (op->inputs[k].required)
                msgpack_pack_true(&o->pk);
            else
                msgpack_pack_false(&o->pk);
        }
        pb_out_str(o, "outputs");
        pack_strs(o, op->outputs, op->noutputs);
        pb_out_str(o, "options");
        msgpack_pack_map(&o->pk, (size_t)op->noptions);
        for (int k = 0; k < op->noptions; k++) {
            const pb_opt_spec_t *sp = &op->options[k];
            pb_out_str(o, sp->name);
            msgpack_pack_map(&o->pk, sp->values ? 3 : 2);
            pb_out_str(o, "type");
            pb_out_str(o, opt_type_names[sp->type]);
            pb_out_str(o, "default");
            if (sp->def_auto) {
                msgpack_pack_nil(&o->pk);
            } else switch (sp->type) {
            case PB_OPT_STR: pb_out_str(o, sp->values ? sp->values[sp->def_index] : ""); break;
            case PB_OPT_BOOL: if (sp->def_re != 0) msgpack_pack_true(&o->pk); else msgpack_pack_false(&o->pk); break;
            case PB_OPT_INT: msgpack_pack_int64(&o->pk, (int64_t)sp->def_re); break;
            case PB_OPT_FLOAT:
            case PB_OPT_SCALAR: msgpack_pack_double(&o->pk, sp->def_re); break;
            case PB_OPT_AXES:
            case PB_OPT_AXES2:
            case PB_OPT_TEXT: msgpack_pack_nil(&o->pk); break;
            }
            if (sp->values) {
                int n = 0;
                while (sp->values[n])
                    n++;
                pb_out_str(o, "values");
                pack_strs(o, sp->values, n);
            }
        }
        pb_out_str(o, "dtypes");
        pack_dtypes(o, op->dtypes);
        pb_out_str(o, "devices");
        pack_devices(o, op->devices);
        pb_out_str(o, "wrt");
        pack_strs(o, op->wrt_names, op->nwrt);
    }
}

static size_t phys_memory(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    return pages > 0 && psz > 0 ? (size_t)pages * (size_t)psz : 0;
}

static void enc_stats(pb_req_t *r, pb_out_t *o)
{
    pb_server_t *s = r->srv;
    const pb_peer_acct_t *me = pb_tapes_peer(&s->tapes, r->conn->uid);
    size_t npeers = 0;
    for (size_t i = 0; i < s->tapes.npeers; i++)
        npeers += s->tapes.peers[i].tapes > 0;
    size_t nbuf, buf_bytes;
    pb_shm_totals(&nbuf, &buf_bytes);
    msgpack_pack_map(&o->pk, 12);
    pb_out_str(o, "tapes");
    msgpack_pack_uint64(&o->pk, s->tapes.count);
    pb_out_str(o, "tape_bytes");
    msgpack_pack_uint64(&o->pk, s->tapes.bytes);
    pb_out_str(o, "peer_tapes");
    msgpack_pack_uint64(&o->pk, me ? me->tapes : 0);
    pb_out_str(o, "peer_tape_bytes");
    msgpack_pack_uint64(&o->pk, me ? me->bytes : 0);
    pb_out_str(o, "connections");
    msgpack_pack_uint64(&o->pk, s->nconns);
    pb_out_str(o, "requests_served");
    msgpack_pack_uint64(&o->pk, s->requests_served);
    pb_out_str(o, "requests_in_flight");
    /* This stats request itself is in flight; it is not counted. */
    msgpack_pack_uint64(&o->pk, s->requests_in_flight - 1);
    pb_out_str(o, "buffers");
    msgpack_pack_uint64(&o->pk, nbuf);
    pb_out_str(o, "buffer_bytes");
    msgpack_pack_uint64(&o->pk, buf_bytes);
    pb_out_str(o, "uptime_s");
    msgpack_pack_double(&o->pk, (double)(uv_now(s->loop) - s->start_ms) / 1000.0);
    pb_out_str(o, "devices");
    msgpack_pack_array(&o->pk, 1);
    msgpack_pack_map(&o->pk, 2);
    pb_out_str(o, "name");
    pb_out_str(o, "cpu");
    pb_out_str(o, "memory_bytes");
    msgpack_pack_uint64(&o->pk, phys_memory());
    pb_out_str(o, "peers");
    msgpack_pack_array(&o->pk, npeers);
    for (size_t i = 0; i < s->tapes.npeers; i++) {
        const pb_peer_acct_t *p = &s->tapes.peers[i];
        if (p->tapes == 0)
            continue;
        msgpack_pack_map(&o->pk, 3);
        pb_out_str(o, "uid");
        msgpack_pack_uint32(&o->pk, p->uid);
        pb_out_str(o, "tapes");
        msgpack_pack_uint64(&o->pk, p->tapes);
        pb_out_str(o, "tape_bytes");
        msgpack_pack_uint64(&o->pk, p->bytes);
    }
}

static void enc_admin(pb_req_t *r, pb_out_t *o)
{
    msgpack_pack_map(&o->pk, 1);
    pb_out_str(o, r->srv->stopping ? "shutting_down" : "draining");
    msgpack_pack_true(&o->pk);
}

/* ---- tapes -------------------------------------------------------------- */

static bool expired(const pb_server_t *s, const pb_tape_t *t)
{
    return uv_now(s->loop) >= t->expires_ms;
}

static void tape_unlink(pb_tape_t *t)
{
    pb_conn_t *c = t->owner;
    if (c == NULL)
        return;
    if (t->cprev)
        t->cprev->cnext = t->cnext;
    else
        c->tapes = t->cnext;
    if (t->cnext)
        t->cnext->cprev = t->cprev;
    t->cprev = t->cnext = NULL;
    t->owner = NULL;
    c->ntapes--;
}

/* Free t and answer the requests waiting on it as for a missing tape. */
static void tape_free(pb_server_t *s, pb_tape_t *t)
{
    pb_req_t *w = t->wait_head;
    t->wait_head = t->wait_tail = NULL;
    tape_unlink(t);
    pb_tapes_remove(&s->tapes, t);
    while (w) {
        pb_req_t *n = w->wnext;
        if (w->is_release) {
            w->released = false;
            finish(w);
        } else {
            pb_err_set(&w->err, PB_EUNKNOWN_TAPE, "tape", "tape %llu was consumed or released while this request waited",
                       (unsigned long long)w->handle);
            fail(w, PB_EUNKNOWN_TAPE);
        }
        w = n;
    }
}

/* The tape behind handle as connection c may see it, or NULL. */
static pb_tape_t *tape_lookup(pb_server_t *s, pb_conn_t *c, uint64_t handle)
{
    pb_tape_t *t = pb_tapes_find(&s->tapes, handle);
    if (t == NULL || t->doomed)
        return NULL;
    if (t->peer_scope ? t->uid != c->uid : t->owner != c)
        return NULL;
    if (!t->busy && t->wait_head == NULL && expired(s, t)) {
        tape_free(s, t);
        return NULL;
    }
    return t;
}

static void enqueue(pb_tape_t *t, pb_req_t *r)
{
    r->wnext = NULL;
    if (t->wait_tail)
        t->wait_tail->wnext = r;
    else
        t->wait_head = r;
    t->wait_tail = r;
}

static void do_release(pb_server_t *s, pb_req_t *r, pb_tape_t *t)
{
    tape_free(s, t);
    r->released = true;
    finish(r);
}

/* Run the waiters of an idle tape, in order, until one makes it busy. */
static void tape_next(pb_server_t *s, pb_tape_t *t)
{
    while (!t->busy && t->wait_head) {
        pb_req_t *w = t->wait_head;
        t->wait_head = w->wnext;
        if (t->wait_head == NULL)
            t->wait_tail = NULL;
        if (w->is_release) {
            do_release(s, w, t);
            return; /* t is gone */
        }
        start_reverse(w, t);
        if (pb_tapes_find(&s->tapes, w->handle) != t)
            return; /* consumed inline */
    }
}

void pb_rpc_conn_closed(pb_conn_t *c)
{
    pb_server_t *s = c->srv;
    while (c->tapes) {
        pb_tape_t *t = c->tapes;
        tape_unlink(t);
        if (t->peer_scope)
            continue;
        if (t->busy)
            t->doomed = true;
        else
            tape_free(s, t);
    }
}

static void sweep_one(pb_tape_t *t, void *ctx)
{
    pb_server_t *s = ctx;
    if (!t->busy && t->wait_head == NULL && expired(s, t))
        tape_free(s, t);
}

void pb_rpc_sweep(pb_server_t *s)
{
    pb_tapes_foreach(&s->tapes, sweep_one, s);
}

/* ---- forward, augmented_forward, check ---------------------------------- */

/* Write the results that have an into target into their buffers, on the
 * thread that computed them, and keep what the reply says of them. */
static int store_into(pb_req_t *r, pb_tensor_t *res, int n)
{
    for (int i = 0; i < n; i++) {
        if (r->into[i].storage == NULL || res[i].storage == NULL)
            continue;
        int rc = pb_into_store(&r->into[i], &res[i], r->accumulate, &r->err);
        if (rc)
            return rc;
        r->into_meta[i] = res[i];
        r->into_meta[i].storage = NULL;
        r->into_meta[i].offset = 0;
        pb_tensor_clear(&res[i]);
    }
    return 0;
}

/* A request that read or wrote a buffer the client shrank under it (the
 * SIGBUS handler put zero pages there) computed garbage: fail it.  The
 * buffers it touched are the mappings its inputs, cotangents and into
 * targets view (a mapping is aligned for its dtype, so no input of it was
 * replaced by an aligned copy). */
static int check_broken(pb_req_t *r)
{
    const pb_storage_t *seen[3 * PB_MAX_IO + 2];
    int n = 0;
    for (int i = 0; i < PB_MAX_IO; i++) {
        seen[n++] = r->call.in[i].storage;
        seen[n++] = r->cot[i].storage;
    }
    for (int i = 0; i < PB_MAX_IO + 2; i++)
        seen[n++] = r->into[i].storage;
    for (int i = 0; i < n; i++)
        if (pb_shm_broken(seen[i]))
            return pb_err_set(&r->err, PB_EINVALID_ARGUMENT, NULL,
                              "buffer %llu shrank below its registered size while this request used it; its "
                              "contents are lost: unregister it",
                              (unsigned long long)pb_shm_id(seen[i]));
    return 0;
}

static void run_forward(pb_job_t *j)
{
    pb_req_t *r = (pb_req_t *)j;
    r->rc = pb_op_run_forward(&r->call, r->call.taped ? &r->tdata : NULL, &r->err);
    if (r->rc == 0)
        r->rc = store_into(r, r->call.out, r->call.op->noutputs);
}

static void run_check(pb_job_t *j)
{
    pb_req_t *r = (pb_req_t *)j;
    r->rc = pb_check_run(&r->call, r->seed, &r->max_rel, r->per_input, &r->err);
}

static void forward_done(pb_job_t *j)
{
    pb_req_t *r = (pb_req_t *)j;
    pb_server_t *s = r->srv;
    pb_conn_t *c = r->conn;
    int broken = check_broken(r);
    if (broken)
        r->rc = broken;
    if (!r->call.taped || r->rc) {
        if (r->call.taped) {
            pb_tapes_unreserve(&s->tapes, c->uid, r->reserved);
            c->ntapes--;
        }
        if (r->rc)
            fail(r, r->rc);
        else
            finish(r);
        return;
    }
    c->ntapes--; /* the pending count becomes the tape's own below */
    if (c->closing && !r->peer_scope) {
        pb_tapes_unreserve(&s->tapes, c->uid, r->reserved);
        finish(r); /* nobody can use it; the reply is dropped too */
        return;
    }
    pb_tape_t *t = pb_tapes_insert(&s->tapes, c->uid, r->reserved, &r->tdata);
    if (t == NULL) {
        pb_err_set(&r->err, PB_ENOMEM, NULL, "out of memory for the tape");
        fail(r, PB_ENOMEM);
        return;
    }
    t->peer_scope = r->peer_scope;
    t->ttl_ms = r->ttl_ms;
    t->expires_ms = uv_now(s->loop) + r->ttl_ms;
    if (!c->closing) {
        t->owner = c;
        t->cnext = c->tapes;
        if (c->tapes)
            c->tapes->cprev = t;
        c->tapes = t;
        c->ntapes++;
    }
    r->made = t;
    finish(r);
}

static void submit(pb_req_t *r, double cost, pb_device_t dev)
{
    if (cost < PB_INLINE_COST && dev.kind == PB_DEV_CPU) {
        r->job.run(&r->job);
        r->job.done(&r->job);
    } else {
        pb_pool_submit(&r->srv->pool, dev, &r->job);
    }
}

static void m_call(pb_req_t *r, const msgpack_object *params, pb_storage_t *msg, pb_call_kind_t kind)
{
    pb_server_t *s = r->srv;
    pb_conn_t *c = r->conn;
    /* drain and shutdown refuse new forward calls.  SIGTERM does not: what
     * was sent before it is served normally, and what came later is
     * refused before it gets here (late, in pb_rpc_message). */
    if (s->draining) {
        pb_err_set(&r->err, PB_ESHUTTING_DOWN, NULL, "the daemon is draining: no new forward calls");
        return fail(r, PB_ESHUTTING_DOWN);
    }
    pb_call_extra_t x = {0};
    pb_resolver_t res = pb_buffers_resolver(&c->buffers);
    int rc = pb_request_call(&s->cfg, params, msg, &res, kind, &r->call, &x, &r->err);
    memcpy(r->into, x.into, sizeof x.into); /* the references are r's now, freed with it */
    if (rc)
        return fail(r, rc);
    r->peer_scope = x.peer_scope;
    r->ttl_ms = x.ttl_ms;
    r->seed = x.seed;
    r->reply_bytes = x.reply_bytes;
    if (kind == PB_CALL_AUGMENTED) {
        if (c->ntapes >= s->cfg.max_tapes_per_connection) {
            pb_err_set(&r->err, PB_ERESOURCE_EXHAUSTED, "max_tapes_per_connection",
                       "this connection holds %zu tapes, the max_tapes_per_connection limit", c->ntapes);
            return fail(r, PB_ERESOURCE_EXHAUSTED);
        }
        if ((rc = pb_tapes_reserve(&s->tapes, c->uid, r->call.tape_bytes, &r->err)))
            return fail(r, rc);
        r->reserved = r->call.tape_bytes;
        c->ntapes++;
    }
    /* A check answers with a few numbers. */
    if (kind != PB_CALL_CHECK)
        reserve_bytes(r, r->reply_bytes);
    r->encode = kind == PB_CALL_FORWARD ? enc_forward : kind == PB_CALL_AUGMENTED ? enc_augmented : enc_check;
    r->job.run = kind == PB_CALL_CHECK ? run_check : run_forward;
    r->job.done = forward_done;
    /* A check runs the op about 4·|wrt| + 2 times. */
    double cost = r->call.cost * (kind == PB_CALL_CHECK ? 4.0 * r->call.op->nwrt + 2 : 1);
    submit(r, cost, r->call.device);
}

static void m_forward(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { m_call(r, p, m, PB_CALL_FORWARD); }
static void m_augmented(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { m_call(r, p, m, PB_CALL_AUGMENTED); }
static void m_check(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { m_call(r, p, m, PB_CALL_CHECK); }

/* ---- reverse, release --------------------------------------------------- */

static void run_reverse(pb_job_t *j)
{
    pb_req_t *r = (pb_req_t *)j;
    r->rc = pb_op_run_reverse(&r->tape->data, r->cot, r->grad, r->order, &r->warn, &r->err);
    if (r->rc == 0)
        r->rc = store_into(r, r->grad, r->tape->data.op->nwrt);
}

static void reverse_done(pb_job_t *j)
{
    pb_req_t *r = (pb_req_t *)j;
    pb_server_t *s = r->srv;
    pb_tape_t *t = r->tape;
    /* Failed, so the tape is kept: the client may retry with a sound
     * buffer. */
    int broken = check_broken(r);
    if (broken)
        r->rc = broken;
    t->busy = false;
    r->tape = NULL;
    if (t->doomed) {
        tape_free(s, t);
    } else if (r->rc == 0 && !r->keep) {
        tape_free(s, t);
    } else {
        t->expires_ms = uv_now(s->loop) + t->ttl_ms;
        tape_next(s, t);
    }
    if (r->rc)
        fail(r, r->rc);
    else
        finish(r);
}

static void start_reverse(pb_req_t *r, pb_tape_t *t)
{
    t->busy = true;
    r->tape = t;
    /* The gradients are described by the tape; keep its identity for the
     * encoder, without its tensors. */
    r->tdata.op = t->data.op;
    r->tdata.wrt = t->data.wrt;
    r->job.run = run_reverse;
    r->job.done = reverse_done;
    /* A reverse costs about twice its forward. */
    double cost = 2.0 * t->data.cost;
    submit(r, cost, t->data.device);
}

static void m_reverse(pb_req_t *r, const msgpack_object *params, pb_storage_t *msg)
{
    static const char *const keys[] = {"tape", "cotangents", "keep", "order", "into", "accumulate", NULL};
    pb_server_t *s = r->srv;
    int rc = pb_request_check_keys(params, keys, &r->err);
    if (rc == 0)
        rc = pb_request_accumulate(params, &r->accumulate, &r->err);
    if (rc == 0 && r->accumulate && pb__obj_get(params, "into") == NULL)
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "accumulate",
                        "accumulate adds gradients into their into buffers, and this reverse has no into");
    if (rc == 0)
        rc = get_handle(params, &r->handle, &r->err);
    if (rc == 0)
        rc = pb_request_order(params, &r->order, &r->err);
    const msgpack_object *keep = pb__obj_get(params, "keep");
    if (rc == 0 && keep) {
        if (keep->type != MSGPACK_OBJECT_BOOLEAN)
            rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "keep", "keep must be true or false");
        else
            r->keep = keep->via.boolean;
    }
    if (rc)
        return fail(r, rc);
    pb_tape_t *t = tape_lookup(s, r->conn, r->handle);
    if (t == NULL) {
        pb_err_set(&r->err, PB_EUNKNOWN_TAPE, "tape", "tape %llu is not held (consumed, released, expired, "
                   "of another connection, or never issued)", (unsigned long long)r->handle);
        return fail(r, PB_EUNKNOWN_TAPE);
    }
    pb_resolver_t res = pb_buffers_resolver(&r->conn->buffers);
    if ((rc = pb_request_cotangents(&t->data, pb__obj_get(params, "cotangents"), msg, &res, r->cot, &r->err)))
        return fail(r, rc);
    /* Gradients have their input's dtype and shape; those of alpha and
     * beta are scalars of the call's dtype.  All come in the order asked. */
    const pb_op_t *op = t->data.op;
    pb_tensor_t gmeta[PB_MAX_IO + 2];
    memset(gmeta, 0, sizeof gmeta);
    for (int k = 0; k < op->nwrt; k++) {
        if (k < op->ninputs)
            gmeta[k] = t->data.in_meta[k];
        else
            gmeta[k].dtype = t->data.dtype;
        gmeta[k].order = r->order;
    }
    if ((rc = pb_request_into(pb__obj_get(params, "into"), &res, op->wrt_names, op->nwrt, t->data.wrt, gmeta,
                              "gradient", r->into, &r->err)))
        return fail(r, rc);
    /* The gradients that go in the reply (alpha and beta: a scalar each,
     * not worth counting). */
    size_t grads = 0;
    for (int k = 0; k < op->ninputs; k++) {
        const pb_tensor_t *m = &t->data.in_meta[k];
        size_t b;
        if ((t->data.wrt & (1u << k)) && r->into[k].storage == NULL &&
            pb_shape_count(m->rank, m->shape, pb_dtype_size(m->dtype), NULL, &b))
            grads += b;
    }
    reserve_bytes(r, grads);
    r->encode = enc_reverse;
    if (t->busy || t->wait_head)
        enqueue(t, r);
    else
        start_reverse(r, t);
}

static void release_common(pb_req_t *r, const msgpack_object *params)
{
    static const char *const keys[] = {"tape", NULL};
    int rc = pb_request_check_keys(params, keys, &r->err);
    const msgpack_object *h = pb__obj_get(params, "tape");
    if (rc == 0 && h == NULL)
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "tape", "missing tape");
    if (rc == 0 && !pb__obj_handle(h, &r->handle))
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "tape", "tape must be an integer handle");
    if (rc)
        return fail(r, rc);
    r->is_release = true;
    r->encode = enc_release;
    pb_tape_t *t = tape_lookup(r->srv, r->conn, r->handle);
    if (t == NULL) {
        r->released = false;
        return finish(r);
    }
    if (t->busy || t->wait_head)
        enqueue(t, r);
    else
        do_release(r->srv, r, t);
}

static void m_release(pb_req_t *r, const msgpack_object *params, pb_storage_t *msg)
{
    (void)msg;
    release_common(r, params);
}

/* ---- small methods ------------------------------------------------------ */

static void m_simple(pb_req_t *r, const msgpack_object *params, encode_fn enc)
{
    static const char *const none[] = {NULL};
    int rc = pb_request_check_keys(params, none, &r->err);
    if (rc)
        return fail(r, rc);
    r->encode = enc;
    finish(r);
}

static void m_hello(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { (void)m; m_simple(r, p, enc_hello); }
static void m_ops(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { (void)m; m_simple(r, p, enc_ops); }

static void m_stats(pb_req_t *r, const msgpack_object *p, pb_storage_t *m)
{
    (void)m;
    pb_rpc_sweep(r->srv);
    m_simple(r, p, enc_stats);
}

static bool admin(const pb_req_t *r)
{
    return r->conn->uid == 0 || r->conn->uid == r->srv->self_uid;
}

static void m_admin(pb_req_t *r, const msgpack_object *params, bool shutdown)
{
    static const char *const none[] = {NULL};
    int rc = pb_request_check_keys(params, none, &r->err);
    if (rc)
        return fail(r, rc);
    if (!admin(r)) {
        pb_err_set(&r->err, PB_EPERMISSION_DENIED, NULL, "%s is allowed only for uid 0 and the daemon's uid %u",
                   shutdown ? "shutdown" : "drain", (unsigned)r->srv->self_uid);
        pb_log(PB_LOG_WARNING, "connection %llu: %s refused for uid %u, pid %d (permission_denied)",
               (unsigned long long)r->conn->id, shutdown ? "shutdown" : "drain", (unsigned)r->conn->uid,
               (int)r->conn->pid);
        return fail(r, PB_EPERMISSION_DENIED);
    }
    r->srv->draining = true;
    pb_log(PB_LOG_NOTICE, "%s requested by uid %u", shutdown ? "shutdown" : "drain", (unsigned)r->conn->uid);
    if (shutdown)
        pb_server_stop(r->srv);
    r->encode = enc_admin;
    finish(r);
}

static void m_drain(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { (void)m; m_admin(r, p, false); }
static void m_shutdown(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { (void)m; m_admin(r, p, true); }

/* ---- shared-memory buffers ---------------------------------------------- */

/* The fd came with the request's bytes (conn.c says which fds belong to
 * which message); mmap and fstat are quick enough for the loop thread. */
static void m_register(pb_req_t *r, const msgpack_object *params, pb_storage_t *msg)
{
    (void)msg;
    static const char *const keys[] = {"size", NULL};
    pb_conn_t *c = r->conn;
    uint64_t size = 0;
    int rc = pb_request_check_keys(params, keys, &r->err);
    const msgpack_object *sz = pb__obj_get(params, "size");
    if (rc == 0 && (!pb__obj_uint(sz, &size) || size == 0))
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "size",
                        "size must be a positive integer: the bytes to map from the start of the file");
    if (rc == 0 && r->notify)
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, NULL,
                        "register_buffer must be a request: a notification could not learn its buffer id");
    if (rc == 0 && c->msg_nfds == 0)
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, NULL,
                        "register_buffer needs a file descriptor (a memfd or shm file) sent as SCM_RIGHTS on the "
                        "same sendmsg as the request, and none came with it");
    if (rc == 0 && c->msg_nfds > 1)
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, NULL,
                        "register_buffer takes one file descriptor, and %d came with it", c->msg_nfds);
    if (rc)
        return fail(r, rc);
    int fd = c->msg_fds[0];
    c->msg_fds[0] = -1; /* ours to close now */
    rc = pb_buffers_register(&c->buffers, fd, size, r->srv->cfg.max_buffers_per_connection,
                             r->srv->cfg.max_buffer_bytes_per_connection, &r->handle, &r->err);
    if (rc)
        return fail(r, rc);
    r->encode = enc_register;
    finish(r);
}

static void m_unregister(pb_req_t *r, const msgpack_object *params, pb_storage_t *msg)
{
    (void)msg;
    static const char *const keys[] = {"buffer", NULL};
    uint64_t id = 0;
    int rc = pb_request_check_keys(params, keys, &r->err);
    if (rc == 0 && !pb__obj_handle(pb__obj_get(params, "buffer"), &id))
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "buffer", "buffer must be the id register_buffer returned");
    if (rc == 0)
        rc = pb_buffers_unregister(&r->conn->buffers, id, &r->err);
    if (rc)
        return fail(r, rc);
    r->encode = enc_unregister;
    finish(r);
}

static const struct method {
    const char *name;
    void (*fn)(pb_req_t *, const msgpack_object *, pb_storage_t *);
} methods[] = {
    {"hello", m_hello},
    {"ops", m_ops},
    {"forward", m_forward},
    {"augmented_forward", m_augmented},
    {"reverse", m_reverse},
    {"release", m_release},
    {"check", m_check},
    {"stats", m_stats},
    {"drain", m_drain},
    {"shutdown", m_shutdown},
    {"register_buffer", m_register},
    {"unregister_buffer", m_unregister},
};

/* ---- envelope ----------------------------------------------------------- */

static void reply_early(pb_conn_t *c, uint32_t msgid, int code, const char *fmt, const char *detail)
{
    pb_err_t err;
    pb_err_set(&err, code, NULL, fmt, detail);
    pb_out_t o;
    pb_out_init(&o);
    pb_out_error_response(&o, msgid, &err);
    pb_conn_send(c, &o);
    c->srv->requests_served++;
}

void pb_rpc_message(pb_conn_t *c, pb_storage_t *msg, bool late)
{
    pb_server_t *s = c->srv;
    msgpack_object root;
    size_t off = 0;
    if (msgpack_unpack(msg->ptr, msg->size, &off, &c->zone, &root) != MSGPACK_UNPACK_SUCCESS) {
        reply_early(c, 0, PB_EINVALID_REQUEST, "%s", "the message could not be decoded");
        goto out;
    }
    const msgpack_object *m = &root;
    if (m->type != MSGPACK_OBJECT_ARRAY || m->via.array.size < 3 ||
        m->via.array.ptr[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
        reply_early(c, 0, PB_EINVALID_REQUEST, "%s",
                    "not a msgpack-RPC request [0, msgid, method, [params]] or notification [2, method, [params]]");
        goto out;
    }
    const msgpack_object *a = m->via.array.ptr;
    uint64_t type = a[0].via.u64;
    bool notify = type == 2;
    uint64_t msgid = 0;
    if (type == 0 && m->via.array.size == 4) {
        if (!pb__obj_uint(&a[1], &msgid) || msgid > UINT32_MAX) {
            reply_early(c, 0, PB_EINVALID_REQUEST, "%s", "msgid must be a uint32");
            goto out;
        }
    } else if (!(notify && m->via.array.size == 3)) {
        reply_early(c, 0, PB_EINVALID_REQUEST, "%s",
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
            pb_log(PB_LOG_NOTICE, "connection %llu: bad notification dropped: %s", (unsigned long long)c->id, bad);
        else
            reply_early(c, (uint32_t)msgid, PB_EINVALID_REQUEST, "%s", bad);
        goto out;
    }

    pb_req_t *r = calloc(1, sizeof *r);
    if (r == NULL) {
        if (!notify)
            reply_early(c, (uint32_t)msgid, PB_ENOMEM, "%s", "out of memory");
        goto out;
    }
    r->conn = c;
    r->srv = s;
    r->msgid = (uint32_t)msgid;
    r->notify = notify;
    c->refs++;
    c->inflight++;
    s->requests_in_flight++;
    /* The request keeps its message (its tensors point into it) until
     * it is answered. */
    reserve_bytes(r, msg->size);
    if (late) {
        pb_err_set(&r->err, PB_ESHUTTING_DOWN, NULL, "the daemon is shutting down");
        fail(r, PB_ESHUTTING_DOWN);
        goto out;
    }
    const struct method *found = NULL;
    for (size_t i = 0; i < sizeof methods / sizeof methods[0] && !found; i++)
        if (pb__obj_is_str(meth, methods[i].name))
            found = &methods[i];
    if (found == NULL) {
        pb_err_set(&r->err, PB_EUNKNOWN_METHOD, "method", "unknown method '%.*s'",
                   (int)(meth->via.str.size > 40 ? 40 : meth->via.str.size), meth->via.str.ptr);
        fail(r, PB_EUNKNOWN_METHOD);
        goto out;
    }
    found->fn(r, &pa->via.array.ptr[0], msg);
out:
    msgpack_zone_clear(&c->zone);
}
