/* The TensorOperations rules: tensorcontract, tensoradd, tensortrace.
 *
 * Forward:
 *   tensorcontract  C = beta·C + alpha·permute(opA(A)·opB(B), pAB), one GEMM
 *                   (contract.c), or the einsum form `spec`;
 *   tensoradd       C = beta·C + alpha·permute(opA(A), pA), one strided pass;
 *   tensortrace     C = beta·C + alpha·Σ_k A[p…, q1=k, q2=k], a scaling pass
 *                   and an accumulating pass whose traced index walks A's
 *                   diagonal (stride q1 + stride q2).
 * Reverse, in the convention dL = Re Σ conj(X̄)·dX, with G = C̄:
 *   Ā  = conj(α)·(G·B̂ᴴ, unpermuted)     (conjA: α·conj(…)),
 *   B̄  = conj(α)·(Âᴴ·G, unpermuted)     (conjB: α·conj(…)),
 *   C̄  = conj(β)·G,  ᾱ = ⟨permute(opA(A)·opB(B)), G⟩,  β̄ = ⟨C, G⟩,
 * and for add and trace the same with the GEMM replaced by the pass.  ᾱ
 * and β̄ are real when the dtype is real or the scalar was sent as a real
 * number (their gradient projected onto the reals, as for a Real in Julia).
 *
 * ᾱ of tensorcontract is recomputed, not kept: ⟨M, G⟩ = ⟨Â, G·B̂ᴴ⟩, and
 * G·B̂ᴴ is the GEMM Ā needs anyway, so with Ā in wrt ᾱ costs one inner
 * product over A (with B̄ only, symmetrically over B); with neither it
 * costs one GEMM of the forward's size.  Keeping the I×J product instead
 * would cost its bytes on every tape.  So the minimal tape is: C only for
 * β̄, A only for B̄ or ᾱ, B only for Ā or ᾱ; add and trace keep A only for
 * ᾱ and C only for β̄. */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "contract.h"
#include "op.h"
#include "strided.h"

/* tensorcontract's inputs, options and wrt slots */
enum { TC_A, TC_B, TC_C };
enum { TC_PA, TC_PB, TC_PAB, TC_CONJA, TC_CONJB, TC_ALPHA, TC_BETA, TC_SPEC };
enum { TC_WALPHA = 3, TC_WBETA = 4 };
/* tensoradd and tensortrace: inputs A, C; options (pA | p, q), conjA, alpha, beta */
enum { TA_A, TA_C };
enum { TA_PA, TA_CONJA, TA_ALPHA, TA_BETA };
enum { TT_P, TT_Q, TT_CONJA, TT_ALPHA, TT_BETA };
enum { T1_WALPHA = 2, T1_WBETA = 3 };
enum { SAVED_A, SAVED_B, SAVED_C };

static pb_scalar_t sc(const pb_optval_t *v) { return (pb_scalar_t){v->re, v->im}; }
static pb_scalar_t sconj(pb_scalar_t s) { return (pb_scalar_t){s.re, -s.im}; }
static bool nonzero(pb_scalar_t s) { return s.re != 0 || s.im != 0; }
static const pb_scalar_t ONE = {1, 0}, ZERO = {0, 0};

/* "[0, 2, 1]" into buf. */
static const char *axes_str(const signed char *ax, int n, char *buf, size_t len)
{
    size_t o = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < n && o < len; i++)
        o += (size_t)snprintf(buf + o, len - o, "%s%d", i ? ", " : "", ax[i]);
    if (o < len)
        snprintf(buf + o, len - o, "]");
    return buf;
}

/* Are a ++ b (lengths na, nb) a permutation of 0..rank-1? */
static bool is_perm(const signed char *a, int na, const signed char *b, int nb, int rank)
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

