/* The polar decompositions and their pullback for one dtype: a body for
 * dtype_t.h, instantiated by factor_polar.c.  right_polar(A) =
 * left_polar(Aᴴ) with Wh = Wᴴ; the tape keeps W, and P's eigenvectors V
 * and values S (P = V·S·Vᴴ). */

/* A = W·P (m ≥ n) through the SVD A = U·S·Vh: W = U·Vh, P = Vhᴴ·S·Vh.
 * Also returns V = Vhᴴ and S, which the pullback solves with. */
static int FN(polar_factor)(const T *A, int m, int n, T *W, T *P, T *V, RT *S, pb_err_t *err)
{
    T *U = FZ(zalloc)((size_t)m * n), *Vh = FZ(zalloc)((size_t)n * n), *SV = FZ(zalloc)((size_t)n * n);
    int rc = PB_ENOMEM;
    const T one = 1, zero = 0;
    if (U && Vh && SV && (rc = FZ(svd_factor)(A, m, n, U, S, Vh, err)) == 0) {
        FZ(gemm)('N', 'N', m, n, n, one, U, m, Vh, n, zero, W, m);
        /* P = (S^½·Vh)ᴴ(S^½·Vh): a rank-n update, Hermitian by construction
         * (on a GPU the whole product, its lower half kept) */
        FZ(copy)(SV, n, Vh, n, n, n);
        FZ_KERNEL(NULL, .kind = PB_GPU_FZ_ROWS_SQRT_MUL, .m = n, .n = n, .ld = n, .x = SV, .w = S);
        if (pb_exec_gpu() >= 0)
            FZ(gemm)('C', 'N', n, n, n, one, SV, n, SV, n, zero, P, n);
        else if (n > 0)
#if CPLX
            CBLAS(herk)(CblasColMajor, CblasLower, CblasConjTrans, n, n, 1.0, SV, LD(n), 0.0, P, LD(n));
#else
            CBLAS(syrk)(CblasColMajor, CblasLower, CblasTrans, n, n, 1.0, SV, LD(n), 0.0, P, LD(n));
#endif
        FZ_KERNEL(NULL, .kind = PB_GPU_FZ_MIRROR_LOWER, .m = n, .n = n, .ld = n, .x = P);
        FZ(adjoint)(Vh, n, n, V);
    }
    pb__fz_free(U);
    pb__fz_free(Vh);
    pb__fz_free(SV);
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
    T *P = FZ(zalloc)(nn), *M = FZ(zalloc)(nn), *C = FZ(zalloc)(nn), *Z = FZ(zalloc)(nn), *Ph = FZ(zalloc)(nn);
    T *K = FZ(zalloc)(nn);
    int rc = PB_ENOMEM;
    const T one = 1, zero = 0, mone = -1;
    const bool tall = m > n && dW;
    if (!(P && M && C && Z && Ph && K))
        goto out;
    /* (n×n passes: a transpose's strides, T(X) = Xᵀ's) */
    pb_loop_t L = {.rank = 2, .dim = {(uint64_t)n, (uint64_t)n}, .s = {{1, n}, {n, 1}, {1, n}}};
    FZ(copy)(Z, n, V, n, n, n); /* P = V·S·Vᴴ */
    FZ_KERNEL(NULL, .kind = PB_GPU_FZ_COLS_MUL, .m = n, .n = n, .ld = n, .x = Z, .w = S);
    FZ(gemm)('N', 'C', n, n, n, one, Z, n, V, n, zero, P, n);
    if (dP) /* Ph = (ΔP + ΔPᴴ)/2 */
        pb_strided(DT, &L, Ph, dP, true, (pb_scalar_t){0.5, 0}, dP, (pb_scalar_t){0.5, 0}, false);
    if (dW)
        FZ(gemm)('C', 'N', n, n, m, one, W, m, dW, m, zero, K, n);
    FZ(copy)(M, n, K, n, n, n);
    if (dP)
        FZ(gemm)('N', 'N', n, n, n, mone, Ph, n, P, n, one, M, n);
    /* C = M − Mᴴ */
    pb_strided(DT, &L, C, M, true, (pb_scalar_t){-1, 0}, M, (pb_scalar_t){1, 0}, false);
    FZ(gemm)('C', 'N', n, n, n, one, V, n, C, n, zero, M, n);
    FZ(gemm)('N', 'N', n, n, n, one, M, n, V, n, zero, C, n);
    FZ_KERNEL(NULL, .kind = PB_GPU_FZ_POLAR_F, .m = n, .n = n, .ld = n, .x = C, .w = S, .param = tol);
    FZ(gemm)('N', 'N', n, n, n, one, V, n, C, n, zero, M, n);
    FZ(gemm)('N', 'C', n, n, n, one, M, n, V, n, zero, C, n); /* X */
    pb_loop_t F = {.rank = 1, .dim = {nn}, .s = {{1}, {1}}}; /* C += Ph */
    pb_strided(DT, &F, C, Ph, false, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, true);
    if (tall) { /* Z = P⁻¹ (pseudo-inverse past tol); C −= K·P⁻¹; ΔA += ΔW·P⁻¹ */
        FZ(copy)(M, n, V, n, n, n);
        FZ_KERNEL(NULL, .kind = PB_GPU_FZ_COLS_PINV, .m = n, .n = n, .ld = n, .x = M, .w = S, .param = tol);
        FZ(gemm)('N', 'C', n, n, n, one, M, n, V, n, zero, Z, n);
        FZ(gemm)('N', 'N', n, n, n, mone, K, n, Z, n, one, C, n);
        FZ(gemm)('N', 'N', m, n, n, one, dW, m, Z, n, one, dA, m);
    }
    FZ(gemm)('N', 'N', m, n, n, one, W, m, C, n, one, dA, m);
    rc = 0;
out:
    pb__fz_free(P);
    pb__fz_free(M);
    pb__fz_free(C);
    pb__fz_free(Z);
    pb__fz_free(Ph);
    pb__fz_free(K);
    return rc;
}

