/* The factorizations and their pullbacks for one element type; included
 * by factor.c four times with
 *   T     element type          RT   its real type     CT  complex of RT
 *   SFX   name suffix (_s ...)  LP   LAPACK/CBLAS letter (s, d, c, z)
 *   DT, RDT, CDT  the pb_dtype_t of T, RT and CT       CPLX  1 for complex T
 * and undefines them at its end.
 *
 * Every matrix here is column-major with its leading dimension equal to
 * its row count (E(M, ld, i, j)); 0-size dimensions are allowed and every
 * array has room for at least one element.  Functions return 0 or a
 * negative PB_E* code with err filled. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)
#define LAPACK(name) CAT(LAPACKE_, CAT(LP, name))
#define CBLAS(name) CAT(cblas_, CAT(LP, name))

#if CPLX
#define RE(x) creal(x)
#define IM(x) cimag(x)
#define CONJ(x) ((T)conj(x))
#define ABS(x) cabs(x)
#define SCAL(x) (&(x))
#define ORGQR LAPACK(ungqr)
#define ORGLQ LAPACK(unglq)
#define SYEVD LAPACK(heevd)
#else
#define RE(x) ((double)(x))
#define IM(x) 0.0
#define CONJ(x) (x)
#define ABS(x) fabs((double)(x))
#define SCAL(x) (x)
#define ORGQR LAPACK(orgqr)
#define ORGLQ LAPACK(orglq)
#define SYEVD LAPACK(syevd)
#endif

/* Zeroed work arrays of n elements (never 0 bytes, so never NULL for a
 * zero-size matrix), with the tail slack LAPACK's over-reads need
 * (tensor.h); freed with free(). */
static T *FN(zalloc)(size_t n)
{
    return pb_mem_calloc(n ? n : 1, sizeof(T));
}

static RT *FN(ralloc)(size_t n)
{
    return pb_mem_calloc(n ? n : 1, sizeof(RT));
}

/* c = alpha·op(a)·op(b) + beta·c, op 'N', 'T' or 'C'. */
static void FN(gemm)(char ta, char tb, int m, int n, int k, T alpha, const T *a, int lda, const T *b, int ldb, T beta,
                     T *c, int ldc)
{
    if (m <= 0 || n <= 0)
        return;
    CBLAS(gemm)(CblasColMajor, fz_tr(ta), fz_tr(tb), m, n, k < 0 ? 0 : k, SCAL(alpha), a, LD(lda), b, LD(ldb),
                SCAL(beta), c, LD(ldc));
}

/* X (m×n) ← X·op(U)⁻¹ for an upper triangular n×n U: op 'N' or 'C'. */
static void FN(trsm_right)(char op, int m, int n, const T *U, int ldu, T *X, int ldx)
{
    if (m <= 0 || n <= 0)
        return;
    T one = 1;
    CBLAS(trsm)(CblasColMajor, CblasRight, CblasUpper, fz_tr(op), CblasNonUnit, m, n, SCAL(one), U, LD(ldu), X,
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
        FN(gemm)(ta, tb, n, n, k, alpha, A, lda, B, ldb, one, C, ldc);
        return;
    }
    int n1 = n / 2, n2 = n - n1;
    const T *A2 = ta == 'N' ? A + n1 : A + (size_t)n1 * lda, *B2 = tb == 'N' ? B + (size_t)n1 * ldb : B + n1;
    FN(gemm_upper)(ta, tb, n1, k, alpha, A, lda, B, ldb, C, ldc);
    FN(gemm)(ta, tb, n1, n2, k, alpha, A, lda, B2, ldb, one, C + (size_t)n1 * ldc, ldc);
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
            FN(gemm)('N', 'C', je, jw, n - j0, one, D + (size_t)j0 * ldd, ldd, R + (size_t)j0 * ldr + j0, ldr, one,
                     C + (size_t)j0 * ldc, ldc);
        }
        return;
    }
    int n1 = n / 2, n2 = n - n1;
    const T *D12 = D + (size_t)n1 * ldd, *R12 = R + (size_t)n1 * ldr;
    FN(triu_mul_upper)(n1, D, ldd, R, ldr, C, ldc, work);
    FN(gemm_upper)('N', 'C', n1, n2, one, D12, ldd, R12, ldr, C, ldc);
    /* C₁₂ += D₁₂·R₂₂ᴴ: the TRMM works in place, so on a copy of D₁₂ */
    for (int j = 0; j < n2; j++)
        memcpy(work + (size_t)j * n1, D12 + (size_t)j * ldd, (size_t)n1 * sizeof(T));
    CBLAS(trmm)(CblasColMajor, CblasRight, CblasUpper, CblasConjTrans, CblasNonUnit, n1, n2, SCAL(one), R12 + n1,
                LD(ldr), work, LD(n1));
    for (int j = 0; j < n2; j++)
        for (int i = 0; i < n1; i++)
            E(C, ldc, i, n1 + j) += E(work, n1, i, j);
    FN(triu_mul_upper)(n2, D12 + n1, ldd, R12 + n1, ldr, C + (size_t)n1 * ldc + n1, ldc, work);
}

/* Y (n×m) = Xᴴ for X m×n. */
static void FN(adjoint)(const T *X, int m, int n, T *Y)
{
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++)
            E(Y, n, j, i) = CONJ(E(X, m, i, j));
}

/* The largest |entry| of the r×c block at (i0, j0) of M (ld). */
static double FN(maxabs)(const T *M, int ld, int i0, int r, int j0, int c)
{
    double g = 0;
    for (int j = j0; j < j0 + c; j++)
        for (int i = i0; i < i0 + r; i++)
            g = fmax(g, ABS(E(M, ld, i, j)));
    return g;
}

/* The largest |entry| of the anti-Hermitian part of the square X (n×n). */
static double FN(maxantiherm)(const T *X, int n)
{
    double g = 0;
    for (int j = 0; j < n; j++)
        for (int i = 0; i <= j; i++)
            g = fmax(g, 0.5 * ABS(E(X, n, i, j) - CONJ(E(X, n, j, i))));
    return g;
}

/* X ← (X − Xᴴ)/2 in place. */
static void FN(antiherm)(T *X, int n)
{
    for (int j = 0; j < n; j++)
        for (int i = 0; i <= j; i++) {
            T a = E(X, n, i, j), b = E(X, n, j, i);
            E(X, n, i, j) = (T)((a - CONJ(b)) * 0.5);
            E(X, n, j, i) = (T)((b - CONJ(a)) * 0.5);
        }
}

/* A tensor's values as a column-major m×n array (a vector: n = 1); a C-
 * ordered matrix goes through the cache-blocked permutation pass. */
static void FN(load)(const pb_tensor_t *t, T *dst, int m, int n)
{
    const T *src = pb_tensor_data(t);
    if (t->rank == 2 && t->order == 'C' && m > 1 && n > 1) {
        pb_loop_t L = {.rank = 2, .dim = {(uint64_t)m, (uint64_t)n}, .s = {{1, m}, {n, 1}}};
        pb_strided(DT, &L, dst, src, false, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, false);
    } else
        memcpy(dst, src, (size_t)m * (size_t)n * sizeof(T));
}

/* max|A_i| over n entries, in one pass that also notices NaN and Inf
 * (x − x is 0 for every finite x): *finite is false when there is one. */
static double FN(amax)(const T *A, size_t n, bool *finite)
{
    double big = 0, bad = 0;
    for (size_t i = 0; i < n; i++) {
        double re = RE(A[i]), im = IM(A[i]), a = re * re + im * im;
        big = a > big ? a : big;
        bad += (re - re) + (im - im);
    }
    *finite = bad == 0;
    return sqrt(big);
}

/* A cotangent as a fresh column-major array (NULL when absent: zero). */
static int FN(load_cot)(const pb_tensor_t *t, int m, int n, T **out)
{
    *out = NULL;
    if (t->storage == NULL)
        return 0;
    if ((*out = FN(zalloc)((size_t)m * (size_t)n)) == NULL)
        return PB_ENOMEM;
    FN(load)(t, *out, m, n);
    return 0;
}

/* A new zeroed F-ordered m×n tensor of dtype DT (a vector when n < 0). */
static T *FN(newmat)(pb_tensor_t *t, int m, int n)
{
    uint64_t sh[2] = {(uint64_t)m, (uint64_t)(n < 0 ? 1 : n)};
    if (pb_tensor_alloc(t, DT, n < 0 ? 1 : 2, sh, 'F', true))
        return NULL;
    return pb_tensor_data(t);
}

/* Multiply column j of V (m×c) by the unit phase that makes its largest-
 * magnitude entry (the first, on a tie) real and positive; ph[j] gets that
 * phase's conjugate (what a matching row of Vᴴ is multiplied by), when ph
 * is not NULL. */
static void FN(fix_phases)(T *V, int m, int c, T *ph)
{
    for (int j = 0; j < c; j++) {
        int best = 0;
        double big = -1;
        for (int i = 0; i < m; i++) { /* squared magnitudes: no hypot per entry */
            T v = E(V, m, i, j);
            double a = RE(v) * RE(v) + IM(v) * IM(v);
            if (a > big) {
                big = a;
                best = i;
            }
        }
        big = sqrt(big);
        T p = 1;
        if (m > 0 && big > 0)
            p = (T)(CONJ(E(V, m, best, j)) / big);
        for (int i = 0; i < m; i++)
            E(V, m, i, j) *= p;
        if (m > 0)
            E(V, m, best, j) = (T)ABS(E(V, m, best, j)); /* exactly real */
        if (ph)
            ph[j] = CONJ(p);
    }
}

static int FN(lapack_fail)(const char *what, lapack_int info, pb_err_t *err)
{
    if (info < 0)
        return pb_err_set(err, PB_EINTERNAL, NULL, "LAPACK %c%s rejected argument %d", LP_CHAR, what, (int)-info);
    int rc = pb_err_set(err, PB_ENUMERICAL, "inputs.A", "LAPACK %c%s did not converge (info %d)", LP_CHAR, what,
                        (int)info);
    err->info = info;
    err->has_info = 1;
    return rc;
}

/* ---- QR and LQ ---------------------------------------------------------- */

/* A = Q·R with diag(R) real and ≥ 0.  A (m×n) is overwritten; Q is m×nq
 * (nq = k or m), R is nr×n (nr = nq), both zeroed by the caller. */
