/* The call methods (methods.h): forward, augmented_forward and check run
 * an op; reverse runs a tape's pullback; release drops a tape.  Each
 * validates its params (request.c), reserves what it will hold, and runs
 * its math inline or on a worker; the completion, on the loop thread,
 * keeps or frees the tape and answers. */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "../cuda/gpu.h"
#include "../kernels/check.h"
#include "buffer.h"
#include "log.h"
#include "methods.h"
#include "reply.h"
#include "rpc.h"

/* ---- shared by the calls -------------------------------------------------- */

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
static int broken(pb_req_t *r, const pb_storage_t *st, const char *part, const char *name)
{
    char arg[96];
    snprintf(arg, sizeof arg, "%s.%s", part, name);
    return pb_err_set(&r->err, PB_EINVALID_ARGUMENT, arg,
                      "buffer %llu shrank below its registered size while this request used it; its "
                      "contents are lost: unregister it",
                      (unsigned long long)pb_shm_id(st));
}

static int check_broken(pb_req_t *r)
{
    if (r->kind != PB_REQ_CALL && r->kind != PB_REQ_REVERSE)
        return 0;
    bool call = r->kind == PB_REQ_CALL;
    const pb_op_t *op = call ? r->u.call.call.op : r->u.rev.op;
    for (int k = 0; k < PB_MAX_IO; k++) {
        const pb_storage_t *st = call ? r->u.call.call.in[k].storage : r->u.rev.cot[k].storage;
        if (pb_shm_broken(st))
            return broken(r, st, call ? "inputs" : "cotangents", call ? op->inputs[k].name : op->outputs[k]);
    }
    for (int k = 0; k < PB_MAX_IO + 2; k++) /* outputs of a call, gradients of a reverse */
        if (pb_shm_broken(r->into[k].storage))
            return broken(r, r->into[k].storage, "into", call ? op->outputs[k] : op->wrt_names[k]);
    return 0;
}

/* A GPU that failed under a request is logged once, with the first
 * failure's words (the request's error says which call found it). */
static void log_failed_gpus(const pb_err_t *err)
{
    static bool logged[PB_GPU_MAX_DEVICES];
    for (int g = 0; g < pb_gpu_count(); g++)
        if (!logged[g] && pb_gpu->failed(g)) {
            logged[g] = true;
            pb_log(PB_LOG_ERR, "cuda:%d has failed (%s); its requests and its tapes' reverses now answer "
                   "device_unavailable until the daemon restarts, and the CPU and other GPUs keep serving",
                   g, err->message);
        }
}

static void answer(pb_req_t *r)
{
    if (r->rc == PB_EDEVICE_UNAVAILABLE)
        log_failed_gpus(&r->err);
    if (r->rc)
        pb__req_fail(r, r->rc);
    else
        pb__req_finish(r);
}

/* ---- forward, augmented_forward, check ---------------------------------- */

static void run_forward(pb_job_t *j)
{
    pb_req_t *r = (pb_req_t *)j;
    pb_req_call_t *x = &r->u.call;
    r->rc = pb_op_run_forward(&x->call, x->call.taped ? &x->tdata : NULL, &r->err);
    if (r->rc == 0)
        r->rc = store_into(r, x->call.out, x->call.op->noutputs);
}

static void run_check(pb_job_t *j)
{
    pb_req_t *r = (pb_req_t *)j;
    pb_req_call_t *x = &r->u.call;
    r->rc = pb_check_run(&x->call, x->seed, &x->max_rel, x->per_input, &r->err);
}

/* A check makes no tape (pb_check_run keeps its own) and took no count. */
static void check_done(pb_job_t *j)
{
    pb_req_t *r = (pb_req_t *)j;
    pb__req_gpu_release(r, r->u.call.call.device);
    int broken = check_broken(r);
    if (broken)
        r->rc = broken;
    answer(r);
}

