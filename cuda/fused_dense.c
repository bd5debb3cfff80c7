/* fused_dense on the GPU: the CPU op's rule (kernels/fused_dense.c) with
 * the same minimal tape, on a worker bound to the call's device.
 *
 * Forward: the inputs go to the device, y = W·x by the backend's GEMM,
 * then one bias+activation kernel (act.h's math), and y comes back.
 * Reverse: ȳ goes to the device in the order of the saved source, one dz
 * kernel in place, W̄ = dz·xᵀ and x̄ = Wᵀ·dz as GEMMs, b̄ as a
 * deterministic row sum, and the gradients come back.  The tape holds
 * device tensors only: the activation's source, x for W̄, W for x̄. */
#include <string.h>

#include "../kernels/act.h"
#include "gpu_ops.h"

enum { IN_W, IN_X, IN_B };
enum { OPT_ACT };
enum { SAVED_SRC, SAVED_X, SAVED_W };

static const pb_scalar_t one = {1, 0}, zero = {0, 0};

/* c = a·b, or zeros when the inner dimension is empty. */
static int gemm_or_zero(pb_dtype_t d, pb_mview_t a, pb_mview_t b, pb_tensor_t *c)
{
    if (a.cols == 0)
        return pb_gpu->zero(pb_tensor_data(c), pb_tensor_bytes(c));
    return pb_gpu_gemm(d, one, a, b, zero, pb_mview_of(c));
}

int pb_gpu_fused_dense_forward(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    int dev = c->device.index, act = c->opt[OPT_ACT].index;
    const pb_tensor_t *ym = &c->out_meta[0];
    size_t out = ym->shape[0], batch = ym->rank == 2 ? ym->shape[1] : 1;
    bool taped = tape && c->wrt, save_z = taped && pb_act_src[act] == PB_ACT_FROM_Z;
    pb_tensor_t w = {0}, x = {0}, b = {0}, y = {0}, z = {0}, host = {0};
    int rc = pb_gpu_upload(&w, dev, &c->in[IN_W]);
    if (rc == 0)
        rc = pb_gpu_upload(&x, dev, &c->in[IN_X]);
    if (rc == 0 && c->in[IN_B].storage)
        rc = pb_gpu_upload(&b, dev, &c->in[IN_B]);
    if (rc == 0)
        rc = pb_gpu_tensor_alloc(&y, dev, c->dtype, ym->rank, ym->shape, c->order);
    if (rc == 0 && save_z)
        rc = pb_gpu_tensor_alloc(&z, dev, c->dtype, ym->rank, ym->shape, c->order);
    if (rc == 0)
        rc = gemm_or_zero(c->dtype, pb_mview_of(&w), pb_mview_of(&x), &y);
    if (rc == 0)
        rc = pb_gpu->bias_act((int)c->dtype, act, pb_tensor_data(&y), save_z ? pb_tensor_data(&z) : NULL,
                              b.storage ? pb_tensor_data(&b) : NULL, out, batch, ym->rank == 1 ? 'F' : c->order);
    if (rc == 0)
        rc = pb_gpu_download(&host, &y);
    /* A tape owns what it keeps: not a client's GPU buffer. */
    if (rc == 0 && taped && (c->wrt & (1u << IN_W)))
        rc = pb_gpu_own(&x, dev);
    if (rc == 0 && taped && (c->wrt & (1u << IN_X)))
        rc = pb_gpu_own(&w, dev);
    if (rc == 0)
        rc = pb_gpu->sync();
    if (rc == 0 && taped) {
        if (pb_act_src[act] != PB_ACT_FROM_NONE)
            tape->saved[SAVED_SRC] = save_z ? z : y;
        if (save_z)
            z = (pb_tensor_t){0};
        else if (pb_act_src[act] == PB_ACT_FROM_Y)
            y = (pb_tensor_t){0};
        if (c->wrt & (1u << IN_W)) {
            tape->saved[SAVED_X] = x;
            x = (pb_tensor_t){0};
        }
        if (c->wrt & (1u << IN_X)) {
            tape->saved[SAVED_W] = w;
            w = (pb_tensor_t){0};
        }
    }
    pb_tensor_t *temps[] = {&w, &x, &b, &y, &z};
    for (size_t i = 0; i < sizeof temps / sizeof *temps; i++)
        pb_tensor_clear(temps[i]);
    if (rc) {
        pb_tensor_clear(&host);
        return pb_gpu_fail(err, rc, dev, "fused_dense forward");
    }
    c->out[0] = host;
    return 0;
}