static int FN(qr_factor)(T *A, int m, int n, int nq, T *Q, T *Rm, pb_err_t *err)
{
    int k = m < n ? m : n, nr = nq;
    lapack_int info;
    T *tau = FN(zalloc)((size_t)k);
    if (tau == NULL)
        return PB_ENOMEM;
    if (k > 0 && (info = LAPACK(geqrf)(LAPACK_COL_MAJOR, m, n, A, LD(m), tau))) {
        free(tau);
        return FN(lapack_fail)("geqrf", info, err);
    }
    for (int j = 0; j < n; j++)
        for (int i = 0; i <= j && i < k; i++)
            E(Rm, nr, i, j) = E(A, m, i, j);
    if (k > 0) {
        memcpy(Q, A, (size_t)m * (size_t)k * sizeof(T));
        if ((info = ORGQR(LAPACK_COL_MAJOR, m, nq, k, Q, LD(m), tau))) {
            free(tau);
            return FN(lapack_fail)(CPLX ? "ungqr" : "orgqr", info, err);
        }
    } else
        for (int j = 0; j < nq; j++)
            E(Q, m, j, j) = 1;
    free(tau);
    /* the phases of diag(R) move into Q: R's rows (walked by columns,
     * as they lie) times conj(phase), Q's columns times the phase */
    T *ph = FN(zalloc)((size_t)k);
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
    free(ph);
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
            g = fmax(g, FN(maxabs)(dQ, m, 0, m, p, nq - p));
        if (dR)
            g = fmax(g, FN(maxabs)(dR, nr, p, k - p, p, n - p));
    }
    T *dQt = FN(zalloc)((size_t)m * (size_t)p), *M = FN(zalloc)((size_t)p * (size_t)p);
    /* X: Q₂ᴴΔQ₂ and Q₁ᴴΔQ₂, then triu_mul_upper's scratch (p/2)×(p−p/2) */
    size_t xn = (size_t)(p > q2 ? p : q2) * (size_t)q2, wn = (size_t)(p / 2) * (size_t)(p - p / 2);
    T *X = FN(zalloc)(xn > wn ? xn : wn);
    if (dQt == NULL || M == NULL || X == NULL) {
        free(dQt);
        free(M);
        free(X);
        return PB_ENOMEM;
    }
    const T one = 1, zero = 0, mone = -1;
    if (dQ) {
        memcpy(dQt, dQ, (size_t)m * (size_t)p * sizeof(T));
        if (q2 > 0) {
            const T *Q2 = Q + (size_t)p * m, *dQ2 = dQ + (size_t)p * m;
            FN(gemm)('C', 'N', q2, q2, m, one, Q2, m, dQ2, m, zero, X, q2);
            g = fmax(g, FN(maxantiherm)(X, q2));
            FN(gemm)('C', 'N', p, q2, m, one, Q, m, dQ2, m, zero, X, p);
            FN(gemm)('N', 'C', m, p, q2, mone, Q2, m, X, p, one, dQt, m);
        }
    }
    if (dR && n > p) {
        const T *R12 = Rm + (size_t)p * nr, *dR12 = dR + (size_t)p * nr;
        FN(gemm)('N', 'C', p, p, n - p, one, dR12, nr, R12, nr, zero, M, p);
        FN(gemm)('N', 'N', m, p, p, mone, Q, m, M, p, one, dQt, m);
        FN(gemm)('N', 'N', m, n - p, p, one, Q, m, dR12, nr, one, dA + (size_t)p * m, m);
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
    FN(gemm)('N', 'N', m, p, p, one, Q, m, M, p, one, dQt, m);
    FN(trsm_right)('C', m, p, Rm, nr, dQt, m);
    for (size_t i = 0; i < (size_t)m * (size_t)p; i++)
        dA[i] += dQt[i];
    free(dQt);
    free(M);
    free(X);
    *gauge = g;
    return 0;
}

/* A = L·Q with diag(L) real and ≥ 0.  A (m×n) is overwritten; L is m×nl,
 * Q is nl×n (nl = k or n), zeroed by the caller. */
static int FN(lq_factor)(T *A, int m, int n, int nl, T *L, T *Q, pb_err_t *err)
{
    int k = m < n ? m : n;
    lapack_int info;
    T *tau = FN(zalloc)((size_t)k);
    if (tau == NULL)
        return PB_ENOMEM;
    if (k > 0 && (info = LAPACK(gelqf)(LAPACK_COL_MAJOR, m, n, A, LD(m), tau))) {
        free(tau);
        return FN(lapack_fail)("gelqf", info, err);
    }
    for (int j = 0; j < k; j++)
        for (int i = j; i < m; i++)
            E(L, m, i, j) = E(A, m, i, j);
    if (k > 0) {
        for (int j = 0; j < n; j++)
            for (int i = 0; i < k; i++)
                E(Q, nl, i, j) = E(A, m, i, j);
        if ((info = ORGLQ(LAPACK_COL_MAJOR, nl, n, k, Q, LD(nl), tau))) {
            free(tau);
            return FN(lapack_fail)(CPLX ? "unglq" : "orglq", info, err);
        }
    } else
        for (int i = 0; i < nl; i++)
            E(Q, nl, i, i) = 1;
    free(tau);
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
    return 0;
}

/* LQ's pullback is QR's of Aᴴ = Qᴴ·Lᴴ, taken through adjoints. */
static int FN(lq_pullback)(const T *L, int m, int nl, const T *Q, int n, const T *dL, const T *dQ, T *dA,
                           double rank_atol, double *gauge)
{
    T *Qa = FN(zalloc)((size_t)n * nl), *Ra = FN(zalloc)((size_t)nl * m), *dAa = FN(zalloc)((size_t)n * m);
    T *dQa = dQ ? FN(zalloc)((size_t)n * nl) : NULL, *dRa = dL ? FN(zalloc)((size_t)nl * m) : NULL;
    int rc = PB_ENOMEM;
    if (Qa && Ra && dAa && (dQa || !dQ) && (dRa || !dL)) {
        FN(adjoint)(Q, nl, n, Qa);
        FN(adjoint)(L, m, nl, Ra);
        if (dQ)
            FN(adjoint)(dQ, nl, n, dQa);
        if (dL)
            FN(adjoint)(dL, m, nl, dRa);
        rc = FN(qr_pullback)(Qa, n, nl, Ra, nl, m, dQa, dRa, dAa, rank_atol, gauge);
        if (rc == 0)
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++)
                    E(dA, m, i, j) += CONJ(E(dAa, n, j, i));
    }
    free(Qa);
    free(Ra);
    free(dAa);
    free(dQa);
    free(dRa);
    return rc;
}

/* N (m×(m−k)): the last columns of the full Q of A = Q·R. */
static int FN(qr_null)(T *A, int m, int n, T *N, pb_err_t *err)
{
    int k = m < n ? m : n;
    T *Q = FN(zalloc)((size_t)m * m), *Rm = FN(zalloc)((size_t)m * (size_t)n);
    int rc = PB_ENOMEM;
    if (Q && Rm && (rc = FN(qr_factor)(A, m, n, m, Q, Rm, err)) == 0)
        memcpy(N, Q + (size_t)k * m, (size_t)m * (size_t)(m - k) * sizeof(T));
    free(Q);
    free(Rm);
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
    T *Ac = FN(zalloc)((size_t)m * n), *Q = FN(zalloc)((size_t)m * k), *Rm = FN(zalloc)((size_t)k * n);
    T *W = FN(zalloc)((size_t)nn * (nn > k ? nn : k)), *X = FN(zalloc)((size_t)nn * n);
    T *G = FN(zalloc)((size_t)k * k);
    int rc = PB_ENOMEM;
    const T one = 1, zero = 0, mone = -1;
    if (!(Ac && Q && Rm && W && X && G))
        goto out;
    FN(gemm)('C', 'N', nn, nn, m, one, N, m, dN, m, zero, W, nn);
    *gauge = FN(maxantiherm)(W, nn);
    memcpy(Ac, A, (size_t)m * n * sizeof(T));
    if ((rc = FN(qr_factor)(Ac, m, n, k, Q, Rm, err)))
        goto out;
    int p = FN(qr_rank)(Rm, k, k, rank_atol);
    FN(gemm)('C', 'N', nn, p, m, one, dN, m, Q, m, zero, W, nn); /* ΔNᴴQ₁ */
    if (p == n) {
        FN(trsm_right)('C', nn, p, Rm, k, W, nn);
        memcpy(X, W, (size_t)nn * (size_t)n * sizeof(T));
    } else if (p > 0) {
        /* W·(R₁R₁ᴴ)⁻¹ through Cholesky of G = R₁R₁ᴴ: solve G·Zᴴ = Wᴴ */
        FN(gemm)('N', 'C', p, p, n, one, Rm, k, Rm, k, zero, G, p);
        T *Zh = FN(zalloc)((size_t)p * nn);
        if (Zh == NULL) {
            rc = PB_ENOMEM;
            goto out;
        }
        FN(adjoint)(W, nn, p, Zh);
        lapack_int info = LAPACK(potrf)(LAPACK_COL_MAJOR, 'U', p, G, LD(p));
        if (info == 0)
            info = LAPACK(potrs)(LAPACK_COL_MAJOR, 'U', p, nn, G, LD(p), Zh, LD(p));
        if (info) {
            free(Zh);
            rc = FN(lapack_fail)("potrf", info, err);
            goto out;
        }
        FN(gemm)('C', 'N', nn, n, p, one, Zh, p, Rm, k, zero, X, nn);
        free(Zh);
    }
    FN(gemm)('N', 'N', m, n, nn, mone, N, m, X, nn, one, dA, m);
    rc = 0;
out:
    free(Ac);
    free(Q);
    free(Rm);
    free(W);
    free(X);
    free(G);
    return rc;
}

/* ---- eigh --------------------------------------------------------------- */

/* A = V·diag(D)·Vᴴ for A (m×m) Hermitian within herm_atol (invalid_argument
 * otherwise); A is overwritten by V, D ascending, phases fixed. */
static int FN(eigh_factor)(T *A, int m, RT *D, double herm_atol, pb_err_t *err)
{
    double worst = 0;
    for (int j = 0; j < m; j++)
        for (int i = 0; i <= j; i++) {
            T d = E(A, m, i, j) - CONJ(E(A, m, j, i));
            double a = RE(d) * RE(d) + IM(d) * IM(d);
            worst = a > worst ? a : worst;
        }
    worst = sqrt(worst);
    if (worst > herm_atol)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs.A",
                          "A is not Hermitian: |A - Aᴴ| reaches %.3g, more than herm_atol %.3g", worst, herm_atol);
    for (int j = 0; j < m; j++) {
        E(A, m, j, j) = (T)RE(E(A, m, j, j));
        for (int i = j + 1; i < m; i++) /* the lower triangle is what LAPACK reads */
            E(A, m, i, j) = (T)((E(A, m, i, j) + CONJ(E(A, m, j, i))) * 0.5);
    }
    lapack_int info;
    if (m > 0 && (info = SYEVD(LAPACK_COL_MAJOR, 'V', 'L', m, A, LD(m), D)))
        return FN(lapack_fail)(CPLX ? "heevd" : "syevd", info, err);
    FN(fix_phases)(A, m, m, NULL);
    return 0;
}

