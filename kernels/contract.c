#include "contract.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "../cuda/exec.h"
#include "blas.h"
#include "strided.h"

pb_tview_t pb_tview_of(const pb_tensor_t *t)
{
    pb_tview_t v;
    memset(&v, 0, sizeof v);
    v.p = pb_tensor_data(t);
    v.rank = t->rank;
    memcpy(v.shape, t->shape, sizeof v.shape);
    pb_dense_strides(t->rank, t->shape, t->order, v.stride);
    return v;
}

/* One group of axes and their strides in up to three operands:
 * I: A, out, C;  J: B, out, C;  K: A, B. */
typedef struct grp {
    int n;
    uint64_t dim[PB_MAX_RANK];
    int64_t s[3][PB_MAX_RANK];
} grp_t;

static uint64_t gsize(const grp_t *g)
{
    uint64_t n = 1;
    for (int i = 0; i < g->n; i++)
        n *= g->dim[i];
    return n;
}

/* The group's axes sorted by their stride in operand w, fastest first. */
static void order_by(const grp_t *g, int w, int *ord)
{
    for (int i = 0; i < g->n; i++)
        ord[i] = i;
    for (int i = 1; i < g->n; i++)
        for (int j = i; j > 0 && g->s[w][ord[j]] < g->s[w][ord[j - 1]]; j--) {
            int t = ord[j];
            ord[j] = ord[j - 1];
            ord[j - 1] = t;
        }
}

/* The stride of the group's linear index (axes in ord, first fastest) in
 * operand w, when the axes chain into one; -1 when they do not.  Size-1
 * axes do not count; a group of one element has stride 1. */
static int64_t chain(const grp_t *g, const int *ord, int w)
{
    int64_t base = -1, next = 0;
    for (int i = 0; i < g->n; i++) {
        int a = ord[i];
        if (g->dim[a] == 1)
            continue;
        if (base < 0)
            base = g->s[w][a];
        else if (g->s[w][a] != next)
            return -1;
        next = g->s[w][a] * (int64_t)g->dim[a];
    }
    return base < 0 ? 1 : base;
}

/* Can a GEMM read Y = X (or Xᵀ when trans), conjugated when conj, from X
 * as it lies (nr×nc, row stride rs, column stride cs)?  Sets BLAS's op
 * and leading dimension. */
static bool readable(uint64_t nr, uint64_t nc, int64_t rs, int64_t cs, bool trans, bool conj, char *op, int64_t *ld)
{
    if (trans) {
        uint64_t tn = nr;
        nr = nc;
        nc = tn;
        int64_t ts = rs;
        rs = cs;
        cs = ts;
    }
    if (rs < 0 || cs < 0)
        return false;
    int64_t mr = nr ? (int64_t)nr : 1, mc = nc ? (int64_t)nc : 1;
    if (!conj && (nr <= 1 || rs == 1) && (nc <= 1 || cs >= mr)) { /* column-major */
        *op = 'N';
        *ld = nc <= 1 ? mr : cs;
    } else if ((nc <= 1 || cs == 1) && (nr <= 1 || rs >= mc)) { /* row-major: BLAS transposes */
        *op = conj ? 'C' : 'T';
        *ld = nr <= 1 ? mc : rs;
    } else
        return false;
    return *ld <= INT_MAX;
}

typedef struct plan {
    int form; /* 0: M = Â·B̂ (I×J); 1: Mᵀ = B̂ᵀ·Âᵀ (J×I) */
    int oI[PB_MAX_RANK], oJ[PB_MAX_RANK], oK[PB_MAX_RANK];
    bool copyA, copyB, tmp;
    char opA, opB;
    int64_t ldA, ldB, ldO;
    uint64_t cost;
} plan_t;

static void evaluate(plan_t *p, const grp_t *I, const grp_t *J, const grp_t *K, bool conjA, bool conjB)
{
    uint64_t ni = gsize(I), nj = gsize(J), nk = gsize(K);
    int64_t aI = chain(I, p->oI, 0), aK = chain(K, p->oK, 0);
    int64_t bK = chain(K, p->oK, 1), bJ = chain(J, p->oJ, 0);
    int64_t oI = chain(I, p->oI, 1), oJ = chain(J, p->oJ, 1);
    bool tr = p->form == 1;
    /* form 0 reads Â (I×K) and B̂ (K×J); form 1 reads B̂ᵀ and Âᵀ */
    p->copyA = !readable(ni, nk, aI, aK, tr, conjA, &p->opA, &p->ldA);
    p->copyB = !readable(nk, nj, bK, bJ, tr, conjB, &p->opB, &p->ldB);
    char oo;
    p->tmp = !readable(ni, nj, oI, oJ, tr, false, &oo, &p->ldO) || oo != 'N';
    p->cost = (p->copyA ? ni * nk : 0) + (p->copyB ? nk * nj : 0) + (p->tmp ? ni * nj : 0);
}

