/* Reply encoders (reply.h): the result map of each method, written from
 * the request that computed it. */
#include "reply.h"

#include <stdio.h>

#include "../cuda/gpu.h"

#include "buffer.h"
#include "catalogue.h"
#include "rpc.h"

#ifndef PB_VERSION
#define PB_VERSION "0"
#endif

static void enc_outputs(pb_req_t *r, pb_out_t *o)
{
    const pb_op_t *op = r->u.call.call.op;
    pb_out_str(o, "outputs");
    msgpack_pack_map(&o->pk, (size_t)op->noutputs);
    for (int i = 0; i < op->noutputs; i++) {
        pb_out_str(o, op->outputs[i]);
        if (r->into[i].storage)
            pb_out_tensor_in_buffer(o, &r->into_meta[i], r->into[i].buffer, r->into[i].offset);
        else
            pb_out_tensor(o, &r->u.call.call.out[i]);
    }
}

void pb__enc_forward(pb_req_t *r, pb_out_t *o)
{
    msgpack_pack_map(&o->pk, 1);
    enc_outputs(r, o);
}

void pb__enc_augmented(pb_req_t *r, pb_out_t *o)
{
    msgpack_pack_map(&o->pk, 3);
    enc_outputs(r, o);
    pb_out_str(o, "tape");
    msgpack_pack_uint64(&o->pk, r->u.call.made->handle);
    pb_out_str(o, "tape_bytes");
    msgpack_pack_uint64(&o->pk, r->u.call.made->bytes);
}

void pb__enc_reverse(pb_req_t *r, pb_out_t *o)
{
    const pb_req_reverse_t *v = &r->u.rev;
    const pb_op_t *op = v->op;
    unsigned wrt = v->wrt;
    msgpack_pack_map(&o->pk, v->warn.n ? 2 : 1);
    pb_out_str(o, "gradients");
    msgpack_pack_map(&o->pk, (size_t)__builtin_popcount(wrt));
    for (int k = 0; k < op->nwrt; k++) {
        if (!(wrt & (1u << k)))
            continue;
        pb_out_str(o, op->wrt_names[k]);
        if (r->into[k].storage)
            pb_out_tensor_in_buffer(o, &r->into_meta[k], r->into[k].buffer, r->into[k].offset);
        else
            pb_out_tensor(o, &v->grad[k]);
    }
    if (v->warn.n) {
        pb_out_str(o, "warnings");
        msgpack_pack_array(&o->pk, (size_t)v->warn.n);
        for (int i = 0; i < v->warn.n; i++)
            pb_out_str(o, v->warn.text[i]);
    }
}

void pb__enc_register(pb_req_t *r, pb_out_t *o)
{
    msgpack_pack_map(&o->pk, 1);
    pb_out_str(o, "buffer");
    msgpack_pack_uint64(&o->pk, r->u.buffer);
}

void pb__enc_unregister(pb_req_t *r, pb_out_t *o)
{
    (void)r;
    msgpack_pack_map(&o->pk, 1);
    pb_out_str(o, "unregistered");
    msgpack_pack_true(&o->pk);
}

void pb__enc_release(pb_req_t *r, pb_out_t *o)
{
    msgpack_pack_map(&o->pk, 1);
    pb_out_str(o, "released");
    if (r->u.rel.released)
        msgpack_pack_true(&o->pk);
    else
        msgpack_pack_false(&o->pk);
}

void pb__enc_check(pb_req_t *r, pb_out_t *o)
{
    const pb_req_call_t *x = &r->u.call;
    const pb_op_t *op = x->call.op;
    msgpack_pack_map(&o->pk, 2);
    pb_out_str(o, "max_rel_err");
    msgpack_pack_double(&o->pk, x->max_rel);
    pb_out_str(o, "per_input");
    msgpack_pack_map(&o->pk, (size_t)__builtin_popcount(x->call.wrt));
    for (int k = 0; k < op->nwrt; k++) {
        if (!(x->call.wrt & (1u << k)))
            continue;
        pb_out_str(o, op->wrt_names[k]);
        msgpack_pack_double(&o->pk, x->per_input[k]);
    }
}

void pb__enc_ops(pb_req_t *r, pb_out_t *o)
{
    (void)r;
    msgpack_pack_map(&o->pk, 1);
    pb_out_str(o, "ops");
    pb_catalogue_ops(o);
}

