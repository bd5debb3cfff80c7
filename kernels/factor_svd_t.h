/* The SVD (compact, full, values, truncated), its pullback and the
 * check's projections for one dtype: a body for dtype_t.h, instantiated by
 * factor_svd.c.  The tape keeps U, S and Vh (svd_vals: U and Vh); the
 * truncated form keeps the full decomposition, and its reverse pads the
 * kept vectors' cotangents, so its pullback is exact for the kept factors. */

/* On a GPU (cuda/exec.h): cuSOLVER's gesvd, which takes no wide matrix:
 * a wide A goes as Aᴴ = V·S·Uᴴ.  With vectors, U (m×k) and Vh (k×n);
 * without, S alone (U and Vh unused). */
static int FN(svd_cusolver)(const T *A, int m, int n, T *U, RT *S, T *Vh, bool vectors, pb_err_t *err)
{
    const bool wide = m < n;
    const int M = wide ? n : m, N = wide ? m : n; /* M ≥ N = k */
    T *W = FZ(zalloc)((size_t)M * N), *Ut = NULL, *Vt = NULL;
    int rc = PB_ENOMEM;
    if (W && (!vectors || !wide || ((Ut = FZ(zalloc)((size_t)M * N)) && (Vt = FZ(zalloc)((size_t)N * N))))) {
        if (wide)
            FZ(adjoint)(A, m, n, W);
        else
            FZ(copy)(W, m, A, m, m, n);
        int info = pb__exec_gesvd(DT, vectors, M, N, W, M, S, vectors ? (wide ? Ut : U) : NULL, M,
                                  vectors ? (wide ? Vt : Vh) : NULL, N);
        if (info)
            rc = FZ(lapack_fail)("gesvd", info, err);
        else {
            rc = 0;
            if (vectors && wide) { /* U = (Vᴴ of Aᴴ)ᴴ, Vh = (U of Aᴴ)ᴴ */
                FZ(adjoint)(Vt, N, N, U);
                FZ(adjoint)(Ut, M, N, Vh);
            }
        }
    }
    pb__fz_free(W);
    pb__fz_free(Ut);
    pb__fz_free(Vt);
    return rc;
}

/* gesdd, and gesvd when gesdd does not converge (cuSOLVER's gesvd on a
 * GPU): U, S and Vh as they come, k = min(m, n) > 0. */
static int FN(svd_drivers)(const T *A, int m, int n, T *U, RT *S, T *Vh, pb_err_t *err)
{
    const int k = m < n ? m : n;
    if (pb_exec_gpu() >= 0)
        return FN(svd_cusolver)(A, m, n, U, S, Vh, true, err);
    /* W: A's copy for LAPACK to overwrite; U and Vh through LAPACK's
     * leading dimensions (FZ(pad)) */
    int ldw = FZ(lapack_ld)(m), ldu, ldv;
    T *W = FZ(zalloc)((size_t)ldw * n);
    T *Up = FZ(pad)(U, m, k, false, &ldu), *Vp = FZ(pad)(Vh, k, n, false, &ldv);
    RT *superb = FZ(ralloc)((size_t)k);
    int rc = PB_ENOMEM;
    if (W && Up && Vp && superb) {
        FZ(copy)(W, ldw, A, m, m, n);
        const char *drv = "gesdd"; /* the driver whose info is reported */
        lapack_int info = LAPACK(gesdd)(LAPACK_COL_MAJOR, 'S', m, n, W, ldw, S, Up, ldu, Vp, ldv);
        if (info > 0) {
            FZ(copy)(W, ldw, A, m, m, n);
            drv = "gesvd";
            info = LAPACK(gesvd)(LAPACK_COL_MAJOR, 'S', 'S', m, n, W, ldw, S, Up, ldu, Vp, ldv, superb);
        }
        if (info)
            rc = FZ(lapack_fail)(drv, info, err);
        else
            rc = 0;
    }
    FZ(unpad)(Up, ldu, U, m, k, rc == 0);
    FZ(unpad)(Vp, ldv, Vh, k, n, rc == 0);
    pb__fz_free(W);
    pb__fz_free(superb);
    return rc;
}

