/* tensorcontract: C = beta·C + alpha·permute(opA(A)·opB(B), pAB), one GEMM
 * (contract.c), or the einsum form `spec`; its rule is in tensorops.h. */
#include "tensorops.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

/* tensorcontract's inputs, options and wrt slots */
enum { TC_A, TC_B, TC_C };
enum { TC_PA, TC_PB, TC_PAB, TC_CONJA, TC_CONJB, TC_ALPHA, TC_BETA, TC_SPEC };
enum { TC_WALPHA = 3, TC_WBETA = 4 };

/* The einsum form: "ab,bc->ac".  Fills s (and checks ranks and sizes). */
static int parse_spec(const char *spec, const pb_tensor_t *A, const pb_tensor_t *B, pb_cspec_t *s, pb_err_t *err)
{
    const char *arg = "options.spec";
    const char *comma = strchr(spec, ','), *arrow = strstr(spec, "->");
    if (comma == NULL || arrow == NULL || comma > arrow || strchr(comma + 1, ',') || strstr(arrow + 2, "->"))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "spec must look like \"ijk,kl->lij\", got \"%s\"",
                          pb_quote(PB_QUOTED, spec, strlen(spec)));
    const char *part[3] = {spec, comma + 1, arrow + 2};
    int len[3] = {(int)(comma - spec), (int)(arrow - comma - 1), (int)strlen(arrow + 2)};
    int where[3][128];
    memset(where, -1, sizeof where);
    for (int k = 0; k < 3; k++) {
        if (len[k] > PB_MAX_RANK)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "spec: operand %d has more than 16 letters", k + 1);
        for (int i = 0; i < len[k]; i++) {
            unsigned char ch = (unsigned char)part[k][i];
            if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z')))
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "spec: '%c' is not a letter a-z or A-Z",
                                  ch >= 32 && ch < 127 ? ch : '?');
            if (where[k][ch] >= 0)
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "spec: letter '%c' repeats in %s", ch,
                                  k == 0 ? "A" : k == 1 ? "B" : "the output");
            where[k][ch] = i;
        }
    }
    const char *nm[2] = {"A", "B"};
    const pb_tensor_t *t[2] = {A, B};
    for (int k = 0; k < 2; k++)
        if (t[k]->rank != len[k]) {
            char sh[96];
            return pb_err_set(err, PB_ESHAPE_MISMATCH, k ? "inputs.B" : "inputs.A",
                              "spec gives %s %d axes but %s has shape %s", nm[k], len[k], nm[k],
                              pb_shape_str(t[k], sh, sizeof sh));
        }
    s->noA = s->nc = s->noB = 0;
    signed char mOut[2 * PB_MAX_RANK];
    int nM = 0;
    for (int i = 0; i < len[0]; i++) {
        unsigned char ch = (unsigned char)part[0][i];
        int inB = where[1][ch], inO = where[2][ch];
        if (inB >= 0) {
            if (inO >= 0)
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg,
                                  "spec: letter '%c' is in A, B and the output (batch axes are not supported)", ch);
            if (A->shape[i] != B->shape[inB])
                return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.B",
                                  "spec: contracted letter '%c' has size %llu in A but %llu in B", ch,
                                  (unsigned long long)A->shape[i], (unsigned long long)B->shape[inB]);
            s->cA[s->nc] = (signed char)i;
            s->cB[s->nc++] = (signed char)inB;
        } else {
            if (inO < 0)
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg,
                                  "spec: letter '%c' of A is neither in B nor in the output", ch);
            s->oA[s->noA++] = (signed char)i;
            mOut[nM++] = (signed char)ch;
        }
    }
    for (int i = 0; i < len[1]; i++) {
        unsigned char ch = (unsigned char)part[1][i];
        if (where[0][ch] >= 0)
            continue;
        if (where[2][ch] < 0)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, arg,
                              "spec: letter '%c' of B is neither in A nor in the output", ch);
        s->oB[s->noB++] = (signed char)i;
        mOut[nM++] = (signed char)ch;
    }
    if (len[2] != nM) {
        for (int i = 0; i < len[2]; i++) {
            unsigned char ch = (unsigned char)part[2][i];
            if (where[0][ch] < 0 && where[1][ch] < 0)
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "spec: output letter '%c' is in neither A nor B",
                                  ch);
        }
        return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "spec: the output must hold each open letter once");
    }
    for (int d = 0; d < len[2]; d++) {
        unsigned char ch = (unsigned char)part[2][d];
        int m = -1;
        for (int k = 0; k < nM; k++)
            if (mOut[k] == (signed char)ch)
                m = k;
        if (m < 0)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "spec: output letter '%c' is contracted or absent",
                              ch);
        s->pAB[d] = (signed char)m;
    }
    return 0;
}