static void forward_done(pb_job_t *j)
{
    pb_req_t *r = (pb_req_t *)j;
    pb_req_call_t *x = &r->u.call;
    pb__req_gpu_release(r, x->call.device);
    pb_tapes_t *tapes = &r->rpc->tapes;
    pb_conn_t *c = r->conn;
    pb_tape_list_t *mine = pb_conn_tapes(c);
    uid_t uid = pb_conn_uid(c);
    int broken = check_broken(r);
    if (broken)
        r->rc = broken;
    if (!x->call.taped || r->rc) {
        if (x->call.taped) {
            pb_tapes_unreserve(tapes, uid, x->call.device, x->reserved);
            mine->n--;
        }
        return answer(r);
    }
    mine->n--; /* the pending count becomes the tape's own below */
    if (pb_conn_closing(c) || r->notify) {
        /* Its handle reaches nobody (the reply is dropped, or there is
         * none): nobody can use it, in peer scope either. */
        pb_tapes_unreserve(tapes, uid, x->call.device, x->reserved);
        return pb__req_finish(r);
    }
    pb_tape_t *t = pb_tapes_insert(tapes, uid, x->reserved, &x->tdata);
    if (t == NULL) {
        pb_err_set(&r->err, PB_ENOMEM, NULL, "out of memory for the tape");
        return pb__req_fail(r, PB_ENOMEM);
    }
    t->peer_scope = x->peer_scope;
    t->ttl_ms = x->ttl_ms;
    t->expires_ms = uv_now(r->rpc->loop) + x->ttl_ms;
    if (!pb_conn_closing(c))
        pb_tape_link(t, mine);
    x->made = t;
    pb__req_finish(r);
}

static void m_call(pb_req_t *r, const msgpack_object *params, pb_storage_t *msg, pb_call_kind_t kind)
{
    pb_rpc_t *rpc = r->rpc;
    pb_conn_t *c = r->conn;
    pb_req_call_t *x = &r->u.call;
    r->kind = PB_REQ_CALL;
    /* drain and shutdown refuse new forward calls.  SIGTERM does not: what
     * was sent before it is served normally, and what came later is
     * refused before it gets here (late, in pb_rpc_message). */
    if (rpc->draining) {
        pb_err_set(&r->err, PB_ESHUTTING_DOWN, NULL, "the daemon is draining: no new forward calls");
        return pb__req_fail(r, PB_ESHUTTING_DOWN);
    }
    pb_call_extra_t ex = {0};
    pb_resolver_t res = pb_buffers_resolver(pb_conn_buffers(c));
    int rc = pb_request_call(rpc->cfg, params, msg, &res, kind, &x->call, &ex, &r->err);
    memcpy(r->into, ex.into, sizeof ex.into); /* the references are r's now, freed with it */
    if (rc)
        return pb__req_fail(r, rc);
    x->peer_scope = ex.peer_scope;
    x->ttl_ms = ex.ttl_ms;
    x->seed = ex.seed;
    if (kind == PB_CALL_AUGMENTED) {
        pb_tape_list_t *mine = pb_conn_tapes(c);
        /* At a limit, tapes whose ttl has passed go first (the sweep timer
         * runs once a second): an expired tape holds no slot and no bytes. */
        if (mine->n >= rpc->cfg->max_tapes_per_connection)
            pb_rpc_sweep(rpc);
        if (mine->n >= rpc->cfg->max_tapes_per_connection) {
            pb_err_set(&r->err, PB_ERESOURCE_EXHAUSTED, "max_tapes_per_connection",
                       "this connection holds %zu tapes, at or past the max_tapes_per_connection limit (%zu)",
                       mine->n, rpc->cfg->max_tapes_per_connection);
            return pb__req_fail(r, PB_ERESOURCE_EXHAUSTED);
        }
        rc = pb_tapes_reserve(&rpc->tapes, pb_conn_uid(c), x->call.device, x->call.tape_bytes, &r->err);
        if (rc == PB_ERESOURCE_EXHAUSTED) {
            pb_rpc_sweep(rpc);
            rc = pb_tapes_reserve(&rpc->tapes, pb_conn_uid(c), x->call.device, x->call.tape_bytes, &r->err);
        }
        if (rc)
            return pb__req_fail(r, rc);
        x->reserved = x->call.tape_bytes;
        mine->n++;
    }
    /* A check answers with a few numbers. */
    if (kind != PB_CALL_CHECK)
        pb__req_reserve(r, ex.reply_bytes);
    r->encode = kind == PB_CALL_FORWARD     ? pb__enc_forward
                : kind == PB_CALL_AUGMENTED ? pb__enc_augmented
                                            : pb__enc_check;
    r->job.run = kind == PB_CALL_CHECK ? run_check : run_forward;
    r->job.done = kind == PB_CALL_CHECK ? check_done : forward_done;
    /* A check runs the op up to 8·|wrt| + 2 times (kernels/check.c). */
    double cost = x->call.cost * (kind == PB_CALL_CHECK ? 8.0 * x->call.op->nwrt + 2 : 1);
    /* On a GPU: the inputs and outputs, and as much again for temporaries
     * (contract.c's copies, fused_dense's z); the tape keeps some of them. */
    size_t need = 0;
    for (int i = 0; i < PB_MAX_IO; i++)
        need += 2 * (pb_tensor_bytes(&x->call.in[i]) + pb_tensor_bytes(&x->call.out_meta[i]));
    /* A check keeps a tape while it runs the op again in double precision
     * (kernels/check.c): twice that, three times from f32 and c64. */
    need += x->call.work_bytes; /* what the op says its temporaries take */
    if (kind == PB_CALL_CHECK)
        need *= x->call.dtype == PB_F32 || x->call.dtype == PB_C64 ? 3 : 2;
    pb__req_submit(r, cost, x->call.device, need);
}