/* A = U·diag(S)·Vh, then the phases: U's columns by fix_phases, Vh's rows
 * by the same phases. */
int FZ(svd_factor)(const T *A, int m, int n, T *U, RT *S, T *Vh, pb_err_t *err)
{
    int k = m < n ? m : n;
    if (k == 0)
        return 0;
    T *ph = FZ(zalloc)((size_t)k);
    int rc = ph ? FN(svd_drivers)(A, m, n, U, S, Vh, err) : PB_ENOMEM;
    if (rc == 0) {
        FZ(fix_phases)(U, m, k, ph);
        FZ_KERNEL(NULL, .kind = PB_GPU_FZ_ROWS_MUL, .m = k, .n = n, .ld = k, .x = Vh, .v = ph);
    }
    pb__fz_free(ph);
    return rc;
}

/* Cols k..m of Qf (m×m) complete the orthonormal columns of Qf[:, :k]:
 * the Householder completion of them, which varies smoothly with them,
 * each column's phase fixed as usual. */
static int FN(complete)(T *Qf, int m, int k, pb_err_t *err)
{
    if (k >= m)
        return 0;
    T *W = FZ(zalloc)((size_t)m * k), *Q = FZ(zalloc)((size_t)m * m), *Rm = FZ(zalloc)((size_t)m * k);
    int rc = PB_ENOMEM;
    if (W && Q && Rm) {
        memcpy(W, Qf, (size_t)m * k * sizeof(T));
        rc = FZ(qr_factor)(W, m, k, m, Q, Rm, err);
        if (rc == 0) {
            memcpy(Qf + (size_t)k * m, Q + (size_t)k * m, (size_t)m * (size_t)(m - k) * sizeof(T));
            FZ(fix_phases)(Qf + (size_t)k * m, m, m - k, NULL);
        }
    }
    pb_mem_free(W);
    pb_mem_free(Q);
    pb_mem_free(Rm);
    return rc;
}

/* The rank r of S (descending): the last i with S_i ≥ atol, plus one;
 * -1 when out of memory (S on a GPU is read through a host copy). */
