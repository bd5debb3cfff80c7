/* tensortrace: C = beta·C + alpha·Σ_k A[p…, q1=k, q2=k], a scaling pass
 * and an accumulating pass whose traced index walks A's diagonal (stride
 * q1 + stride q2); its rule is in tensorops.h. */
#include "tensorops.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

/* options */
enum { TT_P, TT_Q, TT_CONJA, TT_ALPHA, TT_BETA };

typedef struct trace_spec {
    int np, nq;
    signed char p[PB_MAX_RANK], q1[PB_MAX_RANK], q2[PB_MAX_RANK];
} trace_spec_t;

static int trace_of(const pb_optval_t *opt, const pb_tensor_t *A, trace_spec_t *s, pb_err_t *err)
{
    char b1[96], b2[96], b3[96];
    const pb_optval_t *q = &opt[TT_Q], *p = &opt[TT_P];
    memset(s, 0, sizeof *s);
    if (q->given) {
        if (q->nax[0] != q->nax[1])
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.q", "q = [%s, %s]: the two lists must be as long",
                              pb__tops_axes_str(q->ax[0], q->nax[0], b1, sizeof b1), pb__tops_axes_str(q->ax[1], q->nax[1], b2, sizeof b2));
        s->nq = q->nax[0];
        memcpy(s->q1, q->ax[0], (size_t)s->nq);
        memcpy(s->q2, q->ax[1], (size_t)s->nq);
    }
    if (p->given) {
        s->np = p->nax[0];
        memcpy(s->p, p->ax[0], (size_t)s->np);
    } else {
        unsigned traced = 0;
        for (int i = 0; i < s->nq; i++)
            if (s->q1[i] >= 0 && s->q1[i] < PB_MAX_RANK && s->q2[i] >= 0 && s->q2[i] < PB_MAX_RANK)
                traced |= (1u << s->q1[i]) | (1u << s->q2[i]);
        for (int k = 0; k < A->rank; k++)
            if (!(traced & (1u << k)))
                s->p[s->np++] = (signed char)k;
    }
    signed char all[PB_MAX_RANK * 3];
    int n = 0;
    for (int i = 0; i < s->np && n < PB_MAX_RANK * 3; i++)
        all[n++] = s->p[i];
    for (int i = 0; i < s->nq && n < PB_MAX_RANK * 3 - 1; i++) {
        all[n++] = s->q1[i];
        all[n++] = s->q2[i];
    }
    if (n > PB_MAX_RANK || !pb__tops_is_perm(all, n, NULL, 0, A->rank))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, p->given ? "options.p" : "options.q",
                          "p = %s and q = [%s, %s] must together name each of A's %d axes once",
                          pb__tops_axes_str(s->p, s->np, b1, sizeof b1), pb__tops_axes_str(s->q1, s->nq, b2, sizeof b2),
                          pb__tops_axes_str(s->q2, s->nq, b3, sizeof b3), A->rank);
    for (int i = 0; i < s->nq; i++)
        if (A->shape[(int)s->q1[i]] != A->shape[(int)s->q2[i]])
            return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.A",
                              "traced axes %d and %d of A have sizes %llu and %llu", s->q1[i], s->q2[i],
                              (unsigned long long)A->shape[(int)s->q1[i]], (unsigned long long)A->shape[(int)s->q2[i]]);
    return 0;
}

/* ᾱ = ⟨trace(opA(A)), G⟩: the tape keeps that trace (output-sized) rather
 * than A when it is smaller (tensorops.h).  Needs c->out_meta[0]. */
static bool tt_keeps_trace(const pb_call_t *c)
{
    return (c->wrt & (1u << T1_WALPHA)) && pb_tensor_bytes(&c->out_meta[0]) < pb_tensor_bytes(&c->in[TA_A]);
}