/* pA, pB, pAB (or spec) into s, checked against A's and B's shapes. */
static int cspec_of(const pb_optval_t *opt, const pb_tensor_t *A, const pb_tensor_t *B, pb_cspec_t *s, pb_err_t *err)
{
    char b1[96], b2[96];
    memset(s, 0, sizeof *s);
    if (opt[TC_SPEC].given) {
        if (opt[TC_PA].given || opt[TC_PB].given || opt[TC_PAB].given)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.spec", "give either spec or pA/pB/pAB, not both");
        return parse_spec(opt[TC_SPEC].text, A, B, s, err);
    }
    if (!opt[TC_PA].given || !opt[TC_PB].given)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, opt[TC_PA].given ? "options.pB" : "options.pA",
                          "tensorcontract needs pA = [openA, contA] and pB = [contB, openB], or spec");
    const pb_optval_t *pa = &opt[TC_PA], *pb = &opt[TC_PB], *pab = &opt[TC_PAB];
    if (!pb__tops_is_perm(pa->ax[0], pa->nax[0], pa->ax[1], pa->nax[1], A->rank))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.pA",
                          "pA = [%s, %s] must split a permutation of A's %d axes", pb__tops_axes_str(pa->ax[0], pa->nax[0], b1, sizeof b1),
                          pb__tops_axes_str(pa->ax[1], pa->nax[1], b2, sizeof b2), A->rank);
    if (!pb__tops_is_perm(pb->ax[0], pb->nax[0], pb->ax[1], pb->nax[1], B->rank))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.pB",
                          "pB = [%s, %s] must split a permutation of B's %d axes", pb__tops_axes_str(pb->ax[0], pb->nax[0], b1, sizeof b1),
                          pb__tops_axes_str(pb->ax[1], pb->nax[1], b2, sizeof b2), B->rank);
    if (pa->nax[1] != pb->nax[0])
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.pB", "pB contracts %d axes of B but pA contracts %d of A",
                          pb->nax[0], pa->nax[1]);
    s->noA = pa->nax[0];
    s->nc = pa->nax[1];
    s->noB = pb->nax[1];
    memcpy(s->oA, pa->ax[0], (size_t)s->noA);
    memcpy(s->cA, pa->ax[1], (size_t)s->nc);
    memcpy(s->cB, pb->ax[0], (size_t)s->nc);
    memcpy(s->oB, pb->ax[1], (size_t)s->noB);
    for (int v = 0; v < s->nc; v++)
        if (A->shape[(int)s->cA[v]] != B->shape[(int)s->cB[v]])
            return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.B",
                              "contracted axis %d of A has size %llu but axis %d of B has size %llu", s->cA[v],
                              (unsigned long long)A->shape[(int)s->cA[v]], s->cB[v],
                              (unsigned long long)B->shape[(int)s->cB[v]]);
    int nm = s->noA + s->noB;
    if (nm > PB_MAX_RANK)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.pA", "the output would have rank %d, above 16", nm);
    if (pab->given) {
        if (!pb__tops_is_perm(pab->ax[0], pab->nax[0], NULL, 0, nm))
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.pAB", "pAB = %s must be a permutation of the %d output axes",
                              pb__tops_axes_str(pab->ax[0], pab->nax[0], b1, sizeof b1), nm);
        memcpy(s->pAB, pab->ax[0], (size_t)nm);
    } else
        for (int d = 0; d < nm; d++)
            s->pAB[d] = (signed char)d;
    return 0;
}

int pb_tensorcontract_spec(const pb_optval_t *opt, const pb_tensor_t *A, const pb_tensor_t *B, pb_cspec_t *s,
                           pb_err_t *err)
{
    return cspec_of(opt, A, B, s, err);
}

/* Shape of axis m of M = [open A ++ open B]. */
static uint64_t m_dim(const pb_cspec_t *s, const pb_tensor_t *A, const pb_tensor_t *B, int m)
{
    return m < s->noA ? A->shape[(int)s->oA[m]] : B->shape[(int)s->oB[m - s->noA]];
}

