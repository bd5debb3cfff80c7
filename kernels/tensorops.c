/* The helpers tensorcontract, tensoradd and tensortrace share
 * (tensorops.h). */
#include "tensorops.h"

#include <stdio.h>
#include <string.h>

#include "../cuda/exec.h"

const pb_io_spec_t pb__tops_t1_inputs[2] = {{"A", true}, {"C", false}};
const char *const pb__tops_c_outputs[1] = {"C"};
const char *const pb__tops_t1_wrt[4] = {"A", "C", "alpha", "beta"};


/* "[0, 2, 1]" into buf. */
const char *pb__tops_axes_str(const signed char *ax, int n, char *buf, size_t len)
{
    size_t o = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < n && o < len; i++)
        o += (size_t)snprintf(buf + o, len - o, "%s%d", i ? ", " : "", ax[i]);
    if (o < len)
        snprintf(buf + o, len - o, "]");
    return buf;
}

/* Are a ++ b (lengths na, nb) a permutation of 0..rank-1? */
bool pb__tops_is_perm(const signed char *a, int na, const signed char *b, int nb, int rank)
{
    if (na + nb != rank)
        return false;
    unsigned seen = 0;
    for (int i = 0; i < na + nb; i++) {
        int x = i < na ? a[i] : b[i - na];
        if (x < 0 || x >= rank || (seen & (1u << x)))
            return false;
        seen |= 1u << x;
    }
    return true;
}

int pb__tops_need_shape(const pb_tensor_t *t, int rank, const uint64_t *shape, const char *arg, pb_err_t *err)
{
    char s1[128], s2[128];
    pb_tensor_t want = {.rank = rank};
    memcpy(want.shape, shape, sizeof(uint64_t) * (size_t)rank);
    bool ok = t->rank == rank;
    for (int i = 0; ok && i < rank; i++)
        ok = t->shape[i] == shape[i];
    if (!ok)
        return pb_err_set(err, PB_ESHAPE_MISMATCH, arg, "%s must have shape %s, got %s", arg + 7,
                          pb_shape_str(&want, s1, sizeof s1), pb_shape_str(t, s2, sizeof s2));
    return 0;
}

/* The output's metadata, size checks and the cost of a pass over it. */
int pb__tops_set_output(pb_call_t *c, int rank, const uint64_t *shape, pb_err_t *err)
{
    pb_tensor_t *y = &c->out_meta[0];
    memset(y, 0, sizeof *y);
    y->dtype = c->dtype;
    y->rank = rank;
    y->order = c->order;
    memcpy(y->shape, shape, sizeof(uint64_t) * (size_t)rank);
    size_t bytes;
    if (!pb_shape_count(rank, shape, pb_dtype_size(c->dtype), NULL, &bytes))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs", "output C would have too many elements");
    return 0;
}

/* C: present when beta ≠ 0 or beta is in wrt; its shape that of the output. */
int pb__tops_check_c(pb_call_t *c, int ic, int obeta, int wbeta, pb_err_t *err)
{
    const pb_tensor_t *C = &c->in[ic];
    bool needed = nonzero(sc(&c->opt[obeta])) || (c->wrt & (1u << wbeta));
    if (needed && C->storage == NULL)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs.C",
                          "missing input C: it is read when beta is nonzero or in wrt");
    if (C->storage)
        return pb__tops_need_shape(C, c->out_meta[0].rank, c->out_meta[0].shape, "inputs.C", err);
    return 0;
}

size_t pb__tops_tape_of(const pb_call_t *c, bool a, bool b, bool cin, int ia, int ib, int ic)
{
    if (!c->taped)
        return 0;
    size_t n = 0;
    if (a)
        n += pb_tensor_bytes(&c->in[ia]);
    if (b && ib >= 0)
        n += pb_tensor_bytes(&c->in[ib]);
    if (cin)
        n += pb_tensor_bytes(&c->in[ic]);
    return n;
}