static int need_shape(const pb_tensor_t *t, int rank, const uint64_t *shape, const char *arg, pb_err_t *err)
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
static int set_output(pb_call_t *c, int rank, const uint64_t *shape, pb_err_t *err)
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
static int check_c(pb_call_t *c, int ic, int obeta, int wbeta, pb_err_t *err)
{
    const pb_tensor_t *C = &c->in[ic];
    bool needed = nonzero(sc(&c->opt[obeta])) || (c->wrt & (1u << wbeta));
    if (needed && C->storage == NULL)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs.C",
                          "missing input C: it is read when beta is nonzero or in wrt");
    if (C->storage)
        return need_shape(C, c->out_meta[0].rank, c->out_meta[0].shape, "inputs.C", err);
    return 0;
}

static size_t tape_of(const pb_call_t *c, bool a, bool b, bool cin, int ia, int ib, int ic)
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

static double flops_per(pb_dtype_t d) { return pb_dtype_is_complex(d) ? 4.0 : 1.0; }

/* ------------------------------------------------------------------ */
/* tensorcontract                                                      */

/* The einsum form: "ab,bc->ac".  Fills s (and checks ranks and sizes). */
static int parse_spec(const char *spec, const pb_tensor_t *A, const pb_tensor_t *B, pb_cspec_t *s, pb_err_t *err)
{
    const char *arg = "options.spec";
    const char *comma = strchr(spec, ','), *arrow = strstr(spec, "->");
    if (comma == NULL || arrow == NULL || comma > arrow || strchr(comma + 1, ',') || strstr(arrow + 2, "->"))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "spec must look like \"ijk,kl->lij\", got \"%s\"", spec);
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
    if (!is_perm(pa->ax[0], pa->nax[0], pa->ax[1], pa->nax[1], A->rank))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.pA",
                          "pA = [%s, %s] must split a permutation of A's %d axes", axes_str(pa->ax[0], pa->nax[0], b1, sizeof b1),
                          axes_str(pa->ax[1], pa->nax[1], b2, sizeof b2), A->rank);
    if (!is_perm(pb->ax[0], pb->nax[0], pb->ax[1], pb->nax[1], B->rank))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.pB",
                          "pB = [%s, %s] must split a permutation of B's %d axes", axes_str(pb->ax[0], pb->nax[0], b1, sizeof b1),
                          axes_str(pb->ax[1], pb->nax[1], b2, sizeof b2), B->rank);
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
        if (!is_perm(pab->ax[0], pab->nax[0], NULL, 0, nm))
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.pAB", "pAB = %s must be a permutation of the %d output axes",
                              axes_str(pab->ax[0], pab->nax[0], b1, sizeof b1), nm);
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
    if ((rc = set_output(c, nm, shape, err)) || (rc = check_c(c, TC_C, TC_BETA, TC_WBETA, err)))
        return rc;
    unsigned w = c->wrt;
    bool wa = w & (1u << TC_WALPHA);
    c->tape_bytes = tape_of(c, (w & (1u << TC_B)) || wa, (w & (1u << TC_A)) || wa, w & (1u << TC_WBETA), TC_A, TC_B,
                            TC_C);
    c->cost = flops_per(c->dtype) * (2.0 * (double)ni * (double)nj * (double)nk + 2.0 * (double)ni * (double)nj);
    return 0;
}

/* Save what the reverse needs for wrt: A, B, C as the minimal tape says. */
static int save(pb_call_t *c, pb_tapedata_t *tape, bool a, bool b, bool cin, int ia, int ib, int ic)
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

