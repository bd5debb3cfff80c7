/* eigh (full, values, truncated), its pullback and the check's
 * projections for one dtype: a body for dtype_t.h, instantiated by
 * factor_eigh.c.  The tape keeps D and V (eigh_vals: V only); the
 * truncated form keeps the full decomposition, and its reverse chooses the
 * kept vectors again from it and pads the cotangents, so its pullback is
 * exact for the kept factors. */

#if CPLX
#define SYEVD LAPACK(heevd)
#else
#define SYEVD LAPACK(syevd)
#endif

/* A = V·diag(D)·Vᴴ for A (m×m) Hermitian within herm_atol (invalid_argument
 * otherwise); D ascending; with `vectors` A is overwritten by V, phases
 * fixed, else by syevd's work (the values alone: a third of the work). */
static int FN(eigh_factor)(T *A, int m, RT *D, double herm_atol, bool vectors, pb_err_t *err)
{
    double worst = FZ_KERNEL(NULL, .kind = PB_GPU_FZ_HERM_GAP, .m = m, .n = m, .ld = m, .x = A);
    if (worst > herm_atol)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs.A",
                          "A is not Hermitian: |A - Aᴴ| reaches %.3g, more than herm_atol %.3g", worst, herm_atol);
    FZ_KERNEL(NULL, .kind = PB_GPU_FZ_HERMITIZE, .m = m, .n = m, .ld = m, .x = A);
    lapack_int info = 0;
    if (m > 0 && pb_exec_gpu() >= 0) /* on a GPU (cuda/exec.h): its solver */
        info = pb__exec_syevd(DT, vectors, m, A, m, D);
    else if (m > 0)
        info = SYEVD(LAPACK_COL_MAJOR, vectors ? 'V' : 'N', 'L', m, A, LD(m), D);
    if (info)
        return FZ(lapack_fail)(CPLX ? "heevd" : "syevd", info, err);
    if (vectors)
        FZ(fix_phases)(A, m, m, NULL);
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
    T *K = FZ(zalloc)((size_t)m * m), *Y = FZ(zalloc)((size_t)m * m);
    if (K == NULL || Y == NULL) {
        pb__fz_free(K);
        pb__fz_free(Y);
        return PB_ENOMEM;
    }
    const T one = 1, zero = 0;
    double g = 0;
    if (dV) {
        FZ(gemm)('C', 'N', m, m, m, one, V, m, dV, m, zero, K, m);
        FZ(antiherm)(K, m);
    }
    /* K_ij/(D_j − D_i), 0 on the diagonal and in degenerate blocks (the
     * gauge part, measured), dD on the diagonal; with no dV, K is 0 and D
     * may be absent (eigh_vals keeps none) */
    g = FZ_KERNEL(NULL, .kind = PB_GPU_FZ_EIGH_F, .m = m, .n = m, .ld = m, .x = K, .w = dV ? D : NULL, .v = dD,
                  .param = deg_atol);
    FZ(gemm)('N', 'N', m, m, m, one, V, m, K, m, zero, Y, m);
    FZ(gemm)('N', 'C', m, m, m, one, Y, m, V, m, one, dA, m);
    pb__fz_free(K);
    pb__fz_free(Y);
    *gauge = g;
    return 0;
}

/* eigh_trunc keeps the largest |λ| above max(atol, rtol·max|λ|), at most
 * maxrank of them; idx gets their indices in ascending order of λ.  D may
 * be device memory (cuda/exec.h): the choice is made on a host copy. */
static int FN(eigh_keep)(const RT *Dx, int m, const fz_opts_t *o, int *idx)
{
    RT *host;
    const RT *D = FZ(host_r)(Dx, m, &host);
    if (D == NULL)
        return -1;
    double big = 0;
    for (int i = 0; i < m; i++)
        big = fmax(big, fabs((double)D[i]));
    double thr = fmax(o->atol, o->rtol * big);
    char *keep = pb_mem_calloc((size_t)(m ? m : 1), 1);
    if (keep == NULL) {
        pb_mem_free(host);
        return -1;
    }
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
    pb_mem_free(keep);
    pb_mem_free(host);
    return r;
}

/* ---- the entry points (factor_eigh.c's rows) -------------------------------- */