/* Strides of a dense col-major buffer whose rows are group g1 (axes in
 * o1, first fastest) and columns g2: written into st1/st2 by axis. */
static void dense_layout(const grp_t *g1, const int *o1, const grp_t *g2, const int *o2, int64_t *st1, int64_t *st2)
{
    int64_t s = 1;
    for (int i = 0; i < g1->n; i++) {
        st1[o1[i]] = s;
        s *= (int64_t)g1->dim[o1[i]];
    }
    for (int i = 0; i < g2->n; i++) {
        st2[o2[i]] = s;
        s *= (int64_t)g2->dim[o2[i]];
    }
}

/* A loop over the axes of g1 then g2: operand w1/w2 strides of each group
 * as operand slot k of the loop. */
static void loop_init(pb_loop_t *L, const grp_t *g1, const grp_t *g2)
{
    memset(L, 0, sizeof *L);
    L->rank = g1->n + g2->n;
    for (int i = 0; i < g1->n; i++)
        L->dim[i] = g1->dim[i];
    for (int i = 0; i < g2->n; i++)
        L->dim[g1->n + i] = g2->dim[i];
}

static void loop_set(pb_loop_t *L, int slot, const int64_t *st1, int n1, const int64_t *st2, int n2)
{
    for (int i = 0; i < n1; i++)
        L->s[slot][i] = st1[i];
    for (int i = 0; i < n2; i++)
        L->s[slot][n1 + i] = st2[i];
}

/* Scratch of n items on the execution device (cuda/exec.h), freed by
 * scratch_free. */
static void *scratch(size_t n, size_t item)
{
    return pb_exec_gpu() >= 0 ? pb_exec_alloc(n * item) : pb_mem_alloc((n ? n : 1) * item);
}

static void scratch_free(void *p)
{
    if (pb_exec_gpu() >= 0)
        pb_exec_free(p);
    else
        pb_mem_free(p);
}

