/* QR and LQ, their null spaces, and their pullbacks for one dtype: a
 * body for dtype_t.h, instantiated by factor_qr.c.  The tape keeps Q and R
 * (L and Q); the null forms keep A and N. */

#define QR_BLOCK 96 /* below this order the QR pullback's triangular products stop halving */
#if CPLX
#define ORGQR LAPACK(ungqr)
#define ORGLQ LAPACK(unglq)
#else
#define ORGQR LAPACK(orgqr)
#define ORGLQ LAPACK(orglq)
#endif

/* X (m×n) ← X·op(U)⁻¹ for an upper triangular n×n U: op 'N' or 'C'. */
static void FN(trsm_right)(char op, int m, int n, const T *U, int ldu, T *X, int ldx)
{
    if (m <= 0 || n <= 0)
        return;
    T one = 1;
    CBLAS(trsm)(CblasColMajor, CblasRight, CblasUpper, pb_blas_trans(op), CblasNonUnit, m, n, SCAL(one), U, LD(ldu), X,
                LD(ldx));
}

/* The upper triangle (diagonal included) of C (n×n, ldc) += alpha·
 * op(A)·op(B), op(A) n×k and op(B) k×n, op 'N' or 'C': half a GEMM's
 * flops, taken recursively so that most of them run as large GEMMs
 * (C₁₂ += op(A)₁·op(B)₂) rather than many thin ones.  Entries below C's
 * diagonal are left undefined. */
static void FN(gemm_upper)(char ta, char tb, int n, int k, T alpha, const T *A, int lda, const T *B, int ldb, T *C,
                           int ldc)
{
    const T one = 1;
    if (n <= QR_BLOCK) {
        FZ(gemm)(ta, tb, n, n, k, alpha, A, lda, B, ldb, one, C, ldc);
        return;
    }
    int n1 = n / 2, n2 = n - n1;
    const T *A2 = ta == 'N' ? A + n1 : A + (size_t)n1 * lda, *B2 = tb == 'N' ? B + (size_t)n1 * ldb : B + n1;
    FN(gemm_upper)(ta, tb, n1, k, alpha, A, lda, B, ldb, C, ldc);
    FZ(gemm)(ta, tb, n1, n2, k, alpha, A, lda, B2, ldb, one, C + (size_t)n1 * ldc, ldc);
    FN(gemm_upper)(ta, tb, n2, k, alpha, A2, lda, B2, ldb, C + (size_t)n1 * ldc + n1, ldc);
}

/* The upper triangle of C (n×n, ldc) += D·Rᴴ for D and R upper
 * triangular (n×n; D's lower part is never read): C_ij += Σ_{k≥j}
 * D_ik conj(R_jk), n³/3 flops.  In halves: C₁₁ += D₁₁R₁₁ᴴ + D₁₂R₁₂ᴴ,
 * C₁₂ += D₁₂R₂₂ᴴ (a TRMM), C₂₂ += D₂₂R₂₂ᴴ.  Entries below C's diagonal
 * are left undefined; work (n×n/2 at least) is scratch. */
static void FN(triu_mul_upper)(int n, const T *D, int ldd, const T *R, int ldr, T *C, int ldc, T *work)
{
    const T one = 1;
    if (n <= QR_BLOCK) { /* C[:je, j0:je] += D[:je, j0:]·R[j0:je, j0:]ᴴ by column blocks */
        for (int j0 = 0; j0 < n; j0 += 16) {
            int jw = n - j0 < 16 ? n - j0 : 16, je = j0 + jw;
            FZ(gemm)('N', 'C', je, jw, n - j0, one, D + (size_t)j0 * ldd, ldd, R + (size_t)j0 * ldr + j0, ldr, one,
                     C + (size_t)j0 * ldc, ldc);
        }
        return;
    }
    int n1 = n / 2, n2 = n - n1;
    const T *D12 = D + (size_t)n1 * ldd, *R12 = R + (size_t)n1 * ldr;
    FN(triu_mul_upper)(n1, D, ldd, R, ldr, C, ldc, work);
    FN(gemm_upper)('N', 'C', n1, n2, one, D12, ldd, R12, ldr, C, ldc);
    /* C₁₂ += D₁₂·R₂₂ᴴ: the TRMM works in place, so on a copy of D₁₂ */
    FZ(copy)(work, n1, D12, ldd, n1, n2);
    CBLAS(trmm)(CblasColMajor, CblasRight, CblasUpper, CblasConjTrans, CblasNonUnit, n1, n2, SCAL(one), R12 + n1,
                LD(ldr), work, LD(n1));
    for (int j = 0; j < n2; j++)
        for (int i = 0; i < n1; i++)
            E(C, ldc, i, n1 + j) += E(work, n1, i, j);
    FN(triu_mul_upper)(n2, D12 + n1, ldd, R12 + n1, ldr, C + (size_t)n1 * ldc + n1, ldc, work);
}