static int tt_validate(pb_call_t *c, pb_err_t *err)
{
    const pb_tensor_t *A = &c->in[TA_A];
    trace_spec_t s;
    int rc = trace_of(c->opt, A, &s, err);
    if (rc)
        return rc;
    uint64_t shape[PB_MAX_RANK];
    for (int d = 0; d < s.np; d++)
        shape[d] = A->shape[(int)s.p[d]];
    if ((rc = pb__tops_set_output(c, s.np, shape, err)) || (rc = pb__tops_check_c(c, TA_C, TT_BETA, T1_WBETA, err)))
        return rc;
    bool kt = tt_keeps_trace(c);
    c->tape_bytes = pb__tops_tape_of(c, (c->wrt & (1u << T1_WALPHA)) && !kt, false, c->wrt & (1u << T1_WBETA), TA_A, -1,
                                     TA_C) +
                    (c->taped && kt ? pb_tensor_bytes(&c->out_meta[0]) : 0);
    double diag = 1;
    for (int d = 0; d < s.np; d++)
        diag *= (double)shape[d];
    for (int i = 0; i < s.nq; i++)
        diag *= (double)A->shape[(int)s.q1[i]];
    c->cost = flops_per(c->dtype) * 2.0 * diag;
    return 0;
}

/* The loop over free ++ traced indices: slot 0 the output-shaped y
 * (stride 0 along traced indices), slot 1 A along its diagonal. */
static void trace_loop(pb_loop_t *L, const trace_spec_t *s, const pb_tview_t *y, const pb_tview_t *a)
{
    memset(L, 0, sizeof *L);
    L->rank = s->np + s->nq;
    for (int d = 0; d < s->np; d++) {
        L->dim[d] = y->shape[d];
        L->s[0][d] = y->stride[d];
        L->s[1][d] = a->stride[(int)s->p[d]];
    }
    for (int i = 0; i < s->nq; i++) {
        L->dim[s->np + i] = a->shape[(int)s->q1[i]];
        L->s[0][s->np + i] = 0;
        /* Saturating: an empty A's strides may be INT64_MAX (pb_dense_strides). */
        int64_t st;
        if (__builtin_add_overflow(a->stride[(int)s->q1[i]], a->stride[(int)s->q2[i]], &st))
            st = INT64_MAX;
        L->s[1][s->np + i] = st;
    }
}

static int tt_forward(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    const pb_tensor_t *A = &c->in[TA_A];
    trace_spec_t s;
    int rc = trace_of(c->opt, A, &s, err);
    if (rc)
        return rc;
    pb_tensor_t y = {0};
    const pb_tensor_t *ym = &c->out_meta[0];
    if (pb_tensor_alloc(&y, c->dtype, ym->rank, ym->shape, c->order, false))
        return pb__tops_oom(err, "tensortrace");
    pb_scalar_t beta = sc(&c->opt[TT_BETA]);
    if (nonzero(beta))
        pb__tops_scale_into(c->dtype, &y, &c->in[TA_C], beta, false);
    else
        pb_tensor_zero(&y);
    pb_tview_t va = pb_tview_of(A), vy = pb_tview_of(&y);
    pb_loop_t L;
    bool cj = pb_dtype_is_complex(c->dtype) && c->opt[TT_CONJA].b, kt = tape && tt_keeps_trace(c);
    pb_scalar_t alpha = sc(&c->opt[TT_ALPHA]);
    pb_tensor_t tr = {0};
    if (nonzero(alpha)) { /* alpha = 0: A is not read, as in tensoradd and tensorcontract (BLAS) */
        trace_loop(&L, &s, &vy, &va);
        pb_strided(c->dtype, &L, vy.p, va.p, cj, alpha, NULL, ZERO, true);
    }
    if (kt) {
        /* trace(opA(A)) for the tape, in a pass of its own: y is bitwise
         * what forward gives (Σ alpha·a, not alpha·Σ a, which rounds
         * otherwise and can overflow where the other does not) */
        if (pb_tensor_alloc(&tr, c->dtype, ym->rank, ym->shape, 'C', true)) {
            pb_tensor_clear(&y);
            return pb__tops_oom(err, "tensortrace");
        }
        pb_tview_t vt = pb_tview_of(&tr);
        trace_loop(&L, &s, &vt, &va);
        pb_strided(c->dtype, &L, vt.p, va.p, cj, ONE, NULL, ZERO, true);
    }
    if (tape && (rc = pb__tops_save(c, tape, (c->wrt & (1u << T1_WALPHA)) && !kt, false, c->wrt & (1u << T1_WBETA),
                                    TA_A, -1, TA_C))) {
        pb_tensor_clear(&tr);
        pb_tensor_clear(&y);
        return pb__tops_oom(err, "tensortrace");
    }
    if (kt)
        tape->saved[SAVED_M] = tr; /* the tape's now */
    c->out[0] = y;
    return 0;
}