static int FN(svd_rank)(const RT *Sx, int k, double atol)
{
    RT *copy;
    const RT *S = FZ(host_r)(Sx, k, &copy);
    if (S == NULL)
        return -1;
    int r = 0;
    for (int i = 0; i < k; i++)
        if ((double)S[i] >= atol)
            r = i + 1;
    pb_mem_free(copy);
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
    if (r < 0)
        return PB_ENOMEM;
    const bool uperp = dU && m > r, vperp = dVh && n > r; /* complements to project onto */
    double g = 0;
    if (dU)
        g = fmax(g, FZ(maxabs)(dU, m, 0, m, r, k - r));
    if (dVh)
        g = fmax(g, FZ(maxabs)(dVh, nv, r, k - r, 0, n));
    size_t big = (size_t)(m > n ? m : n) * (size_t)(r > 0 ? r : 1);
    T *X = FZ(zalloc)((size_t)r * r), *Y = FZ(zalloc)((size_t)r * r);
    T *dUr = FZ(zalloc)((size_t)m * r), *dVr = FZ(zalloc)((size_t)r * n), *Z = FZ(zalloc)(big);
    T *C = FZ(zalloc)((size_t)(c2 > r ? c2 : r) * (size_t)(c2 > 0 ? c2 : 1));
    int rc = PB_ENOMEM;
    const T one = 1, zero = 0, mone = -1;
    if (!(X && Y && dUr && dVr && Z && C))
        goto out;
    if (dU) {
        FZ(copy)(dUr, m, dU, m, m, r);
        if (cu > 0) { /* completion columns U₂ = U[:, k:] */
            const T *U2 = U + (size_t)k * m, *dU2 = dU + (size_t)k * m;
            FZ(gemm)('C', 'N', cu, cu, m, one, U2, m, dU2, m, zero, C, cu);
            g = fmax(g, FZ(maxantiherm)(C, cu));
            FZ(gemm)('C', 'N', r, cu, m, one, U, m, dU2, m, zero, C, r);
            FZ(gemm)('N', 'C', m, r, cu, mone, U2, m, C, r, one, dUr, m);
        }
        FZ(gemm)('C', 'N', r, r, m, one, U, m, dUr, m, zero, X, r);
        if (uperp) /* (I − UᵣUᵣᴴ)ΔUᵣ, which is 0 when Uᵣ is square */
            FZ(gemm)('N', 'N', m, r, r, mone, U, m, X, r, one, dUr, m);
    }
    if (dVh) {
        FZ(copy)(dVr, r, dVh, nv, r, n);
        if (cv > 0) { /* completion rows Vh[k:, :] */
            const T *V2 = Vh + k, *dV2 = dVh + k;
            FZ(gemm)('N', 'C', cv, cv, n, one, V2, nv, dV2, nv, zero, C, cv);
            g = fmax(g, FZ(maxantiherm)(C, cv));
            FZ(gemm)('N', 'C', r, cv, n, one, Vh, nv, dV2, nv, zero, C, r);
            FZ(gemm)('N', 'N', r, n, cv, mone, C, r, V2, nv, one, dVr, r);
        }
        FZ(gemm)('N', 'C', r, r, n, one, Vh, nv, dVr, r, zero, Y, r);
        if (vperp) /* ΔVhᵣ(I − VhᵣᴴVhᵣ), 0 when Vhᵣ is square */
            FZ(gemm)('C', 'N', r, n, r, mone, Y, r, Vh, nv, one, dVr, r);
    }
    FZ(antiherm)(X, r);
    FZ(antiherm)(Y, r);
    /* K = (aX + aY)∘F⁻ + (aX − aY)∘F⁺ + diag(ΔS), in place of X */
    T *K = X;
    g = fmax(g, FZ_KERNEL(NULL, .kind = PB_GPU_FZ_SVD_F, .m = r, .n = r, .ld = r, .x = K, .y = Y, .w = S, .v = dS,
                          .param = deg_atol));
    if (uperp) /* ΔA += (ΔUᵣ⊥ S⁻¹ + Uᵣ K)·Vhᵣ */
        FZ_KERNEL(NULL, .kind = PB_GPU_FZ_COLS_DIV, .m = m, .n = r, .ld = m, .x = dUr, .w = S);
    FZ(gemm)('N', 'N', m, r, r, one, U, m, K, r, uperp ? one : zero, dUr, m);
    FZ(gemm)('N', 'N', m, n, r, one, dUr, m, Vh, nv, one, dA, m);
    if (vperp) { /* ΔA += Uᵣ·S⁻¹·ΔVhᵣ⊥ */
        FZ_KERNEL(NULL, .kind = PB_GPU_FZ_ROWS_DIV, .m = r, .n = n, .ld = r, .x = dVr, .w = S);
        FZ(gemm)('N', 'N', m, n, r, one, U, m, dVr, r, one, dA, m);
    }
    rc = 0;
out:
    pb__fz_free(X);
    pb__fz_free(Y);
    pb__fz_free(dUr);
    pb__fz_free(dVr);
    pb__fz_free(Z);
    pb__fz_free(C);
    *gauge = g;
    return rc;
}

/* svd_trunc keeps the first r of S (descending): σ_i > max(atol, rtol·σ₁),
 * at most maxrank. */
static int FN(svd_keep)(const RT *Sx, int k, const fz_opts_t *o)
{
    RT *copy;
    const RT *S = FZ(host_r)(Sx, k, &copy);
    if (S == NULL)
        return -1;
    double thr = fmax(o->atol, o->rtol * (k > 0 ? (double)S[0] : 0.0));
    int r = 0;
    while (r < k && (long long)r < o->maxrank && (double)S[r] > thr)
        r++;
    pb_mem_free(copy);
    return r;
}

/* ---- the entry points (factor_svd.c's rows) --------------------------------- */