/* dA (m×m) += the pullback of eigh: with X = VᴴΔV,
 *   ΔA = V·(F∘(X − Xᴴ)/2 + diag(ΔD))·Vᴴ,  F_ij = 1/(D_j − D_i),
 * F_ij = 0 where |D_i − D_j| < deg_atol (MatrixAlgebraKit's rule).
 * *gauge: the anti-Hermitian part of X inside degenerate blocks (its
 * diagonal is the phase gauge). */
static int FN(eigh_pullback)(const RT *D, const T *V, int m, const RT *dD, const T *dV, T *dA, double deg_atol,
                             double *gauge)
{
    T *K = FN(zalloc)((size_t)m * m), *Y = FN(zalloc)((size_t)m * m);
    if (K == NULL || Y == NULL) {
        free(K);
        free(Y);
        return PB_ENOMEM;
    }
    const T one = 1, zero = 0;
    double g = 0;
    if (dV) {
        FN(gemm)('C', 'N', m, m, m, one, V, m, dV, m, zero, K, m);
        FN(antiherm)(K, m);
        for (int j = 0; j < m; j++)
            for (int i = 0; i < m; i++) {
                double gap = (double)D[j] - (double)D[i];
                if (fabs(gap) < deg_atol || i == j) {
                    g = fmax(g, ABS(E(K, m, i, j)));
                    E(K, m, i, j) = 0;
                } else
                    E(K, m, i, j) = (T)(E(K, m, i, j) / gap);
            }
    }
    if (dD)
        for (int i = 0; i < m; i++)
            E(K, m, i, i) += dD[i];
    FN(gemm)('N', 'N', m, m, m, one, V, m, K, m, zero, Y, m);
    FN(gemm)('N', 'C', m, m, m, one, Y, m, V, m, one, dA, m);
    free(K);
    free(Y);
    *gauge = g;
    return 0;
}

/* ---- SVD ---------------------------------------------------------------- */

/* A = U·diag(S)·Vh, compact (U m×k, Vh k×n), S descending; gesdd, and
 * gesvd when gesdd does not converge.  A is left as it was.  Columns of U
 * have their largest entry real positive, rows of Vh the matching phase. */
static int FN(svd_factor)(const T *A, int m, int n, T *U, RT *S, T *Vh, pb_err_t *err)
{
    int k = m < n ? m : n;
    if (k == 0)
        return 0;
    T *W = FN(zalloc)((size_t)m * n), *ph = FN(zalloc)((size_t)k);
    RT *superb = FN(ralloc)((size_t)k);
    int rc = PB_ENOMEM;
    if (W && ph && superb) {
        memcpy(W, A, (size_t)m * n * sizeof(T));
        lapack_int info = LAPACK(gesdd)(LAPACK_COL_MAJOR, 'S', m, n, W, LD(m), S, U, LD(m), Vh, LD(k));
        if (info > 0) {
            memcpy(W, A, (size_t)m * n * sizeof(T));
            info = LAPACK(gesvd)(LAPACK_COL_MAJOR, 'S', 'S', m, n, W, LD(m), S, U, LD(m), Vh, LD(k), superb);
        }
        if (info)
            rc = FN(lapack_fail)(info > 0 ? "gesvd" : "gesdd", info, err);
        else {
            FN(fix_phases)(U, m, k, ph);
            for (int j = 0; j < n; j++)
                for (int i = 0; i < k; i++)
                    E(Vh, k, i, j) *= ph[i];
            rc = 0;
        }
    }
    free(W);
    free(ph);
    free(superb);
    return rc;
}

/* Cols k..m of Qf (m×m) complete the orthonormal columns of Qf[:, :k]:
 * the Householder completion of them, which varies smoothly with them,
 * each column's phase fixed as usual. */
static int FN(complete)(T *Qf, int m, int k, pb_err_t *err)
{
    if (k >= m)
        return 0;
    T *W = FN(zalloc)((size_t)m * k), *Q = FN(zalloc)((size_t)m * m), *Rm = FN(zalloc)((size_t)m * k);
    int rc = PB_ENOMEM;
    if (W && Q && Rm) {
        memcpy(W, Qf, (size_t)m * k * sizeof(T));
        rc = FN(qr_factor)(W, m, k, m, Q, Rm, err);
        if (rc == 0) {
            memcpy(Qf + (size_t)k * m, Q + (size_t)k * m, (size_t)m * (size_t)(m - k) * sizeof(T));
            FN(fix_phases)(Qf + (size_t)k * m, m, m - k, NULL);
        }
    }
    free(W);
    free(Q);
    free(Rm);
    return rc;
}

/* The rank r of S (descending): the last i with S_i ≥ atol, plus one. */
static int FN(svd_rank)(const RT *S, int k, double atol)
{
    int r = 0;
    for (int i = 0; i < k; i++)
        if ((double)S[i] >= atol)
            r = i + 1;
    return r;
}

/* dA (m×n) += the pullback of A = U·diag(S)·Vh, U m×nu, Vh nv×n (nu, nv
 * = k, or m and n for the full form), cotangents NULL when zero.  With r
 * the rank, Uᵣ, Vhᵣ the first r vectors, X = UᵣᴴΔUᵣ, Y = VhᵣΔVhᵣᴴ, and
 * aX, aY their anti-Hermitian parts (MatrixAlgebraKit's rule):
 *   K = (aX + aY)∘F⁻ + (aX − aY)∘F⁺ + diag(ΔS),  F∓_ij = 1/(S_j ∓ S_i)
 *   ΔA = Uᵣ·K·Vhᵣ + (I − UᵣUᵣᴴ)ΔUᵣ·S⁻¹·Vhᵣ + Uᵣ·S⁻¹·ΔVhᵣ·(I − VhᵣᴴVhᵣ)
 * (F⁻ dropped below deg_atol).  The completion columns of the full form
 * reach Uᵣ through U₂ᴴUᵣ = 0: ΔUᵣ −= U₂(UᵣᴴΔU₂)ᴴ, and likewise for Vh.
 * *gauge: ΔU, ΔVh beyond the rank, aX + aY inside degenerate blocks (its
 * diagonal is the phase), the anti-Hermitian part of U₂ᴴΔU₂ and V₂ᴴΔV₂. */
static int FN(svd_pullback)(const T *U, int m, int nu, const RT *S, int k, const T *Vh, int nv, int n, const T *dU,
                            const RT *dS, const T *dVh, T *dA, double rank_atol, double deg_atol, double *gauge)
{
    int r = FN(svd_rank)(S, k, rank_atol), cu = nu - k, cv = nv - k, c2 = cu > cv ? cu : cv;
    const bool uperp = dU && m > r, vperp = dVh && n > r; /* complements to project onto */
    double g = 0;
    if (dU)
        g = fmax(g, FN(maxabs)(dU, m, 0, m, r, k - r));
    if (dVh)
        g = fmax(g, FN(maxabs)(dVh, nv, r, k - r, 0, n));
    size_t big = (size_t)(m > n ? m : n) * (size_t)(r > 0 ? r : 1);
    T *X = FN(zalloc)((size_t)r * r), *Y = FN(zalloc)((size_t)r * r), *K = FN(zalloc)((size_t)r * r);
    T *dUr = FN(zalloc)((size_t)m * r), *dVr = FN(zalloc)((size_t)r * n), *Z = FN(zalloc)(big);
    T *C = FN(zalloc)((size_t)(c2 > r ? c2 : r) * (size_t)(c2 > 0 ? c2 : 1));
    int rc = PB_ENOMEM;
    const T one = 1, zero = 0, mone = -1;
    if (!(X && Y && K && dUr && dVr && Z && C))
        goto out;
    if (dU) {
        memcpy(dUr, dU, (size_t)m * r * sizeof(T));
        if (cu > 0) { /* completion columns U₂ = U[:, k:] */
            const T *U2 = U + (size_t)k * m, *dU2 = dU + (size_t)k * m;
            FN(gemm)('C', 'N', cu, cu, m, one, U2, m, dU2, m, zero, C, cu);
            g = fmax(g, FN(maxantiherm)(C, cu));
            FN(gemm)('C', 'N', r, cu, m, one, U, m, dU2, m, zero, C, r);
            FN(gemm)('N', 'C', m, r, cu, mone, U2, m, C, r, one, dUr, m);
        }
        FN(gemm)('C', 'N', r, r, m, one, U, m, dUr, m, zero, X, r);
        if (uperp) /* (I − UᵣUᵣᴴ)ΔUᵣ, which is 0 when Uᵣ is square */
            FN(gemm)('N', 'N', m, r, r, mone, U, m, X, r, one, dUr, m);
    }
    if (dVh) {
        for (int j = 0; j < n; j++)
            for (int i = 0; i < r; i++)
                E(dVr, r, i, j) = E(dVh, nv, i, j);
        if (cv > 0) { /* completion rows Vh[k:, :] */
            const T *V2 = Vh + k, *dV2 = dVh + k;
            FN(gemm)('N', 'C', cv, cv, n, one, V2, nv, dV2, nv, zero, C, cv);
            g = fmax(g, FN(maxantiherm)(C, cv));
            FN(gemm)('N', 'C', r, cv, n, one, Vh, nv, dV2, nv, zero, C, r);
            FN(gemm)('N', 'N', r, n, cv, mone, C, r, V2, nv, one, dVr, r);
        }
        FN(gemm)('N', 'C', r, r, n, one, Vh, nv, dVr, r, zero, Y, r);
        if (vperp) /* ΔVhᵣ(I − VhᵣᴴVhᵣ), 0 when Vhᵣ is square */
            FN(gemm)('C', 'N', r, n, r, mone, Y, r, Vh, nv, one, dVr, r);
    }
    FN(antiherm)(X, r);
    FN(antiherm)(Y, r);
    for (int j = 0; j < r; j++)
        for (int i = 0; i < r; i++) {
            T a = E(X, r, i, j), b = E(Y, r, i, j);
            double dm = (double)S[j] - (double)S[i], dp = (double)S[j] + (double)S[i];
            T v = 0;
            if (fabs(dm) < deg_atol)
                g = fmax(g, ABS(a + b));
            else
                v += (T)((a + b) / dm);
            if (fabs(dp) >= deg_atol)
                v += (T)((a - b) / dp);
            E(K, r, i, j) = v;
        }
    if (dS)
        for (int i = 0; i < r; i++)
            E(K, r, i, i) += dS[i];
    if (uperp) /* ΔA += (ΔUᵣ⊥ S⁻¹ + Uᵣ K)·Vhᵣ */
        for (int j = 0; j < r; j++)
            for (int i = 0; i < m; i++)
                E(dUr, m, i, j) /= S[j];
    FN(gemm)('N', 'N', m, r, r, one, U, m, K, r, uperp ? one : zero, dUr, m);
    FN(gemm)('N', 'N', m, n, r, one, dUr, m, Vh, nv, one, dA, m);
    if (vperp) { /* ΔA += Uᵣ·S⁻¹·ΔVhᵣ⊥ */
        for (int j = 0; j < n; j++)
            for (int i = 0; i < r; i++)
                E(dVr, r, i, j) /= S[i];
        FN(gemm)('N', 'N', m, n, r, one, U, m, dVr, r, one, dA, m);
    }
    rc = 0;
out:
    free(X);
    free(Y);
    free(K);
    free(dUr);
    free(dVr);
    free(Z);
    free(C);
    *gauge = g;
    return rc;
}