int pb_contract(pb_dtype_t d, const pb_cspec_t *s, pb_scalar_t alpha, const pb_tview_t *A, bool conjA,
                const pb_tview_t *B, bool conjB, pb_scalar_t beta, const pb_tview_t *C, const pb_tview_t *out)
{
    if (!pb_dtype_is_complex(d))
        conjA = conjB = false;
    bool has_beta = beta.re != 0 || beta.im != 0;
    int posO[2 * PB_MAX_RANK];
    for (int k = 0; k < s->noA + s->noB; k++)
        posO[(int)s->pAB[k]] = k;
    grp_t I = {.n = s->noA}, J = {.n = s->noB}, K = {.n = s->nc};
    for (int t = 0; t < s->noA; t++) {
        I.dim[t] = A->shape[(int)s->oA[t]];
        I.s[0][t] = A->stride[(int)s->oA[t]];
        I.s[1][t] = out->stride[posO[t]];
        I.s[2][t] = has_beta ? C->stride[posO[t]] : 0;
    }
    for (int u = 0; u < s->noB; u++) {
        J.dim[u] = B->shape[(int)s->oB[u]];
        J.s[0][u] = B->stride[(int)s->oB[u]];
        J.s[1][u] = out->stride[posO[s->noA + u]];
        J.s[2][u] = has_beta ? C->stride[posO[s->noA + u]] : 0;
    }
    for (int v = 0; v < s->nc; v++) {
        K.dim[v] = A->shape[(int)s->cA[v]];
        K.s[0][v] = A->stride[(int)s->cA[v]];
        K.s[1][v] = B->stride[(int)s->cB[v]];
    }
    uint64_t ni = gsize(&I), nj = gsize(&J), nk = gsize(&K);
    size_t item = pb_dtype_size(d);
    pb_loop_t L;
    if (ni == 0 || nj == 0)
        return 0;
    if (nk == 0) { /* an empty sum: out = beta·C */
        loop_init(&L, &I, &J);
        loop_set(&L, 0, I.s[1], I.n, J.s[1], J.n);
        if (has_beta) {
            loop_set(&L, 1, I.s[2], I.n, J.s[2], J.n);
            pb_strided(d, &L, out->p, C->p, false, beta, NULL, beta, false);
        } else
            pb_strided(d, &L, out->p, NULL, false, (pb_scalar_t){0, 0}, NULL, beta, false);
        return 0;
    }

    /* Choose the plan that copies least. */
    plan_t best = {.cost = UINT64_MAX}, p;
    for (int form = 0; form < 2; form++)
        for (int ci = 0; ci < 2; ci++)
            for (int cj = 0; cj < 2; cj++)
                for (int ck = 0; ck < 2; ck++) {
                    memset(&p, 0, sizeof p);
                    p.form = form;
                    order_by(&I, ci, p.oI);
                    order_by(&J, cj, p.oJ);
                    order_by(&K, ck, p.oK);
                    evaluate(&p, &I, &J, &K, conjA, conjB);
                    if (p.cost < best.cost)
                        best = p;
                }
    p = best;

    void *ab = NULL, *bb = NULL, *mb = NULL;
    int rc = 0;
    const void *ap = A->p, *bp = B->p;
    if (p.copyA) { /* Â (I×K) or Âᵀ (K×I), column-major, conjugated on the way */
        int64_t sI[PB_MAX_RANK], sK[PB_MAX_RANK];
        if (p.form == 0)
            dense_layout(&I, p.oI, &K, p.oK, sI, sK);
        else
            dense_layout(&K, p.oK, &I, p.oI, sK, sI);
        if ((ab = scratch(ni * nk, item)) == NULL)
            goto nomem;
        loop_init(&L, &I, &K);
        loop_set(&L, 0, sI, I.n, sK, K.n);
        loop_set(&L, 1, I.s[0], I.n, K.s[0], K.n);
        pb_strided(d, &L, ab, A->p, conjA, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, false);
        ap = ab;
        p.opA = 'N';
        p.ldA = p.form == 0 ? (int64_t)(ni ? ni : 1) : (int64_t)nk;
    }
    if (p.copyB) { /* B̂ (K×J) or B̂ᵀ (J×K) */
        int64_t sK[PB_MAX_RANK], sJ[PB_MAX_RANK];
        if (p.form == 0)
            dense_layout(&K, p.oK, &J, p.oJ, sK, sJ);
        else
            dense_layout(&J, p.oJ, &K, p.oK, sJ, sK);
        if ((bb = scratch(nk * nj, item)) == NULL)
            goto nomem;
        loop_init(&L, &K, &J);
        loop_set(&L, 0, sK, K.n, sJ, J.n);
        loop_set(&L, 1, K.s[1], K.n, J.s[0], J.n);
        pb_strided(d, &L, bb, B->p, conjB, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, false);
        bp = bb;
        p.opB = 'N';
        p.ldB = p.form == 0 ? (int64_t)nk : (int64_t)nj;
    }
    void *cp = out->p;
    int64_t ldc = p.ldO;
    pb_scalar_t gbeta = {0, 0};
    int64_t mI[PB_MAX_RANK], mJ[PB_MAX_RANK];
    loop_init(&L, &I, &J);
    loop_set(&L, 0, I.s[1], I.n, J.s[1], J.n);
    if (p.tmp) {
        if (p.form == 0)
            dense_layout(&I, p.oI, &J, p.oJ, mI, mJ);
        else
            dense_layout(&J, p.oJ, &I, p.oI, mJ, mI);
        if ((mb = scratch(ni * nj, item)) == NULL)
            goto nomem;
        cp = mb;
        ldc = p.form == 0 ? (int64_t)ni : (int64_t)nj;
    } else if (has_beta) { /* out = C, then the GEMM adds to it with beta */
        loop_set(&L, 1, I.s[2], I.n, J.s[2], J.n);
        pb_strided(d, &L, out->p, C->p, false, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, false);
        gbeta = beta;
    }
    if (p.form == 0)
        pb_gemm_cm(d, p.opA, p.opB, (int)ni, (int)nj, (int)nk, alpha, ap, (int)p.ldA, bp, (int)p.ldB, gbeta, cp,
                   (int)ldc);
    else
        pb_gemm_cm(d, p.opB, p.opA, (int)nj, (int)ni, (int)nk, alpha, bp, (int)p.ldB, ap, (int)p.ldA, gbeta, cp,
                   (int)ldc);
    if (p.tmp) { /* out = permute(M) + beta·C */
        loop_set(&L, 1, mI, I.n, mJ, J.n);
        if (has_beta)
            loop_set(&L, 2, I.s[2], I.n, J.s[2], J.n);
        pb_strided(d, &L, out->p, mb, false, (pb_scalar_t){1, 0}, has_beta ? C->p : NULL, beta, false);
    }
    goto done;
nomem:
    rc = PB_ENOMEM;
done:
    scratch_free(ab);
    scratch_free(bb);
    scratch_free(mb);
    return rc;
}
