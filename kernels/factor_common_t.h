/* The per-dtype helpers the factorization families share (declared, with
 * what each does, in factor_common_p.h): a body for dtype_t.h, instantiated
 * by factor_common.c. */

T *FZ(zalloc)(size_t n)
{
    return pb__fz_zalloc(n, sizeof(T));
}

RT *FZ(ralloc)(size_t n)
{
    return pb__fz_zalloc(n, sizeof(RT));
}

int FZ(lapack_ld)(int m)
{
    size_t bytes = (size_t)m * sizeof(T);
    if (bytes < 512 || pb_exec_gpu() >= 0) /* a GPU's solvers: as they come */
        return LD(m);
    size_t ld = (((bytes + 63) / 64) | 1) * 64 / sizeof(T);
    return ld > INT_MAX ? m : (int)ld;
}

void FZ(copy)(T *dst, int ldd, const T *src, int lds, int m, int n)
{
    if (dst == src || m <= 0 || n <= 0)
        return;
    if (pb_exec_gpu() >= 0) { /* device memory: one strided pass */
        pb_loop_t L = {.rank = 2, .dim = {(uint64_t)m, (uint64_t)n}, .s = {{1, ldd}, {1, lds}}};
        pb_strided(DT, &L, dst, src, false, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, false);
        return;
    }
    for (int j = 0; j < n; j++)
        memcpy(dst + (size_t)j * (size_t)ldd, src + (size_t)j * (size_t)lds, (size_t)m * sizeof(T));
}

T *FZ(pad)(T *M, int m, int n, bool copy, int *ld)
{
    *ld = FZ(lapack_ld)(m);
    if (*ld == LD(m))
        return M;
    T *P = FZ(zalloc)((size_t)*ld * (size_t)(n > 0 ? n : 0));
    if (P && copy)
        FZ(copy)(P, *ld, M, m, m, n);
    return P;
}

int FZ(pad_here)(T *A, int m, int n)
{
    int ld = FZ(lapack_ld)(m);
    /* last column first: each moves up, past what is still to move */
    for (int j = n - 1; j > 0 && ld > m; j--)
        memmove(A + (size_t)j * (size_t)ld, A + (size_t)j * (size_t)m, (size_t)m * sizeof(T));
    return ld;
}

void FZ(unpad)(T *P, int ld, T *M, int m, int n, bool copy)
{
    if (P == M || P == NULL)
        return;
    if (copy)
        FZ(copy)(M, m, P, ld, m, n);
    pb_mem_free(P);
}

void FZ(gemm)(char ta, char tb, int m, int n, int k, T alpha, const T *a, int lda, const T *b, int ldb, T beta, T *c,
              int ldc)
{
    if (m <= 0 || n <= 0)
        return;
    /* Through pb_gemm_cm: a large product is split across idle workers. */
    pb_gemm_cm(DT, ta, tb, m, n, k < 0 ? 0 : k, (pb_scalar_t){RE(alpha), IM(alpha)}, a, LD(lda), b, LD(ldb),
               (pb_scalar_t){RE(beta), IM(beta)}, c, LD(ldc));
}

void FZ(adjoint)(const T *X, int m, int n, T *Y)
{
    if (m <= 0 || n <= 0)
        return;
    /* the cache-blocked pass (on the execution device), conjugating */
    pb_loop_t L = {.rank = 2, .dim = {(uint64_t)m, (uint64_t)n}, .s = {{n, 1}, {1, m}}};
    pb_strided(DT, &L, Y, X, CPLX, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, false);
}

double FZ(maxabs)(const T *M, int ld, int i0, int r, int j0, int c)
{
    return FZ_KERNEL(NULL, .kind = PB_GPU_FZ_AMAX, .m = r, .n = c, .ld = ld, .x = (T *)M + (size_t)j0 * ld + i0);
}

double FZ(maxantiherm)(const T *X, int n)
{
    return 0.5 * FZ_KERNEL(NULL, .kind = PB_GPU_FZ_HERM_GAP, .m = n, .n = n, .ld = n, .x = (T *)X);
}

void FZ(antiherm)(T *X, int n)
{
    FZ_KERNEL(NULL, .kind = PB_GPU_FZ_ANTIHERM, .m = n, .n = n, .ld = n, .x = X);
}