/* What the tape keeps for c's wrt (tensorops.h): B for Ā, A for B̄, and
 * for ᾱ either M (the output-sized opA(A)·opB(B), permuted) or A and B,
 * whichever adds fewer bytes.  Needs c->out_meta[0]. */
typedef struct {
    bool a, b, m;
} tc_keep_t;

static tc_keep_t tc_keep(const pb_call_t *c)
{
    unsigned w = c->wrt;
    tc_keep_t k = {(w & (1u << TC_B)) != 0, (w & (1u << TC_A)) != 0, false};
    if (w & (1u << TC_WALPHA)) {
        size_t more = (k.a ? 0 : pb_tensor_bytes(&c->in[TC_A])) + (k.b ? 0 : pb_tensor_bytes(&c->in[TC_B]));
        if (pb_tensor_bytes(&c->out_meta[0]) < more)
            k.m = true;
        else
            k.a = k.b = true;
    }
    return k;
}

static int tc_validate(pb_call_t *c, pb_err_t *err)
{
    const pb_tensor_t *A = &c->in[TC_A], *B = &c->in[TC_B];
    pb_cspec_t s;
    int rc = cspec_of(c->opt, A, B, &s, err);
    if (rc)
        return rc;
    uint64_t shape[PB_MAX_RANK], ni = 1, nj = 1, nk = 1;
    int nm = s.noA + s.noB;
    for (int d = 0; d < nm; d++)
        shape[d] = m_dim(&s, A, B, s.pAB[d]);
    for (int t = 0; t < s.noA; t++)
        ni *= A->shape[(int)s.oA[t]];
    for (int u = 0; u < s.noB; u++)
        nj *= B->shape[(int)s.oB[u]];
    for (int v = 0; v < s.nc; v++)
        nk *= A->shape[(int)s.cA[v]];
    /* the element counts of A and B were checked at decoding, so these
     * products (each a part of one of them) do not overflow */
    if (ni > INT_MAX || nj > INT_MAX || nk > INT_MAX)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs", "a matrix side of the contraction exceeds BLAS's 2^31-1");
    if ((rc = pb__tops_set_output(c, nm, shape, err)) || (rc = pb__tops_check_c(c, TC_C, TC_BETA, TC_WBETA, err)))
        return rc;
    tc_keep_t k = tc_keep(c);
    c->tape_bytes = pb__tops_tape_of(c, k.a, k.b, c->wrt & (1u << TC_WBETA), TC_A, TC_B, TC_C) +
                    (c->taped && k.m ? pb_tensor_bytes(&c->out_meta[0]) : 0);
    c->cost = flops_per(c->dtype) * (2.0 * (double)ni * (double)nj * (double)nk + 2.0 * (double)ni * (double)nj);
    return 0;
}

static int tc_forward(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    const pb_tensor_t *A = &c->in[TC_A], *B = &c->in[TC_B], *C = &c->in[TC_C];
    pb_cspec_t s;
    int rc = cspec_of(c->opt, A, B, &s, err);
    if (rc)
        return rc;
    pb_tensor_t y = {0};
    const pb_tensor_t *ym = &c->out_meta[0];
    if (pb_tensor_alloc(&y, c->dtype, ym->rank, ym->shape, c->order, false))
        return pb__tops_oom(err, "tensorcontract");
    pb_scalar_t alpha = sc(&c->opt[TC_ALPHA]), beta = sc(&c->opt[TC_BETA]);
    pb_tview_t va = pb_tview_of(A), vb = pb_tview_of(B), vy = pb_tview_of(&y), vc;
    if (nonzero(beta))
        vc = pb_tview_of(C);
    tc_keep_t k = tape ? tc_keep(c) : (tc_keep_t){false, false, false};
    pb_tensor_t m = {0};
    if (!k.m)
        rc = pb_contract(c->dtype, &s, alpha, &va, c->opt[TC_CONJA].b, &vb, c->opt[TC_CONJB].b, beta,
                         nonzero(beta) ? &vc : NULL, &vy);
    else if (pb_tensor_alloc(&m, c->dtype, ym->rank, ym->shape, 'C', false))
        rc = PB_ENOMEM;
    else {
        /* M for the tape, then y = alpha·M + beta·C from it (M is read
         * only for alpha ≠ 0, as BLAS reads A and B). */
        pb_tview_t vm = pb_tview_of(&m);
        rc = pb_contract(c->dtype, &s, ONE, &va, c->opt[TC_CONJA].b, &vb, c->opt[TC_CONJB].b, ZERO, NULL, &vm);
        if (rc == 0 && nonzero(alpha)) {
            pb_loop_t L;
            pb__tops_loop_same(&L, &vy, &vm);
            if (nonzero(beta))
                for (int d = 0; d < vy.rank; d++)
                    L.s[2][d] = vc.stride[d];
            pb_strided(c->dtype, &L, vy.p, vm.p, false, alpha, nonzero(beta) ? vc.p : NULL, beta, false);
        } else if (rc == 0 && nonzero(beta))
            pb__tops_scale_into(c->dtype, &y, C, beta, false);
        else if (rc == 0)
            pb_tensor_zero(&y);
    }
    if (rc == 0 && tape)
        rc = pb__tops_save(c, tape, k.a, k.b, c->wrt & (1u << TC_WBETA), TC_A, TC_B, TC_C);
    if (rc) {
        pb_tensor_clear(&m);
        pb_tensor_clear(&y);
        return pb__tops_oom(err, "tensorcontract");
    }
    if (k.m)
        tape->saved[SAVED_M] = m; /* the tape's now */
    c->out[0] = y;
    return 0;
}

