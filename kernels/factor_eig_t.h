/* eig (full, values), its pullback and the check's projection for one
 * dtype: a body for dtype_t.h, instantiated by factor_eig.c.  D and V are
 * complex (CT) whatever A is: a real A's eig finishes, and its pullback
 * runs, in the complex instance (dtype_t.h instantiates c and z first).
 * The tape keeps D and V (eig_vals: V only). */

/* A = V·diag(D)·V⁻¹ through geev (A, the forward's work array, padded in
 * place and overwritten); D and V complex (CT), m×m, as geev gives them
 * (unit-norm columns); V NULL: the values alone (about half the work).
 * fz_eig_finish then fixes order and phases. */
static int FN(eig_geev)(T *A, int m, CT *D, CT *V, pb_err_t *err)
{
    if (m == 0)
        return 0;
    lapack_int info;
    int ld = FZ(pad_here)(A, m, m); /* A and V through LAPACK's leading dimension */
    const char jobv = V ? 'V' : 'N';
#if CPLX
    int ldv = 1;
    T *Vp = V ? FZ(pad)(V, m, m, false, &ldv) : NULL;
    if (V && Vp == NULL)
        return PB_ENOMEM;
    info = LAPACK(geev)(LAPACK_COL_MAJOR, 'N', jobv, m, A, ld, D, NULL, 1, Vp, ldv);
    FZ(unpad)(Vp, ldv, V, m, m, info == 0);
    if (info)
        return FZ(lapack_fail)("geev", info, err);
#else
    RT *wr = FZ(ralloc)((size_t)m), *wi = FZ(ralloc)((size_t)m);
    T *VR = V ? FZ(zalloc)((size_t)ld * m) : NULL;
    if (wr == NULL || wi == NULL || (V && VR == NULL)) {
        pb_mem_free(wr);
        pb_mem_free(wi);
        pb_mem_free(VR);
        return PB_ENOMEM;
    }
    info = LAPACK(geev)(LAPACK_COL_MAJOR, 'N', jobv, m, A, ld, wr, wi, NULL, 1, VR, V ? ld : 1);
    for (int j = 0; info == 0 && j < m; j++)
        D[j] = (CT)CMPLX(wr[j], wi[j]);
    /* a conjugate pair is stored as the real and imaginary parts of the
     * first vector in two adjacent columns */
    for (int j = 0; info == 0 && V && j < m; j++)
        if (wi[j] != 0 && j + 1 < m) {
            for (int i = 0; i < m; i++) {
                E(V, m, i, j) = (CT)CMPLX(E(VR, ld, i, j), E(VR, ld, i, j + 1));
                E(V, m, i, j + 1) = (CT)CMPLX(E(VR, ld, i, j), -E(VR, ld, i, j + 1));
            }
            j++;
        } else
            for (int i = 0; i < m; i++)
                E(V, m, i, j) = E(VR, ld, i, j);
    pb_mem_free(wr);
    pb_mem_free(wi);
    pb_mem_free(VR);
    if (info)
        return FZ(lapack_fail)("geev", info, err);
#endif
    return 0;
}

#if CPLX
/* Normalise eig's vectors: unit norm, eigenvalues sorted by real part then
 * imaginary part (exact ties keep geev's order), phases fixed; V NULL: the
 * values alone, sorted. */
static int FN(eig_finish)(T *D, T *V, int m)
{
    int *idx = pb_mem_alloc(sizeof(int) * (size_t)(m ? m : 1));
    T *D2 = FZ(zalloc)((size_t)m), *V2 = V ? FZ(zalloc)((size_t)m * m) : NULL;
    if (idx == NULL || D2 == NULL || (V && V2 == NULL)) {
        pb_mem_free(idx);
        pb_mem_free(D2);
        pb_mem_free(V2);
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
        if (V == NULL)
            continue;
        double nrm = 0;
        for (int i = 0; i < m; i++)
            nrm += RE(E(V, m, i, idx[j]) * CONJ(E(V, m, i, idx[j])));
        nrm = sqrt(nrm);
        for (int i = 0; i < m; i++)
            E(V2, m, i, j) = (T)(nrm > 0 ? E(V, m, i, idx[j]) / nrm : E(V, m, i, idx[j]));
    }
    memcpy(D, D2, (size_t)m * sizeof(T));
    if (V) {
        memcpy(V, V2, (size_t)m * m * sizeof(T));
        FZ(fix_phases)(V, m, m, NULL);
    }
    pb_mem_free(idx);
    pb_mem_free(D2);
    pb_mem_free(V2);
    return 0;
}

/* dA (m×m, complex) += the pullback of A = V·diag(D)·V⁻¹ with unit-norm
 * columns.  What moves V along itself goes first, G = ΔV − V·diag(VᴴΔV):
 * the real part of that diagonal cannot move (the norm is fixed), and its
 * imaginary part is the phase, the gauge: removed along V, the direction
 * a phase moves V in, it is the part orthogonal to every gauge-invariant
 * cotangent (Re Σ conj(V·iΘ)∘ΔV = 0 for those), as eigh and svd remove it.
 * (Zeroing Im diag(VᴴΔV) instead removes it along V⁻ᴴ, which for a
 * non-normal A let a pure phase cotangent change the gradient.)  Then
 * with X = VᴴG:
 *   ΔA = V⁻ᴴ·(conj(F)∘X + diag(ΔD))·Vᴴ,  F_ij = 1/(D_j − D_i)
 * (F dropped below deg_atol, and on the diagonal).  *gauge: Im of
 * diag(VᴴΔV) (the phase) and X inside degenerate blocks. */