/* ---- the factorizations and their pullbacks ------------------------------- */

int FZ(qr_factor)(T *A, int m, int n, int nq, T *Q, T *Rm, pb_err_t *err)
{
    int k = m < n ? m : n, nr = nq, ld, ldq;
    lapack_int info = 0;
    /* A and Q through LAPACK's leading dimension (FZ(pad)) */
    T *tau = FZ(zalloc)((size_t)k), *P = FZ(pad)(A, m, n, true, &ld), *Qp = FZ(pad)(Q, m, nq, false, &ldq);
    int rc = tau && P && Qp ? 0 : PB_ENOMEM, e = rc == 0 ? FZ(pow2_normalise)(P, ld, m, n) : 0;
    if (rc == 0 && k > 0 && (info = LAPACK(geqrf)(LAPACK_COL_MAJOR, m, n, P, ld, tau)))
        rc = FZ(lapack_fail)("geqrf", info, err);
    if (rc == 0) {
        for (int j = 0; j < n; j++)
            for (int i = 0; i <= j && i < k; i++)
                E(Rm, nr, i, j) = E(P, ld, i, j);
        if (k > 0)
            FZ(copy)(Qp, ldq, P, ld, m, k);
    }
    FZ(unpad)(P, ld, A, m, n, false); /* done with: not held through orgqr */
    if (rc == 0 && k == 0)
        for (int j = 0; j < nq; j++)
            E(Qp, ldq, j, j) = 1;
    else if (rc == 0 && (info = ORGQR(LAPACK_COL_MAJOR, m, nq, k, Qp, ldq, tau)))
        rc = FZ(lapack_fail)(CPLX ? "ungqr" : "orgqr", info, err);
    pb_mem_free(tau);
    FZ(unpad)(Qp, ldq, Q, m, nq, rc == 0);
    if (rc)
        return rc;
    /* the phases of diag(R) move into Q: R's rows (walked by columns,
     * as they lie) times conj(phase), Q's columns times the phase */
    T *ph = FZ(zalloc)((size_t)k);
    if (ph == NULL)
        return PB_ENOMEM;
    for (int i = 0; i < k; i++) {
        T r = E(Rm, nr, i, i);
        double a = ABS(r);
        ph[i] = a > 0 ? (T)(r / a) : (T)1;
        E(Rm, nr, i, i) = (T)a;
        if (ph[i] != (T)1)
            for (int l = 0; l < m; l++)
                E(Q, m, l, i) *= ph[i];
    }
    for (int j = 0; j < n; j++)
        for (int i = 0; i < k && i < j; i++)
            E(Rm, nr, i, j) *= CONJ(ph[i]);
    pb_mem_free(ph);
    if (e) /* Q is A's as well as A·2^-e's; R goes back last (an overflow in it stays R's) */
        FZ(pow2_mul)(Rm, nr, nr, n, e);
    return 0;
}

/* The numerical rank p of R: the last i with |R_ii| ≥ atol, plus one. */
static int FN(qr_rank)(const T *Rm, int nr, int k, double atol)
{
    int p = 0;
    for (int i = 0; i < k; i++)
        if (ABS(E(Rm, nr, i, i)) >= atol)
            p = i + 1;
    return p;
}

/* dA (m×n, accumulated) from the cotangents dQ (m×nq) and dR (nr×n) of
 * A = Q·R (either may be NULL), MatrixAlgebraKit's rule: with p the rank,
 *   Q̃ = ΔQ₁ − Q₂(Q₁ᴴΔQ₂)ᴴ − Q₁(ΔR₁₂R₁₂ᴴ),  M = ΔR₁₁R₁₁ᴴ − Q₁ᴴQ̃ made
 *   Hermitian from its upper triangle (real diagonal),
 *   ΔA₁ += (Q₁M + Q̃)R₁₁⁻ᴴ,  ΔA₂ += Q₁ΔR₁₂.
 * *gauge: the gauge-dependent size: ΔQ and ΔR beyond the rank, and the
 * anti-Hermitian part of Q₂ᴴΔQ₂ (a rotation of the completion). */