/* ---- the entry points (factor_polar.c's rows) ------------------------------- */

static int FN(polar_fwd)(const pb_call_t *c, T *A, pb_tensor_t *o, pb_tensor_t *sv, bool right, pb_err_t *err)
{
    const int m = (int)c->in[0].shape[0], n = (int)c->in[0].shape[1];
    const int mm = right ? n : m, nn = right ? m : n;
    T *W = FZ(newmat)(&sv[0], mm, nn), *V = FZ(newmat)(&sv[1], nn, nn), *X = NULL;
    RT *S = FZ(newvec_r)(&sv[2], nn);
    T *P = FZ(newmat)(&o[right ? 0 : 1], nn, nn);
    int rc = PB_ENOMEM;
    if (W && V && S && P && (X = FZ(zalloc)((size_t)m * n))) {
        if (right)
            FZ(adjoint)(A, m, n, X);
        else
            FZ(copy)(X, m, A, m, m, n);
        if ((rc = FN(polar_factor)(X, mm, nn, W, P, V, S, err)) == 0 && right) {
            T *Wh = FZ(newmat)(&o[1], nn, mm);
            if (Wh)
                FZ(adjoint)(W, mm, nn, Wh);
            else
                rc = PB_ENOMEM;
        } else if (rc == 0)
            pb_tensor_ref(&o[0], &sv[0]);
    }
    pb__fz_free(X);
    return rc;
}