static int oom(pb_err_t *err, const char *op)
{
    return pb_err_set(err, PB_ENOMEM, NULL, "out of memory in %s", op);
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
        return oom(err, "tensorcontract");
    pb_scalar_t beta = sc(&c->opt[TC_BETA]);
    pb_tview_t va = pb_tview_of(A), vb = pb_tview_of(B), vy = pb_tview_of(&y), vc;
    if (nonzero(beta))
        vc = pb_tview_of(C);
    rc = pb_contract(c->dtype, &s, sc(&c->opt[TC_ALPHA]), &va, c->opt[TC_CONJA].b, &vb, c->opt[TC_CONJB].b, beta,
                     nonzero(beta) ? &vc : NULL, &vy);
    unsigned w = c->wrt;
    bool wa = w & (1u << TC_WALPHA);
    if (rc == 0 && tape)
        rc = save(c, tape, (w & (1u << TC_B)) || wa, (w & (1u << TC_A)) || wa, w & (1u << TC_WBETA), TC_A, TC_B,
                  TC_C);
    if (rc) {
        pb_tensor_clear(&y);
        return oom(err, "tensorcontract");
    }
    c->out[0] = y;
    return 0;
}

/* Allocate the wanted gradients (zeroed when there is no cotangent). */
static int alloc_grads(const pb_tapedata_t *t, int ninputs, pb_tensor_t *grad, char order, bool zero)
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
static void put_scalar(pb_tensor_t *g, pb_scalar_t v, const pb_optval_t *opt)
{
    if (!opt->cplx)
        v.im = 0;
    void *p = pb_tensor_data(g);
    switch (g->dtype) {
    case PB_F32: *(float *)p = (float)v.re; break;
    case PB_F64: *(double *)p = v.re; break;
    case PB_C64: ((float *)p)[0] = (float)v.re, ((float *)p)[1] = (float)v.im; break;
    case PB_C128: ((double *)p)[0] = v.re, ((double *)p)[1] = v.im; break;
    default: break;
    }
}

/* A loop over all axes of one tensor, read through two stride sets. */
static void loop_same(pb_loop_t *L, const pb_tview_t *a, const pb_tview_t *b)
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
static void scale_into(pb_dtype_t d, pb_tensor_t *dst, const pb_tensor_t *src, pb_scalar_t s, bool conj)
{
    pb_tview_t vd = pb_tview_of(dst), vs = pb_tview_of(src);
    pb_loop_t L;
    loop_same(&L, &vd, &vs);
    pb_strided(d, &L, vd.p, vs.p, conj, s, NULL, ZERO, false);
}

static pb_scalar_t dot_of(pb_dtype_t d, const pb_tensor_t *a, bool conj, const pb_tensor_t *b)
{
    pb_tview_t va = pb_tview_of(a), vb = pb_tview_of(b);
    pb_loop_t L;
    loop_same(&L, &va, &vb);
    return pb_strided_dot(d, &L, va.p, conj, vb.p);
}