static int FN(qr_pullback)(const T *Q, int m, int nq, const T *Rm, int nr, int n, const T *dQ, const T *dR, T *dA,
                           double rank_atol, double *gauge)
{
    int k = m < n ? m : n, p = FN(qr_rank)(Rm, nr, k, rank_atol), q2 = nq - p;
    double g = 0;
    if (p < k) {
        if (dQ)
            g = fmax(g, FZ(maxabs)(dQ, m, 0, m, p, nq - p));
        if (dR)
            g = fmax(g, FZ(maxabs)(dR, nr, p, k - p, p, n - p));
    }
    T *dQt = FZ(zalloc)((size_t)m * (size_t)p), *M = FZ(zalloc)((size_t)p * (size_t)p);
    /* X: Q₂ᴴΔQ₂ and Q₁ᴴΔQ₂, then triu_mul_upper's scratch (p/2)×(p−p/2) */
    size_t xn = (size_t)(p > q2 ? p : q2) * (size_t)q2, wn = (size_t)(p / 2) * (size_t)(p - p / 2);
    T *X = FZ(zalloc)(xn > wn ? xn : wn);
    if (dQt == NULL || M == NULL || X == NULL) {
        pb_mem_free(dQt);
        pb_mem_free(M);
        pb_mem_free(X);
        return PB_ENOMEM;
    }
    const T one = 1, zero = 0, mone = -1;
    if (dQ) {
        memcpy(dQt, dQ, (size_t)m * (size_t)p * sizeof(T));
        if (q2 > 0) {
            const T *Q2 = Q + (size_t)p * m, *dQ2 = dQ + (size_t)p * m;
            FZ(gemm)('C', 'N', q2, q2, m, one, Q2, m, dQ2, m, zero, X, q2);
            g = fmax(g, FZ(maxantiherm)(X, q2));
            FZ(gemm)('C', 'N', p, q2, m, one, Q, m, dQ2, m, zero, X, p);
            FZ(gemm)('N', 'C', m, p, q2, mone, Q2, m, X, p, one, dQt, m);
        }
    }
    if (dR && n > p) {
        const T *R12 = Rm + (size_t)p * nr, *dR12 = dR + (size_t)p * nr;
        FZ(gemm)('N', 'C', p, p, n - p, one, dR12, nr, R12, nr, zero, M, p);
        FZ(gemm)('N', 'N', m, p, p, mone, Q, m, M, p, one, dQt, m);
        FZ(gemm)('N', 'N', m, n - p, p, one, Q, m, dR12, nr, one, dA + (size_t)p * m, m);
    }
    /* Only M's upper triangle is used (the rest is its mirror), so both
     * products are taken as triangles: ΔR₁₁R₁₁ᴴ with R upper in p³/3
     * flops instead of 2p³, and Q₁ᴴQ̃ in mp² instead of 2mp². */
    memset(M, 0, (size_t)p * (size_t)p * sizeof(T));
    if (dR)
        FN(triu_mul_upper)(p, dR, nr, Rm, nr, M, p, X);
    FN(gemm_upper)('C', 'N', p, m, mone, Q, m, dQt, m, M, p);
    for (int j = 0; j < p; j++) {
        E(M, p, j, j) = (T)RE(E(M, p, j, j));
        for (int i = j + 1; i < p; i++)
            E(M, p, i, j) = CONJ(E(M, p, j, i));
    }
    /* ΔA₁ += (Q₁M + Q̃)·R₁₁⁻ᴴ: one GEMM into Q̃, one triangular solve */
    FZ(gemm)('N', 'N', m, p, p, one, Q, m, M, p, one, dQt, m);
    FN(trsm_right)('C', m, p, Rm, nr, dQt, m);
    for (size_t i = 0; i < (size_t)m * (size_t)p; i++)
        dA[i] += dQt[i];
    pb_mem_free(dQt);
    pb_mem_free(M);
    pb_mem_free(X);
    *gauge = g;
    return 0;
}

/* A = L·Q with diag(L) real and ≥ 0.  A (m×n) is overwritten; L is m×nl,
 * Q is nl×n (nl = k or n), zeroed by the caller. */