/* ---- polar -------------------------------------------------------------- */

/* A = W·P (m ≥ n) through the SVD A = U·S·Vh: W = U·Vh, P = Vhᴴ·S·Vh.
 * Also returns V = Vhᴴ and S, which the pullback solves with. */
static int FN(polar_factor)(const T *A, int m, int n, T *W, T *P, T *V, RT *S, pb_err_t *err)
{
    T *U = FN(zalloc)((size_t)m * n), *Vh = FN(zalloc)((size_t)n * n), *SV = FN(zalloc)((size_t)n * n);
    int rc = PB_ENOMEM;
    const T one = 1, zero = 0;
    if (U && Vh && SV && (rc = FN(svd_factor)(A, m, n, U, S, Vh, err)) == 0) {
        FN(gemm)('N', 'N', m, n, n, one, U, m, Vh, n, zero, W, m);
        /* P = (S^½·Vh)ᴴ(S^½·Vh): a rank-n update, Hermitian by construction */
        for (int j = 0; j < n; j++)
            for (int i = 0; i < n; i++)
                E(SV, n, i, j) = (T)(sqrt((double)S[i]) * E(Vh, n, i, j));
#if CPLX
        CBLAS(herk)(CblasColMajor, CblasLower, CblasConjTrans, n, n, 1.0, SV, LD(n), 0.0, P, LD(n));
#else
        CBLAS(syrk)(CblasColMajor, CblasLower, CblasTrans, n, n, 1.0, SV, LD(n), 0.0, P, LD(n));
#endif
        for (int j = 0; j < n; j++) {
            E(P, n, j, j) = (T)RE(E(P, n, j, j));
            for (int i = j + 1; i < n; i++)
                E(P, n, j, i) = CONJ(E(P, n, i, j));
        }
        FN(adjoint)(Vh, n, n, V);
    }
    free(U);
    free(Vh);
    free(SV);
    return rc;
}

/* dA (m×n) += the pullback of A = W·P, with P = V·diag(S)·Vᴴ
 * (MatrixAlgebraKit's rule): ΔPₕ = (ΔP + ΔPᴴ)/2, K = WᴴΔW, M = K − ΔPₕ·P,
 * X solving P·X + X·P = M − Mᴴ (in P's eigenbasis: (VᴴCV)_ij/(S_i + S_j)),
 *   ΔA = W·(X + ΔPₕ) + (I − WWᴴ)·ΔW·P⁻¹
 *      = W·(X + ΔPₕ − K·P⁻¹) + ΔW·P⁻¹,
 * the second form reusing K.  A square W is unitary, I − WWᴴ = 0, and the
 * P⁻¹ terms are skipped: 8 GEMMs of n³ then, where the first form took 12. */
static int FN(polar_pullback)(const T *W, int m, int n, const T *V, const RT *S, const T *dW, const T *dP, T *dA,
                              double tol)
{
    size_t nn = (size_t)n * n;
    T *P = FN(zalloc)(nn), *M = FN(zalloc)(nn), *C = FN(zalloc)(nn), *Z = FN(zalloc)(nn), *Ph = FN(zalloc)(nn);
    T *K = FN(zalloc)(nn);
    int rc = PB_ENOMEM;
    const T one = 1, zero = 0, mone = -1;
    const bool tall = m > n && dW;
    if (!(P && M && C && Z && Ph && K))
        goto out;
    for (int j = 0; j < n; j++) /* P = V·S·Vᴴ */
        for (int i = 0; i < n; i++)
            E(Z, n, i, j) = (T)(E(V, n, i, j) * S[j]);
    FN(gemm)('N', 'C', n, n, n, one, Z, n, V, n, zero, P, n);
    if (dP)
        for (int j = 0; j < n; j++)
            for (int i = 0; i < n; i++)
                E(Ph, n, i, j) = (T)((E(dP, n, i, j) + CONJ(E(dP, n, j, i))) * 0.5);
    if (dW)
        FN(gemm)('C', 'N', n, n, m, one, W, m, dW, m, zero, K, n);
    memcpy(M, K, nn * sizeof(T));
    if (dP)
        FN(gemm)('N', 'N', n, n, n, mone, Ph, n, P, n, one, M, n);
    for (int j = 0; j < n; j++) /* C = M − Mᴴ */
        for (int i = 0; i < n; i++)
            E(C, n, i, j) = E(M, n, i, j) - CONJ(E(M, n, j, i));
    FN(gemm)('C', 'N', n, n, n, one, V, n, C, n, zero, M, n);
    FN(gemm)('N', 'N', n, n, n, one, M, n, V, n, zero, C, n);
    for (int j = 0; j < n; j++)
        for (int i = 0; i < n; i++) {
            double s = (double)S[i] + (double)S[j];
            E(C, n, i, j) = (T)(fabs(s) >= tol ? E(C, n, i, j) / s : 0);
        }
    FN(gemm)('N', 'N', n, n, n, one, V, n, C, n, zero, M, n);
    FN(gemm)('N', 'C', n, n, n, one, M, n, V, n, zero, C, n); /* X */
    for (size_t i = 0; i < nn; i++)
        C[i] += Ph[i];
    if (tall) { /* Z = P⁻¹ (pseudo-inverse past tol); C −= K·P⁻¹; ΔA += ΔW·P⁻¹ */
        for (int j = 0; j < n; j++)
            for (int i = 0; i < n; i++)
                E(M, n, i, j) = (T)(fabs((double)S[j]) >= tol ? E(V, n, i, j) / S[j] : 0);
        FN(gemm)('N', 'C', n, n, n, one, M, n, V, n, zero, Z, n);
        FN(gemm)('N', 'N', n, n, n, mone, K, n, Z, n, one, C, n);
        FN(gemm)('N', 'N', m, n, n, one, dW, m, Z, n, one, dA, m);
    }
    FN(gemm)('N', 'N', m, n, n, one, W, m, C, n, one, dA, m);
    rc = 0;
out:
    free(P);
    free(M);
    free(C);
    free(Z);
    free(Ph);
    free(K);
    return rc;
}

/* ---- eig ---------------------------------------------------------------- */

/* A = V·diag(D)·V⁻¹ through geev (A overwritten); D and V complex (CT),
 * m×m, as geev gives them (unit-norm columns).  fz_eig_finish then fixes
 * order and phases. */
static int FN(eig_geev)(T *A, int m, CT *D, CT *V, pb_err_t *err)
{
    if (m == 0)
        return 0;
    lapack_int info;
#if CPLX
    info = LAPACK(geev)(LAPACK_COL_MAJOR, 'N', 'V', m, A, LD(m), D, NULL, 1, V, LD(m));
    if (info)
        return FN(lapack_fail)("geev", info, err);
#else
    RT *wr = FN(ralloc)((size_t)m), *wi = FN(ralloc)((size_t)m);
    T *VR = FN(zalloc)((size_t)m * m);
    if (wr == NULL || wi == NULL || VR == NULL) {
        free(wr);
        free(wi);
        free(VR);
        return PB_ENOMEM;
    }
    info = LAPACK(geev)(LAPACK_COL_MAJOR, 'N', 'V', m, A, LD(m), wr, wi, NULL, 1, VR, LD(m));
    if (info == 0)
        /* a conjugate pair is stored as the real and imaginary parts of
         * the first vector in two adjacent columns */
        for (int j = 0; j < m; j++) {
            D[j] = (CT)CMPLX(wr[j], wi[j]);
            if (wi[j] != 0 && j + 1 < m) {
                D[j + 1] = (CT)CMPLX(wr[j + 1], wi[j + 1]);
                for (int i = 0; i < m; i++) {
                    E(V, m, i, j) = (CT)CMPLX(E(VR, m, i, j), E(VR, m, i, j + 1));
                    E(V, m, i, j + 1) = (CT)CMPLX(E(VR, m, i, j), -E(VR, m, i, j + 1));
                }
                j++;
            } else
                for (int i = 0; i < m; i++)
                    E(V, m, i, j) = E(VR, m, i, j);
        }
    free(wr);
    free(wi);
    free(VR);
    if (info)
        return FN(lapack_fail)("geev", info, err);
#endif
    return 0;
}

#if CPLX
/* Normalise eig's vectors: unit norm, eigenvalues sorted by real part then
 * imaginary part (exact ties keep geev's order), phases fixed. */
static int FN(eig_finish)(T *D, T *V, int m)
{
    int *idx = malloc(sizeof(int) * (size_t)(m ? m : 1));
    T *D2 = FN(zalloc)((size_t)m), *V2 = FN(zalloc)((size_t)m * m);
    if (idx == NULL || D2 == NULL || V2 == NULL) {
        free(idx);
        free(D2);
        free(V2);
        return PB_ENOMEM;
    }
    for (int i = 0; i < m; i++)
        idx[i] = i;
    for (int i = 1; i < m; i++) /* insertion sort: stable */
        for (int j = i; j > 0; j--) {
            T a = D[idx[j - 1]], b = D[idx[j]];
            if (RE(a) < RE(b) || (RE(a) == RE(b) && IM(a) <= IM(b)))
                break;
            int t = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = t;
        }
    for (int j = 0; j < m; j++) {
        D2[j] = D[idx[j]];
        double nrm = 0;
        for (int i = 0; i < m; i++)
            nrm += RE(E(V, m, i, idx[j]) * CONJ(E(V, m, i, idx[j])));
        nrm = sqrt(nrm);
        for (int i = 0; i < m; i++)
            E(V2, m, i, j) = (T)(nrm > 0 ? E(V, m, i, idx[j]) / nrm : E(V, m, i, idx[j]));
    }
    memcpy(D, D2, (size_t)m * sizeof(T));
    memcpy(V, V2, (size_t)m * m * sizeof(T));
    FN(fix_phases)(V, m, m, NULL);
    free(idx);
    free(D2);
    free(V2);
    return 0;
}

/* dA (m×m, complex) += the pullback of A = V·diag(D)·V⁻¹ with unit-norm
 * columns.  The unit norm is undone first, G = ΔV − V·Re(diag(VᴴΔV)),
 * then with X = VᴴG:
 *   ΔA = V⁻ᴴ·(conj(F)∘X + diag(ΔD))·Vᴴ,  F_ij = 1/(D_j − D_i)
 * (F dropped below deg_atol, and on the diagonal).  *gauge: Im of X's
 * diagonal (the phase) and X inside degenerate blocks. */