/* U, S, Vh into sv[0..2]: compact, or (full) U and V = Vhᴴ completed to
 * square unitaries. */
static int FN(svd_decompose)(const T *A, int m, int n, bool full, pb_tensor_t *sv, pb_err_t *err)
{
    const int k = m < n ? m : n;
    T *U = FZ(newmat)(&sv[0], m, full ? m : k), *Vh = FZ(newmat)(&sv[2], full ? n : k, n);
    RT *S = FZ(newvec_r)(&sv[1], k);
    T *Vc = FZ(zalloc)((size_t)k * n), *Vf = NULL;
    int rc = PB_ENOMEM;
    if (U && Vh && S && Vc && (rc = FZ(svd_factor)(A, m, n, U, S, Vc, err)) == 0) {
        if (!full)
            FZ(copy)(Vh, k, Vc, k, k, n);
        else if ((Vf = FZ(zalloc)((size_t)n * n)) == NULL)
            rc = PB_ENOMEM;
        else {
            FZ(adjoint)(Vc, k, n, Vf);
            if ((rc = FN(complete)(U, m, k, err)) == 0 && (rc = FN(complete)(Vf, n, k, err)) == 0)
                FZ(adjoint)(Vf, n, n, Vh);
        }
    }
    pb__fz_free(Vc);
    pb__fz_free(Vf);
    return rc;
}

/* svd_vals with no tape to make: the values alone (gesdd without vectors
 * does about half the work), A padded in place and overwritten; gesvd
 * from A reloaded when gesdd does not converge. */
static int FN(svd_values)(const pb_call_t *c, T *A, int m, int n, pb_tensor_t *o, pb_err_t *err)
{
    const int k = m < n ? m : n;
    RT *S = FZ(newvec_r)(&o[0], k);
    if (S == NULL)
        return PB_ENOMEM;
    if (k == 0)
        return 0;
    if (pb_exec_gpu() >= 0) /* cuSOLVER's gesvd without vectors */
        return FN(svd_cusolver)(A, m, n, NULL, S, NULL, false, err);
    int ld = FZ(pad_here)(A, m, n);
    const char *drv = "gesdd"; /* the driver whose info is reported */
    lapack_int info = LAPACK(gesdd)(LAPACK_COL_MAJOR, 'N', m, n, A, ld, S, NULL, 1, NULL, 1);
    if (info > 0) {
        drv = "gesvd";
        RT *superb = FZ(ralloc)((size_t)k);
        if (superb == NULL)
            return PB_ENOMEM;
        FZ(load)(&c->in[0], A, m, n);
        FZ(pad_here)(A, m, n);
        info = LAPACK(gesvd)(LAPACK_COL_MAJOR, 'N', 'N', m, n, A, ld, S, NULL, 1, NULL, 1, superb);
        pb_mem_free(superb);
    }
    return info ? FZ(lapack_fail)(drv, info, err) : 0;
}

static int FN(svd_fwd)(const pb_call_t *c, T *A, const fz_opts_t *op, pb_tensor_t *o, pb_tensor_t *sv,
                       pb_err_t *err)
{
    const int m = (int)c->in[0].shape[0], n = (int)c->in[0].shape[1], k = m < n ? m : n;
    const fz_variant_t var = (fz_variant_t)c->op->variant;
    if (var == FZ_VALS && !c->taped)
        return FN(svd_values)(c, A, m, n, o, err);
    int rc = FN(svd_decompose)(A, m, n, var == FZ_FULL, sv, err);
    if (rc == 0 && var == FZ_TRUNC) {
        int *sel = pb_mem_alloc(sizeof(int) * (size_t)(k + 1)), r = FN(svd_keep)(pb_tensor_data(&sv[1]), k, op);
        rc = PB_ENOMEM;
        if (sel && r >= 0) {
            for (int i = 0; i < r; i++)
                sel[i] = i;
            if (!pb__fz_take(&o[0], &sv[0], sel, r, false) && !pb__fz_take(&o[1], &sv[1], sel, r, false) &&
                !pb__fz_take(&o[2], &sv[2], sel, r, true))
                rc = 0;
        }
        pb_mem_free(sel);
    } else if (rc == 0 && var == FZ_VALS) {
        pb_tensor_ref(&o[0], &sv[1]); /* S stays on the tape too: its pullback drops the values past the rank */
    } else if (rc == 0)
        for (int i = 0; i < 3; i++)
            pb_tensor_ref(&o[i], &sv[i]);
    return rc;
}