static int FN(lq_factor)(T *A, int m, int n, int nl, T *L, T *Q, pb_err_t *err)
{
    int k = m < n ? m : n, ld, ldq;
    lapack_int info = 0;
    /* A and Q through LAPACK's leading dimension (FZ(pad)) */
    T *tau = FZ(zalloc)((size_t)k), *P = FZ(pad)(A, m, n, true, &ld), *Qp = FZ(pad)(Q, nl, n, false, &ldq);
    int rc = tau && P && Qp ? 0 : PB_ENOMEM, e = rc == 0 ? FZ(pow2_normalise)(P, ld, m, n) : 0;
    if (rc == 0 && k > 0 && (info = LAPACK(gelqf)(LAPACK_COL_MAJOR, m, n, P, ld, tau)))
        rc = FZ(lapack_fail)("gelqf", info, err);
    if (rc == 0) {
        for (int j = 0; j < k; j++)
            for (int i = j; i < m; i++)
                E(L, m, i, j) = E(P, ld, i, j);
        if (k > 0)
            FZ(copy)(Qp, ldq, P, ld, k, n);
    }
    FZ(unpad)(P, ld, A, m, n, false); /* done with: not held through orglq */
    if (rc == 0 && k == 0)
        for (int i = 0; i < nl; i++)
            E(Qp, ldq, i, i) = 1;
    else if (rc == 0 && (info = ORGLQ(LAPACK_COL_MAJOR, nl, n, k, Qp, ldq, tau)))
        rc = FZ(lapack_fail)(CPLX ? "unglq" : "orglq", info, err);
    pb_mem_free(tau);
    FZ(unpad)(Qp, ldq, Q, nl, n, rc == 0);
    if (rc)
        return rc;
    for (int i = 0; i < k; i++) {
        T l = E(L, m, i, i);
        double a = ABS(l);
        T ph = a > 0 ? (T)(l / a) : (T)1;
        for (int r = i; r < m; r++)
            E(L, m, r, i) *= CONJ(ph);
        E(L, m, i, i) = (T)a;
        for (int j = 0; j < n; j++)
            E(Q, nl, i, j) *= ph;
    }
    if (e)
        FZ(pow2_mul)(L, m, m, k, e);
    return 0;
}

/* LQ's pullback is QR's of Aᴴ = Qᴴ·Lᴴ, taken through adjoints. */
static int FN(lq_pullback)(const T *L, int m, int nl, const T *Q, int n, const T *dL, const T *dQ, T *dA,
                           double rank_atol, double *gauge)
{
    T *Qa = FZ(zalloc)((size_t)n * nl), *Ra = FZ(zalloc)((size_t)nl * m), *dAa = FZ(zalloc)((size_t)n * m);
    T *dQa = dQ ? FZ(zalloc)((size_t)n * nl) : NULL, *dRa = dL ? FZ(zalloc)((size_t)nl * m) : NULL;
    int rc = PB_ENOMEM;
    if (Qa && Ra && dAa && (dQa || !dQ) && (dRa || !dL)) {
        FZ(adjoint)(Q, nl, n, Qa);
        FZ(adjoint)(L, m, nl, Ra);
        if (dQ)
            FZ(adjoint)(dQ, nl, n, dQa);
        if (dL)
            FZ(adjoint)(dL, m, nl, dRa);
        rc = FN(qr_pullback)(Qa, n, nl, Ra, nl, m, dQa, dRa, dAa, rank_atol, gauge);
        if (rc == 0)
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++)
                    E(dA, m, i, j) += CONJ(E(dAa, n, j, i));
    }
    pb_mem_free(Qa);
    pb_mem_free(Ra);
    pb_mem_free(dAa);
    pb_mem_free(dQa);
    pb_mem_free(dRa);
    return rc;
}

/* N (m×(m−k)): the last columns of the full Q of A = Q·R. */
static int FN(qr_null)(T *A, int m, int n, T *N, pb_err_t *err)
{
    int k = m < n ? m : n;
    T *Q = FZ(zalloc)((size_t)m * m), *Rm = FZ(zalloc)((size_t)m * (size_t)n);
    int rc = PB_ENOMEM;
    if (Q && Rm && (rc = FZ(qr_factor)(A, m, n, m, Q, Rm, err)) == 0)
        memcpy(N, Q + (size_t)k * m, (size_t)m * (size_t)(m - k) * sizeof(T));
    pb_mem_free(Q);
    pb_mem_free(Rm);
    return rc;
}