void pb__enc_hello(pb_req_t *r, pb_out_t *o)
{
    const pb_config_t *cfg = r->rpc->cfg;
    msgpack_pack_map(&o->pk, 5);
    pb_out_str(o, "protocol");
    msgpack_pack_int(&o->pk, 1);
    pb_out_str(o, "version");
    pb_out_str(o, PB_VERSION);
    pb_out_str(o, "devices");
    pb_catalogue_device_list(o);
    pb_out_str(o, "dtypes");
    pb_catalogue_dtypes(o, PB_DTYPES_ALL);
    pb_out_str(o, "limits");
    pb_config_limit_t lim[PB_CONFIG_MAX_LIMITS];
    int n = pb_config_limits(cfg, lim);
    msgpack_pack_map(&o->pk, (size_t)n + 2);
    for (int i = 0; i < n; i++) {
        pb_out_str(o, lim[i].name);
        msgpack_pack_uint64(&o->pk, lim[i].value);
    }
    /* Not settings: what the kernel lets the daemon map (daemon/buffer.h). */
    pb_out_str(o, "max_mapped_buffers");
    msgpack_pack_uint64(&o->pk, pb_shm_max_mappings());
    pb_out_str(o, "max_mapped_buffers_per_uid");
    msgpack_pack_uint64(&o->pk, pb_shm_max_mappings_per_uid());
}

void pb__enc_stats(pb_req_t *r, pb_out_t *o)
{
    pb_rpc_t *s = r->rpc;
    const pb_peer_acct_t *me = pb_tapes_peer(&s->tapes, pb_conn_uid(r->conn));
    /* Every uid's figures for admins; the caller's own for the others. */
    bool all = pb__req_admin(r);
    uid_t uid = pb_conn_uid(r->conn);
    size_t npeers = 0;
    for (size_t i = 0; i < s->tapes.npeers; i++)
        npeers += s->tapes.peers[i].tapes > 0 && (all || s->tapes.peers[i].uid == uid);
    size_t nbuf, buf_bytes;
    pb_shm_totals(&nbuf, &buf_bytes);
    msgpack_pack_map(&o->pk, 13);
    /* serving; draining (the admin's drain: no new forward calls); stopping
     * (SIGTERM or shutdown: the drain before the exit). */
    pb_out_str(o, "state");
    pb_out_str(o, s->stopping ? "stopping" : s->draining ? "draining" : "serving");
    pb_out_str(o, "tapes");
    msgpack_pack_uint64(&o->pk, s->tapes.count);
    pb_out_str(o, "tape_bytes");
    msgpack_pack_uint64(&o->pk, s->tapes.bytes);
    pb_out_str(o, "peer_tapes");
    msgpack_pack_uint64(&o->pk, me ? me->tapes : 0);
    pb_out_str(o, "peer_tape_bytes");
    msgpack_pack_uint64(&o->pk, me ? me->bytes : 0);
    pb_out_str(o, "connections");
    msgpack_pack_uint64(&o->pk, pb_conns_count(s->conns));
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
    int ngpu = pb_gpu_count();
    msgpack_pack_array(&o->pk, 1 + (size_t)ngpu);
    msgpack_pack_map(&o->pk, 2);
    pb_out_str(o, "name");
    pb_out_str(o, "cpu");
    pb_out_str(o, "memory_bytes");
    msgpack_pack_uint64(&o->pk, pb_config_phys_memory());
    for (int g = 0; g < ngpu; g++) {
        pb_gpu_info_t info = {.total_bytes = 0};
        pb_gpu->info(g, &info);
        char name[16];
        snprintf(name, sizeof name, "cuda:%d", g);
        msgpack_pack_map(&o->pk, 7);
        pb_out_str(o, "name");
        pb_out_str(o, name);
        pb_out_str(o, "model");
        pb_out_str(o, info.name);
        pb_out_str(o, "memory_bytes");
        msgpack_pack_uint64(&o->pk, info.total_bytes);
        pb_out_str(o, "used_bytes");
        msgpack_pack_uint64(&o->pk, pb_gpu->used(g));
        pb_out_str(o, "tapes");
        msgpack_pack_uint64(&o->pk, s->tapes.gpu_tapes[g]);
        pb_out_str(o, "tape_bytes");
        msgpack_pack_uint64(&o->pk, s->tapes.gpu_bytes[g]);
        pb_out_str(o, "failed");
        if (pb_gpu->failed(g))
            msgpack_pack_true(&o->pk);
        else
            msgpack_pack_false(&o->pk);
    }
    pb_out_str(o, "peers");
    msgpack_pack_array(&o->pk, npeers);
    for (size_t i = 0; i < s->tapes.npeers; i++) {
        const pb_peer_acct_t *p = &s->tapes.peers[i];
        if (p->tapes == 0 || !(all || p->uid == uid))
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

void pb__enc_metrics(pb_req_t *r, pb_out_t *o)
{
    msgpack_pack_map(&o->pk, 2);
    pb_out_str(o, "text");
    msgpack_pack_str_with_body(&o->pk, r->u.text.ptr, r->u.text.len);
    pb_out_str(o, "content_type");
    pb_out_str(o, "text/plain; version=0.0.4; charset=utf-8");
}

void pb__enc_admin(pb_req_t *r, pb_out_t *o)
{
    msgpack_pack_map(&o->pk, 1);
    pb_out_str(o, r->rpc->stopping ? "shutting_down" : "draining");
    msgpack_pack_true(&o->pk);
}