static int FN(eigh_fwd)(const pb_call_t *c, T *A, const fz_opts_t *op, pb_tensor_t *o, pb_tensor_t *sv,
                        pb_err_t *err)
{
    const int m = (int)c->in[0].shape[0];
    const fz_variant_t var = (fz_variant_t)c->op->variant;
    if (var == FZ_VALS && !c->taped) { /* no tape to make: the values alone */
        RT *D = FZ(newvec_r)(&o[0], m);
        return D ? FN(eigh_factor)(A, m, D, op->herm_atol, false, err) : PB_ENOMEM;
    }
    int *sel = pb_mem_alloc(sizeof(int) * (size_t)(m + 1));
    RT *D = FZ(newvec_r)(&sv[0], m);
    T *V = FZ(newmat)(&sv[1], m, m);
    int rc = PB_ENOMEM;
    if (sel && D && V) {
        FZ(copy)(V, m, A, m, m, m);
        rc = FN(eigh_factor)(V, m, D, op->herm_atol, true, err);
    }
    if (rc == 0 && var == FZ_TRUNC) {
        int r = FN(eigh_keep)(D, m, op, sel);
        if (r < 0 || pb__fz_take(&o[0], &sv[0], sel, r, false) || pb__fz_take(&o[1], &sv[1], sel, r, false))
            rc = PB_ENOMEM;
    } else if (rc == 0) {
        pb_tensor_ref(&o[0], &sv[0]);
        if (var == FZ_FULL)
            pb_tensor_ref(&o[1], &sv[1]);
        else
            pb_tensor_clear(&sv[0]); /* V·diag(ΔD)·Vᴴ needs no D */
    }
    pb_mem_free(sel);
    return rc;
}

/* The cotangents of the kept pairs, scattered into full-size ones (all m
 * pairs are kept but for eigh_trunc), then eigh's pullback. */
static int FN(eigh_pull)(const pb_tapedata_t *t, const pb_tensor_t *cot, const fz_opts_t *op, T *dA, double *gauge,
                         pb_err_t *err)
{
    (void)err;
    const int m = (int)t->in_meta[0].shape[0];
    const pb_tensor_t *s0 = &t->saved[0], *s1 = &t->saved[1];
    const RT *D = s0->storage ? pb_tensor_data(s0) : NULL;
    int *sel = pb_mem_alloc(sizeof(int) * (size_t)(m + 1)), r = m;
    T *c1 = NULL, *dV = NULL;
    RT *r1 = NULL, *dD = NULL;
    int rc = PB_ENOMEM;
    if (sel == NULL)
        goto out;
    for (int i = 0; i < m; i++)
        sel[i] = i;
    if (t->op->variant == FZ_TRUNC && (r = FN(eigh_keep)(D, m, op, sel)) < 0)
        goto out;
    if ((rc = FZ(load_cot_r)(&cot[0], r, &r1)))
        goto out;
    if (t->op->variant != FZ_VALS && (rc = FZ(load_cot)(&cot[1], m, r, &c1)))
        goto out;
    rc = PB_ENOMEM;
    if ((r1 && (dD = FZ(ralloc)((size_t)m)) == NULL) || (c1 && (dV = FZ(zalloc)((size_t)m * m)) == NULL))
        goto out;
    for (int j = 0, e; j < r; j = e) { /* a run of consecutive kept pairs at once */
        for (e = j + 1; e < r && sel[e] == sel[e - 1] + 1;)
            e++;
        if (dD)
            pb__fz_move(RDT, dD + sel[j], r1 + j, (size_t)(e - j));
        if (dV)
            FZ(copy)(dV + (size_t)sel[j] * m, m, c1 + (size_t)j * m, m, m, e - j);
    }
    rc = FN(eigh_pullback)(D, pb_tensor_data(s1), m, dD, dV, dA, op->deg_atol, gauge);
out:
    pb_mem_free(sel);
    pb__fz_free(c1);
    pb__fz_free(dV);
    pb__fz_free(r1);
    pb__fz_free(dD);
    return rc;
}

static int FN(eigh_forward)(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    return FZ(forward)(c, tape, err, FN(eigh_fwd));
}

static int FN(eigh_reverse)(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                            pb_warnings_t *warn, pb_err_t *err)
{
    return FZ(reverse)(t, cot, grad, order, warn, err, FN(eigh_pull));
}

/* The check's projection: the phases of the eigenvectors dropped. */
static int FN(eigh_fd)(const pb_call_t *c, pb_tensor_t *cot)
{
    const int m = (int)c->in[0].shape[0], r = (int)c->out[1].shape[1];
    T *X0 = FZ(out_arr)(c, 1), *D0 = FZ(zalloc)((size_t)m * r);
    int rc = PB_ENOMEM;
    if (X0 && D0) {
        FZ(load)(&cot[1], D0, m, r);
        FZ(drop_phase)(X0, m, r, D0, NULL);
        FZ(store_back)(&cot[1], D0, m, r);
        rc = 0;
    }
    pb_mem_free(X0);
    pb_mem_free(D0);
    return rc;
}

/* eigh takes Hermitian matrices: a direction is replaced by its Hermitian
 * part. */
static void FN(eigh_direction)(pb_tensor_t *dir)
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

#undef SYEVD