/* The pullback of N = null(Aᴴ) (m×(m−k)), which reads A: from Nᴴ·A = 0,
 * dN = −Q₁·pinv(R₁)ᴴ·dAᴴ·N plus a rotation of N, so
 *   ΔA = −N·(ΔNᴴQ₁)·pinv(R₁)ᴴ,  pinv(R₁)ᴴ = (R₁R₁ᴴ)⁻¹R₁  (R₁⁻ᴴ at full rank)
 * with Q₁ (m×p), R₁ (p×n) the rank-p part of A's QR.  *gauge: the anti-
 * Hermitian part of NᴴΔN (the rotation). */
static int FN(qr_null_pullback)(const T *A, int m, int n, const T *N, const T *dN, T *dA, double rank_atol,
                                double *gauge, pb_err_t *err)
{
    int k = m < n ? m : n, nn = m - k;
    *gauge = 0;
    if (nn == 0 || dN == NULL)
        return 0;
    T *Ac = FZ(zalloc)((size_t)m * n), *Q = FZ(zalloc)((size_t)m * k), *Rm = FZ(zalloc)((size_t)k * n);
    T *W = FZ(zalloc)((size_t)nn * (nn > k ? nn : k)), *X = FZ(zalloc)((size_t)nn * n);
    T *G = FZ(zalloc)((size_t)k * k);
    int rc = PB_ENOMEM;
    const T one = 1, zero = 0, mone = -1;
    if (!(Ac && Q && Rm && W && X && G))
        goto out;
    FZ(gemm)('C', 'N', nn, nn, m, one, N, m, dN, m, zero, W, nn);
    *gauge = FZ(maxantiherm)(W, nn);
    memcpy(Ac, A, (size_t)m * n * sizeof(T));
    if ((rc = FZ(qr_factor)(Ac, m, n, k, Q, Rm, err)))
        goto out;
    int p = FN(qr_rank)(Rm, k, k, rank_atol);
    FZ(gemm)('C', 'N', nn, p, m, one, dN, m, Q, m, zero, W, nn); /* ΔNᴴQ₁ */
    if (p == n) {
        FN(trsm_right)('C', nn, p, Rm, k, W, nn);
        memcpy(X, W, (size_t)nn * (size_t)n * sizeof(T));
    } else if (p > 0) {
        /* W·(R₁R₁ᴴ)⁻¹ through Cholesky of G = R₁R₁ᴴ: solve G·Zᴴ = Wᴴ */
        FZ(gemm)('N', 'C', p, p, n, one, Rm, k, Rm, k, zero, G, p);
        T *Zh = FZ(zalloc)((size_t)p * nn);
        if (Zh == NULL) {
            rc = PB_ENOMEM;
            goto out;
        }
        FZ(adjoint)(W, nn, p, Zh);
        lapack_int info = LAPACK(potrf)(LAPACK_COL_MAJOR, 'U', p, G, LD(p));
        if (info == 0)
            info = LAPACK(potrs)(LAPACK_COL_MAJOR, 'U', p, nn, G, LD(p), Zh, LD(p));
        if (info) {
            pb_mem_free(Zh);
            rc = FZ(lapack_fail)("potrf", info, err);
            goto out;
        }
        FZ(gemm)('C', 'N', nn, n, p, one, Zh, p, Rm, k, zero, X, nn);
        pb_mem_free(Zh);
    }
    FZ(gemm)('N', 'N', m, n, nn, mone, N, m, X, nn, one, dA, m);
    rc = 0;
out:
    pb_mem_free(Ac);
    pb_mem_free(Q);
    pb_mem_free(Rm);
    pb_mem_free(W);
    pb_mem_free(X);
    pb_mem_free(G);
    return rc;
}

/* ---- the entry points (factor_qr.c's rows) ---------------------------------- */

/* qr_null, and lq_null(A) = qr_null(Aᴴ)ᴴ; the tape keeps A, which the
 * pullback reads, and N. */