static int FN(eig_pullback)(const T *D, const T *V, int m, const T *dD, const T *dV, T *dA, double deg_atol,
                            double *gauge, pb_err_t *err)
{
    size_t mm = (size_t)m * m;
    T *X = FZ(zalloc)(mm), *K = FZ(zalloc)(mm), *LU = FZ(zalloc)(mm);
    lapack_int *piv = pb_mem_alloc(sizeof(lapack_int) * (size_t)(m ? m : 1));
    int rc = PB_ENOMEM;
    double g = 0;
    const T one = 1, zero = 0;
    if (!(X && K && LU && piv))
        goto out;
    if (dV) {
        FZ(gemm)('C', 'N', m, m, m, one, V, m, dV, m, zero, X, m);
        for (int j = 0; j < m; j++) {
            g = fmax(g, fabs(IM(E(X, m, j, j))));
            for (int i = 0; i < m; i++)
                E(K, m, i, j) = dV[(size_t)j * m + i] - E(V, m, i, j) * E(X, m, j, j);
        }
        FZ(gemm)('C', 'N', m, m, m, one, V, m, K, m, zero, X, m);
        for (int j = 0; j < m; j++)
            for (int i = 0; i < m; i++) {
                T gap = D[j] - D[i];
                if (i == j) {
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
    FZ(gemm)('N', 'C', m, m, m, one, K, m, V, m, one, dA, m);
    rc = 0;
out:
    pb_mem_free(X);
    pb_mem_free(K);
    pb_mem_free(LU);
    pb_mem_free(piv);
    *gauge = g;
    return rc;
}
#endif

/* ---- the entry points (factor_eig.c's rows) --------------------------------- */

static int FN(eig_fwd)(const pb_call_t *c, T *A, const fz_opts_t *op, pb_tensor_t *o, pb_tensor_t *sv,
                       pb_err_t *err)
{
    const int m = (int)c->in[0].shape[0];
    int rc = PB_ENOMEM;
    (void)op;
    if (c->op->variant == FZ_VALS && !c->taped) { /* no tape to make: the values alone */
        CT *D = FZC(newmat)(&o[0], m, -1);
        if (D && (rc = FN(eig_geev)(A, m, D, NULL, err)) == 0)
            rc = PB_CAT(eig_finish, CSFX)(D, NULL, m);
        return rc;
    }
    CT *D = FZC(newmat)(&sv[0], m, -1), *V = FZC(newmat)(&sv[1], m, m);
    if (D && V && (rc = FN(eig_geev)(A, m, D, V, err)) == 0 && (rc = PB_CAT(eig_finish, CSFX)(D, V, m)) == 0) {
        pb_tensor_ref(&o[0], &sv[0]);
        if (c->op->variant == FZ_FULL)
            pb_tensor_ref(&o[1], &sv[1]);
        else
            pb_tensor_clear(&sv[0]);
    }
    return rc;
}

/* In the complex instance, then (a real A) the real part. */
static int FN(eig_pull)(const pb_tapedata_t *t, const pb_tensor_t *cot, const fz_opts_t *op, T *dA, double *gauge,
                        pb_err_t *err)
{
    const int m = (int)t->in_meta[0].shape[0];
    const pb_tensor_t *s0 = &t->saved[0], *s1 = &t->saved[1];
    CT *d0 = NULL, *d1 = NULL, *dAc = FZC(zalloc)((size_t)m * m);
    const CT *D = s0->storage ? pb_tensor_data(s0) : NULL;
    int rc = PB_ENOMEM;
    if (dAc && (cot[0].storage == NULL || (d0 = FZC(zalloc)((size_t)m))) &&
        (t->op->variant == FZ_VALS || cot[1].storage == NULL || (d1 = FZC(zalloc)((size_t)m * m)))) {
        if (d0)
            memcpy(d0, pb_tensor_data(&cot[0]), (size_t)m * sizeof(CT));
        if (d1)
            FZC(load)(&cot[1], d1, m, m);
        rc = PB_CAT(eig_pullback, CSFX)(D, pb_tensor_data(s1), m, d0, d1, dAc, op->deg_atol, gauge, err);
        for (size_t i = 0; rc == 0 && i < (size_t)m * m; i++)
#if CPLX
            dA[i] = dAc[i];
#else
            dA[i] = (T)creal(dAc[i]); /* a real A: the real part */
#endif
    }
    pb_mem_free(d0);
    pb_mem_free(d1);
    pb_mem_free(dAc);
    return rc;
}

static int FN(eig_forward)(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    return FZ(forward)(c, tape, err, FN(eig_fwd));
}

static int FN(eig_reverse)(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                           pb_warnings_t *warn, pb_err_t *err)
{
    return FZ(reverse)(t, cot, grad, order, warn, err, FN(eig_pull));
}

/* The check's projection: the phases of the (complex) eigenvectors
 * dropped, in the complex instance. */
static int FN(eig_fd)(const pb_call_t *c, pb_tensor_t *cot)
{
    const int m = (int)c->in[0].shape[0];
    CT *V = FZC(out_arr)(c, 1), *dV = FZC(zalloc)((size_t)m * m);
    int rc = PB_ENOMEM;
    if (V && dV) {
        FZC(load)(&cot[1], dV, m, m);
        FZC(drop_phase)(V, m, m, dV, NULL);
        FZC(store_back)(&cot[1], dV, m, m);
        rc = 0;
    }
    pb_mem_free(V);
    pb_mem_free(dV);
    return rc;
}