void pb__m_forward(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { m_call(r, p, m, PB_CALL_FORWARD); }
void pb__m_augmented(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { m_call(r, p, m, PB_CALL_AUGMENTED); }
void pb__m_check(pb_req_t *r, const msgpack_object *p, pb_storage_t *m) { m_call(r, p, m, PB_CALL_CHECK); }

/* ---- reverse -------------------------------------------------------------- */

static pb_req_t *of_waiter(pb_tape_waiter_t *w)
{
    return (pb_req_t *)((char *)w - offsetof(pb_req_t, wait));
}

/* The tape a waiting request wanted went first. */
static void tape_gone(pb_req_t *r, uint64_t handle)
{
    pb_err_set(&r->err, PB_EUNKNOWN_TAPE, "tape", "tape %llu was consumed or released while this request waited",
               (unsigned long long)handle);
    pb__req_fail(r, PB_EUNKNOWN_TAPE);
}

static void run_reverse(pb_job_t *j)
{
    pb_req_t *r = (pb_req_t *)j;
    pb_req_reverse_t *v = &r->u.rev;
    r->rc = pb_op_run_reverse(&v->tape->data, v->cot, v->grad, v->order, &v->warn, &r->err);
    if (r->rc == 0)
        r->rc = store_into(r, v->grad, v->tape->data.op->nwrt);
}

static void reverse_done(pb_job_t *j)
{
    pb_req_t *r = (pb_req_t *)j;
    pb_tape_t *t = r->u.rev.tape;
    pb__req_gpu_release(r, t->data.device);
    int broken = check_broken(r);
    if (broken)
        r->rc = broken;
    r->u.rev.tape = NULL;
    /* Failed, so the tape is kept: the client may retry with a sound
     * buffer. */
    pb_tapes_done(&r->rpc->tapes, t, r->rc == 0 && !r->u.rev.keep, uv_now(r->rpc->loop));
    answer(r);
}

static void start_reverse(pb_req_t *r, pb_tape_t *t)
{
    pb_req_reverse_t *v = &r->u.rev;
    t->busy = true;
    v->tape = t;
    /* The gradients are described by the tape; keep its identity for the
     * encoder. */
    v->op = t->data.op;
    v->wrt = t->data.wrt;
    r->job.run = run_reverse;
    r->job.done = reverse_done;
    /* A reverse costs about twice its forward.  On a GPU it may need the
     * cotangents and gradients, and as much again for temporaries. */
    size_t need = 0;
    for (int i = 0; i < PB_MAX_IO; i++)
        need += 2 * (pb_tensor_bytes(&v->cot[i]) + ((v->wrt >> i) & 1 ? pb_tensor_bytes(&t->data.in_meta[i]) : 0));
    need += t->data.work_bytes;
    pb__req_submit(r, 2.0 * t->data.cost, t->data.device, need);
}

static void reverse_turn(pb_tape_waiter_t *w, pb_tape_t *t)
{
    pb_req_t *r = of_waiter(w);
    if (t)
        start_reverse(r, t);
    else
        tape_gone(r, r->u.rev.handle);
}

static int reverse_params(pb_req_t *r, const msgpack_object *params)
{
    static const char *const keys[] = {"tape", "cotangents", "keep", "order", "into", "accumulate", NULL};
    pb_req_reverse_t *v = &r->u.rev;
    int rc = pb_request_check_keys(params, keys, &r->err);
    if (rc == 0)
        rc = pb_request_accumulate(params, &r->accumulate, &r->err);
    if (rc == 0 && r->accumulate && pb__obj_get(params, "into") == NULL)
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "accumulate",
                        "accumulate adds gradients into their into buffers, and this reverse has no into");
    if (rc == 0) {
        const msgpack_object *o = pb__obj_get(params, "tape");
        if (o == NULL)
            rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "tape", "missing tape (the handle from augmented_forward)");
        else if (!pb__obj_handle(o, &v->handle))
            rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "tape", "tape must be a uint64 handle (a non-negative integer from augmented_forward)");
    }
    /* Contract section 3: {tape, cotangents, keep?}; {} asks for zeros. */
    if (rc == 0 && pb__obj_get(params, "cotangents") == NULL)
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "cotangents",
                        "missing cotangents (a map from output names to their cotangents; {} for all zero)");
    if (rc == 0)
        rc = pb_request_order(params, &v->order, &r->err);
    const msgpack_object *keep = pb__obj_get(params, "keep");
    if (rc == 0 && keep) {
        if (keep->type != MSGPACK_OBJECT_BOOLEAN)
            rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "keep", "keep must be true or false");
        else
            v->keep = keep->via.boolean;
    }
    return rc;
}