static int FN(null_factor)(const pb_call_t *c, T *A, pb_tensor_t *o, pb_tensor_t *sv, bool lq, pb_err_t *err)
{
    const int m = (int)c->in[0].shape[0], n = (int)c->in[0].shape[1], k = m < n ? m : n;
    const int mm = lq ? n : m, nn = lq ? m : n;
    pb_tensor_t tmp = {0};
    T *Ak = FZ(newmat)(&sv[0], m, n), *N = FZ(newmat)(lq ? &tmp : &o[0], mm, mm - k), *X = NULL;
    int rc = PB_ENOMEM;
    if (Ak && N && (X = FZ(zalloc)((size_t)m * n))) {
        memcpy(Ak, A, (size_t)m * n * sizeof(T));
        if (lq)
            FZ(adjoint)(A, m, n, X);
        else
            memcpy(X, A, (size_t)m * n * sizeof(T));
        if ((rc = FN(qr_null)(X, mm, nn, N, err)) == 0 && lq) {
            T *Nl = FZ(newmat)(&o[0], mm - k, mm);
            if (Nl)
                FZ(adjoint)(N, mm, mm - k, Nl);
            else
                rc = PB_ENOMEM;
        }
        if (rc == 0)
            pb_tensor_ref(&sv[1], &o[0]);
    }
    pb_tensor_clear(&tmp);
    pb_mem_free(X);
    return rc;
}

/* qr_compact, qr_full (Q m×k or m×m): the tape keeps Q and R; lq_compact,
 * lq_full (Q k×n or n×n): it keeps L and Q.  The null forms go to
 * null_factor. */
static int FN(qrlq_factor)(const pb_call_t *c, T *A, pb_tensor_t *o, pb_tensor_t *sv, bool lq, pb_err_t *err)
{
    if (c->op->variant == FZ_NULL)
        return FN(null_factor)(c, A, o, sv, lq, err);
    const int m = (int)c->in[0].shape[0], n = (int)c->in[0].shape[1], k = m < n ? m : n;
    const int mid = c->op->variant == FZ_FULL ? (lq ? n : m) : k; /* Q's columns, or L's */
    T *F0 = FZ(newmat)(&o[0], m, mid), *F1 = FZ(newmat)(&o[1], mid, n);
    int rc = PB_ENOMEM;
    if (F0 && F1)
        rc = lq ? FN(lq_factor)(A, m, n, mid, F0, F1, err) : FZ(qr_factor)(A, m, n, mid, F0, F1, err);
    if (rc == 0) {
        pb_tensor_ref(&sv[0], &o[0]);
        pb_tensor_ref(&sv[1], &o[1]);
    }
    return rc;
}

static int FN(qr_fwd)(const pb_call_t *c, T *A, const fz_opts_t *op, pb_tensor_t *o, pb_tensor_t *sv, pb_err_t *err)
{
    (void)op;
    return FN(qrlq_factor)(c, A, o, sv, false, err);
}

static int FN(lq_fwd)(const pb_call_t *c, T *A, const fz_opts_t *op, pb_tensor_t *o, pb_tensor_t *sv, pb_err_t *err)
{
    (void)op;
    return FN(qrlq_factor)(c, A, o, sv, true, err);
}

/* The pullbacks from the tape: qr_null's reads A and N; lq_null's is
 * qr_null's of Aᴴ; the others read Q and R (L and Q). */
static int FN(null_pull)(const pb_tapedata_t *t, const pb_tensor_t *cot, T *dA, double rank_atol, double *gauge,
                         bool lq, pb_err_t *err)
{
    const int m = (int)t->in_meta[0].shape[0], n = (int)t->in_meta[0].shape[1], k = m < n ? m : n;
    const void *A = pb_tensor_data(&t->saved[0]), *N = pb_tensor_data(&t->saved[1]);
    T *c0 = NULL, *c1 = NULL, *Aa = NULL, *Na = NULL, *dAa = NULL;
    int rc = lq ? FZ(load_cot)(&cot[0], n - k, n, &c0) : FZ(load_cot)(&cot[0], m, m - k, &c0);
    if (rc || !lq) {
        if (rc == 0)
            rc = FN(qr_null_pullback)(A, m, n, N, c0, dA, rank_atol, gauge, err);
        pb_mem_free(c0);
        return rc;
    }
    Aa = FZ(zalloc)((size_t)m * n);
    Na = FZ(zalloc)((size_t)n * (n - k));
    dAa = FZ(zalloc)((size_t)m * n);
    rc = PB_ENOMEM;
    if (Aa && Na && dAa && (!c0 || (c1 = FZ(zalloc)((size_t)n * (n - k))))) {
        FZ(adjoint)(A, m, n, Aa);
        FZ(adjoint)(N, n - k, n, Na);
        if (c0)
            FZ(adjoint)(c0, n - k, n, c1);
        rc = FN(qr_null_pullback)(Aa, n, m, Na, c1, dAa, rank_atol, gauge, err);
        if (rc == 0)
            FZ(adjoint)(dAa, n, m, dA);
    }
    pb_mem_free(Aa);
    pb_mem_free(Na);
    pb_mem_free(dAa);
    pb_mem_free(c0);
    pb_mem_free(c1);
    return rc;
}