static int FN(eig_pullback)(const T *D, const T *V, int m, const T *dD, const T *dV, T *dA, double deg_atol,
                            double *gauge, pb_err_t *err)
{
    size_t mm = (size_t)m * m;
    T *X = FN(zalloc)(mm), *K = FN(zalloc)(mm), *LU = FN(zalloc)(mm);
    lapack_int *piv = malloc(sizeof(lapack_int) * (size_t)(m ? m : 1));
    int rc = PB_ENOMEM;
    double g = 0;
    const T one = 1, zero = 0;
    if (!(X && K && LU && piv))
        goto out;
    if (dV) {
        FN(gemm)('C', 'N', m, m, m, one, V, m, dV, m, zero, X, m);
        for (int j = 0; j < m; j++)
            for (int i = 0; i < m; i++)
                E(K, m, i, j) = dV[(size_t)j * m + i] - E(V, m, i, j) * RE(E(X, m, j, j));
        FN(gemm)('C', 'N', m, m, m, one, V, m, K, m, zero, X, m);
        for (int j = 0; j < m; j++)
            for (int i = 0; i < m; i++) {
                T gap = D[j] - D[i];
                if (i == j) {
                    g = fmax(g, fabs(IM(E(X, m, i, i))));
                    E(K, m, i, j) = 0;
                } else if (ABS(gap) < deg_atol) {
                    g = fmax(g, ABS(E(X, m, i, j)));
                    E(K, m, i, j) = 0;
                } else
                    E(K, m, i, j) = (T)(E(X, m, i, j) / CONJ(gap));
            }
    } else
        memset(K, 0, mm * sizeof(T));
    if (dD)
        for (int i = 0; i < m; i++)
            E(K, m, i, i) += dD[i];
    if (m > 0) { /* Y = V⁻ᴴ·K: solve Vᴴ·Y = K with V's LU */
        memcpy(LU, V, mm * sizeof(T));
        lapack_int info = LAPACK(getrf)(LAPACK_COL_MAJOR, m, m, LU, LD(m), piv);
        if (info == 0)
            info = LAPACK(getrs)(LAPACK_COL_MAJOR, 'C', m, m, LU, LD(m), piv, K, LD(m));
        if (info) {
            rc = pb_err_set(err, PB_ENUMERICAL, "tape",
                            "the eigenvectors are linearly dependent (A is defective): no pullback (getrf info %d)",
                            (int)info);
            err->info = info;
            err->has_info = 1;
            goto out;
        }
    }
    FN(gemm)('N', 'C', m, m, m, one, K, m, V, m, one, dA, m);
    rc = 0;
out:
    free(X);
    free(K);
    free(LU);
    free(piv);
    *gauge = g;
    return rc;
}
#endif

/* ---- truncation ---------------------------------------------------------- */

/* svd_trunc keeps the first r of S (descending): σ_i > max(atol, rtol·σ₁),
 * at most maxrank. */
static int FN(svd_keep)(const RT *S, int k, const fz_opts_t *o)
{
    double thr = fmax(o->atol, o->rtol * (k > 0 ? (double)S[0] : 0.0));
    int r = 0;
    while (r < k && (long long)r < o->maxrank && (double)S[r] > thr)
        r++;
    return r;
}

/* eigh_trunc keeps the largest |λ| above max(atol, rtol·max|λ|), at most
 * maxrank of them; idx gets their indices in ascending order of λ. */
static int FN(eigh_keep)(const RT *D, int m, const fz_opts_t *o, int *idx)
{
    double big = 0;
    for (int i = 0; i < m; i++)
        big = fmax(big, fabs((double)D[i]));
    double thr = fmax(o->atol, o->rtol * big);
    char *keep = calloc((size_t)(m ? m : 1), 1);
    if (keep == NULL)
        return -1;
    for (long long c = 0; c < o->maxrank; c++) { /* pick the next largest |λ| (first on a tie) */
        int best = -1;
        for (int i = 0; i < m; i++)
            if (!keep[i] && fabs((double)D[i]) > thr && (best < 0 || fabs((double)D[i]) > fabs((double)D[best])))
                best = i;
        if (best < 0)
            break;
        keep[best] = 1;
    }
    int r = 0;
    for (int i = 0; i < m; i++)
        if (keep[i])
            idx[r++] = i;
    free(keep);
    return r;
}

/* ---- the ops on one dtype ------------------------------------------------- */

static RT *FN(newvec_r)(pb_tensor_t *t, int n)
{
    uint64_t sh[1] = {(uint64_t)n};
    return pb_tensor_alloc(t, RDT, 1, sh, 'F', true) ? NULL : pb_tensor_data(t);
}

static CT *FN(newmat_c)(pb_tensor_t *t, int m, int n)
{
    uint64_t sh[2] = {(uint64_t)m, (uint64_t)(n < 0 ? 1 : n)};
    return pb_tensor_alloc(t, CDT, n < 0 ? 1 : 2, sh, 'F', true) ? NULL : pb_tensor_data(t);
}

/* Columns (or, with rows set, rows) cols[0..r) of the F-ordered X (m×n)
 * as a new tensor of X's dtype. */
static int FN(take)(pb_tensor_t *dst, const pb_tensor_t *X, const int *sel, int r, bool rows)
{
    size_t isz = pb_dtype_size(X->dtype);
    int m = (int)X->shape[0], n = X->rank == 2 ? (int)X->shape[1] : 1;
    uint64_t sh[2] = {(uint64_t)(rows ? r : m), (uint64_t)(rows ? n : r)};
    if (X->rank == 1)
        sh[0] = (uint64_t)r;
    if (pb_tensor_alloc(dst, X->dtype, X->rank, sh, 'F', false))
        return PB_ENOMEM;
    const char *src = pb_tensor_data(X);
    char *d = pb_tensor_data(dst);
    if (X->rank == 1)
        for (int i = 0; i < r; i++)
            memcpy(d + (size_t)i * isz, src + (size_t)sel[i] * isz, isz);
    else if (!rows)
        for (int j = 0; j < r; j++)
            memcpy(d + (size_t)j * m * isz, src + (size_t)sel[j] * m * isz, (size_t)m * isz);
    else
        for (int j = 0; j < n; j++)
            for (int i = 0; i < r; i++)
                memcpy(d + ((size_t)j * r + i) * isz, src + ((size_t)j * m + sel[i]) * isz, isz);
    return 0;
}