/* C̄ = conj(β)·G and β̄ = ⟨C, G⟩, shared by the three ops. */
static void grads_c_beta(const pb_tapedata_t *t, const pb_tensor_t *G, pb_tensor_t *grad, int ic, int obeta,
                         int wbeta)
{
    if (t->wrt & (1u << ic))
        scale_into(t->dtype, &grad[ic], G, sconj(sc(&t->opt[obeta])), false);
    if (t->wrt & (1u << wbeta))
        put_scalar(&grad[wbeta], dot_of(t->dtype, &t->saved[SAVED_C], false, G), &t->opt[obeta]);
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
    if ((rc = alloc_grads(t, 3, grad, order, G->storage == NULL)))
        goto nomem;
    if (G->storage == NULL)
        return 0;
    bool cx = pb_dtype_is_complex(d);
    bool cjA = cx && t->opt[TC_CONJA].b, cjB = cx && t->opt[TC_CONJB].b;
    pb_scalar_t alpha = sc(&t->opt[TC_ALPHA]);
    bool wA = t->wrt & (1u << TC_A), wB = t->wrt & (1u << TC_B), wal = t->wrt & (1u << TC_WALPHA);
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
    pb_tensor_t x = {0};
    if (wA || (wal && !wB)) {
        /* X = G·conj(opB(B))ᵀ in A's shape; Ā = conj(α)·X, or α·conj(X) for conjA */
        pb_tensor_t *dst = wA ? &grad[TC_A] : &x;
        if (!wA && pb_tensor_alloc(&x, d, Am->rank, Am->shape, 'C', false))
            goto nomem;
        pb_tview_t vb = pb_tview_of(&t->saved[SAVED_B]), vx = pb_tview_of(dst);
        if (wal) {
            if ((rc = pb_contract(d, &sa, ONE, &vg, false, &vb, !cjB, ZERO, NULL, &vx)))
                goto nomem;
            ga = dot_of(d, &t->saved[SAVED_A], cjA, dst);
            if (wA)
                scale_into(d, dst, dst, cjA ? alpha : sconj(alpha), cjA);
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
            ga = dot_of(d, &t->saved[SAVED_B], cjB, &grad[TC_B]);
            scale_into(d, &grad[TC_B], &grad[TC_B], cjB ? alpha : sconj(alpha), cjB);
        } else if ((rc = pb_contract(d, &sb, cjB ? alpha : sconj(alpha), &va, cjB ? cjA : !cjA, &vg, cjB, ZERO, NULL,
                                     &vy)))
            goto nomem;
    }
    pb_tensor_clear(&x);
    if (wal)
        put_scalar(&grad[TC_WALPHA], ga, &t->opt[TC_ALPHA]);
    grads_c_beta(t, G, grad, TC_C, TC_BETA, TC_WBETA);
    return 0;
nomem:
    pb_tensor_clear(&x);
    for (int k = 0; k < PB_MAX_IO + 2; k++)
        pb_tensor_clear(&grad[k]);
    return oom(err, "tensorcontract reverse");
}

/* ------------------------------------------------------------------ */
/* tensoradd                                                           */

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
    if (!is_perm(pa->ax[0], pa->nax[0], NULL, 0, A->rank))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.pA", "pA = %s must be a permutation of A's %d axes",
                          axes_str(pa->ax[0], pa->nax[0], b1, sizeof b1), A->rank);
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
    if ((rc = set_output(c, A->rank, shape, err)) || (rc = check_c(c, TA_C, TA_BETA, T1_WBETA, err)))
        return rc;
    c->tape_bytes = tape_of(c, c->wrt & (1u << T1_WALPHA), false, c->wrt & (1u << T1_WBETA), TA_A, -1, TA_C);
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
        return oom(err, "tensoradd");
    pb_scalar_t beta = sc(&c->opt[TA_BETA]);
    pb_tview_t va = pb_tview_of(A), vy = pb_tview_of(&y), vc;
    if (nonzero(beta))
        vc = pb_tview_of(&c->in[TA_C]);
    pb_loop_t L;
    add_loop(&L, p, &vy, &va, nonzero(beta) ? &vc : NULL);
    pb_strided(c->dtype, &L, vy.p, va.p, pb_dtype_is_complex(c->dtype) && c->opt[TA_CONJA].b, sc(&c->opt[TA_ALPHA]),
               nonzero(beta) ? vc.p : NULL, beta, false);
    if (tape && (rc = save(c, tape, c->wrt & (1u << T1_WALPHA), false, c->wrt & (1u << T1_WBETA), TA_A, -1, TA_C))) {
        pb_tensor_clear(&y);
        return oom(err, "tensoradd");
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
    if (alloc_grads(t, 2, grad, order, G->storage == NULL)) {
        for (int k = 0; k < PB_MAX_IO + 2; k++)
            pb_tensor_clear(&grad[k]);
        return oom(err, "tensoradd reverse");
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
        for (int k = 0; k < L.rank; k++) { /* write through p, read G as it lies */
            int64_t tmp = L.s[0][k];
            L.s[0][k] = L.s[1][k];
            L.s[1][k] = tmp;
        }
        pb_strided(d, &L, va.p, vg.p, cj, cj ? alpha : sconj(alpha), NULL, ZERO, false);
    }
    if (t->wrt & (1u << T1_WALPHA)) { /* ᾱ = ⟨permute(opA(A)), G⟩ */
        pb_tview_t va = pb_tview_of(&t->saved[SAVED_A]);
        add_loop(&L, p, &vg, &va, NULL);
        for (int k = 0; k < L.rank; k++) {
            int64_t tmp = L.s[0][k];
            L.s[0][k] = L.s[1][k];
            L.s[1][k] = tmp;
        }
        put_scalar(&grad[T1_WALPHA], pb_strided_dot(d, &L, va.p, cj, vg.p), &t->opt[TA_ALPHA]);
    }
    grads_c_beta(t, G, grad, TA_C, TA_BETA, T1_WBETA);
    return 0;
}