static int tt_reverse(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                      pb_warnings_t *warn, pb_err_t *err)
{
    (void)warn;
    pb_dtype_t d = t->dtype;
    trace_spec_t s;
    int rc = trace_of(t->opt, &t->in_meta[TA_A], &s, err);
    if (rc)
        return rc;
    const pb_tensor_t *G = &cot[0];
    /* Ā is zero off the traced diagonal: allocate it zeroed always. */
    if (pb__tops_alloc_grads(t, 2, grad, order, true)) {
        for (int k = 0; k < PB_MAX_IO + 2; k++)
            pb_tensor_clear(&grad[k]);
        return pb__tops_oom(err, "tensortrace reverse");
    }
    if (G->storage == NULL)
        return 0;
    bool cj = pb_dtype_is_complex(d) && t->opt[TT_CONJA].b;
    pb_scalar_t alpha = sc(&t->opt[TT_ALPHA]);
    pb_tview_t vg = pb_tview_of(G);
    pb_loop_t L;
    if (t->wrt & (1u << TA_A)) { /* the diagonal of Ā = conj(α)·G (α·conj(G) for conjA) */
        pb_tview_t va = pb_tview_of(&grad[TA_A]);
        trace_loop(&L, &s, &vg, &va);
        pb_loop_swap01(&L);
        pb_strided(d, &L, va.p, vg.p, cj, cj ? alpha : sconj(alpha), NULL, ZERO, false);
    }
    if ((t->wrt & (1u << T1_WALPHA)) && t->saved[SAVED_M].storage) /* ᾱ = ⟨trace(opA(A)), G⟩, kept */
        pb__tops_put_scalar(&grad[T1_WALPHA], pb__tops_dot_of(d, &t->saved[SAVED_M], false, G), &t->opt[TT_ALPHA]);
    else if (t->wrt & (1u << T1_WALPHA)) { /* from A */
        pb_tview_t va = pb_tview_of(&t->saved[SAVED_A]);
        trace_loop(&L, &s, &vg, &va);
        pb_loop_swap01(&L);
        pb__tops_put_scalar(&grad[T1_WALPHA], pb_strided_dot(d, &L, va.p, cj, vg.p), &t->opt[TT_ALPHA]);
    }
    pb__tops_grads_c_beta(t, G, grad, TA_C, TT_BETA, T1_WBETA);
    return 0;
}

static const pb_opt_spec_t tt_options[] = {
    {.name = "p", .type = PB_OPT_AXES}, {.name = "q", .type = PB_OPT_AXES2}, {.name = "conjA", .type = PB_OPT_BOOL},
    TOPS_SCALAR("alpha", 1),                 TOPS_SCALAR("beta", 0),
};

const pb_op_t pb_op_tensortrace = {
    .name = "tensortrace",
    .inputs = pb__tops_t1_inputs,
    .ninputs = 2,
    .outputs = pb__tops_c_outputs,
    .noutputs = 1,
    .options = tt_options,
    .noptions = 5,
    .wrt_names = pb__tops_t1_wrt,
    .nwrt = 4,
    .dtypes = PB_DTYPES_ALL,
    .devices = 1u << PB_DEV_CPU | 1u << PB_DEV_CUDA,
    .validate = tt_validate,
    .forward = {[PB_DEV_CPU] = tt_forward, [PB_DEV_CUDA] = pb_gpu_shared_forward},
    .reverse = {[PB_DEV_CPU] = tt_reverse, [PB_DEV_CUDA] = pb_gpu_shared_reverse},
};