static int tc_reverse(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                      pb_warnings_t *warn, pb_err_t *err)
{
    (void)warn;
    pb_dtype_t d = t->dtype;
    const pb_tensor_t *Am = &t->in_meta[TC_A], *Bm = &t->in_meta[TC_B];
    pb_cspec_t s;
    int rc = cspec_of(t->opt, Am, Bm, &s, err);
    if (rc)
        return rc;
    const pb_tensor_t *G = &cot[0];
    pb_tensor_t x = {0}; /* before the first goto nomem, which clears it */
    if ((rc = pb__tops_alloc_grads(t, 3, grad, order, G->storage == NULL)))
        goto nomem;
    if (G->storage == NULL)
        return 0;
    bool cx = pb_dtype_is_complex(d);
    bool cjA = cx && t->opt[TC_CONJA].b, cjB = cx && t->opt[TC_CONJB].b;
    pb_scalar_t alpha = sc(&t->opt[TC_ALPHA]);
    const pb_tensor_t *M = &t->saved[SAVED_M];
    /* wal: ᾱ from A and B (when the tape kept M, ⟨M, G⟩ at the end) */
    bool wA = t->wrt & (1u << TC_A), wB = t->wrt & (1u << TC_B),
         wal = (t->wrt & (1u << TC_WALPHA)) && M->storage == NULL;
    int posO[PB_MAX_RANK];
    for (int k = 0; k < s.noA + s.noB; k++)
        posO[(int)s.pAB[k]] = k;
    pb_tview_t vg = pb_tview_of(G);

    /* Ā-shaped: X = G·B̂ᴴ, contracting G's open-B axes with B's open axes. */
    pb_cspec_t sa = {.noA = s.noA, .nc = s.noB, .noB = s.nc};
    for (int i = 0; i < s.noA; i++)
        sa.oA[i] = (signed char)posO[i];
    for (int u = 0; u < s.noB; u++) {
        sa.cA[u] = (signed char)posO[s.noA + u];
        sa.cB[u] = s.oB[u];
    }
    for (int v = 0; v < s.nc; v++)
        sa.oB[v] = s.cB[v];
    for (int i = 0; i < s.noA; i++)
        sa.pAB[(int)s.oA[i]] = (signed char)i;
    for (int v = 0; v < s.nc; v++)
        sa.pAB[(int)s.cA[v]] = (signed char)(s.noA + v);
    /* B̄-shaped: Y = Âᴴ·G, contracting A's open axes with G's open-A axes. */
    pb_cspec_t sb = {.noA = s.nc, .nc = s.noA, .noB = s.noB};
    for (int v = 0; v < s.nc; v++)
        sb.oA[v] = s.cA[v];
    for (int i = 0; i < s.noA; i++) {
        sb.cA[i] = s.oA[i];
        sb.cB[i] = (signed char)posO[i];
    }
    for (int u = 0; u < s.noB; u++)
        sb.oB[u] = (signed char)posO[s.noA + u];
    for (int v = 0; v < s.nc; v++)
        sb.pAB[(int)s.cB[v]] = (signed char)v;
    for (int u = 0; u < s.noB; u++)
        sb.pAB[(int)s.oB[u]] = (signed char)(s.nc + u);

    pb_scalar_t ga = {0, 0};
    if (wA || (wal && !wB)) {
        /* X = G·conj(opB(B))ᵀ in A's shape; Ā = conj(α)·X, or α·conj(X) for conjA */
        pb_tensor_t *dst = wA ? &grad[TC_A] : &x;
        if (!wA && pb_tensor_alloc(&x, d, Am->rank, Am->shape, 'C', false))
            goto nomem;
        pb_tview_t vb = pb_tview_of(&t->saved[SAVED_B]), vx = pb_tview_of(dst);
        if (wal) {
            if ((rc = pb_contract(d, &sa, ONE, &vg, false, &vb, !cjB, ZERO, NULL, &vx)))
                goto nomem;
            ga = pb__tops_dot_of(d, &t->saved[SAVED_A], cjA, dst);
            if (wA)
                pb__tops_scale_into(d, dst, dst, cjA ? alpha : sconj(alpha), cjA);
        } else if ((rc = pb_contract(d, &sa, cjA ? alpha : sconj(alpha), &vg, cjA, &vb, cjA ? cjB : !cjB, ZERO, NULL,
                                     &vx)))
            goto nomem;
    }
    if (wB) {
        /* Y = conj(opA(A))ᵀ·G in B's shape; B̄ = conj(α)·Y, or α·conj(Y) for conjB */
        pb_tview_t va = pb_tview_of(&t->saved[SAVED_A]), vy = pb_tview_of(&grad[TC_B]);
        if (wal && !wA) {
            if ((rc = pb_contract(d, &sb, ONE, &va, !cjA, &vg, false, ZERO, NULL, &vy)))
                goto nomem;
            ga = pb__tops_dot_of(d, &t->saved[SAVED_B], cjB, &grad[TC_B]);
            pb__tops_scale_into(d, &grad[TC_B], &grad[TC_B], cjB ? alpha : sconj(alpha), cjB);
        } else if ((rc = pb_contract(d, &sb, cjB ? alpha : sconj(alpha), &va, cjB ? cjA : !cjA, &vg, cjB, ZERO, NULL,
                                     &vy)))
            goto nomem;
    }
    pb_tensor_clear(&x);
    if (M->storage)
        ga = pb__tops_dot_of(d, M, false, G);
    if (t->wrt & (1u << TC_WALPHA))
        pb__tops_put_scalar(&grad[TC_WALPHA], ga, &t->opt[TC_ALPHA]);
    pb__tops_grads_c_beta(t, G, grad, TC_C, TC_BETA, TC_WBETA);
    return 0;
nomem:
    pb_tensor_clear(&x);
    for (int k = 0; k < PB_MAX_IO + 2; k++)
        pb_tensor_clear(&grad[k]);
    return pb__tops_oom(err, "tensorcontract reverse");
}