static int FN(forward)(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    const int kind = fz_kind(c->op);
    const pb_tensor_t *At = &c->in[0];
    const int m = (int)At->shape[0], n = (int)At->shape[1], k = m < n ? m : n;
    const bool keep = c->taped && (c->wrt & 1u);
    pb_tensor_t o[3] = {{0}}, sv[3] = {{0}}, tmp = {0};
    int *sel = malloc(sizeof(int) * (size_t)(m > n ? m + 1 : n + 1));
    T *A = FN(zalloc)((size_t)m * n), *X = NULL;
    int rc = PB_ENOMEM;
    if (A == NULL || sel == NULL)
        goto fail;
    FN(load)(At, A, m, n);
    bool finite;
    double amax = FN(amax)(A, (size_t)m * n, &finite);
    if (!finite) {
        rc = pb_err_set(err, PB_ENUMERICAL, "inputs.A", "A has NaN or Inf entries: %s refuses them", c->op->name);
        goto fail;
    }
    fz_opts_t op;
    fz_resolve(c->op, c->opt, amax, DT, k, &op);
    if (tape)
        tape->scalars[0] = amax;
    switch (kind) {
    case FZ_QR_COMPACT:
    case FZ_QR_FULL: {
        int nq = kind == FZ_QR_FULL ? m : k;
        T *Q = FN(newmat)(&o[0], m, nq), *Rm = FN(newmat)(&o[1], nq, n);
        if (Q == NULL || Rm == NULL || (rc = FN(qr_factor)(A, m, n, nq, Q, Rm, err)))
            goto fail;
        pb_tensor_ref(&sv[0], &o[0]);
        pb_tensor_ref(&sv[1], &o[1]);
        break;
    }
    case FZ_LQ_COMPACT:
    case FZ_LQ_FULL: {
        int nl = kind == FZ_LQ_FULL ? n : k;
        T *L = FN(newmat)(&o[0], m, nl), *Q = FN(newmat)(&o[1], nl, n);
        if (L == NULL || Q == NULL || (rc = FN(lq_factor)(A, m, n, nl, L, Q, err)))
            goto fail;
        pb_tensor_ref(&sv[0], &o[0]);
        pb_tensor_ref(&sv[1], &o[1]);
        break;
    }
    case FZ_QR_NULL:
    case FZ_LQ_NULL: {
        /* lq_null(A) = qr_null(Aᴴ)ᴴ; the tape keeps A, which the pullback reads */
        bool lq = kind == FZ_LQ_NULL;
        int mm = lq ? n : m, nn = lq ? m : n;
        T *Ak = FN(newmat)(&sv[0], m, n), *N = FN(newmat)(lq ? &tmp : &o[0], mm, mm - k);
        if (Ak == NULL || N == NULL || (X = FN(zalloc)((size_t)m * n)) == NULL)
            goto fail;
        memcpy(Ak, A, (size_t)m * n * sizeof(T));
        if (lq)
            FN(adjoint)(A, m, n, X);
        else
            memcpy(X, A, (size_t)m * n * sizeof(T));
        if ((rc = FN(qr_null)(X, mm, nn, N, err)))
            goto fail;
        if (lq) {
            T *Nl = FN(newmat)(&o[0], mm - k, mm);
            if (Nl == NULL)
                goto fail;
            FN(adjoint)(N, mm, mm - k, Nl);
        }
        pb_tensor_ref(&sv[1], &o[0]);
        break;
    }
    case FZ_EIGH_FULL:
    case FZ_EIGH_VALS:
    case FZ_EIGH_TRUNC: {
        RT *D = FN(newvec_r)(&sv[0], m);
        T *V = FN(newmat)(&sv[1], m, m);
        if (D == NULL || V == NULL)
            goto fail;
        memcpy(V, A, (size_t)m * m * sizeof(T));
        if ((rc = FN(eigh_factor)(V, m, D, op.herm_atol, err)))
            goto fail;
        if (kind == FZ_EIGH_TRUNC) {
            int r = FN(eigh_keep)(D, m, &op, sel);
            if (r < 0 || FN(take)(&o[0], &sv[0], sel, r, false) || FN(take)(&o[1], &sv[1], sel, r, false))
                goto fail;
        } else {
            pb_tensor_ref(&o[0], &sv[0]);
            if (kind == FZ_EIGH_FULL)
                pb_tensor_ref(&o[1], &sv[1]);
        }
        break;
    }
    case FZ_EIG_FULL:
    case FZ_EIG_VALS: {
        CT *D = FN(newmat_c)(&sv[0], m, -1), *V = FN(newmat_c)(&sv[1], m, m);
        if (D == NULL || V == NULL || (rc = FN(eig_geev)(A, m, D, V, err)) || (rc = CAT(eig_finish, CSFX)(D, V, m)))
            goto fail;
        pb_tensor_ref(&o[0], &sv[0]);
        if (kind == FZ_EIG_FULL)
            pb_tensor_ref(&o[1], &sv[1]);
        break;
    }
    case FZ_SVD_COMPACT:
    case FZ_SVD_FULL:
    case FZ_SVD_VALS:
    case FZ_SVD_TRUNC: {
        bool full = kind == FZ_SVD_FULL;
        T *U = FN(newmat)(&sv[0], m, full ? m : k), *Vh = FN(newmat)(&sv[2], full ? n : k, n);
        RT *S = FN(newvec_r)(&sv[1], k);
        T *Vc = FN(zalloc)((size_t)k * n);
        if (U == NULL || Vh == NULL || S == NULL || Vc == NULL || (rc = FN(svd_factor)(A, m, n, U, S, Vc, err))) {
            free(Vc);
            goto fail;
        }
        if (full) { /* complete U, and V = Vhᴴ, to square unitaries */
            T *Vf = FN(zalloc)((size_t)n * n);
            if (Vf == NULL) {
                free(Vc);
                goto fail;
            }
            FN(adjoint)(Vc, k, n, Vf);
            if ((rc = FN(complete)(U, m, k, err)) == 0 && (rc = FN(complete)(Vf, n, k, err)) == 0)
                FN(adjoint)(Vf, n, n, Vh);
            free(Vf);
        } else
            memcpy(Vh, Vc, (size_t)k * n * sizeof(T));
        free(Vc);
        if (rc)
            goto fail;
        if (kind == FZ_SVD_TRUNC) {
            int r = FN(svd_keep)(S, k, &op);
            for (int i = 0; i < r; i++)
                sel[i] = i;
            if (FN(take)(&o[0], &sv[0], sel, r, false) || FN(take)(&o[1], &sv[1], sel, r, false) ||
                FN(take)(&o[2], &sv[2], sel, r, true))
                goto fail;
        } else if (kind == FZ_SVD_VALS) {
            pb_tensor_ref(&o[0], &sv[1]);
            pb_tensor_clear(&sv[1]); /* its pullback reads U and Vh only */
        } else
            for (int i = 0; i < 3; i++)
                pb_tensor_ref(&o[i], &sv[i]);
        break;
    }
    case FZ_LEFT_POLAR:
    case FZ_RIGHT_POLAR: {
        /* right_polar(A) = left_polar(Aᴴ) with Wh = Wᴴ; the tape keeps W, V, S */
        bool right = kind == FZ_RIGHT_POLAR;
        int mm = right ? n : m, nn = right ? m : n;
        T *W = FN(newmat)(&sv[0], mm, nn), *V = FN(newmat)(&sv[1], nn, nn);
        RT *S = FN(newvec_r)(&sv[2], nn);
        T *P = FN(newmat)(&o[right ? 0 : 1], nn, nn);
        if (W == NULL || V == NULL || S == NULL || P == NULL || (X = FN(zalloc)((size_t)m * n)) == NULL)
            goto fail;
        if (right)
            FN(adjoint)(A, m, n, X);
        else
            memcpy(X, A, (size_t)m * n * sizeof(T));
        if ((rc = FN(polar_factor)(X, mm, nn, W, P, V, S, err)))
            goto fail;
        if (right) {
            T *Wh = FN(newmat)(&o[1], nn, mm);
            if (Wh == NULL)
                goto fail;
            FN(adjoint)(W, mm, nn, Wh);
        } else
            pb_tensor_ref(&o[0], &sv[0]);
        break;
    }
    default:
        rc = pb_err_set(err, PB_EINTERNAL, NULL, "no forward for %s", c->op->name);
        goto fail;
    }
    if (kind == FZ_EIGH_VALS)
        pb_tensor_clear(&sv[0]); /* V·diag(ΔD)·Vᴴ needs no D */
    if (kind == FZ_EIG_VALS)
        pb_tensor_clear(&sv[0]);
    /* outputs in the order asked for; truncated shapes are known now */
    for (int i = 0; i < c->op->noutputs; i++) {
        if (c->order == 'C' && o[i].rank == 2) {
            pb_tensor_t t = {0};
            if (pb_tensor_to_order(&t, &o[i], 'C'))
                goto fail;
            pb_tensor_clear(&o[i]);
            o[i] = t;
        }
        memcpy(c->out_meta[i].shape, o[i].shape, sizeof o[i].shape);
        if (tape)
            memcpy(tape->out_meta[i].shape, o[i].shape, sizeof o[i].shape);
    }
    for (int i = 0; i < 3; i++) {
        c->out[i] = o[i];
        if (keep && tape)
            tape->saved[i] = sv[i];
        else
            pb_tensor_clear(&sv[i]);
    }
    pb_tensor_clear(&tmp);
    free(A);
    free(X);
    free(sel);
    return 0;
fail:
    for (int i = 0; i < 3; i++) {
        pb_tensor_clear(&o[i]);
        pb_tensor_clear(&sv[i]);
    }
    pb_tensor_clear(&tmp);
    free(A);
    free(X);
    free(sel);
    if (rc == PB_ENOMEM)
        return pb_err_set(err, PB_ENOMEM, NULL, "out of memory in %s", c->op->name);
    return rc;
}

/* Frobenius norm of a tensor's entries (0 for an absent one). */
static double FN(tnorm)(const pb_tensor_t *t)
{
    if (t->storage == NULL)
        return 0;
    size_t n = pb_tensor_count(t);
    double s = 0;
    /* a complex tensor as its 2n real parts: |z|² = re² + im² without
     * cabs's overflow-safe (and slow) hypot; a gauge threshold needs no
     * more range than a double's */
    if (t->dtype == RDT || t->dtype == CDT) {
        const RT *x = pb_tensor_data(t);
        size_t nr = t->dtype == CDT ? 2 * n : n;
        for (size_t i = 0; i < nr; i++)
            s += (double)x[i] * (double)x[i];
    }
    return sqrt(s);
}

/* A real-valued cotangent (S, D of eigh) as a fresh array, or NULL. */
static int FN(load_cot_r)(const pb_tensor_t *t, int n, RT **out)
{
    *out = NULL;
    if (t->storage == NULL)
        return 0;
    if ((*out = FN(ralloc)((size_t)n)) == NULL)
        return PB_ENOMEM;
    memcpy(*out, pb_tensor_data(t), (size_t)n * sizeof(RT));
    return 0;
}