/* A C-ordered matrix goes through the cache-blocked permutation pass. */
void FZ(load)(const pb_tensor_t *t, T *dst, int m, int n)
{
    const T *src = pb_tensor_data(t);
    if (t->rank == 2 && t->order == 'C' && m > 1 && n > 1) {
        pb_loop_t L = {.rank = 2, .dim = {(uint64_t)m, (uint64_t)n}, .s = {{1, m}, {n, 1}}};
        pb_strided(DT, &L, dst, src, false, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, false);
    } else
        FZ(copy)(dst, m, src, m, m, n);
}

/* max|A_i| over n entries, in one pass that also notices NaN and Inf
 * (x − x is 0 for every finite x): *finite is false when there is one.
 * A complex modulus is taken from the squares where they neither overflow
 * (|A_i| above 2^511) nor lose bits below DBL_MIN, else again with every
 * entry scaled by a power of two first. */
static double FN(amax_host)(const T *A, int ld, int m, int n, bool *finite)
{
    double big = 0, top = 0, bad = 0;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            T x = E(A, ld, i, j);
            double re = RE(x), im = IM(x), a = re * re + im * im, t = fmax(fabs(re), fabs(im));
            big = a > big ? a : big;
            top = t > top ? t : top;
            bad += (re - re) + (im - im);
        }
    *finite = bad == 0;
    if (!CPLX || !*finite || top == 0)
        return top;
    if (big >= DBL_MIN && big <= DBL_MAX)
        return sqrt(big);
    int e;
    frexp(top, &e);
    big = 0;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            T x = E(A, ld, i, j);
            double re = ldexp(RE(x), -e), im = ldexp(IM(x), -e), a = re * re + im * im;
            big = a > big ? a : big;
        }
    return fmin(ldexp(sqrt(big), e), DBL_MAX);
}

/* The Frobenius norm of the m×n M (ld), from the squares of its real
 * parts in double: only a sum that overflows or leaves the normal range is
 * summed again, scaled by a power of two (no hypot per entry). */
static double FN(norm_host)(const T *M, int ld, int m, int n)
{
    double s = 0, top = 0;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            T x = E(M, ld, i, j);
            s += RE(x) * RE(x) + IM(x) * IM(x);
            top = fmax(top, fmax(fabs(RE(x)), fabs(IM(x))));
        }
    if ((s >= DBL_MIN && s <= DBL_MAX) || top == 0 || !isfinite(top) || s != s)
        return sqrt(s);
    int e;
    frexp(top, &e);
    s = 0;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            T x = E(M, ld, i, j);
            double re = ldexp(RE(x), -e), im = ldexp(IM(x), -e);
            s += re * re + im * im;
        }
    return ldexp(sqrt(s), e);
}

/* max over i <= j of |A_ij − conj(A_ji)| (A n×n), from the squares unless
 * they leave double's normal range. */
static double FN(herm_gap_host)(const T *A, int ld, int n)
{
    double worst = 0, top = 0;
    for (int j = 0; j < n; j++)
        for (int i = 0; i <= j; i++) {
            T d = E(A, ld, i, j) - CONJ(E(A, ld, j, i));
            double a = RE(d) * RE(d) + IM(d) * IM(d), t = fmax(fabs(RE(d)), fabs(IM(d)));
            worst = a > worst ? a : worst;
            top = t > top ? t : top;
        }
    if ((worst >= DBL_MIN && worst <= DBL_MAX) || top == 0)
        return sqrt(worst);
    worst = 0;
    for (int j = 0; j < n; j++)
        for (int i = 0; i <= j; i++) {
            T d = E(A, ld, i, j) - CONJ(E(A, ld, j, i));
            worst = fmax(worst, hypot(RE(d), IM(d)));
        }
    return worst;
}

static void FN(fix_phases_host)(T *V, int ld, int m, int c, T *ph)
{
    for (int j = 0; j < c; j++) {
        int best = 0;
        double big = -1;
        for (int i = 0; i < m; i++) { /* squared magnitudes: no hypot per entry */
            T v = E(V, ld, i, j);
            double a = RE(v) * RE(v) + IM(v) * IM(v);
            if (a > big) {
                big = a;
                best = i;
            }
        }
        big = sqrt(big);
        T p = 1;
        if (m > 0 && big > 0)
            p = (T)(CONJ(E(V, ld, best, j)) / big);
        for (int i = 0; i < m; i++)
            E(V, ld, i, j) *= p;
        if (m > 0)
            E(V, ld, best, j) = (T)ABS(E(V, ld, best, j)); /* exactly real */
        if (ph)
            ph[j] = CONJ(p);
    }
}