/* ------------------------------------------------------------------ */
/* tensortrace                                                         */

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
                              axes_str(q->ax[0], q->nax[0], b1, sizeof b1), axes_str(q->ax[1], q->nax[1], b2, sizeof b2));
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
    if (n > PB_MAX_RANK || !is_perm(all, n, NULL, 0, A->rank))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, p->given ? "options.p" : "options.q",
                          "p = %s and q = [%s, %s] must together name each of A's %d axes once",
                          axes_str(s->p, s->np, b1, sizeof b1), axes_str(s->q1, s->nq, b2, sizeof b2),
                          axes_str(s->q2, s->nq, b3, sizeof b3), A->rank);
    for (int i = 0; i < s->nq; i++)
        if (A->shape[(int)s->q1[i]] != A->shape[(int)s->q2[i]])
            return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.A",
                              "traced axes %d and %d of A have sizes %llu and %llu", s->q1[i], s->q2[i],
                              (unsigned long long)A->shape[(int)s->q1[i]], (unsigned long long)A->shape[(int)s->q2[i]]);
    return 0;
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
    if ((rc = set_output(c, s.np, shape, err)) || (rc = check_c(c, TA_C, TT_BETA, T1_WBETA, err)))
        return rc;
    c->tape_bytes = tape_of(c, c->wrt & (1u << T1_WALPHA), false, c->wrt & (1u << T1_WBETA), TA_A, -1, TA_C);
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
        L->s[1][s->np + i] = a->stride[(int)s->q1[i]] + a->stride[(int)s->q2[i]];
    }
}