static int FN(reverse)(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                       pb_warnings_t *warn, pb_err_t *err)
{
    const int kind = fz_kind(t->op);
    const int m = (int)t->in_meta[0].shape[0], n = (int)t->in_meta[0].shape[1], k = m < n ? m : n;
    if (!(t->wrt & 1u))
        return 0;
    fz_opts_t op;
    fz_resolve(t->op, t->opt, t->scalars[0], DT, k, &op);
    double cn = 0;
    for (int i = 0; i < t->op->noutputs; i++)
        cn = hypot(cn, FN(tnorm)(&cot[i]));
    int gi = fz_opt(t->op, "gauge_atol");
    if (gi < 0 || !t->opt[gi].given)
        op.gauge_atol = 10.0 * pow(DT == PB_F32 || DT == PB_C64 ? FLT_EPSILON : DBL_EPSILON, 0.75) * cn;
    T *dA = FN(zalloc)((size_t)m * n), *c0 = NULL, *c1 = NULL, *c2 = NULL;
    RT *r1 = NULL;
    int *sel = malloc(sizeof(int) * (size_t)(m + 1));
    double gauge = 0;
    int rc = PB_ENOMEM;
    if (dA == NULL || sel == NULL)
        goto out;
    const pb_tensor_t *s0 = &t->saved[0], *s1 = &t->saved[1], *s2 = &t->saved[2];
    const pb_tensor_t *o0 = &t->out_meta[0], *o1 = &t->out_meta[1];
    switch (kind) {
    case FZ_QR_COMPACT:
    case FZ_QR_FULL: {
        int nq = (int)s0->shape[1];
        if ((rc = FN(load_cot)(&cot[0], m, nq, &c0)) || (rc = FN(load_cot)(&cot[1], nq, n, &c1)))
            goto out;
        rc = FN(qr_pullback)(pb_tensor_data(s0), m, nq, pb_tensor_data(s1), nq, n, c0, c1, dA, op.rank_atol, &gauge);
        break;
    }
    case FZ_LQ_COMPACT:
    case FZ_LQ_FULL: {
        int nl = (int)s0->shape[1];
        if ((rc = FN(load_cot)(&cot[0], m, nl, &c0)) || (rc = FN(load_cot)(&cot[1], nl, n, &c1)))
            goto out;
        rc = FN(lq_pullback)(pb_tensor_data(s0), m, nl, pb_tensor_data(s1), n, c0, c1, dA, op.rank_atol, &gauge);
        break;
    }
    case FZ_QR_NULL:
        if ((rc = FN(load_cot)(&cot[0], m, m - k, &c0)))
            goto out;
        rc = FN(qr_null_pullback)(pb_tensor_data(s0), m, n, pb_tensor_data(s1), c0, dA, op.rank_atol, &gauge, err);
        break;
    case FZ_LQ_NULL: { /* through qr_null of Aᴴ */
        T *Aa = FN(zalloc)((size_t)m * n), *Na = FN(zalloc)((size_t)n * (n - k)), *dAa = FN(zalloc)((size_t)m * n);
        if ((rc = FN(load_cot)(&cot[0], n - k, n, &c0)) == 0 && Aa && Na && dAa && (!c0 || (c1 = FN(zalloc)((size_t)n * (n - k))))) {
            FN(adjoint)(pb_tensor_data(s0), m, n, Aa);
            FN(adjoint)(pb_tensor_data(s1), n - k, n, Na);
            if (c0)
                FN(adjoint)(c0, n - k, n, c1);
            rc = FN(qr_null_pullback)(Aa, n, m, Na, c1, dAa, op.rank_atol, &gauge, err);
            if (rc == 0)
                FN(adjoint)(dAa, n, m, dA);
        } else if (rc == 0)
            rc = PB_ENOMEM;
        free(Aa);
        free(Na);
        free(dAa);
        break;
    }
    case FZ_EIGH_FULL:
    case FZ_EIGH_VALS:
    case FZ_EIGH_TRUNC: {
        const RT *D = s0->storage ? pb_tensor_data(s0) : NULL;
        int r = m;
        for (int i = 0; i < m; i++)
            sel[i] = i;
        if (kind == FZ_EIGH_TRUNC && (r = FN(eigh_keep)(D, m, &op, sel)) < 0)
            goto out;
        T *dV = NULL;
        RT *dD = NULL;
        if ((rc = FN(load_cot_r)(&cot[0], r, &r1)))
            goto out;
        if (kind != FZ_EIGH_VALS && (rc = FN(load_cot)(&cot[1], m, r, &c1)))
            goto out;
        rc = PB_ENOMEM; /* scatter the kept columns into full-size cotangents */
        if ((r1 && (dD = FN(ralloc)((size_t)m)) == NULL) || (c1 && (dV = FN(zalloc)((size_t)m * m)) == NULL)) {
            free(dD);
            goto out;
        }
        for (int j = 0; j < r; j++) {
            if (dD)
                dD[sel[j]] = r1[j];
            if (dV)
                memcpy(dV + (size_t)sel[j] * m, c1 + (size_t)j * m, (size_t)m * sizeof(T));
        }
        rc = FN(eigh_pullback)(D, pb_tensor_data(s1), m, dD, dV, dA, op.deg_atol, &gauge);
        free(dD);
        free(dV);
        break;
    }
    case FZ_EIG_FULL:
    case FZ_EIG_VALS: {
        CT *d0 = NULL, *d1 = NULL, *dAc = CAT(zalloc, CSFX)((size_t)m * m);
        const CT *D = s0->storage ? pb_tensor_data(s0) : NULL;
        rc = PB_ENOMEM;
        if (dAc && (cot[0].storage == NULL || (d0 = CAT(zalloc, CSFX)((size_t)m))) &&
            (kind == FZ_EIG_VALS || cot[1].storage == NULL || (d1 = CAT(zalloc, CSFX)((size_t)m * m)))) {
            if (d0)
                memcpy(d0, pb_tensor_data(&cot[0]), (size_t)m * sizeof(CT));
            if (d1)
                CAT(load, CSFX)(&cot[1], d1, m, m);
            rc = CAT(eig_pullback, CSFX)(D, pb_tensor_data(s1), m, d0, d1, dAc, op.deg_atol, &gauge, err);
            for (size_t i = 0; rc == 0 && i < (size_t)m * m; i++)
#if CPLX
                dA[i] = dAc[i];
#else
                dA[i] = (T)creal(dAc[i]); /* a real A: the real part */
#endif
        }
        free(d0);
        free(d1);
        free(dAc);
        break;
    }
    case FZ_SVD_COMPACT:
    case FZ_SVD_FULL:
    case FZ_SVD_VALS:
    case FZ_SVD_TRUNC: {
        int nu = (int)s0->shape[1], nv = (int)s2->shape[0];
        const RT *S = s1->storage ? pb_tensor_data(s1) : NULL;
        RT *ones = NULL;
        if (kind == FZ_SVD_VALS) { /* ΔA = U·diag(ΔS)·Vh: the pullback with S = 1 and only ΔS */
            if ((rc = FN(load_cot_r)(&cot[0], k, &r1)))
                goto out;
            rc = PB_ENOMEM;
            if ((ones = FN(ralloc)((size_t)k)) == NULL)
                goto out;
            for (int i = 0; i < k; i++)
                ones[i] = 1;
            rc = r1 ? FN(svd_pullback)(pb_tensor_data(s0), m, nu, ones, k, pb_tensor_data(s2), nv, n, NULL, r1,
                                       NULL, dA, 0.5, 0.5, &gauge)
                    : 0;
            free(ones);
            break;
        }
        int r = kind == FZ_SVD_TRUNC ? (int)o1->shape[0] : k;
        int cu = kind == FZ_SVD_TRUNC ? r : nu, cv = kind == FZ_SVD_TRUNC ? r : nv;
        RT *dS = NULL;
        if ((rc = FN(load_cot)(&cot[0], m, cu, &c0)) || (rc = FN(load_cot_r)(&cot[1], r, &r1)) ||
            (rc = FN(load_cot)(&cot[2], cv, n, &c2)))
            goto out;
        (void)o0;
        if (kind == FZ_SVD_TRUNC) { /* pad the kept vectors' cotangents to all k */
            rc = PB_ENOMEM;
            T *pu = c0 ? FN(zalloc)((size_t)m * k) : NULL, *pv = c2 ? FN(zalloc)((size_t)k * n) : NULL;
            if ((c0 && !pu) || (c2 && !pv) || (r1 && (dS = FN(ralloc)((size_t)k)) == NULL)) {
                free(pu);
                free(pv);
                goto out;
            }
            if (pu)
                memcpy(pu, c0, (size_t)m * r * sizeof(T));
            for (int j = 0; pv && j < n; j++)
                for (int i = 0; i < r; i++)
                    E(pv, k, i, j) = E(c2, r, i, j);
            for (int i = 0; dS && i < r; i++)
                dS[i] = r1[i];
            free(c0);
            free(c2);
            c0 = pu;
            c2 = pv;
        }
        rc = FN(svd_pullback)(pb_tensor_data(s0), m, nu, S, k, pb_tensor_data(s2), nv, n, c0, dS ? dS : r1, c2, dA,
                              op.rank_atol, op.deg_atol, &gauge);
        free(dS);
        break;
    }
    case FZ_LEFT_POLAR:
    case FZ_RIGHT_POLAR: {
        bool right = kind == FZ_RIGHT_POLAR;
        int mm = right ? n : m, nn = right ? m : n;
        T *dAa = NULL;
        if ((rc = FN(load_cot)(&cot[right ? 1 : 0], right ? nn : mm, right ? mm : nn, &c0)) ||
            (rc = FN(load_cot)(&cot[right ? 0 : 1], nn, nn, &c1)))
            goto out;
        rc = PB_ENOMEM;
        if (right && c0) { /* ΔW = ΔWhᴴ */
            if ((c2 = FN(zalloc)((size_t)mm * nn)) == NULL)
                goto out;
            FN(adjoint)(c0, nn, mm, c2);
        }
        if (right && (dAa = FN(zalloc)((size_t)mm * nn)) == NULL)
            goto out;
        rc = FN(polar_pullback)(pb_tensor_data(s0), mm, nn, pb_tensor_data(s1), pb_tensor_data(s2),
                                right ? c2 : c0, c1, right ? dAa : dA, op.rank_atol);
        if (right && rc == 0)
            FN(adjoint)(dAa, mm, nn, dA);
        free(dAa);
        break;
    }
    default:
        rc = pb_err_set(err, PB_EINTERNAL, NULL, "no reverse for %s", t->op->name);
        goto out;
    }
    if (rc)
        goto out;
    if (gauge > op.gauge_atol) {
        if (op.strict) {
            rc = pb_err_set(err, PB_EGAUGE_DEPENDENT, "cotangents",
                            "%s: the cotangents depend on the gauge (size %.3g, gauge_atol %.3g) and strict_gauge "
                            "is set",
                            t->op->name, gauge, op.gauge_atol);
            goto out;
        }
        if (warn->n < PB_MAX_WARNINGS)
            snprintf(warn->text[warn->n++], sizeof warn->text[0],
                     "%s: the cotangents depend on the gauge (size %.3g > gauge_atol %.3g); that part was ignored",
                     t->op->name, gauge, op.gauge_atol);
    }
    {
        pb_tensor_t g = {0};
        T *gp = FN(newmat)(&g, m, n);
        rc = PB_ENOMEM;
        if (gp == NULL)
            goto out;
        memcpy(gp, dA, (size_t)m * n * sizeof(T));
        if (order == 'C') {
            rc = pb_tensor_to_order(&grad[0], &g, 'C');
            pb_tensor_clear(&g);
            if (rc)
                goto out;
        } else
            grad[0] = g;
    }
    rc = 0;
out:
    free(dA);
    free(c0);
    free(c1);
    free(c2);
    free(r1);
    free(sel);
    if (rc == PB_ENOMEM)
        return pb_err_set(err, PB_ENOMEM, NULL, "out of memory in the reverse of %s", t->op->name);
    return rc;
}

/* ---- the finite-difference check's projections -------------------------- */

/* Per column j of V (m×c): ΔV_j −= i·v_j·Im(v_jᴴΔV_j), plus im[j] when
 * given (the unit-modulus phase direction of each column). */
static void FN(drop_phase)(const T *V, int m, int c, T *dV, const double *extra)
{
#if CPLX
    for (int j = 0; j < c; j++) {
        T s = 0;
        for (int i = 0; i < m; i++)
            s += CONJ(E(V, m, i, j)) * E(dV, m, i, j);
        double a = IM(s) + (extra ? extra[j] : 0.0);
        for (int i = 0; i < m; i++)
            E(dV, m, i, j) -= (T)(I * a) * E(V, m, i, j);
    }
#else
    (void)V, (void)m, (void)c, (void)dV, (void)extra;
#endif
}

/* dX (m×c) columns [j0, c) ← the projection of them onto span(Q[:, :p]). */
static void FN(onto_span)(const T *Q, int m, int p, T *dX, int j0, int c)
{
    if (j0 >= c)
        return;
    T *Y = FN(zalloc)((size_t)(p ? p : 1) * (size_t)(c - j0)), *Z = FN(zalloc)((size_t)m * (size_t)(c - j0));
    if (Y && Z) {
        const T one = 1, zero = 0;
        FN(gemm)('C', 'N', p, c - j0, m, one, Q, m, dX + (size_t)j0 * m, m, zero, Y, p);
        FN(gemm)('N', 'N', m, c - j0, p, one, Q, m, Y, p, zero, Z, m);
        memcpy(dX + (size_t)j0 * m, Z, (size_t)m * (size_t)(c - j0) * sizeof(T));
    }
    free(Y);
    free(Z);
}

/* Write an F-ordered array back into a tensor of either order. */
static void FN(store_back)(pb_tensor_t *t, const T *src, int m, int n)
{
    T *dst = pb_tensor_data(t);
    if (t->rank == 2 && t->order == 'C')
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++)
                dst[(size_t)i * n + j] = E(src, m, i, j);
    else
        memcpy(dst, src, (size_t)m * n * sizeof(T));
}

/* The outputs' values as F-ordered arrays (out[i] of c, any order). */
static T *FN(out_arr)(const pb_call_t *c, int i)
{
    const pb_tensor_t *t = &c->out[i];
    int m = (int)t->shape[0], n = t->rank == 2 ? (int)t->shape[1] : 1;
    T *a = FN(zalloc)((size_t)m * n);
    if (a)
        FN(load)(t, a, m, n);
    return a;
}

/* Remove from random cotangents what depends on the gauge, so that the
 * finite differences of the check see a gauge-invariant loss: phases of
 * vectors, vectors past the rank, and rotations of completions. */