/* eigh's F-matrix on K (n×n): K_ij/(D_j − D_i), 0 inside a degenerate
 * block (|D_j − D_i| < deg) and on the diagonal (none of it without D),
 * which then gets dD when given; returns the largest |K_ij| zeroed (the
 * gauge part). */
static double FN(eigh_f_host)(T *K, int ld, int n, const RT *D, const RT *dD, double deg)
{
    double g = 0;
    for (int j = 0; j < n && D; j++)
        for (int i = 0; i < n; i++) {
            double gap = (double)D[j] - (double)D[i];
            if (fabs(gap) < deg || i == j) {
                g = fmax(g, ABS(E(K, ld, i, j)));
                E(K, ld, i, j) = 0;
            } else
                E(K, ld, i, j) = (T)(E(K, ld, i, j) / gap);
        }
    if (dD)
        for (int i = 0; i < n; i++)
            E(K, ld, i, i) += dD[i];
    return g;
}

/* The SVD's K in place of X (n×n, with Y: factor_svd_t.h's pullback says
 * what it is); returns the largest |X_ij + Y_ij| dropped as degenerate. */
static double FN(svd_f_host)(T *X, const T *Y, int ld, int n, const RT *S, const RT *dS, double deg)
{
    double g = 0;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < n; i++) {
            T a = E(X, ld, i, j), b = E(Y, ld, i, j);
            double dm = (double)S[j] - (double)S[i], dp = (double)S[j] + (double)S[i];
            T v = 0;
            if (fabs(dm) < deg)
                g = fmax(g, ABS(a + b));
            else
                v += (T)((a + b) / dm);
            if (fabs(dp) >= deg)
                v += (T)((a - b) / dp);
            E(X, ld, i, j) = v;
        }
    if (dS)
        for (int i = 0; i < n; i++)
            E(X, ld, i, i) += dS[i];
    return g;
}

void FZ(kernel_host)(const pb_gpu_fz_t *k, double out[2])
{
    T *x = k->x;
    const int m = k->m, n = k->n, ld = k->ld;
    bool finite = true;
    switch ((pb_gpu_fz_kind_t)k->kind) {
    case PB_GPU_FZ_AMAX:
        out[0] = FN(amax_host)(x, ld, m, n, &finite);
        out[1] = finite;
        break;
    case PB_GPU_FZ_NORM:
        out[0] = FN(norm_host)(x, ld, m, n);
        break;
    case PB_GPU_FZ_HERM_GAP:
        out[0] = FN(herm_gap_host)(x, ld, n);
        break;
    case PB_GPU_FZ_HERMITIZE:
        for (int j = 0; j < n; j++) {
            E(x, ld, j, j) = (T)RE(E(x, ld, j, j));
            for (int i = j + 1; i < n; i++) /* the lower triangle is what LAPACK reads */
                E(x, ld, i, j) = (T)((E(x, ld, i, j) + CONJ(E(x, ld, j, i))) * 0.5);
        }
        break;
    case PB_GPU_FZ_ANTIHERM:
        for (int j = 0; j < n; j++)
            for (int i = 0; i <= j; i++) {
                T a = E(x, ld, i, j), b = E(x, ld, j, i);
                E(x, ld, i, j) = (T)((a - CONJ(b)) * 0.5);
                E(x, ld, j, i) = (T)((b - CONJ(a)) * 0.5);
            }
        break;
    case PB_GPU_FZ_PHASES:
        FN(fix_phases_host)(x, ld, m, n, (T *)k->v);
        break;
    case PB_GPU_FZ_EIGH_F:
        out[0] = FN(eigh_f_host)(x, ld, n, k->w, k->v, k->param);
        break;
    case PB_GPU_FZ_ROWS_MUL:
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++)
                E(x, ld, i, j) *= ((const T *)k->v)[i];
        break;
    case PB_GPU_FZ_COLS_DIV:
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++)
                E(x, ld, i, j) /= ((const RT *)k->w)[j];
        break;
    case PB_GPU_FZ_ROWS_DIV:
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++)
                E(x, ld, i, j) /= ((const RT *)k->w)[i];
        break;
    case PB_GPU_FZ_SVD_F:
        out[0] = FN(svd_f_host)(x, k->y, ld, n, k->w, k->v, k->param);
        break;
    case PB_GPU_FZ_ROWS_SQRT_MUL:
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++)
                E(x, ld, i, j) = (T)(sqrt((double)((const RT *)k->w)[i]) * E(x, ld, i, j));
        break;
    case PB_GPU_FZ_COLS_MUL:
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++)
                E(x, ld, i, j) = (T)(E(x, ld, i, j) * ((const RT *)k->w)[j]);
        break;
    case PB_GPU_FZ_MIRROR_LOWER:
        for (int j = 0; j < n; j++) {
            E(x, ld, j, j) = (T)RE(E(x, ld, j, j));
            for (int i = j + 1; i < n; i++)
                E(x, ld, j, i) = CONJ(E(x, ld, i, j));
        }
        break;
    case PB_GPU_FZ_POLAR_F:
        for (int j = 0; j < n; j++)
            for (int i = 0; i < n; i++) {
                double s = (double)((const RT *)k->w)[i] + (double)((const RT *)k->w)[j];
                E(x, ld, i, j) = (T)(fabs(s) >= k->param ? E(x, ld, i, j) / s : 0);
            }
        break;
    case PB_GPU_FZ_COLS_PINV:
        for (int j = 0; j < n; j++) {
            RT w = ((const RT *)k->w)[j];
            for (int i = 0; i < m; i++)
                E(x, ld, i, j) = (T)(fabs((double)w) >= k->param ? E(x, ld, i, j) / w : 0);
        }
        break;
    }
}

