/* tensoradd: C = beta·C + alpha·permute(opA(A), pA), one strided pass;
 * its rule is in tensorops.h. */
#include "tensorops.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

/* options */
enum { TA_PA, TA_CONJA, TA_ALPHA, TA_BETA };

/* pA, defaulting to the identity. */
static int add_perm(const pb_optval_t *opt, const pb_tensor_t *A, signed char *p, pb_err_t *err)
{
    char b1[96];
    const pb_optval_t *pa = &opt[TA_PA];
    if (!pa->given) {
        for (int k = 0; k < A->rank; k++)
            p[k] = (signed char)k;
        return 0;
    }
    if (!pb__tops_is_perm(pa->ax[0], pa->nax[0], NULL, 0, A->rank))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.pA", "pA = %s must be a permutation of A's %d axes",
                          pb__tops_axes_str(pa->ax[0], pa->nax[0], b1, sizeof b1), A->rank);
    memcpy(p, pa->ax[0], (size_t)A->rank);
    return 0;
}

static int ta_validate(pb_call_t *c, pb_err_t *err)
{
    const pb_tensor_t *A = &c->in[TA_A];
    signed char p[PB_MAX_RANK];
    int rc = add_perm(c->opt, A, p, err);
    if (rc)
        return rc;
    uint64_t shape[PB_MAX_RANK];
    for (int d = 0; d < A->rank; d++)
        shape[d] = A->shape[(int)p[d]];
    if ((rc = pb__tops_set_output(c, A->rank, shape, err)) || (rc = pb__tops_check_c(c, TA_C, TA_BETA, T1_WBETA, err)))
        return rc;
    c->tape_bytes = pb__tops_tape_of(c, c->wrt & (1u << T1_WALPHA), false, c->wrt & (1u << T1_WBETA), TA_A, -1, TA_C);
    c->cost = flops_per(c->dtype) * 3.0 * (double)pb_tensor_count(A);
    return 0;
}

/* The loop over the output's axes: slot 0 the output-shaped y, slot 1
 * A read through p, slot 2 C. */
static void add_loop(pb_loop_t *L, const signed char *p, const pb_tview_t *y, const pb_tview_t *a,
                     const pb_tview_t *cin)
{
    memset(L, 0, sizeof *L);
    L->rank = y->rank;
    for (int d = 0; d < y->rank; d++) {
        L->dim[d] = y->shape[d];
        L->s[0][d] = y->stride[d];
        L->s[1][d] = a->stride[(int)p[d]];
        L->s[2][d] = cin ? cin->stride[d] : 0;
    }
}

static int ta_forward(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    const pb_tensor_t *A = &c->in[TA_A];
    signed char p[PB_MAX_RANK];
    int rc = add_perm(c->opt, A, p, err);
    if (rc)
        return rc;
    pb_tensor_t y = {0};
    const pb_tensor_t *ym = &c->out_meta[0];
    if (pb_tensor_alloc(&y, c->dtype, ym->rank, ym->shape, c->order, false))
        return pb__tops_oom(err, "tensoradd");
    pb_scalar_t beta = sc(&c->opt[TA_BETA]);
    pb_tview_t va = pb_tview_of(A), vy = pb_tview_of(&y), vc;
    if (nonzero(beta))
        vc = pb_tview_of(&c->in[TA_C]);
    pb_loop_t L;
    add_loop(&L, p, &vy, &va, nonzero(beta) ? &vc : NULL);
    pb_strided(c->dtype, &L, vy.p, va.p, pb_dtype_is_complex(c->dtype) && c->opt[TA_CONJA].b, sc(&c->opt[TA_ALPHA]),
               nonzero(beta) ? vc.p : NULL, beta, false);
    if (tape && (rc = pb__tops_save(c, tape, c->wrt & (1u << T1_WALPHA), false, c->wrt & (1u << T1_WBETA), TA_A, -1, TA_C))) {
        pb_tensor_clear(&y);
        return pb__tops_oom(err, "tensoradd");
    }
    c->out[0] = y;
    return 0;
}

static int ta_reverse(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                      pb_warnings_t *warn, pb_err_t *err)
{
    (void)warn;
    pb_dtype_t d = t->dtype;
    signed char p[PB_MAX_RANK];
    int rc = add_perm(t->opt, &t->in_meta[TA_A], p, err);
    if (rc)
        return rc;
    const pb_tensor_t *G = &cot[0];
    if (pb__tops_alloc_grads(t, 2, grad, order, G->storage == NULL)) {
        for (int k = 0; k < PB_MAX_IO + 2; k++)
            pb_tensor_clear(&grad[k]);
        return pb__tops_oom(err, "tensoradd reverse");
    }
    if (G->storage == NULL)
        return 0;
    bool cj = pb_dtype_is_complex(d) && t->opt[TA_CONJA].b;
    pb_scalar_t alpha = sc(&t->opt[TA_ALPHA]);
    pb_tview_t vg = pb_tview_of(G);
    pb_loop_t L;
    if (t->wrt & (1u << TA_A)) { /* Ā[p[d]…] = conj(α)·G, or α·conj(G) for conjA */
        pb_tview_t va = pb_tview_of(&grad[TA_A]);
        add_loop(&L, p, &vg, &va, NULL);
        pb_loop_swap01(&L); /* write through p, read G as it lies */
        pb_strided(d, &L, va.p, vg.p, cj, cj ? alpha : sconj(alpha), NULL, ZERO, false);
    }
    if (t->wrt & (1u << T1_WALPHA)) { /* ᾱ = ⟨permute(opA(A)), G⟩ */
        pb_tview_t va = pb_tview_of(&t->saved[SAVED_A]);
        add_loop(&L, p, &vg, &va, NULL);
        pb_loop_swap01(&L);
        pb__tops_put_scalar(&grad[T1_WALPHA], pb_strided_dot(d, &L, va.p, cj, vg.p), &t->opt[TA_ALPHA]);
    }
    pb__tops_grads_c_beta(t, G, grad, TA_C, TA_BETA, T1_WBETA);
    return 0;
}

static const pb_opt_spec_t ta_options[] = {
    {.name = "pA", .type = PB_OPT_AXES},
    {.name = "conjA", .type = PB_OPT_BOOL},
    TOPS_SCALAR("alpha", 1),
    TOPS_SCALAR("beta", 0),
};

const pb_op_t pb_op_tensoradd = {
    .name = "tensoradd",
    .inputs = pb__tops_t1_inputs,
    .ninputs = 2,
    .outputs = pb__tops_c_outputs,
    .noutputs = 1,
    .options = ta_options,
    .noptions = 4,
    .wrt_names = pb__tops_t1_wrt,
    .nwrt = 4,
    .dtypes = PB_DTYPES_ALL,
    .devices = 1u << PB_DEV_CPU | 1u << PB_DEV_CUDA,
    .validate = ta_validate,
    .forward = {[PB_DEV_CPU] = ta_forward, [PB_DEV_CUDA] = pb_gpu_shared_forward},
    .reverse = {[PB_DEV_CPU] = ta_reverse, [PB_DEV_CUDA] = pb_gpu_shared_reverse},
};