/* svd_trunc: the kept vectors' cotangents (r of them) padded to all k. */
static int FN(svd_pad)(int m, int n, int k, int r, T **c0, T **c2, const RT *r1, RT **dS)
{
    T *pu = *c0 ? FZ(zalloc)((size_t)m * k) : NULL, *pv = *c2 ? FZ(zalloc)((size_t)k * n) : NULL;
    if ((*c0 && !pu) || (*c2 && !pv) || (r1 && (*dS = FZ(ralloc)((size_t)k)) == NULL)) {
        pb__fz_free(pu);
        pb__fz_free(pv);
        return PB_ENOMEM;
    }
    if (pu)
        FZ(copy)(pu, m, *c0, m, m, r);
    if (pv)
        FZ(copy)(pv, k, *c2, r, r, n);
    if (*dS)
        pb__fz_move(RDT, *dS, r1, (size_t)r);
    pb__fz_free(*c0);
    pb__fz_free(*c2);
    *c0 = pu;
    *c2 = pv;
    return 0;
}

static int FN(svd_pull)(const pb_tapedata_t *t, const pb_tensor_t *cot, const fz_opts_t *op, T *dA, double *gauge,
                        pb_err_t *err)
{
    const int m = (int)t->in_meta[0].shape[0], n = (int)t->in_meta[0].shape[1], k = m < n ? m : n;
    const fz_variant_t var = (fz_variant_t)t->op->variant;
    const pb_tensor_t *s0 = &t->saved[0], *s1 = &t->saved[1], *s2 = &t->saved[2];
    const int nu = (int)s0->shape[1], nv = (int)s2->shape[0];
    T *c0 = NULL, *c2 = NULL;
    RT *r1 = NULL, *dS = NULL;
    int rc;
    (void)err;
    if (var == FZ_VALS) {
        /* ΔA = Uᵣ·diag(ΔSᵣ)·Vhᵣ: the pullback with ΔS alone.  Its rank cut
         * drops the values past the rank, which are not differentiable and
         * whose vectors are any basis LAPACK picked (contract section 4). */
        if ((rc = FZ(load_cot_r)(&cot[0], k, &r1)))
            goto out;
        rc = r1 ? FN(svd_pullback)(pb_tensor_data(s0), m, nu, pb_tensor_data(s1), k, pb_tensor_data(s2), nv, n, NULL,
                                   r1, NULL, dA, op->rank_atol, op->deg_atol, gauge)
                : 0;
        goto out;
    }
    const RT *S = s1->storage ? pb_tensor_data(s1) : NULL;
    int r = var == FZ_TRUNC ? (int)t->out_meta[1].shape[0] : k;
    int cu = var == FZ_TRUNC ? r : nu, cv = var == FZ_TRUNC ? r : nv;
    if ((rc = FZ(load_cot)(&cot[0], m, cu, &c0)) || (rc = FZ(load_cot_r)(&cot[1], r, &r1)) ||
        (rc = FZ(load_cot)(&cot[2], cv, n, &c2)))
        goto out;
    if (var == FZ_TRUNC && (rc = FN(svd_pad)(m, n, k, r, &c0, &c2, r1, &dS)))
        goto out;
    rc = FN(svd_pullback)(pb_tensor_data(s0), m, nu, S, k, pb_tensor_data(s2), nv, n, c0, dS ? dS : r1, c2, dA,
                          op->rank_atol, op->deg_atol, gauge);
out:
    pb__fz_free(c0);
    pb__fz_free(c2);
    pb__fz_free(r1);
    pb__fz_free(dS);
    return rc;
}