/* With ΔW = ΔWhᴴ for right_polar, and its dA the adjoint. */
static int FN(polar_pull)(const pb_tapedata_t *t, const pb_tensor_t *cot, const fz_opts_t *op, T *dA, bool right)
{
    const int m = (int)t->in_meta[0].shape[0], n = (int)t->in_meta[0].shape[1];
    const int mm = right ? n : m, nn = right ? m : n;
    const pb_tensor_t *s0 = &t->saved[0], *s1 = &t->saved[1], *s2 = &t->saved[2];
    T *c0 = NULL, *c1 = NULL, *c2 = NULL, *dAa = NULL;
    int rc;
    if ((rc = FZ(load_cot)(&cot[right ? 1 : 0], right ? nn : mm, right ? mm : nn, &c0)) ||
        (rc = FZ(load_cot)(&cot[right ? 0 : 1], nn, nn, &c1)))
        goto out;
    rc = PB_ENOMEM;
    if (right && c0) {
        if ((c2 = FZ(zalloc)((size_t)mm * nn)) == NULL)
            goto out;
        FZ(adjoint)(c0, nn, mm, c2);
    }
    if (right && (dAa = FZ(zalloc)((size_t)mm * nn)) == NULL)
        goto out;
    /* Terms dividing by Sᵢ + Sⱼ or Sⱼ are dropped below rank_atol, but never
     * above eps^¾·S₁: the contract's default rank_atol, eps(max|A_ij|)^¾,
     * passes every singular value of a well-conditioned A of 1e-60 and
     * would zero its gradient.  Nor below the smallest normal number: a
     * zero A (S₁ = 0) divides by nothing. */
    const bool single = DT == PB_F32 || DT == PB_C64;
    const RT *S = pb_tensor_data(s2);
    RT s1max = 0; /* S₁, read where the host can (a GPU's S: FZ(host_r)) */
    if (nn > 0) {
        RT *copy;
        const RT *h = FZ(host_r)(S, 1, &copy);
        if (h == NULL)
            goto out;
        s1max = h[0];
        pb_mem_free(copy);
    }
    double rel = pow(single ? FLT_EPSILON : DBL_EPSILON, 0.75) * (double)s1max;
    double tol = fmax(fmin(op->rank_atol, rel), single ? FLT_MIN : DBL_MIN);
    rc = FN(polar_pullback)(pb_tensor_data(s0), mm, nn, pb_tensor_data(s1), S, right ? c2 : c0, c1, right ? dAa : dA,
                            tol);
    if (right && rc == 0)
        FZ(adjoint)(dAa, mm, nn, dA);
out:
    pb__fz_free(c0);
    pb__fz_free(c1);
    pb__fz_free(c2);
    pb__fz_free(dAa);
    return rc;
}

/* The two sides, as FZ(forward) and FZ(reverse) call them (polar has no
 * gauge: *gauge stays 0). */
static int FN(left_fwd)(const pb_call_t *c, T *A, const fz_opts_t *op, pb_tensor_t *o, pb_tensor_t *sv,
                        pb_err_t *err)
{
    (void)op;
    return FN(polar_fwd)(c, A, o, sv, false, err);
}

static int FN(right_fwd)(const pb_call_t *c, T *A, const fz_opts_t *op, pb_tensor_t *o, pb_tensor_t *sv,
                         pb_err_t *err)
{
    (void)op;
    return FN(polar_fwd)(c, A, o, sv, true, err);
}

static int FN(left_pull)(const pb_tapedata_t *t, const pb_tensor_t *cot, const fz_opts_t *op, T *dA, double *gauge,
                         pb_err_t *err)
{
    (void)gauge, (void)err;
    return FN(polar_pull)(t, cot, op, dA, false);
}

static int FN(right_pull)(const pb_tapedata_t *t, const pb_tensor_t *cot, const fz_opts_t *op, T *dA, double *gauge,
                          pb_err_t *err)
{
    (void)gauge, (void)err;
    return FN(polar_pull)(t, cot, op, dA, true);
}

static int FN(left_polar_forward)(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    return FZ(forward)(c, tape, err, FN(left_fwd));
}

static int FN(right_polar_forward)(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    return FZ(forward)(c, tape, err, FN(right_fwd));
}

static int FN(left_polar_reverse)(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                                  pb_warnings_t *warn, pb_err_t *err)
{
    return FZ(reverse)(t, cot, grad, order, warn, err, FN(left_pull));
}

static int FN(right_polar_reverse)(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                                   pb_warnings_t *warn, pb_err_t *err)
{
    return FZ(reverse)(t, cot, grad, order, warn, err, FN(right_pull));
}