static void swap_slots(pb_loop_t *L)
{
    for (int k = 0; k < L->rank; k++) {
        int64_t tmp = L->s[0][k];
        L->s[0][k] = L->s[1][k];
        L->s[1][k] = tmp;
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
        return oom(err, "tensortrace");
    pb_scalar_t beta = sc(&c->opt[TT_BETA]);
    if (nonzero(beta))
        scale_into(c->dtype, &y, &c->in[TA_C], beta, false);
    else
        pb_tensor_zero(&y);
    pb_tview_t va = pb_tview_of(A), vy = pb_tview_of(&y);
    pb_loop_t L;
    trace_loop(&L, &s, &vy, &va);
    pb_strided(c->dtype, &L, vy.p, va.p, pb_dtype_is_complex(c->dtype) && c->opt[TT_CONJA].b, sc(&c->opt[TT_ALPHA]),
               NULL, ZERO, true);
    if (tape && (rc = save(c, tape, c->wrt & (1u << T1_WALPHA), false, c->wrt & (1u << T1_WBETA), TA_A, -1, TA_C))) {
        pb_tensor_clear(&y);
        return oom(err, "tensortrace");
    }
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
    if (alloc_grads(t, 2, grad, order, true)) {
        for (int k = 0; k < PB_MAX_IO + 2; k++)
            pb_tensor_clear(&grad[k]);
        return oom(err, "tensortrace reverse");
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
        swap_slots(&L);
        pb_strided(d, &L, va.p, vg.p, cj, cj ? alpha : sconj(alpha), NULL, ZERO, false);
    }
    if (t->wrt & (1u << T1_WALPHA)) { /* ᾱ = ⟨trace(opA(A)), G⟩ */
        pb_tview_t va = pb_tview_of(&t->saved[SAVED_A]);
        trace_loop(&L, &s, &vg, &va);
        swap_slots(&L);
        put_scalar(&grad[T1_WALPHA], pb_strided_dot(d, &L, va.p, cj, vg.p), &t->opt[TT_ALPHA]);
    }
    grads_c_beta(t, G, grad, TA_C, TT_BETA, T1_WBETA);
    return 0;
}

/* ------------------------------------------------------------------ */
/* The table entries                                                   */

#define SCALAR(nm, def) {.name = nm, .type = PB_OPT_SCALAR, .def_re = def}

static const pb_io_spec_t tc_inputs[] = {{"A", true}, {"B", true}, {"C", false}};
static const pb_io_spec_t t1_inputs[] = {{"A", true}, {"C", false}};
static const char *const c_outputs[] = {"C"};
static const char *const tc_wrt[] = {"A", "B", "C", "alpha", "beta"};
static const char *const t1_wrt[] = {"A", "C", "alpha", "beta"};
static const pb_opt_spec_t tc_options[] = {
    {.name = "pA", .type = PB_OPT_AXES2},   {.name = "pB", .type = PB_OPT_AXES2},
    {.name = "pAB", .type = PB_OPT_AXES},   {.name = "conjA", .type = PB_OPT_BOOL},
    {.name = "conjB", .type = PB_OPT_BOOL}, SCALAR("alpha", 1),
    SCALAR("beta", 0),                      {.name = "spec", .type = PB_OPT_TEXT},
};
static const pb_opt_spec_t ta_options[] = {
    {.name = "pA", .type = PB_OPT_AXES},
    {.name = "conjA", .type = PB_OPT_BOOL},
    SCALAR("alpha", 1),
    SCALAR("beta", 0),
};
static const pb_opt_spec_t tt_options[] = {
    {.name = "p", .type = PB_OPT_AXES}, {.name = "q", .type = PB_OPT_AXES2}, {.name = "conjA", .type = PB_OPT_BOOL},
    SCALAR("alpha", 1),                 SCALAR("beta", 0),
};

const pb_op_t pb_op_tensorcontract = {
    .name = "tensorcontract",
    .inputs = tc_inputs,
    .ninputs = 3,
    .outputs = c_outputs,
    .noutputs = 1,
    .options = tc_options,
    .noptions = 8,
    .wrt_names = tc_wrt,
    .nwrt = 5,
    .dtypes = PB_DTYPES_ALL,
    .devices = 1u << PB_DEV_CPU,
    .validate = tc_validate,
    .forward = {[PB_DEV_CPU] = tc_forward},
    .reverse = {[PB_DEV_CPU] = tc_reverse},
};

const pb_op_t pb_op_tensoradd = {
    .name = "tensoradd",
    .inputs = t1_inputs,
    .ninputs = 2,
    .outputs = c_outputs,
    .noutputs = 1,
    .options = ta_options,
    .noptions = 4,
    .wrt_names = t1_wrt,
    .nwrt = 4,
    .dtypes = PB_DTYPES_ALL,
    .devices = 1u << PB_DEV_CPU,
    .validate = ta_validate,
    .forward = {[PB_DEV_CPU] = ta_forward},
    .reverse = {[PB_DEV_CPU] = ta_reverse},
};

const pb_op_t pb_op_tensortrace = {
    .name = "tensortrace",
    .inputs = t1_inputs,
    .ninputs = 2,
    .outputs = c_outputs,
    .noutputs = 1,
    .options = tt_options,
    .noptions = 5,
    .wrt_names = t1_wrt,
    .nwrt = 4,
    .dtypes = PB_DTYPES_ALL,
    .devices = 1u << PB_DEV_CPU,
    .validate = tt_validate,
    .forward = {[PB_DEV_CPU] = tt_forward},
    .reverse = {[PB_DEV_CPU] = tt_reverse},
};