static double FN(amax)(const T *A, size_t n, bool *finite)
{
    double o[2];
    FZ_KERNEL(o, .kind = PB_GPU_FZ_AMAX, .m = (int)n, .n = 1, .ld = (int)n, .x = (T *)A);
    *finite = o[1] != 0;
    return o[0];
}

int FZ(pow2_normalise)(T *M, int ld, int m, int n)
{
    const int lim = DT == PB_F32 || DT == PB_C64 ? 30 : 250;
    double top = 0;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++)
            top = fmax(top, fmax(fabs(RE(E(M, ld, i, j))), fabs(IM(E(M, ld, i, j)))));
    if (top == 0 || (top >= ldexp(1.0, -lim) && top <= ldexp(1.0, lim)))
        return 0;
    int e = ilogb(top);
    e = e < DBL_MIN_EXP - 1 ? DBL_MIN_EXP - 1 : e; /* 2^-e stays a double */
    FZ(pow2_mul)(M, ld, m, n, -e);
    return e;
}

void FZ(pow2_mul)(T *M, int ld, int m, int n, int e)
{
    const double s = ldexp(1.0, e);
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++)
            E(M, ld, i, j) *= (RT)s;
}

int FZ(load_cot)(const pb_tensor_t *t, int m, int n, T **out)
{
    *out = NULL;
    if (t->storage == NULL)
        return 0;
    if ((*out = FZ(zalloc)((size_t)m * (size_t)n)) == NULL)
        return PB_ENOMEM;
    FZ(load)(t, *out, m, n);
    return 0;
}

int FZ(load_cot_r)(const pb_tensor_t *t, int n, RT **out)
{
    *out = NULL;
    if (t->storage == NULL)
        return 0;
    if ((*out = FZ(ralloc)((size_t)n)) == NULL)
        return PB_ENOMEM;
    pb__fz_move(RDT, *out, pb_tensor_data(t), (size_t)n);
    return 0;
}

T *FZ(newmat)(pb_tensor_t *t, int m, int n)
{
    uint64_t sh[2] = {(uint64_t)m, (uint64_t)(n < 0 ? 1 : n)};
    if (pb_tensor_alloc(t, DT, n < 0 ? 1 : 2, sh, 'F', true))
        return NULL;
    return pb_tensor_data(t);
}

RT *FZ(newvec_r)(pb_tensor_t *t, int n)
{
    uint64_t sh[1] = {(uint64_t)n};
    return pb_tensor_alloc(t, RDT, 1, sh, 'F', true) ? NULL : pb_tensor_data(t);
}

void FZ(fix_phases)(T *V, int m, int c, T *ph)
{
    FZ_KERNEL(NULL, .kind = PB_GPU_FZ_PHASES, .m = m, .n = c, .ld = m, .x = V, .v = ph);
}