int pb_gpu_fused_dense_reverse(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                               pb_warnings_t *warn, pb_err_t *err)
{
    (void)warn;
    int dev = t->device.index, act = t->opt[OPT_ACT].index;
    const pb_tensor_t *ym = &t->out_meta[0], *src = &t->saved[SAVED_SRC];
    size_t out = ym->shape[0], batch = ym->rank == 2 ? ym->shape[1] : 1;
    pb_dtype_t d = t->dtype;
    if (cot[0].storage == NULL) { /* ȳ = 0: every gradient is zero */
        for (int k = 0; k < 3; k++) {
            const pb_tensor_t *m = &t->in_meta[k];
            if ((t->wrt & (1u << k)) && pb_tensor_alloc(&grad[k], d, m->rank, m->shape, order, true)) {
                for (int j = 0; j < 3; j++)
                    pb_tensor_clear(&grad[j]);
                return pb_err_set(err, PB_ENOMEM, NULL, "out of memory in fused_dense reverse");
            }
        }
        return 0;
    }
    /* dz in the order of the saved source (vectors and identity: ȳ's). */
    char o = src->storage && ym->rank == 2 ? src->order : cot[0].order;
    pb_tensor_t yb = {0}, dz = {0}, g[3] = {{0}};
    int rc = 0;
    if (cot[0].order == o)
        pb_tensor_ref(&yb, &cot[0]);
    else
        rc = pb_tensor_to_order(&yb, &cot[0], o);
    if (rc == 0)
        rc = pb_gpu_upload(&dz, dev, &yb);
    pb_tensor_clear(&yb);
    if (rc == 0)
        rc = pb_gpu->dz((int)d, act, pb_tensor_data(&dz), pb_tensor_data(&dz),
                        src->storage ? pb_tensor_data(src) : NULL, out, batch, ym->rank == 1 ? 'F' : o);
    for (int k = 0; k < 3 && rc == 0; k++)
        if (t->wrt & (1u << k))
            rc = pb_gpu_tensor_alloc(&g[k], dev, d, t->in_meta[k].rank, t->in_meta[k].shape, order);
    pb_mview_t dzv = pb_mview_of(&dz);
    if (rc == 0 && (t->wrt & (1u << IN_W))) /* W̄ = dz·xᵀ */
        rc = gemm_or_zero(d, dzv, pb_mview_transpose(pb_mview_of(&t->saved[SAVED_X])), &g[IN_W]);
    if (rc == 0 && (t->wrt & (1u << IN_X))) /* x̄ = Wᵀ·dz */
        rc = gemm_or_zero(d, pb_mview_transpose(pb_mview_of(&t->saved[SAVED_W])), dzv, &g[IN_X]);
    if (rc == 0 && (t->wrt & (1u << IN_B)))
        rc = pb_gpu->row_sum((int)d, pb_tensor_data(&dz), pb_tensor_data(&g[IN_B]), out, batch,
                             ym->rank == 1 ? 'F' : o);
    for (int k = 0; k < 3 && rc == 0; k++)
        if (g[k].storage)
            rc = pb_gpu_download(&grad[k], &g[k]);
    if (rc == 0)
        rc = pb_gpu->sync();
    pb_tensor_clear(&dz);
    for (int k = 0; k < 3; k++)
        pb_tensor_clear(&g[k]);
    if (rc) {
        for (int k = 0; k < 3; k++)
            pb_tensor_clear(&grad[k]);
        return pb_gpu_fail(err, rc, dev, "fused_dense reverse");
    }
    return 0;
}