static int FN(svd_forward)(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    return FZ(forward)(c, tape, err, FN(svd_fwd));
}

static int FN(svd_reverse)(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                           pb_warnings_t *warn, pb_err_t *err)
{
    return FZ(reverse)(t, cot, grad, order, warn, err, FN(svd_pull));
}

/* The check's projections: values at the rank or below are not
 * differentiable; of the vectors, the phases (shared by u_j and v_j),
 * those past the rank and the rotations of the completions are dropped. */
static int FN(svd_fd)(const pb_call_t *c, pb_tensor_t *cot)
{
    const int m = (int)c->in[0].shape[0], n = (int)c->in[0].shape[1], k = m < n ? m : n;
    fz_opts_t op;
    if (FZ(fd_opts)(c, &op))
        return PB_ENOMEM;
    if (c->op->variant == FZ_VALS) {
        const RT *S = pb_tensor_data(&c->out[0]);
        RT *dS = pb_tensor_data(&cot[0]);
        int r = FN(svd_rank)(S, k, op.rank_atol);
        for (int i = r; r >= 0 && i < k; i++)
            dS[i] = 0;
        return r < 0 ? PB_ENOMEM : 0;
    }
    int rc = PB_ENOMEM;
    int cu = (int)c->out[0].shape[1], cv = (int)c->out[2].shape[0], rs = (int)c->out[1].shape[0];
    const RT *S = pb_tensor_data(&c->out[1]);
    int r = FN(svd_rank)(S, rs, op.rank_atol);
    if (r < 0)
        return PB_ENOMEM;
    T *X0 = FZ(out_arr)(c, 0), *X1 = FZ(out_arr)(c, 2);
    T *D0 = FZ(zalloc)((size_t)m * cu), *D1 = FZ(zalloc)((size_t)cv * n);
    double *ph = pb_mem_calloc((size_t)(r ? r : 1), sizeof(double));
    if (!(X0 && X1 && D0 && D1 && ph))
        goto out;
    FZ(load)(&cot[0], D0, m, cu);
    FZ(load)(&cot[2], D1, cv, n);
#if CPLX
    for (int j = 0; j < r; j++) { /* Im(v_jᴴΔv_j), v_j = Vh[j, :]ᴴ */
        T s = 0;
        for (int l = 0; l < n; l++)
            s += E(X1, cv, j, l) * CONJ(E(D1, cv, j, l));
        ph[j] = IM(s);
    }
#endif
    FZ(drop_phase)(X0, m, r, D0, ph);
    for (int j = r; j < (r < rs ? cu : rs); j++) /* past the rank */
        memset(D0 + (size_t)j * m, 0, (size_t)m * sizeof(T));
    for (int j = 0; j < n; j++)
        for (int i = r; i < (r < rs ? cv : rs); i++)
            E(D1, cv, i, j) = 0;
    if (r == rs && cu > rs) /* the completions: only their span(Uᵣ) part */
        FZ(onto_span)(X0, m, r, D0, rs, cu);
    if (r == rs && cv > rs) {
        T *Vt = FZ(zalloc)((size_t)n * cv), *dVt = FZ(zalloc)((size_t)n * cv);
        if (Vt && dVt) {
            FZ(adjoint)(X1, cv, n, Vt);
            FZ(adjoint)(D1, cv, n, dVt);
            FZ(onto_span)(Vt, n, r, dVt, rs, cv);
            FZ(adjoint)(dVt, n, cv, D1);
        }
        pb_mem_free(Vt);
        pb_mem_free(dVt);
    }
    if (r < rs) {
        RT *dS = pb_tensor_data(&cot[1]);
        for (int i = r; i < rs; i++)
            dS[i] = 0;
    }
    FZ(store_back)(&cot[0], D0, m, cu);
    FZ(store_back)(&cot[2], D1, cv, n);
    rc = 0;
out:
    pb_mem_free(X0);
    pb_mem_free(X1);
    pb_mem_free(D0);
    pb_mem_free(D1);
    pb_mem_free(ph);
    return rc;
}