const RT *FZ(host_r)(const RT *v, int n, RT **copy)
{
    *copy = NULL;
    if (v == NULL || pb_exec_gpu() < 0)
        return v;
    /* zeros where a failure kept skips the copy (the wrapper reports it) */
    if ((*copy = pb_mem_calloc((size_t)(n > 0 ? n : 1), sizeof(RT))) != NULL)
        pb__exec_d2h(*copy, v, sizeof(RT) * (size_t)(n > 0 ? n : 0));
    return *copy;
}

int FZ(lapack_fail)(const char *what, lapack_int info, pb_err_t *err)
{
    const char *lib = pb_exec_gpu() >= 0 ? "cuSOLVER" : "LAPACK"; /* the solver that ran (cuda/exec.h) */
    if (info < 0)
        return pb_err_set(err, PB_EINTERNAL, NULL, "%s %c%s rejected argument %d", lib, LP_CHAR, what, (int)-info);
    int rc = pb_err_set(err, PB_ENUMERICAL, "inputs.A", "%s %c%s did not converge (info %d)", lib, LP_CHAR, what,
                        (int)info);
    err->info = info;
    err->has_info = 1;
    return rc;
}

/* The forward's start: A (m×n) as a fresh column-major array, NaN and
 * Inf refused, the options resolved, max|A_ij| kept in the tape. */
static int FN(input)(const pb_call_t *c, pb_tapedata_t *tape, T **A, fz_opts_t *op, pb_err_t *err)
{
    const pb_tensor_t *At = &c->in[0];
    const int m = (int)At->shape[0], n = (int)At->shape[1], k = m < n ? m : n;
    pb__fz_lapack_setup();
    T *a = FZ(zalloc)((size_t)FZ(lapack_ld)(m) * n); /* room to pad in place (FZ(pad_here)) */
    if (a == NULL)
        return pb_err_set(err, PB_ENOMEM, NULL, "out of memory in %s", c->op->name);
    FZ(load)(At, a, m, n);
    bool finite;
    double amax = FN(amax)(a, (size_t)m * n, &finite);
    if (!finite) {
        pb__fz_free(a);
        return pb_err_set(err, PB_ENUMERICAL, "inputs.A", "A has NaN or Inf entries: %s refuses them", c->op->name);
    }
    /* The pullbacks add and subtract singular values and eigenvalues, up
     * to √(m·n)·max|A_ij| each: near the dtype's largest number a sum
     * overflows, and a term 1/Inf = 0 made gradients silently wrong
     * (polar by 3% at half the largest number).  Refused where the
     * reverse would run, with an eighth of the range to spare. */
    double top = DT == PB_F32 || DT == PB_C64 ? FLT_MAX : DBL_MAX;
    if (tape && amax > top / (8.0 * sqrt((double)m * (double)n + 1.0))) {
        pb__fz_free(a);
        return pb_err_set(err, PB_ENUMERICAL, "inputs.A",
                          "%s: max|A_ij| = %.3g is too near the dtype's largest number for the reverse, whose "
                          "intermediate sums reach about √(m·n)·max|A_ij|; scale A down (the factors scale with it)",
                          c->op->name, amax);
    }
    pb__fz_resolve(c->op, c->opt, amax, DT, k, op);
    if (tape)
        tape->scalars[0] = amax;
    *A = a;
    return 0;
}

/* Frobenius norm of a tensor's entries (0 for an absent one). */
static double FN(tnorm)(const pb_tensor_t *t)
{
    if (t->storage == NULL || (t->dtype != RDT && t->dtype != CDT))
        return 0;
    int n = (int)pb_tensor_count(t);
    return pb__fz_kernel(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_NORM, .dtype = t->dtype, .m = n, .n = 1, .ld = n,
                                         .x = (void *)pb_tensor_data(t)},
                         NULL);
}

/* The reverse's start: the options as the forward resolved them, the
 * default gauge_atol from the cotangents' norm, and a zeroed dA (m×n). */
static int FN(rev_begin)(const pb_tapedata_t *t, const pb_tensor_t *cot, fz_opts_t *op, T **dA)
{
    const int m = (int)t->in_meta[0].shape[0], n = (int)t->in_meta[0].shape[1], k = m < n ? m : n;
    pb__fz_lapack_setup();
    pb__fz_resolve(t->op, t->opt, t->scalars[0], DT, k, op);
    double cn = 0;
    for (int i = 0; i < t->op->noutputs; i++)
        cn = hypot(cn, FN(tnorm)(&cot[i]));
    int gi = pb__fz_opt(t->op, "gauge_atol");
    if (gi < 0 || !t->opt[gi].given)
        op->gauge_atol = 10.0 * pow(DT == PB_F32 || DT == PB_C64 ? FLT_EPSILON : DBL_EPSILON, 0.75) * cn;
    *dA = FZ(zalloc)((size_t)m * n);
    return *dA ? 0 : PB_ENOMEM;
}