static int FN(qrlq_pull)(const pb_tapedata_t *t, const pb_tensor_t *cot, const fz_opts_t *op, T *dA, double *gauge,
                         bool lq, pb_err_t *err)
{
    if (t->op->variant == FZ_NULL)
        return FN(null_pull)(t, cot, dA, op->rank_atol, gauge, lq, err);
    const int m = (int)t->in_meta[0].shape[0], n = (int)t->in_meta[0].shape[1];
    const pb_tensor_t *s0 = &t->saved[0], *s1 = &t->saved[1];
    const int mid = (int)s0->shape[1];
    T *c0 = NULL, *c1 = NULL;
    int rc = FZ(load_cot)(&cot[0], m, mid, &c0);
    if (rc == 0 && (rc = FZ(load_cot)(&cot[1], mid, n, &c1)) == 0)
        rc = lq ? FN(lq_pullback)(pb_tensor_data(s0), m, mid, pb_tensor_data(s1), n, c0, c1, dA, op->rank_atol, gauge)
                : FN(qr_pullback)(pb_tensor_data(s0), m, mid, pb_tensor_data(s1), mid, n, c0, c1, dA, op->rank_atol,
                                  gauge);
    pb_mem_free(c0);
    pb_mem_free(c1);
    return rc;
}

static int FN(qr_pull)(const pb_tapedata_t *t, const pb_tensor_t *cot, const fz_opts_t *op, T *dA, double *gauge,
                       pb_err_t *err)
{
    return FN(qrlq_pull)(t, cot, op, dA, gauge, false, err);
}

static int FN(lq_pull)(const pb_tapedata_t *t, const pb_tensor_t *cot, const fz_opts_t *op, T *dA, double *gauge,
                       pb_err_t *err)
{
    return FN(qrlq_pull)(t, cot, op, dA, gauge, true, err);
}

static int FN(qr_forward)(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    return FZ(forward)(c, tape, err, FN(qr_fwd));
}

static int FN(lq_forward)(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    return FZ(forward)(c, tape, err, FN(lq_fwd));
}

static int FN(qr_reverse)(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                          pb_warnings_t *warn, pb_err_t *err)
{
    return FZ(reverse)(t, cot, grad, order, warn, err, FN(qr_pull));
}

static int FN(lq_reverse)(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                          pb_warnings_t *warn, pb_err_t *err)
{
    return FZ(reverse)(t, cot, grad, order, warn, err, FN(lq_pull));
}

/* The check's projection for QR and LQ, in QR form (Q mq×nq, R nq×nr; LQ
 * through adjoints): vectors past the rank dropped, and of a completion
 * only its span(Q₁) part kept. */