static const pb_io_spec_t tc_inputs[] = {{"A", true}, {"B", true}, {"C", false}};
static const char *const tc_wrt[] = {"A", "B", "C", "alpha", "beta"};
static const pb_opt_spec_t tc_options[] = {
    {.name = "pA", .type = PB_OPT_AXES2},   {.name = "pB", .type = PB_OPT_AXES2},
    {.name = "pAB", .type = PB_OPT_AXES},   {.name = "conjA", .type = PB_OPT_BOOL},
    {.name = "conjB", .type = PB_OPT_BOOL}, TOPS_SCALAR("alpha", 1),
    TOPS_SCALAR("beta", 0),                      {.name = "spec", .type = PB_OPT_TEXT},
};

const pb_op_t pb_op_tensorcontract = {
    .name = "tensorcontract",
    .inputs = tc_inputs,
    .ninputs = 3,
    .outputs = pb__tops_c_outputs,
    .noutputs = 1,
    .options = tc_options,
    .noptions = 8,
    .wrt_names = tc_wrt,
    .nwrt = 5,
    .dtypes = PB_DTYPES_ALL,
    .devices = 1u << PB_DEV_CPU | 1u << PB_DEV_CUDA,
    .validate = tc_validate,
    .forward = {[PB_DEV_CPU] = tc_forward, [PB_DEV_CUDA] = pb_gpu_shared_forward},
    .reverse = {[PB_DEV_CPU] = tc_reverse, [PB_DEV_CUDA] = pb_gpu_shared_reverse},
};