/* The tape behind r's handle as r's connection may see it, or NULL. */
static pb_tape_t *lookup(pb_req_t *r, uint64_t handle)
{
    return pb_tapes_lookup(&r->rpc->tapes, handle, pb_conn_uid(r->conn), pb_conn_tapes(r->conn),
                           uv_now(r->rpc->loop));
}

void pb__m_reverse(pb_req_t *r, const msgpack_object *params, pb_storage_t *msg)
{
    pb_req_reverse_t *v = &r->u.rev;
    r->kind = PB_REQ_REVERSE;
    int rc = reverse_params(r, params);
    if (rc)
        return pb__req_fail(r, rc);
    pb_tape_t *t = lookup(r, v->handle);
    if (t == NULL) {
        pb_err_set(&r->err, PB_EUNKNOWN_TAPE, "tape", "tape %llu is not held (consumed, released, expired, "
                   "of another connection, or never issued)", (unsigned long long)v->handle);
        return pb__req_fail(r, PB_EUNKNOWN_TAPE);
    }
    pb_resolver_t res = pb_buffers_resolver(pb_conn_buffers(r->conn));
    if ((rc = pb_request_cotangents(&t->data, pb__obj_get(params, "cotangents"), msg, &res, v->cot, &r->err)))
        return pb__req_fail(r, rc);
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
        gmeta[k].order = v->order;
    }
    if ((rc = pb_request_into(pb__obj_get(params, "into"), &res, op->wrt_names, op->nwrt, t->data.wrt, gmeta,
                              "gradient", r->into, &r->err)))
        return pb__req_fail(r, rc);
    /* A GPU buffer serves only a tape of its own GPU. */
    for (int k = 0; k < PB_MAX_IO + 2 && rc == 0; k++) {
        char what[64];
        if (k < op->noutputs) {
            snprintf(what, sizeof what, "cotangents.%s", op->outputs[k]);
            rc = pb_request_on_device(k < PB_MAX_IO ? v->cot[k].storage : NULL, t->data.device, what, &r->err);
        }
        if (rc == 0 && k < op->nwrt) {
            snprintf(what, sizeof what, "into.%s", op->wrt_names[k]);
            rc = pb_request_on_device(r->into[k].storage, t->data.device, what, &r->err);
        }
    }
    if (rc)
        return pb__req_fail(r, rc);
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
    pb__req_reserve(r, grads);
    r->encode = pb__enc_reverse;
    if (pb_tape_idle(t)) {
        start_reverse(r, t);
    } else {
        r->wait.run = reverse_turn;
        pb_tape_wait(t, &r->wait);
    }
}

/* ---- release -------------------------------------------------------------- */

static void do_release(pb_req_t *r, pb_tape_t *t)
{
    r->u.rel.released = t != NULL;
    if (t)
        pb_tapes_free(&r->rpc->tapes, t);
    pb__req_finish(r);
}

static void release_turn(pb_tape_waiter_t *w, pb_tape_t *t)
{
    do_release(of_waiter(w), t);
}

void pb__m_release(pb_req_t *r, const msgpack_object *params, pb_storage_t *msg)
{
    (void)msg;
    static const char *const keys[] = {"tape", NULL};
    r->kind = PB_REQ_RELEASE;
    int rc = pb_request_check_keys(params, keys, &r->err);
    const msgpack_object *h = pb__obj_get(params, "tape");
    if (rc == 0 && h == NULL)
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "tape", "missing tape");
    if (rc == 0 && !pb__obj_handle(h, &r->u.rel.handle))
        rc = pb_err_set(&r->err, PB_EINVALID_ARGUMENT, "tape", "tape must be a uint64 handle (a non-negative integer from augmented_forward)");
    if (rc)
        return pb__req_fail(r, rc);
    r->encode = pb__enc_release;
    pb_tape_t *t = lookup(r, r->u.rel.handle);
    if (t == NULL || pb_tape_idle(t)) {
        do_release(r, t);
    } else {
        r->wait.run = release_turn;
        pb_tape_wait(t, &r->wait);
    }
}