/* Save what the reverse needs for wrt: A, B, C as the minimal tape says. */
int pb__tops_save(pb_call_t *c, pb_tapedata_t *tape, bool a, bool b, bool cin, int ia, int ib, int ic)
{
    int rc = 0;
    if (a && (rc = pb_tape_keep(&tape->saved[SAVED_A], &c->in[ia])))
        return rc;
    if (b && ib >= 0 && (rc = pb_tape_keep(&tape->saved[SAVED_B], &c->in[ib])))
        return rc;
    if (cin && (rc = pb_tape_keep(&tape->saved[SAVED_C], &c->in[ic])))
        return rc;
    return 0;
}

int pb__tops_oom(pb_err_t *err, const char *op)
{
    return pb_err_set(err, PB_ENOMEM, NULL, "out of memory in %s", op);
}

/* Allocate the wanted gradients (zeroed when there is no cotangent). */
int pb__tops_alloc_grads(const pb_tapedata_t *t, int ninputs, pb_tensor_t *grad, char order, bool zero)
{
    for (int k = 0; k < t->op->nwrt; k++) {
        if (!(t->wrt & (1u << k)))
            continue;
        int rc;
        if (k < ninputs)
            rc = pb_tensor_alloc(&grad[k], t->dtype, t->in_meta[k].rank, t->in_meta[k].shape, order, zero);
        else
            rc = pb_tensor_alloc(&grad[k], t->dtype, 0, NULL, order, true);
        if (rc)
            return rc;
    }
    return 0;
}

/* A scalar gradient into its rank-0 tensor, real-projected when the
 * scalar was real. */
void pb__tops_put_scalar(pb_tensor_t *g, pb_scalar_t v, const pb_optval_t *opt)
{
    if (!opt->cplx)
        v.im = 0;
    union {
        float f[2];
        double d[2];
    } e = {.d = {0, 0}};
    switch (g->dtype) {
    case PB_F32: e.f[0] = (float)v.re; break;
    case PB_F64: e.d[0] = v.re; break;
    case PB_C64: e.f[0] = (float)v.re, e.f[1] = (float)v.im; break;
    case PB_C128: e.d[0] = v.re, e.d[1] = v.im; break;
    default: return;
    }
    if (pb_exec_gpu() >= 0) /* device memory (cuda/exec.h) */
        pb__exec_h2d(pb_tensor_data(g), &e, pb_dtype_size(g->dtype));
    else
        memcpy(pb_tensor_data(g), &e, pb_dtype_size(g->dtype));
}

/* A loop over all axes of one tensor, read through two stride sets. */
void pb__tops_loop_same(pb_loop_t *L, const pb_tview_t *a, const pb_tview_t *b)
{
    memset(L, 0, sizeof *L);
    L->rank = a->rank;
    for (int k = 0; k < a->rank; k++) {
        L->dim[k] = a->shape[k];
        L->s[0][k] = a->stride[k];
        L->s[1][k] = b->stride[k];
    }
}

/* dst = s·op(src) elementwise over one shape (dst may be src). */
void pb__tops_scale_into(pb_dtype_t d, pb_tensor_t *dst, const pb_tensor_t *src, pb_scalar_t s, bool conj)
{
    pb_tview_t vd = pb_tview_of(dst), vs = pb_tview_of(src);
    pb_loop_t L;
    pb__tops_loop_same(&L, &vd, &vs);
    pb_strided(d, &L, vd.p, vs.p, conj, s, NULL, ZERO, false);
}

pb_scalar_t pb__tops_dot_of(pb_dtype_t d, const pb_tensor_t *a, bool conj, const pb_tensor_t *b)
{
    pb_tview_t va = pb_tview_of(a), vb = pb_tview_of(b);
    pb_loop_t L;
    pb__tops_loop_same(&L, &va, &vb);
    return pb_strided_dot(d, &L, va.p, conj, vb.p);
}

/* C̄ = conj(β)·G and β̄ = ⟨C, G⟩, shared by the three ops. */
void pb__tops_grads_c_beta(const pb_tapedata_t *t, const pb_tensor_t *G, pb_tensor_t *grad, int ic, int obeta,
                         int wbeta)
{
    if (t->wrt & (1u << ic))
        pb__tops_scale_into(t->dtype, &grad[ic], G, sconj(sc(&t->opt[obeta])), false);
    if (t->wrt & (1u << wbeta))
        pb__tops_put_scalar(&grad[wbeta], pb__tops_dot_of(t->dtype, &t->saved[SAVED_C], false, G), &t->opt[obeta]);
}