static int FN(fd_cotangents)(const pb_call_t *c, pb_tensor_t *cot)
{
    const int kind = fz_kind(c->op);
    const int m = (int)c->in[0].shape[0], n = (int)c->in[0].shape[1], k = m < n ? m : n;
    double amax = 0;
    { /* the rank tolerance as the forward resolved it */
        T *A = FN(zalloc)((size_t)m * n);
        if (A == NULL)
            return PB_ENOMEM;
        bool finite;
        FN(load)(&c->in[0], A, m, n);
        amax = FN(amax)(A, (size_t)m * n, &finite);
        free(A);
    }
    fz_opts_t op;
    fz_resolve(c->op, c->opt, amax, DT, k, &op);
    T *X0 = NULL, *X1 = NULL, *D0 = NULL, *D1 = NULL;
    int rc = PB_ENOMEM;
    switch (kind) {
    case FZ_QR_COMPACT:
    case FZ_QR_FULL:
    case FZ_LQ_COMPACT:
    case FZ_LQ_FULL: {
        /* in QR form: Q (mq×nq), R (nq×nr); LQ through adjoints */
        bool lq = kind == FZ_LQ_COMPACT || kind == FZ_LQ_FULL;
        int qi = lq ? 1 : 0, ri = lq ? 0 : 1;
        int mq = lq ? n : m, nr = lq ? m : n, nq = lq ? (int)c->out[1].shape[0] : (int)c->out[0].shape[1];
        T *Q = FN(out_arr)(c, qi), *Rm = FN(out_arr)(c, ri);
        X0 = FN(zalloc)((size_t)mq * nq);
        X1 = FN(zalloc)((size_t)nq * nr);
        D0 = FN(zalloc)((size_t)mq * nq);
        D1 = FN(zalloc)((size_t)nq * nr);
        if (!(Q && Rm && X0 && X1 && D0 && D1)) {
            free(Q);
            free(Rm);
            break;
        }
        if (lq) { /* Q_qr = Qᴴ, R_qr = Lᴴ, and their cotangents likewise */
            T *t0 = FN(zalloc)((size_t)mq * nq), *t1 = FN(zalloc)((size_t)nq * nr);
            if (t0 == NULL || t1 == NULL) {
                free(t0);
                free(t1);
                free(Q);
                free(Rm);
                break;
            }
            FN(adjoint)(Q, nq, mq, X0);
            FN(adjoint)(Rm, nr, nq, X1);
            FN(load)(&cot[qi], t0, nq, mq);
            FN(adjoint)(t0, nq, mq, D0);
            FN(load)(&cot[ri], t1, nr, nq);
            FN(adjoint)(t1, nr, nq, D1);
            free(t0);
            free(t1);
        } else {
            memcpy(X0, Q, (size_t)mq * nq * sizeof(T));
            memcpy(X1, Rm, (size_t)nq * nr * sizeof(T));
            FN(load)(&cot[qi], D0, mq, nq);
            FN(load)(&cot[ri], D1, nq, nr);
        }
        int p = FN(qr_rank)(X1, nq, k, op.rank_atol);
        for (int j = p; j < (p < k ? nq : k); j++) /* vectors past the rank */
            memset(D0 + (size_t)j * mq, 0, (size_t)mq * sizeof(T));
        if (p == k)
            FN(onto_span)(X0, mq, p, D0, k, nq); /* the completion: only its span(Q₁) part */
        for (int j = p; j < nr; j++)
            for (int i = p; i < k; i++)
                E(D1, nq, i, j) = 0;
        if (lq) {
            T *t0 = FN(zalloc)((size_t)mq * nq), *t1 = FN(zalloc)((size_t)nq * nr);
            if (t0 && t1) {
                FN(adjoint)(D0, mq, nq, t0); /* ΔQ (nq×mq) */
                FN(store_back)(&cot[qi], t0, nq, mq);
                FN(adjoint)(D1, nq, nr, t1); /* ΔL (nr×nq) */
                FN(store_back)(&cot[ri], t1, nr, nq);
            }
            free(t0);
            free(t1);
        } else {
            FN(store_back)(&cot[qi], D0, mq, nq);
            FN(store_back)(&cot[ri], D1, nq, nr);
        }
        free(Q);
        free(Rm);
        rc = 0;
        break;
    }
    case FZ_QR_NULL:
    case FZ_LQ_NULL: { /* drop the rotation of N: ΔN −= N·antiherm(NᴴΔN) */
        bool lq = kind == FZ_LQ_NULL;
        int mm = lq ? n : m, nn = mm - k;
        T *N = FN(out_arr)(c, 0);
        X0 = FN(zalloc)((size_t)mm * nn);
        D0 = FN(zalloc)((size_t)mm * nn);
        X1 = FN(zalloc)((size_t)nn * nn);
        if (N && X0 && D0 && X1) {
            const T one = 1, zero = 0, mone = -1;
            if (lq) {
                FN(adjoint)(N, nn, mm, X0);
                T *t = FN(zalloc)((size_t)mm * nn);
                if (t) {
                    FN(load)(&cot[0], t, nn, mm);
                    FN(adjoint)(t, nn, mm, D0);
                }
                free(t);
            } else {
                memcpy(X0, N, (size_t)mm * nn * sizeof(T));
                FN(load)(&cot[0], D0, mm, nn);
            }
            FN(gemm)('C', 'N', nn, nn, mm, one, X0, mm, D0, mm, zero, X1, nn);
            FN(antiherm)(X1, nn);
            FN(gemm)('N', 'N', mm, nn, nn, mone, X0, mm, X1, nn, one, D0, mm);
            if (lq) {
                T *t = FN(zalloc)((size_t)mm * nn);
                if (t) {
                    FN(adjoint)(D0, mm, nn, t);
                    FN(store_back)(&cot[0], t, nn, mm);
                }
                free(t);
            } else
                FN(store_back)(&cot[0], D0, mm, nn);
            rc = 0;
        }
        free(N);
        break;
    }
    case FZ_EIGH_FULL:
    case FZ_EIGH_TRUNC: {
        int r = (int)c->out[1].shape[1];
        X0 = FN(out_arr)(c, 1);
        D0 = FN(zalloc)((size_t)m * r);
        if (X0 && D0) {
            FN(load)(&cot[1], D0, m, r);
            FN(drop_phase)(X0, m, r, D0, NULL);
            FN(store_back)(&cot[1], D0, m, r);
            rc = 0;
        }
        break;
    }
    case FZ_EIG_FULL: { /* V is complex whatever A is: the complex body does it */
        CT *V = CAT(out_arr, CSFX)(c, 1), *dV = CAT(zalloc, CSFX)((size_t)m * m);
        if (V && dV) {
            CAT(load, CSFX)(&cot[1], dV, m, m);
            CAT(drop_phase, CSFX)(V, m, m, dV, NULL);
            CAT(store_back, CSFX)(&cot[1], dV, m, m);
            rc = 0;
        }
        free(V);
        free(dV);
        break;
    }
    case FZ_SVD_VALS: { /* values at the rank or below are not differentiable */
        const RT *S = pb_tensor_data(&c->out[0]);
        RT *dS = pb_tensor_data(&cot[0]);
        for (int i = FN(svd_rank)(S, k, op.rank_atol); i < k; i++)
            dS[i] = 0;
        rc = 0;
        break;
    }
    case FZ_SVD_COMPACT:
    case FZ_SVD_FULL:
    case FZ_SVD_TRUNC: {
        int cu = (int)c->out[0].shape[1], cv = (int)c->out[2].shape[0], rs = (int)c->out[1].shape[0];
        const RT *S = pb_tensor_data(&c->out[1]);
        int r = FN(svd_rank)(S, rs, op.rank_atol);
        X0 = FN(out_arr)(c, 0);
        X1 = FN(out_arr)(c, 2);
        D0 = FN(zalloc)((size_t)m * cu);
        D1 = FN(zalloc)((size_t)cv * n);
        double *ph = calloc((size_t)(r ? r : 1), sizeof(double));
        if (!(X0 && X1 && D0 && D1 && ph)) {
            free(ph);
            break;
        }
        FN(load)(&cot[0], D0, m, cu);
        FN(load)(&cot[2], D1, cv, n);
#if CPLX
        for (int j = 0; j < r; j++) { /* Im(v_jᴴΔv_j), v_j = Vh[j, :]ᴴ */
            T s = 0;
            for (int l = 0; l < n; l++)
                s += E(X1, cv, j, l) * CONJ(E(D1, cv, j, l));
            ph[j] = IM(s);
        }
#endif
        FN(drop_phase)(X0, m, r, D0, ph);
        for (int j = r; j < (r < rs ? cu : rs); j++) /* past the rank */
            memset(D0 + (size_t)j * m, 0, (size_t)m * sizeof(T));
        for (int j = 0; j < n; j++)
            for (int i = r; i < (r < rs ? cv : rs); i++)
                E(D1, cv, i, j) = 0;
        if (r == rs && cu > rs) /* the completions: only their span(Uᵣ) part */
            FN(onto_span)(X0, m, r, D0, rs, cu);
        if (r == rs && cv > rs) {
            T *Vt = FN(zalloc)((size_t)n * cv), *dVt = FN(zalloc)((size_t)n * cv);
            if (Vt && dVt) {
                FN(adjoint)(X1, cv, n, Vt);
                FN(adjoint)(D1, cv, n, dVt);
                FN(onto_span)(Vt, n, r, dVt, rs, cv);
                FN(adjoint)(dVt, n, cv, D1);
            }
            free(Vt);
            free(dVt);
        }
        if (r < rs) {
            RT *dS = pb_tensor_data(&cot[1]);
            for (int i = r; i < rs; i++)
                dS[i] = 0;
        }
        FN(store_back)(&cot[0], D0, m, cu);
        FN(store_back)(&cot[2], D1, cv, n);
        free(ph);
        rc = 0;
        break;
    }
    default:
        rc = 0;
        break;
    }
    free(X0);
    free(X1);
    free(D0);
    free(D1);
    return rc;
}

/* eigh takes Hermitian matrices: a direction is replaced by its Hermitian
 * part. */
static void FN(fd_hermitian)(pb_tensor_t *dir)
{
    int m = (int)dir->shape[0];
    T *a = pb_tensor_data(dir);
    for (int j = 0; j < m; j++)
        for (int i = 0; i <= j; i++) {
            T v = (T)((a[(size_t)j * m + i] + CONJ(a[(size_t)i * m + j])) * 0.5);
            a[(size_t)j * m + i] = v;
            a[(size_t)i * m + j] = CONJ(v);
        }
}

#undef CAT_
#undef CAT
#undef FN
#undef LAPACK
#undef CBLAS
#undef RE
#undef IM
#undef CONJ
#undef ABS
#undef SCAL
#undef ORGQR
#undef ORGLQ
#undef SYEVD
#undef T
#undef RT
#undef CT
#undef SFX
#undef CSFX
#undef LP
#undef LP_CHAR
#undef DT
#undef RDT
#undef CDT
#undef CPLX