static int FN(qrlq_fd)(const pb_call_t *c, pb_tensor_t *cot, bool lq)
{
    const int m = (int)c->in[0].shape[0], n = (int)c->in[0].shape[1], k = m < n ? m : n;
    fz_opts_t op;
    if (FZ(fd_opts)(c, &op))
        return PB_ENOMEM;
    int qi = lq ? 1 : 0, ri = lq ? 0 : 1;
    int mq = lq ? n : m, nr = lq ? m : n, nq = lq ? (int)c->out[1].shape[0] : (int)c->out[0].shape[1];
    T *Q = FZ(out_arr)(c, qi), *Rm = FZ(out_arr)(c, ri), *t0 = NULL, *t1 = NULL;
    T *X0 = FZ(zalloc)((size_t)mq * nq), *X1 = FZ(zalloc)((size_t)nq * nr);
    T *D0 = FZ(zalloc)((size_t)mq * nq), *D1 = FZ(zalloc)((size_t)nq * nr);
    int rc = PB_ENOMEM;
    if (!(Q && Rm && X0 && X1 && D0 && D1))
        goto out;
    if (lq) { /* Q_qr = Qᴴ, R_qr = Lᴴ, and their cotangents likewise */
        t0 = FZ(zalloc)((size_t)mq * nq);
        t1 = FZ(zalloc)((size_t)nq * nr);
        if (t0 == NULL || t1 == NULL)
            goto out;
        FZ(adjoint)(Q, nq, mq, X0);
        FZ(adjoint)(Rm, nr, nq, X1);
        FZ(load)(&cot[qi], t0, nq, mq);
        FZ(adjoint)(t0, nq, mq, D0);
        FZ(load)(&cot[ri], t1, nr, nq);
        FZ(adjoint)(t1, nr, nq, D1);
    } else {
        memcpy(X0, Q, (size_t)mq * nq * sizeof(T));
        memcpy(X1, Rm, (size_t)nq * nr * sizeof(T));
        FZ(load)(&cot[qi], D0, mq, nq);
        FZ(load)(&cot[ri], D1, nq, nr);
    }
    int p = FN(qr_rank)(X1, nq, k, op.rank_atol);
    for (int j = p; j < (p < k ? nq : k); j++) /* vectors past the rank */
        memset(D0 + (size_t)j * mq, 0, (size_t)mq * sizeof(T));
    if (p == k)
        FZ(onto_span)(X0, mq, p, D0, k, nq); /* the completion: only its span(Q₁) part */
    for (int j = p; j < nr; j++)
        for (int i = p; i < k; i++)
            E(D1, nq, i, j) = 0;
    if (lq) {
        FZ(adjoint)(D0, mq, nq, t0); /* ΔQ (nq×mq) */
        FZ(store_back)(&cot[qi], t0, nq, mq);
        FZ(adjoint)(D1, nq, nr, t1); /* ΔL (nr×nq) */
        FZ(store_back)(&cot[ri], t1, nr, nq);
    } else {
        FZ(store_back)(&cot[qi], D0, mq, nq);
        FZ(store_back)(&cot[ri], D1, nq, nr);
    }
    rc = 0;
out:
    pb_mem_free(Q);
    pb_mem_free(Rm);
    pb_mem_free(t0);
    pb_mem_free(t1);
    pb_mem_free(X0);
    pb_mem_free(X1);
    pb_mem_free(D0);
    pb_mem_free(D1);
    return rc;
}

/* The null spaces' projection: drop the rotation of N,
 * ΔN −= N·antiherm(NᴴΔN). */
static int FN(null_fd)(const pb_call_t *c, pb_tensor_t *cot, bool lq)
{
    const int m = (int)c->in[0].shape[0], n = (int)c->in[0].shape[1], k = m < n ? m : n;
    const int mm = lq ? n : m, nn = mm - k;
    T *N = FZ(out_arr)(c, 0), *X0 = FZ(zalloc)((size_t)mm * nn), *D0 = FZ(zalloc)((size_t)mm * nn);
    T *X1 = FZ(zalloc)((size_t)nn * nn);
    int rc = PB_ENOMEM;
    if (N && X0 && D0 && X1) {
        const T one = 1, zero = 0, mone = -1;
        if (lq) {
            FZ(adjoint)(N, nn, mm, X0);
            T *t = FZ(zalloc)((size_t)mm * nn);
            if (t) {
                FZ(load)(&cot[0], t, nn, mm);
                FZ(adjoint)(t, nn, mm, D0);
            }
            pb_mem_free(t);
        } else {
            memcpy(X0, N, (size_t)mm * nn * sizeof(T));
            FZ(load)(&cot[0], D0, mm, nn);
        }
        FZ(gemm)('C', 'N', nn, nn, mm, one, X0, mm, D0, mm, zero, X1, nn);
        FZ(antiherm)(X1, nn);
        FZ(gemm)('N', 'N', mm, nn, nn, mone, X0, mm, X1, nn, one, D0, mm);
        if (lq) {
            T *t = FZ(zalloc)((size_t)mm * nn);
            if (t) {
                FZ(adjoint)(D0, mm, nn, t);
                FZ(store_back)(&cot[0], t, nn, mm);
            }
            pb_mem_free(t);
        } else
            FZ(store_back)(&cot[0], D0, mm, nn);
        rc = 0;
    }
    pb_mem_free(N);
    pb_mem_free(X0);
    pb_mem_free(D0);
    pb_mem_free(X1);
    return rc;
}

static int FN(qr_fd)(const pb_call_t *c, pb_tensor_t *cot)
{
    return c->op->variant == FZ_NULL ? FN(null_fd)(c, cot, false) : FN(qrlq_fd)(c, cot, false);
}

static int FN(lq_fd)(const pb_call_t *c, pb_tensor_t *cot)
{
    return c->op->variant == FZ_NULL ? FN(null_fd)(c, cot, true) : FN(qrlq_fd)(c, cot, true);
}

#undef QR_BLOCK
#undef ORGQR
#undef ORGLQ