int FZ(forward)(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err, FZ(factor_fn) *factor)
{
    pb_tensor_t o[3] = {{0}}, sv[3] = {{0}};
    fz_opts_t op;
    T *A = NULL;
    int rc = FN(input)(c, tape, &A, &op, err);
    if (rc)
        return rc;
    rc = factor(c, A, &op, o, sv, err);
    pb__fz_free(A);
    return pb__fz_finish(c, tape, o, sv, rc, err);
}

int FZ(reverse)(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order, pb_warnings_t *warn,
                pb_err_t *err, FZ(pullback_fn) *pullback)
{
    if (!(t->wrt & 1u))
        return 0;
    fz_opts_t op;
    T *dA = NULL;
    double gauge = 0;
    int rc = FN(rev_begin)(t, cot, &op, &dA);
    if (rc == 0)
        rc = pullback(t, cot, &op, dA, &gauge, err);
    if (rc == 0 && !pb__fz_finite(dA, (size_t)t->in_meta[0].shape[0] * t->in_meta[0].shape[1], DT)) {
        bool cots = true; /* a NaN or Inf cotangent propagates, as it should */
        for (int i = 0; i < t->op->noutputs; i++)
            cots = cots && pb__fz_all_finite(&cot[i]);
        if (cots)
            rc = pb_err_set(err, PB_ENUMERICAL, "inputs.A",
                            "%s: the gradient is not finite though A and the cotangents are: an intermediate "
                            "result overflowed (max|A_ij| %.3g); scale A or the cotangents down",
                            t->op->name, t->scalars[0]);
    }
    return pb__fz_rev_finish(t, rc, dA, gauge, &op, grad, order, warn, err);
}

int FZ(fd_opts)(const pb_call_t *c, fz_opts_t *op)
{
    const int m = (int)c->in[0].shape[0], n = (int)c->in[0].shape[1], k = m < n ? m : n;
    T *A = FZ(zalloc)((size_t)m * n);
    if (A == NULL)
        return PB_ENOMEM;
    bool finite;
    FZ(load)(&c->in[0], A, m, n);
    double amax = FN(amax)(A, (size_t)m * n, &finite);
    pb__fz_free(A);
    pb__fz_resolve(c->op, c->opt, amax, DT, k, op);
    return 0;
}

void FZ(drop_phase)(const T *V, int m, int c, T *dV, const double *extra)
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

void FZ(onto_span)(const T *Q, int m, int p, T *dX, int j0, int c)
{
    if (j0 >= c)
        return;
    T *Y = FZ(zalloc)((size_t)(p ? p : 1) * (size_t)(c - j0)), *Z = FZ(zalloc)((size_t)m * (size_t)(c - j0));
    if (Y && Z) {
        const T one = 1, zero = 0;
        FZ(gemm)('C', 'N', p, c - j0, m, one, Q, m, dX + (size_t)j0 * m, m, zero, Y, p);
        FZ(gemm)('N', 'N', m, c - j0, p, one, Q, m, Y, p, zero, Z, m);
        memcpy(dX + (size_t)j0 * m, Z, (size_t)m * (size_t)(c - j0) * sizeof(T));
    }
    pb_mem_free(Y);
    pb_mem_free(Z);
}

void FZ(store_back)(pb_tensor_t *t, const T *src, int m, int n)
{
    T *dst = pb_tensor_data(t);
    if (t->rank == 2 && t->order == 'C')
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++)
                dst[(size_t)i * n + j] = E(src, m, i, j);
    else
        memcpy(dst, src, (size_t)m * n * sizeof(T));
}

T *FZ(out_arr)(const pb_call_t *c, int i)
{
    const pb_tensor_t *t = &c->out[i];
    int m = (int)t->shape[0], n = t->rank == 2 ? (int)t->shape[1] : 1;
    T *a = FZ(zalloc)((size_t)m * n);
    if (a)
        FZ(load)(t, a, m, n);
    return a;
}
