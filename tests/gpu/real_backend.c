/* cuda.real: the real GPU backend (cuda/real.cu, the module the daemon
 * loads) on cuda:0, call by call: copies across staging chunks, zero, GEMM
 * (k = 0 too), bias_act, dz and row_sum for every activation, dtype and
 * order against kernels/act.h on the CPU (relative 1e-13 f64, 3e-6 f32; z
 * and row sums exactly), allocation from a thread that is not a worker,
 * the used-bytes count; strided (a rank-3 permutation with complex alpha,
 * beta and conj in c128 and f32, in place, the alpha = 0 rule, a traced
 * accumulation, rank 0, zero size) and dot (f64 and c64, conj both ways,
 * repeatable bit for bit) against host loops.  fz: every kind in all four dtypes against
 * host loops (ld > m, NaN padding left alone, the scaled and hypot passes, ties in phases,
 * zero sizes); syevd with and without vectors in all four dtypes (A·V = V·diag(w), VᴴV = I,
 * w ascending, bitwise repeatable, only the lower triangle read; n = 0).  The newer fz
 * kinds: phases' v (conj of the rounded phase, 1 - 0i for a zero column), rows_mul,
 * cols_div, rows_div and svd_f (degenerate pairs, dp = 0, with and without dS, y left
 * alone) in all four dtypes, ld > m.  The v4 kinds rows_sqrt_mul, cols_mul, mirror_lower,
 * polar_f and cols_pinv in all four dtypes, bit for bit against the CPU's expressions in the
 * element type (ld > m, polar_f's sums and cols_pinv's w on both sides of tol, zero sizes,
 * a missing w, a stray w and non-square x refused).  gesvd with and without vectors in f64, c128 and f32
 * on a tall 9×5 (lda 11) and a square 6×6 matrix (U·diag(s)·Vᴴ = A, UᴴU = I, VᴴV = I,
 * s descending and >= 0, the values alone the same; m = 0, n = 0; m < n refused).  Exits
 * 77 (skip) with "no CUDA device" when the module is missing or finds no GPU. */
#include <complex.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cuda/gpu.h"
#include "kernels/act.h"

#define NAME(sym, name, src) name,
#define SRC(sym, name, src) PB_ACT_FROM_##src,
static const char *const names[] = {PB_ACT_TABLE(NAME)};
static const enum pb_act_src srcs[] = {PB_ACT_TABLE(SRC)};

static const pb_gpu_backend_t *G;
static int fails;
#define CHECK(c) do { if (!(c)) { fails++; printf("FAIL %s:%d %s [%s]\n", __FILE__, __LINE__, #c, G->last_error()); } } while (0)
#define RC(call) do { int rc_ = (call); if (rc_) { fails++; printf("FAIL %s:%d %s -> %d [%s]\n", __FILE__, __LINE__, #call, rc_, G->last_error()); } } while (0)

static int close_enough(double got, double want, double tol)
{
    if (isnan(want)) return isnan(got);
    if (isinf(want)) return got == want;
    return fabs(got - want) <= tol * fmax(1.0, fabs(want));
}

static void *free_from_other_thread(void *p) { G->free(0, p); return NULL; }
static void *alloc_from_other_thread(void *pp) { return (void *)(long)G->alloc(0, 1000, (void **)pp); }

/* ---- strided and dot against host loops ---- */

static int cclose(double complex got, double complex want, double tol)
{
    return close_enough(creal(got), creal(want), tol) && close_enough(cimag(got), cimag(want), tol);
}

static void *dalloc_copy(const void *h, size_t bytes)
{
    void *d = NULL;
    RC(G->alloc(0, bytes, &d));
    if (h) RC(G->h2d(d, h, bytes));
    return d;
}

static pb_gpu_loop_t loop3(const unsigned long long *dim, const long long *s0, const long long *s1, const long long *s2)
{
    pb_gpu_loop_t L;
    memset(&L, 0, sizeof L);
    L.rank = 3;
    for (int k = 0; k < 3; k++) { L.dim[k] = dim[k]; L.s[0][k] = s0[k]; L.s[1][k] = s1[k]; L.s[2][k] = s2 ? s2[k] : 0; }
    return L;
}

static void strided_checks(void)
{
    /* a permutation of a rank-3 tensor, (3, 4, 5): dst in C order, src
     * stored as (5, 3, 4) in C order, src2 in F order; complex alpha and
     * beta, conj; c128, then f32 (alpha's and beta's imaginary parts and
     * conj ignored) */
    enum { D0 = 3, D1 = 4, D2 = 5, N = D0 * D1 * D2 };
    const unsigned long long dim[3] = {D0, D1, D2};
    const long long sd[3] = {D1 * D2, D2, 1}, ss[3] = {D1, 1, D0 * D1}, s2[3] = {1, D0, D0 * D1};
    pb_gpu_loop_t L = loop3(dim, sd, ss, s2);
    const double al[2] = {0.75, -1.25}, be[2] = {-0.5, 2.0};
    double complex zs[N], z2[N], zd[N];
    float fs[N], f2[N], fd[N];
    for (int i = 0; i < N; i++) {
        zs[i] = (i % 7 - 3) * 0.3 + I * (i % 5 - 2) * 0.7; z2[i] = (i % 3) * 1.5 - I * (i % 11) * 0.125;
        fs[i] = (float)((i % 9) * 0.25 - 1); f2[i] = (float)((i % 4) * 0.5 + 0.125);
    }
    for (int cj = 0; cj < 2; cj++) {
        void *ds = dalloc_copy(zs, sizeof zs), *d2 = dalloc_copy(z2, sizeof z2), *dd = dalloc_copy(NULL, sizeof zd);
        RC(G->strided(3, &L, dd, ds, cj, al, d2, be, 0));
        RC(G->d2h(zd, dd, sizeof zd));
        int bad = 0;
        for (int i = 0; i < D0; i++) for (int j = 0; j < D1; j++) for (int k = 0; k < D2; k++) {
            double complex a = al[0] + I * al[1], b = be[0] + I * be[1], x = zs[i * ss[0] + j * ss[1] + k * ss[2]];
            double complex w = a * (cj ? conj(x) : x) + b * z2[i * s2[0] + j * s2[1] + k * s2[2]];
            if (!cclose(zd[i * sd[0] + j * sd[1] + k * sd[2]], w, 1e-15) && bad++ < 3) printf("strided c128 conj %d (%d,%d,%d)\n", cj, i, j, k);
        }
        fails += bad;
        /* in place, dst = src with the same strides: c128 dst = alpha·op(dst) */
        pb_gpu_loop_t Li = L;
        for (int k = 0; k < 3; k++) Li.s[1][k] = Li.s[0][k];
        double complex before[N];
        memcpy(before, zd, sizeof zd);
        RC(G->strided(3, &Li, dd, dd, cj, al, NULL, be, 0));
        RC(G->d2h(zd, dd, sizeof zd));
        for (int i = 0; i < N; i++) { double complex x = before[i]; if (!cclose(zd[i], (al[0] + I * al[1]) * (cj ? conj(x) : x), 1e-15)) { CHECK(!"strided in place"); break; } }
        G->free(0, ds); G->free(0, d2); G->free(0, dd);

        ds = dalloc_copy(fs, sizeof fs); d2 = dalloc_copy(f2, sizeof f2); dd = dalloc_copy(NULL, sizeof fd);
        RC(G->strided(0, &L, dd, ds, cj, al, d2, be, 0));
        RC(G->d2h(fd, dd, sizeof fd));
        bad = 0;
        for (int i = 0; i < D0; i++) for (int j = 0; j < D1; j++) for (int k = 0; k < D2; k++) {
            float w = (float)al[0] * fs[i * ss[0] + j * ss[1] + k * ss[2]] + (float)be[0] * f2[i * s2[0] + j * s2[1] + k * s2[2]];
            if (!close_enough(fd[i * sd[0] + j * sd[1] + k * sd[2]], w, 1e-6) && bad++ < 3) printf("strided f32 conj %d (%d,%d,%d)\n", cj, i, j, k);
        }
        fails += bad;
        G->free(0, ds); G->free(0, d2); G->free(0, dd);
    }
    /* alpha = 0: src (all NaN) is not read: dst = beta·src2, or zeros */
    {
        double complex nan_src[N], junk[N];
        for (int i = 0; i < N; i++) { nan_src[i] = NAN + I * NAN; junk[i] = 7 - 3 * I; }
        const double zero[2] = {0, 0};
        void *ds = dalloc_copy(nan_src, sizeof nan_src), *d2 = dalloc_copy(z2, sizeof z2), *dd = dalloc_copy(junk, sizeof junk);
        RC(G->strided(3, &L, dd, ds, 1, zero, d2, be, 0));
        RC(G->d2h(zd, dd, sizeof zd));
        int bad = 0;
        for (int i = 0; i < D0; i++) for (int j = 0; j < D1; j++) for (int k = 0; k < D2; k++) {
            double complex w = (be[0] + I * be[1]) * z2[i * s2[0] + j * s2[1] + k * s2[2]];
            if (!cclose(zd[i * sd[0] + j * sd[1] + k * sd[2]], w, 1e-15) && bad++ < 3) printf("strided alpha=0 beta·src2 (%d,%d,%d)\n", i, j, k);
        }
        fails += bad;
        RC(G->strided(3, &L, dd, ds, 0, zero, NULL, NULL, 0));
        RC(G->d2h(zd, dd, sizeof zd));
        for (int i = 0; i < N; i++) if (zd[i] != 0 || signbit(creal(zd[i])) || signbit(cimag(zd[i]))) { CHECK(!"strided alpha=0 zeros"); break; }
        G->free(0, ds); G->free(0, d2); G->free(0, dd);
    }
    /* zero size: nothing happens */
    {
        const unsigned long long dz0[3] = {D0, 0, D2};
        pb_gpu_loop_t Lz = loop3(dz0, sd, ss, s2);
        RC(G->strided(3, &Lz, NULL, NULL, 0, al, NULL, be, 0));
        double out[2] = {1, 1};
        RC(G->dot(3, &Lz, NULL, 0, NULL, out));
        CHECK(out[0] == 0 && out[1] == 0);
    }
    /* accumulate a trace: dst[i] += alpha·op(A[i, j, j]) over (i, j), A
     * (6, 7, 7) in C order: dst strides (1, 0), src (49, 8); f64, c64
     * with conj, and the full trace into one element (dst strides 0) */
    {
        enum { TN = 6, TM = 7 };
        pb_gpu_loop_t T;
        memset(&T, 0, sizeof T);
        T.rank = 2; T.dim[0] = TN; T.dim[1] = TM;
        T.s[0][0] = 1; T.s[0][1] = 0; T.s[1][0] = TM * TM; T.s[1][1] = TM + 1;
        double A[TN * TM * TM], acc[TN], accw[TN];
        float complex Ac[TN * TM * TM], accc[TN], acccw[TN];
        for (int i = 0; i < TN * TM * TM; i++) { A[i] = sin(i * 0.37) * 3; Ac[i] = (float)cos(i * 0.21) + I * (float)sin(i * 0.11); }
        for (int i = 0; i < TN; i++) { acc[i] = accw[i] = i - 2.5; accc[i] = acccw[i] = (float)i * 0.5f - I * (float)i; }
        const double a2[2] = {1.5, 0.25};
        void *dA = dalloc_copy(A, sizeof A), *dacc = dalloc_copy(acc, sizeof acc);
        RC(G->strided(1, &T, dacc, dA, 1, a2, NULL, NULL, 1));
        RC(G->d2h(acc, dacc, sizeof acc));
        for (int i = 0; i < TN; i++) { for (int j = 0; j < TM; j++) accw[i] += a2[0] * A[i * TM * TM + j * (TM + 1)]; CHECK(close_enough(acc[i], accw[i], 1e-15)); }
        G->free(0, dA); G->free(0, dacc);
        dA = dalloc_copy(Ac, sizeof Ac); dacc = dalloc_copy(accc, sizeof accc);
        float complex fa = (float)a2[0] + I * (float)a2[1];
        RC(G->strided(2, &T, dacc, dA, 1, a2, NULL, NULL, 1));
        RC(G->d2h(accc, dacc, sizeof accc));
        for (int i = 0; i < TN; i++) { for (int j = 0; j < TM; j++) acccw[i] += fa * conjf(Ac[i * TM * TM + j * (TM + 1)]); CHECK(cclose(accc[i], acccw[i], 1e-6)); }
        /* the whole trace of each A[i] into accc[0]: dst strides 0, 0 */
        T.s[0][0] = 0;
        float complex tot = accc[0];
        RC(G->strided(2, &T, dacc, dA, 0, a2, NULL, NULL, 1));
        RC(G->d2h(accc, dacc, sizeof accc));
        for (int i = 0; i < TN; i++) for (int j = 0; j < TM; j++) tot += fa * Ac[i * TM * TM + j * (TM + 1)];
        CHECK(cclose(accc[0], tot, 1e-6));
        for (int i = 1; i < TN; i++) CHECK(accc[i] == acccw[i]);
        G->free(0, dA); G->free(0, dacc);
    }
    /* rank 0: one element, set and accumulated */
    {
        pb_gpu_loop_t R;
        memset(&R, 0, sizeof R);
        double x = 3.5, y = -1.25, r = 99;
        void *dx = dalloc_copy(&x, 8), *dy = dalloc_copy(&y, 8), *dr = dalloc_copy(&r, 8);
        const double a2[2] = {2, 0}, b2[2] = {4, 0};
        RC(G->strided(1, &R, dr, dx, 0, a2, dy, b2, 0));
        RC(G->d2h(&r, dr, 8));
        CHECK(r == 2 * 3.5 + 4 * -1.25);
        RC(G->strided(1, &R, dr, dx, 0, a2, NULL, NULL, 1));
        RC(G->d2h(&r, dr, 8));
        CHECK(r == 2 * 3.5 + 4 * -1.25 + 7);
        double out[2];
        RC(G->dot(1, &R, dx, 0, dy, out));
        CHECK(out[0] == 3.5 * -1.25 && out[1] == 0);
        G->free(0, dx); G->free(0, dy); G->free(0, dr);
    }
}

static void dot_checks(void)
{
    /* f64 over (n) with a reversed (stride -1), b every third element;
     * c64 over (517, 601) with a transposed against b, conj both ways;
     * sums against the host's in double, and bitwise repeatable */
    size_t n = 300007;
    double *a = malloc(n * 8), *b = malloc(3 * n * 8);
    for (size_t i = 0; i < n; i++) a[i] = sin((double)i) * 2;
    for (size_t i = 0; i < 3 * n; i++) b[i] = cos(i * 0.5) + 0.25;
    double want = 0;
    for (size_t i = 0; i < n; i++) want += a[n - 1 - i] * b[3 * i];
    void *da = dalloc_copy(a, n * 8), *db = dalloc_copy(b, 3 * n * 8);
    pb_gpu_loop_t L;
    memset(&L, 0, sizeof L);
    L.rank = 1; L.dim[0] = n; L.s[0][0] = -1; L.s[1][0] = 3;
    double out[2], again[2];
    RC(G->dot(1, &L, (double *)da + (n - 1), 1, db, out));
    RC(G->dot(1, &L, (double *)da + (n - 1), 1, db, again));
    CHECK(close_enough(out[0], want, 1e-11) && out[1] == 0);
    CHECK(memcmp(out, again, sizeof out) == 0);
    G->free(0, da); G->free(0, db); free(a); free(b);

    enum { M = 517, K = 601 };
    float complex *ca = malloc(sizeof(float complex) * M * K), *cb = malloc(sizeof(float complex) * M * K);
    for (int i = 0; i < M * K; i++) { ca[i] = (float)sin(i * 0.01) + I * (float)cos(i * 0.013); cb[i] = (float)(i % 17) * 0.125f - I * (float)(i % 5); }
    da = dalloc_copy(ca, sizeof(float complex) * M * K); db = dalloc_copy(cb, sizeof(float complex) * M * K);
    memset(&L, 0, sizeof L);
    L.rank = 2; L.dim[0] = M; L.dim[1] = K; L.s[0][0] = K; L.s[0][1] = 1; L.s[1][0] = 1; L.s[1][1] = M;
    for (int cj = 0; cj < 2; cj++) {
        double complex w = 0;
        for (int i = 0; i < M; i++) for (int j = 0; j < K; j++) {
            double complex x = ca[i * K + j], y = cb[i + j * M];
            w += (cj ? x : conj(x)) * y;
        }
        RC(G->dot(2, &L, da, cj, db, out));
        RC(G->dot(2, &L, da, cj, db, again));
        if (!cclose(out[0] + I * out[1], w, 1e-11)) { fails++; printf("dot c64 conj %d: %.17g%+.17gi want %.17g%+.17gi\n", cj, out[0], out[1], creal(w), cimag(w)); }
        CHECK(memcmp(out, again, sizeof out) == 0);
    }
    G->free(0, da); G->free(0, db); free(ca); free(cb);
}

/* ---- fz and syevd against host loops ----
 *
 * Host arrays of any dtype are read and written through double complex
 * (the imaginary part 0 and dropped for real dtypes); the references are
 * the CPU's formulas in double, compared per dtype (relative 2e-6 for
 * f32 and c64, 1e-14 for f64 and c128), exactly where the contract makes
 * a value exact.  Rows past m in a column (ld > m) hold NaN: no kind may
 * read or write them. */

static const size_t esz[4] = {4, 8, 8, 16};
static const double fz_tol[4] = {2e-6, 1e-14, 2e-6, 1e-14};

static double complex hget(int dt, const void *p, size_t k)
{
    switch (dt) {
    case 0: return ((const float *)p)[k];
    case 1: return ((const double *)p)[k];
    case 2: return ((const float complex *)p)[k];
    default: return ((const double complex *)p)[k];
    }
}

static void hset(int dt, void *p, size_t k, double complex v)
{
    switch (dt) {
    case 0: ((float *)p)[k] = (float)creal(v); break;
    case 1: ((double *)p)[k] = creal(v); break;
    case 2: ((float complex *)p)[k] = CMPLXF((float)creal(v), (float)cimag(v)); break;
    default: ((double complex *)p)[k] = v; break;
    }
}

static double rnd(unsigned *s)
{
    *s = *s * 1664525u + 1013904223u;
    return (double)(*s >> 8) / (1 << 23) - 1.0; /* [-1, 1) */
}

/* An m×n matrix of dtype dt (leading dimension ld), entries scale·[-1, 1)
 * in each part, NaN past row m. */
static void *hmat(int dt, int m, int n, int ld, unsigned seed, double scale)
{
    void *h = malloc(esz[dt] * (size_t)ld * (size_t)(n ? n : 1));
    for (int j = 0; j < n; j++)
        for (int i = 0; i < ld; i++) {
            double re = rnd(&seed) * scale, im = rnd(&seed) * scale;
            hset(dt, h, (size_t)j * ld + i, i < m ? CMPLX(re, im) : CMPLX(NAN, NAN));
        }
    return h;
}

/* Both parts of got within tol of want, relative to max(1, |want|); NaN
 * where want is (the padding). */
static int mclose(double complex got, double complex want, double tol)
{
    return isnan(creal(want)) ? isnan(creal(got)) : cclose(got, want, tol);
}

static int rclose(double got, double want, double tol)
{
    return fabs(got - want) <= tol * fabs(want);
}

/* dev (dtype dt, ld × n) against want (double complex, ld × n) */
static int same_mat(int dt, const void *dev, const double complex *want, int ld, int n, double tol, const char *what)
{
    void *h = malloc(esz[dt] * (size_t)ld * (size_t)n);
    RC(G->d2h(h, dev, esz[dt] * (size_t)ld * (size_t)n));
    int bad = 0;
    for (int k = 0; k < ld * n; k++)
        if (!mclose(hget(dt, h, k), want[k], tol) && bad++ < 3) {
            double complex g = hget(dt, h, k);
            printf("fz %s dt %d (%d,%d): %.17g%+.17gi want %.17g%+.17gi\n", what, dt, k % ld, k / ld, creal(g),
                   cimag(g), creal(want[k]), cimag(want[k]));
        }
    fails += bad;
    free(h);
    return bad == 0;
}

static double complex *as_z(int dt, const void *h, size_t count)
{
    double complex *z = malloc(sizeof *z * (count ? count : 1));
    for (size_t k = 0; k < count; k++)
        z[k] = hget(dt, h, k);
    return z;
}

static void fz_run(const pb_gpu_fz_t *k, double out[2])
{
    RC(G->fz(k, out));
}

static void fz_reductions(int dt)
{
    const double tol = fz_tol[dt];
    const int m = 5, n = 7, ld = 6;
    void *h = hmat(dt, m, n, ld, 11u + dt, 1.0);
    double complex *z = as_z(dt, h, (size_t)ld * n);
    void *d = dalloc_copy(h, esz[dt] * ld * n);
    double out[2] = {-1, -1}, amax = 0, ss = 0;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            amax = fmax(amax, cabs(z[j * ld + i]));
            ss += creal(z[j * ld + i]) * creal(z[j * ld + i]) + cimag(z[j * ld + i]) * cimag(z[j * ld + i]);
        }
    fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_AMAX, .dtype = dt, .m = m, .n = n, .ld = ld, .x = d}, out);
    if (!close_enough(out[0], amax, tol) || out[1] != 1) { fails++; printf("fz amax dt %d: %.17g (%g) want %.17g (1)\n", dt, out[0], out[1], amax); }
    fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_NORM, .dtype = dt, .m = m, .n = n, .ld = ld, .x = d}, out);
    if (!close_enough(out[0], sqrt(ss), tol)) { fails++; printf("fz norm dt %d: %.17g want %.17g\n", dt, out[0], sqrt(ss)); }
    /* a NaN, then an Inf, inside the matrix: not finite, and NaN norms */
    for (int c = 0; c < 2; c++) {
        void *h2 = malloc(esz[dt] * ld * n);
        memcpy(h2, h, esz[dt] * ld * n);
        hset(dt, h2, (size_t)(n - 1) * ld + (m - 1), c ? CMPLX(INFINITY, 0) : CMPLX(NAN, 0));
        RC(G->h2d(d, h2, esz[dt] * ld * n));
        fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_AMAX, .dtype = dt, .m = m, .n = n, .ld = ld, .x = d}, out);
        CHECK(out[1] == 0);
        fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_NORM, .dtype = dt, .m = m, .n = n, .ld = ld, .x = d}, out);
        CHECK(c ? out[0] == INFINITY : isnan(out[0]));
        free(h2);
    }
    G->free(0, d);
    free(h);
    free(z);
    /* zero size: nothing read, {0, 1} */
    out[0] = out[1] = 5;
    fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_AMAX, .dtype = dt, .m = 0, .n = 3, .ld = 1}, out);
    CHECK(out[0] == 0 && out[1] == 1);
    out[0] = 5;
    fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_NORM, .dtype = dt, .m = 4, .n = 0, .ld = 4}, out);
    CHECK(out[0] == 0);
    fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_HERMITIZE, .dtype = dt, .m = 0, .n = 0, .ld = 1}, NULL);
    /* c128 entries whose squares overflow, then underflow: the scaled
     * passes of amax and norm, and herm_gap's hypot pass */
    if (dt == 3)
        for (int c = 0; c < 2; c++) {
            double s = ldexp(1.0, c ? -600 : 600);
            h = hmat(dt, m, n, ld, 5u, s);
            z = as_z(dt, h, (size_t)ld * n);
            d = dalloc_copy(h, esz[dt] * ld * n);
            double big = 0, sc = 0;
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) {
                    double complex y = z[j * ld + i] / s;
                    big = fmax(big, cabs(z[j * ld + i]));
                    sc += creal(y) * creal(y) + cimag(y) * cimag(y);
                }
            fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_AMAX, .dtype = dt, .m = m, .n = n, .ld = ld, .x = d}, out);
            if (!rclose(out[0], big, 1e-15) || out[1] != 1) { fails++; printf("fz amax scaled %d: %.17g want %.17g\n", c, out[0], big); }
            fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_NORM, .dtype = dt, .m = m, .n = n, .ld = ld, .x = d}, out);
            if (!rclose(out[0], sqrt(sc) * s, 1e-14)) { fails++; printf("fz norm scaled %d: %.17g want %.17g\n", c, out[0], sqrt(sc) * s); }
            G->free(0, d);
            free(h);
            free(z);
            h = hmat(dt, n, n, n, 6u, s);
            z = as_z(dt, h, (size_t)n * n);
            d = dalloc_copy(h, esz[dt] * n * n);
            double gap = 0;
            for (int j = 0; j < n; j++)
                for (int i = 0; i <= j; i++)
                    gap = fmax(gap, cabs(z[j * n + i] - conj(z[i * n + j])));
            fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_HERM_GAP, .dtype = dt, .m = n, .n = n, .ld = n, .x = d}, out);
            if (!rclose(out[0], gap, 1e-15)) { fails++; printf("fz herm_gap hypot %d: %.17g want %.17g\n", c, out[0], gap); }
            G->free(0, d);
            free(h);
            free(z);
        }
}

/* The square kinds on a 7×7 matrix, ld 7 and 9. */
static void fz_square(int dt, int ld)
{
    enum { N = 7 };
    const double tol = fz_tol[dt];
    const int rdt = dt == 2 ? 0 : dt == 3 ? 1 : dt;
    void *h = hmat(dt, N, N, ld, 23u + dt + ld, 1.0);
    double complex *z = as_z(dt, h, (size_t)ld * N), *want = malloc(sizeof *want * ld * N);
    size_t bytes = esz[dt] * ld * N;
    void *d = dalloc_copy(h, bytes);
    double out[2];
#define Z(i, j) z[(size_t)(j) * ld + (i)]
#define W(i, j) want[(size_t)(j) * ld + (i)]
    /* herm_gap */
    double gap = 0;
    for (int j = 0; j < N; j++)
        for (int i = 0; i <= j; i++)
            gap = fmax(gap, cabs(Z(i, j) - conj(Z(j, i))));
    fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_HERM_GAP, .dtype = dt, .m = N, .n = N, .ld = ld, .x = d}, out);
    if (!close_enough(out[0], gap, tol)) { fails++; printf("fz herm_gap dt %d ld %d: %.17g want %.17g\n", dt, ld, out[0], gap); }
    /* hermitize: the upper triangle and the padding stay exactly */
    memcpy(want, z, sizeof *want * ld * N);
    for (int j = 0; j < N; j++) {
        W(j, j) = creal(Z(j, j));
        for (int i = j + 1; i < N; i++)
            W(i, j) = (Z(i, j) + conj(Z(j, i))) * 0.5;
    }
    fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_HERMITIZE, .dtype = dt, .m = N, .n = N, .ld = ld, .x = d}, NULL);
    same_mat(dt, d, want, ld, N, tol, "hermitize");
    void *back = malloc(bytes);
    RC(G->d2h(back, d, bytes));
    for (int j = 0; j < N; j++) {
        CHECK(cimag(hget(dt, back, (size_t)j * ld + j)) == 0);
        for (int i = 0; i < j; i++)
            CHECK(memcmp((char *)back + esz[dt] * ((size_t)j * ld + i), (char *)h + esz[dt] * ((size_t)j * ld + i), esz[dt]) == 0);
    }
    /* antiherm of the original, both triangles */
    RC(G->h2d(d, h, bytes));
    memcpy(want, z, sizeof *want * ld * N);
    for (int j = 0; j < N; j++)
        for (int i = 0; i < N; i++)
            W(i, j) = (Z(i, j) - conj(Z(j, i))) * 0.5;
    fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_ANTIHERM, .dtype = dt, .m = N, .n = N, .ld = ld, .x = d}, NULL);
    same_mat(dt, d, want, ld, N, tol, "antiherm");
    /* eigh_f: w ascending with an equal pair (5, 6) and a near one (2, 3),
     * v on the diagonal, deg 1e-3, then 1/256 (the near pair degenerate
     * too); v alone (no w: only the diagonal changes); w alone */
    const double wv[N] = {-2, -1, 0.5, 0.5 + 1.0 / 512, 1, 3, 3}, deg = 1e-3;
    const double deg2 = 1.0 / 256; /* (2, 3) degenerate only under this one */
    double hw[N], hv[N];
    float fw[N], fv[N];
    for (int i = 0; i < N; i++) { hw[i] = wv[i]; hv[i] = 0.125 * (i + 1); fw[i] = (float)hw[i]; fv[i] = (float)hv[i]; }
    size_t rb = rdt ? sizeof hw : sizeof fw;
    void *dw = dalloc_copy(rdt ? (void *)hw : (void *)fw, rb), *dv = dalloc_copy(rdt ? (void *)hv : (void *)fv, rb);
    for (int c = 0; c < 4; c++) {
        double dg = c == 1 ? deg2 : deg, g = 0;
        int usew = c != 2, usev = c != 3;
        RC(G->h2d(d, h, bytes));
        memcpy(want, z, sizeof *want * ld * N);
        for (int j = 0; j < N && usew; j++)
            for (int i = 0; i < N; i++) {
                double gp = wv[j] - wv[i];
                if (fabs(gp) < dg || i == j) {
                    g = fmax(g, cabs(Z(i, j)));
                    W(i, j) = 0;
                } else
                    W(i, j) = Z(i, j) / gp;
            }
        for (int i = 0; i < N && usev; i++)
            W(i, i) += hv[i];
        out[0] = -1;
        fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_EIGH_F, .dtype = dt, .m = N, .n = N, .ld = ld, .x = d,
                              .w = usew ? dw : NULL, .v = usev ? dv : NULL, .param = dg}, out);
        char what[32];
        snprintf(what, sizeof what, "eigh_f case %d", c);
        same_mat(dt, d, want, ld, N, tol, what);
        if (!close_enough(out[0], g, tol)) { fails++; printf("fz eigh_f dt %d case %d gauge %.17g want %.17g\n", dt, c, out[0], g); }
    }
#undef Z
#undef W
    G->free(0, d); G->free(0, dw); G->free(0, dv);
    free(h); free(z); free(want); free(back);
}

/* phases on a 7×5 matrix (ld 8): a random column, a zero column (stays
 * exactly), a tie between rows 2 and 5 (the first wins), random ones;
 * without v, then with it: v_j = conj(p_j) of the rounded p_j, p_j =
 * conj(x_best)/|x_best| (1 - 0i, bit for bit as the CPU's, for the zero
 * column). */
static void fz_phases(int dt, int with_v)
{
    enum { M = 7, C = 5, LD = 8 };
    const double tol = fz_tol[dt];
    void *h = hmat(dt, M, C, LD, 31u + dt, 0.5);
    for (int i = 0; i < M; i++)
        hset(dt, h, (size_t)LD + i, 0);
    hset(dt, h, 2 * LD + 2, dt >= 2 ? CMPLX(0.5, -0.75) : 0.75);
    hset(dt, h, 2 * LD + 5, dt >= 2 ? CMPLX(-0.75, 0.5) : -0.75);
    double complex *z = as_z(dt, h, (size_t)LD * C), *want = malloc(sizeof *want * LD * C), vw[C];
    memcpy(want, z, sizeof *want * LD * C);
    int bests[C];
    for (int j = 0; j < C; j++) {
        int best = 0;
        double big = -1;
        for (int i = 0; i < M; i++) {
            double complex v = z[j * LD + i];
            double a = creal(v) * creal(v) + cimag(v) * cimag(v);
            if (a > big) { big = a; best = i; }
        }
        bests[j] = best;
        double r = sqrt(big);
        double complex p = r > 0 ? conj(z[j * LD + best]) / r : 1;
        vw[j] = conj(p);
        for (int i = 0; i < M; i++)
            want[j * LD + i] = z[j * LD + i] * p;
        want[j * LD + best] = cabs(z[j * LD + best]);
    }
    CHECK(bests[2] == 2);
    void *d = dalloc_copy(h, esz[dt] * LD * C), *dv = NULL;
    if (with_v) {
        void *junk = hmat(dt, C, 1, C, 3u, 9.0);
        dv = dalloc_copy(junk, esz[dt] * C);
        free(junk);
    }
    RC(G->fz(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_PHASES, .dtype = dt, .m = M, .n = C, .ld = LD, .x = d, .v = dv}, NULL));
    same_mat(dt, d, want, LD, C, tol, with_v ? "phases (v)" : "phases");
    if (with_v) {
        same_mat(dt, dv, vw, C, 1, tol, "phases' v");
        void *hv = malloc(esz[dt] * C);
        RC(G->d2h(hv, dv, esz[dt] * C));
        double complex v1 = hget(dt, hv, 1); /* the zero column's */
        CHECK(creal(v1) == 1 && cimag(v1) == 0 && (dt < 2 || signbit(cimag(v1))));
        free(hv);
        G->free(0, dv);
    }
    void *back = malloc(esz[dt] * LD * C);
    RC(G->d2h(back, d, esz[dt] * LD * C));
    for (int j = 0; j < C; j++) {
        double complex b = hget(dt, back, (size_t)j * LD + bests[j]);
        CHECK(cimag(b) == 0 && creal(b) >= 0);
    }
    for (int i = 0; i < M; i++)
        CHECK(hget(dt, back, (size_t)LD + i) == 0);
    G->free(0, d);
    free(h); free(z); free(want); free(back);
}

/* rows_mul, cols_div and rows_div on a 5×4 matrix (ld 7: NaN padding
 * left alone): v of the dtype (m values), w real (n or m values, some
 * negative, none 0). */
static void fz_scale_kinds(int dt)
{
    enum { M = 5, C = 4, LD = 7 };
    const double tol = fz_tol[dt];
    const int rdt = dt == 2 ? 0 : dt == 3 ? 1 : dt;
    void *h = hmat(dt, M, C, LD, 51u + dt, 2.0), *hv = hmat(dt, M, 1, M, 52u + dt, 1.5);
    double complex *z = as_z(dt, h, (size_t)LD * C), *vz = as_z(dt, hv, M), *want = malloc(sizeof *want * LD * C);
    double wr[M] = {0.75, -1.25, 3.0, -0.375, 1.0 / 3};
    void *hw = malloc(esz[rdt] * M);
    for (int i = 0; i < M; i++)
        hset(rdt, hw, i, wr[i]);
    for (int i = 0; i < M; i++) /* as the device reads them */
        wr[i] = creal(hget(rdt, hw, i));
    size_t bytes = esz[dt] * LD * C;
    void *d = dalloc_copy(h, bytes), *dv = dalloc_copy(hv, esz[dt] * M), *dw = dalloc_copy(hw, esz[rdt] * M);
    for (int kind = 0; kind < 3; kind++) {
        static const char *const what[3] = {"rows_mul", "cols_div", "rows_div"};
        RC(G->h2d(d, h, bytes));
        memcpy(want, z, sizeof *want * LD * C);
        for (int j = 0; j < C; j++)
            for (int i = 0; i < M; i++)
                want[j * LD + i] = kind == 0 ? z[j * LD + i] * vz[i] : z[j * LD + i] / wr[kind == 1 ? j : i];
        pb_gpu_fz_t k = {.kind = kind == 0 ? PB_GPU_FZ_ROWS_MUL : kind == 1 ? PB_GPU_FZ_COLS_DIV : PB_GPU_FZ_ROWS_DIV,
                         .dtype = dt, .m = M, .n = C, .ld = LD, .x = d};
        if (kind == 0)
            k.v = dv;
        else
            k.w = dw;
        RC(G->fz(&k, NULL));
        same_mat(dt, d, want, LD, C, tol, what[kind]);
        /* zero size: nothing read */
        k.m = 0;
        k.x = NULL;
        RC(G->fz(&k, NULL));
    }
    G->free(0, d); G->free(0, dv); G->free(0, dw);
    free(h); free(hv); free(hw); free(z); free(vz); free(want);
}

/* svd_f on a 6×6 pair (ld 8, NaN padding): S descending with an equal
 * pair (1, 2), a near one (3, 4) and a 0 last (its dp = 0 too); deg
 * 1e-3, then 1/256 (the near pair degenerate too); with dS, then without;
 * y unchanged. */
static void fz_svd_f(int dt)
{
    enum { N = 6, LD = 8 };
    const double tol = fz_tol[dt];
    const int rdt = dt == 2 ? 0 : dt == 3 ? 1 : dt;
    const double sv[N] = {3, 2, 2, 1 + 1.0 / 512, 1, 0};
    void *hx = hmat(dt, N, N, LD, 61u + dt, 1.0), *hy = hmat(dt, N, N, LD, 62u + dt, 1.0);
    double complex *x = as_z(dt, hx, (size_t)LD * N), *y = as_z(dt, hy, (size_t)LD * N);
    double complex *want = malloc(sizeof *want * LD * N);
    void *hs = malloc(esz[rdt] * N), *hds = malloc(esz[rdt] * N);
    double ds[N];
    for (int i = 0; i < N; i++) {
        hset(rdt, hs, i, sv[i]);
        hset(rdt, hds, i, 0.25 * i - 0.5);
        ds[i] = creal(hget(rdt, hds, i));
    }
    size_t bytes = esz[dt] * LD * N;
    void *dx = dalloc_copy(hx, bytes), *dy = dalloc_copy(hy, bytes);
    void *dsv = dalloc_copy(hs, esz[rdt] * N), *dds = dalloc_copy(hds, esz[rdt] * N);
    for (int c = 0; c < 3; c++) {
        const double deg = c == 1 ? 1.0 / 256 : 1e-3;
        const int with_ds = c != 2;
        double g = 0, out[2] = {-1, -1};
        RC(G->h2d(dx, hx, bytes));
        memcpy(want, x, sizeof *want * LD * N);
        for (int j = 0; j < N; j++)
            for (int i = 0; i < N; i++) {
                double complex a = x[j * LD + i], b = y[j * LD + i], v = 0;
                double dm = sv[j] - sv[i], dp = sv[j] + sv[i];
                if (fabs(dm) < deg)
                    g = fmax(g, cabs(a + b));
                else
                    v += (a + b) / dm;
                if (fabs(dp) >= deg)
                    v += (a - b) / dp;
                want[j * LD + i] = v + (with_ds && i == j ? ds[i] : 0);
            }
        fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_SVD_F, .dtype = dt, .m = N, .n = N, .ld = LD, .x = dx, .y = dy,
                              .w = dsv, .v = with_ds ? dds : NULL, .param = deg}, out);
        char what[32];
        snprintf(what, sizeof what, "svd_f case %d", c);
        same_mat(dt, dx, want, LD, N, tol, what);
        if (!close_enough(out[0], g, tol) || out[1] != 1) { fails++; printf("fz svd_f dt %d case %d gauge %.17g want %.17g\n", dt, c, out[0], g); }
    }
    void *back = malloc(bytes);
    RC(G->d2h(back, dy, bytes));
    for (int k = 0; k < LD * N; k++)
        if (memcmp((char *)back + esz[dt] * k, (char *)hy + esz[dt] * k, esz[dt]) != 0) { CHECK(!"svd_f wrote y"); break; }
    /* zero size: {0, 1}, nothing read */
    double out[2] = {5, 5};
    fz_run(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_SVD_F, .dtype = dt, .m = 0, .n = 0, .ld = 1, .param = 1e-3}, out);
    CHECK(out[0] == 0 && out[1] == 1);
    G->free(0, dx); G->free(0, dy); G->free(0, dsv); G->free(0, dds);
    free(hx); free(hy); free(x); free(y); free(want); free(hs); free(hds); free(back);
}

/* ---- the stream kinds of module v4 ----
 *
 * The references are the CPU's expressions (kernels/factor_common_t.h's
 * FZ(kernel_host)) in the element type itself, one body for the four
 * dtypes, and the device must give the same bits: each is IEEE-rounded
 * arithmetic (in double where the CPU promotes) and a correctly rounded
 * sqrt, no libm function that may differ by an ulp. */
static float fz_id_s(float v) { return v; }
static double fz_id_d(double v) { return v; }

#define FZ_V4_REF(S, T, RT, RE, CONJ)                                                             \
    static void fz_ref_##S(int kind, void *xv, int m, int n, int ld, const void *wv, double param) \
    {                                                                                              \
        T *x = xv;                                                                                 \
        const RT *w = wv;                                                                          \
        for (int j = 0; j < n; j++)                                                                \
            for (int i = 0; i < m; i++) {                                                          \
                T *e = x + (size_t)j * ld + i;                                                     \
                double s;                                                                          \
                switch (kind) {                                                                    \
                case PB_GPU_FZ_ROWS_SQRT_MUL:                                                      \
                    *e = (T)(sqrt((double)w[i]) * *e);                                             \
                    break;                                                                         \
                case PB_GPU_FZ_COLS_MUL:                                                           \
                    *e = (T)(*e * w[j]);                                                           \
                    break;                                                                         \
                case PB_GPU_FZ_MIRROR_LOWER: /* x_jj, and x_ji from x_ij below it */               \
                    if (i == j)                                                                    \
                        *e = (T)RE(*e);                                                            \
                    else if (i > j)                                                                \
                        x[(size_t)i * ld + j] = CONJ(*e);                                          \
                    break;                                                                         \
                case PB_GPU_FZ_POLAR_F:                                                            \
                    s = (double)w[i] + (double)w[j];                                               \
                    *e = (T)(fabs(s) >= param ? *e / s : 0);                                       \
                    break;                                                                         \
                case PB_GPU_FZ_COLS_PINV:                                                          \
                    *e = (T)(fabs((double)w[j]) >= param ? *e / w[j] : 0);                         \
                    break;                                                                         \
                }                                                                                  \
            }                                                                                      \
    }
FZ_V4_REF(s, float, float, fz_id_s, fz_id_s)
FZ_V4_REF(d, double, double, fz_id_d, fz_id_d)
FZ_V4_REF(c, float complex, float, crealf, conjf)
FZ_V4_REF(z, double complex, double, creal, conj)
#undef FZ_V4_REF

/* Each v4 kind in dtype dt against fz_ref: rows_sqrt_mul, cols_mul and
 * cols_pinv on a 5×4 matrix (ld 7: the NaN padding left alone),
 * mirror_lower and polar_f on 6×6 ones (ld 6 and 8), bit for bit.  w:
 * rows_sqrt_mul's >= 0 with a 0, cols_mul's with a negative and a 0;
 * cols_pinv's |w_j| on both sides of each of two tols (1e-3: w_1 =
 * -1e-4 and w_3 = 0 zero their columns; 1e-5: w_3 alone), polar_f's sums
 * too (w_1 + w_4 = 0 under both, w_2 + w_3 = 1/512 under 1/256 alone).
 * Zero sizes (x NULL), and the refusals of real_fz's checks. */
static void fz_v4_kinds(int dt)
{
    static void (*const ref[4])(int, void *, int, int, int, const void *, double) = {fz_ref_s, fz_ref_d, fz_ref_c,
                                                                                        fz_ref_z};
    static const double w_rsm[5] = {0.75, 2, 1.0 / 3, 0, 10}, w_cm[4] = {0.75, -1.25, 1.0 / 3, 0};
    static const double w_pinv[4] = {0.75, -1e-4, -3.0 / 7, 0}, w_pol[6] = {-2, -1, -0.5, 0.5 + 1.0 / 512, 1, 1.0 / 3};
    static const struct {
        int kind, m, n, ld;
        const double *w;
        double param;
        const char *what;
    } cs[] = {
        {PB_GPU_FZ_ROWS_SQRT_MUL, 5, 4, 7, w_rsm, 0, "rows_sqrt_mul"},
        {PB_GPU_FZ_COLS_MUL, 5, 4, 7, w_cm, 0, "cols_mul"},
        {PB_GPU_FZ_COLS_PINV, 5, 4, 7, w_pinv, 1e-3, "cols_pinv 1e-3"},
        {PB_GPU_FZ_COLS_PINV, 5, 4, 7, w_pinv, 1e-5, "cols_pinv 1e-5"},
        {PB_GPU_FZ_MIRROR_LOWER, 6, 6, 6, NULL, 0, "mirror_lower ld 6"},
        {PB_GPU_FZ_MIRROR_LOWER, 6, 6, 8, NULL, 0, "mirror_lower ld 8"},
        {PB_GPU_FZ_POLAR_F, 6, 6, 6, w_pol, 1e-3, "polar_f 1e-3"},
        {PB_GPU_FZ_POLAR_F, 6, 6, 8, w_pol, 1.0 / 256, "polar_f 1/256"},
    };
    const int rdt = dt == 2 ? 0 : dt == 3 ? 1 : dt;
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        const int m = cs[c].m, n = cs[c].n, ld = cs[c].ld, kind = cs[c].kind;
        const int wn = kind == PB_GPU_FZ_ROWS_SQRT_MUL ? m : n;
        const size_t bytes = esz[dt] * (size_t)ld * n;
        void *h = hmat(dt, m, n, ld, 81u + 8 * dt + (unsigned)c, 1.5), *want = malloc(bytes), *got = malloc(bytes);
        void *hw = malloc(esz[rdt] * (size_t)wn), *dw = NULL;
        for (int i = 0; i < wn && cs[c].w; i++)
            hset(rdt, hw, i, cs[c].w[i]);
        memcpy(want, h, bytes);
        ref[dt](kind, want, m, n, ld, cs[c].w ? hw : NULL, cs[c].param);
        if (kind == PB_GPU_FZ_POLAR_F || kind == PB_GPU_FZ_COLS_PINV) { /* both sides of tol */
            int zeroed = 0;
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) {
                    double a = kind == PB_GPU_FZ_COLS_PINV ? creal(hget(rdt, hw, j))
                                                           : creal(hget(rdt, hw, i)) + creal(hget(rdt, hw, j));
                    zeroed += fabs(a) < cs[c].param;
                }
            CHECK(zeroed > 0 && zeroed < m * n);
        }
        void *d = dalloc_copy(h, bytes);
        if (cs[c].w)
            dw = dalloc_copy(hw, esz[rdt] * (size_t)wn);
        pb_gpu_fz_t k = {.kind = kind, .dtype = dt, .m = m, .n = n, .ld = ld, .x = d, .w = dw, .param = cs[c].param};
        RC(G->fz(&k, NULL));
        RC(G->d2h(got, d, bytes));
        int bad = 0;
        for (int e = 0; e < ld * n; e++)
            if (memcmp((char *)got + esz[dt] * e, (char *)want + esz[dt] * e, esz[dt]) != 0 && bad++ < 3) {
                double complex g = hget(dt, got, e), w = hget(dt, want, e);
                printf("fz %s dt %d (%d,%d): %.17g%+.17gi want %.17g%+.17gi\n", cs[c].what, dt, e % ld, e / ld,
                       creal(g), cimag(g), creal(w), cimag(w));
            }
        fails += bad;
        /* zero sizes, x NULL: nothing read */
        const int square = kind == PB_GPU_FZ_MIRROR_LOWER || kind == PB_GPU_FZ_POLAR_F;
        k.x = NULL;
        k.m = 0;
        k.n = square ? 0 : n;
        RC(G->fz(&k, NULL));
        if (!square) {
            k.m = m;
            k.n = 0;
            RC(G->fz(&k, NULL));
        }
        G->free(0, d);
        if (dw)
            G->free(0, dw);
        free(h); free(want); free(got); free(hw);
    }
    /* refused: a w kind without w, mirror_lower given one or a 4×3 x, polar_f 4×3; the device fine */
    void *d = dalloc_copy(NULL, esz[dt] * 12), *dw = dalloc_copy(NULL, esz[rdt] * 4);
    static const int needs_w[4] = {PB_GPU_FZ_ROWS_SQRT_MUL, PB_GPU_FZ_COLS_MUL, PB_GPU_FZ_POLAR_F, PB_GPU_FZ_COLS_PINV};
    for (int i = 0; i < 4; i++)
        CHECK(G->fz(&(pb_gpu_fz_t){.kind = needs_w[i], .dtype = dt, .m = 3, .n = 3, .ld = 4, .x = d, .param = 1e-3},
                    NULL) == PB_EINTERNAL);
    CHECK(G->fz(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_MIRROR_LOWER, .dtype = dt, .m = 3, .n = 3, .ld = 3, .x = d, .w = dw},
                NULL) == PB_EINTERNAL);
    CHECK(G->fz(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_MIRROR_LOWER, .dtype = dt, .m = 4, .n = 3, .ld = 4, .x = d},
                NULL) == PB_EINTERNAL);
    CHECK(G->fz(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_POLAR_F, .dtype = dt, .m = 4, .n = 3, .ld = 4, .x = d, .w = dw,
                               .param = 1e-3}, NULL) == PB_EINTERNAL);
    CHECK(!G->failed(0));
    G->free(0, d); G->free(0, dw);
}

static void fz_checks(void)
{
    for (int dt = 0; dt < 4; dt++) {
        fz_reductions(dt);
        fz_square(dt, 7);
        fz_square(dt, 9);
        fz_phases(dt, 0);
        fz_phases(dt, 1);
        fz_scale_kinds(dt);
        fz_svd_f(dt);
        fz_v4_kinds(dt);
    }
}

/* syevd on a random 7×7 Hermitian matrix, its upper triangle and the
 * rows past 7 garbage (only the lower triangle may be read), lda 7 and 9:
 * info 0, w ascending,
 * A·V = V·diag(w) and VᴴV = I (relative 1e-4 f32 and c64, 1e-12 f64 and
 * c128), the values alone the same, twice the same bits; n = 0. */
static void syevd_checks(void)
{
    enum { N = 7 };
    static const double tol[4] = {1e-4, 1e-12, 1e-4, 1e-12};
    for (int dt = 0; dt < 4; dt++)
        for (int c = 0; c < 2; c++) {
            const int lda = c ? 9 : N, rdt = dt == 2 ? 0 : dt == 3 ? 1 : dt;
            size_t bytes = esz[dt] * lda * N, rb = esz[rdt] * N;
            void *h = hmat(dt, N, N, lda, 41u + dt * 2 + c, 1.0);
            for (int j = 0; j < N; j++) /* finite garbage past row N: never read */
                for (int i = N; i < lda; i++)
                    hset(dt, h, (size_t)j * lda + i, 7e3);
            double complex A[N][N]; /* A[i][j], Hermitian, from the lower triangle */
            double anorm = 0;
            for (int j = 0; j < N; j++)
                for (int i = j; i < N; i++) {
                    double complex v = hget(dt, h, (size_t)j * lda + i);
                    if (i == j) { v = creal(v); hset(dt, h, (size_t)j * lda + i, v); }
                    else hset(dt, h, (size_t)i * lda + j, 1e3 + 1e3 * I); /* garbage above */
                    A[i][j] = v;
                    A[j][i] = conj(v);
                    anorm += (i == j ? 1 : 2) * (creal(v) * creal(v) + cimag(v) * cimag(v));
                }
            anorm = sqrt(anorm);
            void *da = dalloc_copy(h, bytes), *dw = dalloc_copy(NULL, rb);
            int info = -1;
            RC(G->syevd(dt, 1, N, da, lda, dw, &info));
            CHECK(info == 0);
            void *hv = malloc(bytes), *hw = malloc(rb);
            RC(G->d2h(hv, da, bytes));
            RC(G->d2h(hw, dw, rb));
            double w[N], res = 0, orth = 0;
            for (int i = 0; i < N; i++) w[i] = creal(hget(rdt, hw, i));
            for (int i = 0; i + 1 < N; i++) CHECK(w[i] <= w[i + 1]);
            for (int j = 0; j < N; j++)
                for (int i = 0; i < N; i++) {
                    double complex av = 0, vv = 0;
                    for (int k = 0; k < N; k++) {
                        av += A[i][k] * hget(dt, hv, (size_t)j * lda + k);
                        vv += conj(hget(dt, hv, (size_t)i * lda + k)) * hget(dt, hv, (size_t)j * lda + k);
                    }
                    res = fmax(res, cabs(av - w[j] * hget(dt, hv, (size_t)j * lda + i)));
                    orth = fmax(orth, cabs(vv - (i == j)));
                }
            if (res > tol[dt] * anorm || orth > tol[dt]) { fails++; printf("syevd dt %d lda %d: |AV - VW| %.3g (|A| %.3g), |VᴴV - I| %.3g\n", dt, lda, res, anorm, orth); }
            /* the same solve again: the same bits (deterministic mode) */
            void *hv2 = malloc(bytes), *hw2 = malloc(rb);
            RC(G->h2d(da, h, bytes));
            RC(G->syevd(dt, 1, N, da, lda, dw, &info));
            RC(G->d2h(hv2, da, bytes));
            RC(G->d2h(hw2, dw, rb));
            CHECK(info == 0 && memcmp(hw, hw2, rb) == 0);
            for (int j = 0; j < N; j++)
                CHECK(memcmp((char *)hv + esz[dt] * (size_t)j * lda, (char *)hv2 + esz[dt] * (size_t)j * lda, esz[dt] * N) == 0);
            /* the values alone */
            RC(G->h2d(da, h, bytes));
            RC(G->zero(dw, rb));
            info = -1;
            RC(G->syevd(dt, 0, N, da, lda, dw, &info));
            RC(G->d2h(hw2, dw, rb));
            CHECK(info == 0);
            for (int i = 0; i < N; i++)
                if (fabs(creal(hget(rdt, hw2, i)) - w[i]) > tol[dt] * anorm) { fails++; printf("syevd values dt %d lda %d: w[%d] %.17g want %.17g\n", dt, lda, i, creal(hget(rdt, hw2, i)), w[i]); }
            G->free(0, da); G->free(0, dw);
            free(h); free(hv); free(hw); free(hv2); free(hw2);
        }
    int info = -1;
    RC(G->syevd(1, 1, 0, NULL, 1, NULL, &info));
    CHECK(info == 0);
}

/* gesvd in f64, c128 and f32 on a tall 9×5 matrix (lda 11, the rows past
 * 9 garbage) and a square 6×6 one (lda 6): info 0, s descending and >= 0,
 * U·diag(s)·Vᴴ = A, UᴴU = I and VᴴVᴴᴴ = I (relative 1e-12 f64 and c128,
 * 1e-4 f32; U and Vᴴ with leading dimensions past m and n in the tall
 * case), the values alone the same; m = 0 and n = 0; m < n refused. */
static void gesvd_checks(void)
{
    static const int dts[3] = {1, 3, 0};
    static const double tol[4] = {1e-4, 1e-12, 1e-4, 1e-12};
    for (int t = 0; t < 3; t++)
        for (int c = 0; c < 2; c++) {
            const int dt = dts[t], rdt = dt == 2 ? 0 : dt == 3 ? 1 : dt;
            const int m = c ? 6 : 9, n = c ? 6 : 5, lda = c ? 6 : 11, ldu = c ? m : m + 2, ldvt = c ? n : n + 1;
            void *h = hmat(dt, m, n, lda, 71u + dt * 2 + c, 1.0);
            for (int j = 0; j < n; j++) /* finite garbage past row m: never read */
                for (int i = m; i < lda; i++)
                    hset(dt, h, (size_t)j * lda + i, 5e3);
            double anorm = 0;
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) {
                    double complex v = hget(dt, h, (size_t)j * lda + i);
                    anorm += creal(v) * creal(v) + cimag(v) * cimag(v);
                }
            anorm = sqrt(anorm);
            size_t ab = esz[dt] * lda * n, ub = esz[dt] * ldu * n, vb = esz[dt] * ldvt * n, sb = esz[rdt] * n;
            void *da = dalloc_copy(h, ab), *ds = dalloc_copy(NULL, sb), *du = dalloc_copy(NULL, ub), *dvt = dalloc_copy(NULL, vb);
            int info = -1;
            RC(G->gesvd(dt, 1, m, n, da, lda, ds, du, ldu, dvt, ldvt, &info));
            CHECK(info == 0);
            void *hu = malloc(ub), *hvt = malloc(vb), *hs = malloc(sb), *hs2 = malloc(sb);
            RC(G->d2h(hu, du, ub));
            RC(G->d2h(hvt, dvt, vb));
            RC(G->d2h(hs, ds, sb));
            double sv[9];
            for (int i = 0; i < n; i++) sv[i] = creal(hget(rdt, hs, i));
            for (int i = 0; i < n; i++) CHECK(sv[i] >= 0 && (i == 0 || sv[i] <= sv[i - 1]));
            double res = 0, uo = 0, vo = 0;
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) { /* (U·diag(s)·Vᴴ)_ij */
                    double complex r = 0;
                    for (int k = 0; k < n; k++)
                        r += hget(dt, hu, (size_t)k * ldu + i) * sv[k] * hget(dt, hvt, (size_t)j * ldvt + k);
                    res = fmax(res, cabs(r - hget(dt, h, (size_t)j * lda + i)));
                }
            for (int j = 0; j < n; j++)
                for (int i = 0; i < n; i++) {
                    double complex uu = 0, vv = 0;
                    for (int k = 0; k < m; k++) /* (UᴴU)_ij */
                        uu += conj(hget(dt, hu, (size_t)i * ldu + k)) * hget(dt, hu, (size_t)j * ldu + k);
                    for (int k = 0; k < n; k++) /* (Vᴴ·V)_ij: the rows of Vᴴ */
                        vv += hget(dt, hvt, (size_t)k * ldvt + i) * conj(hget(dt, hvt, (size_t)k * ldvt + j));
                    uo = fmax(uo, cabs(uu - (i == j)));
                    vo = fmax(vo, cabs(vv - (i == j)));
                }
            if (res > tol[dt] * anorm || uo > tol[dt] || vo > tol[dt]) { fails++; printf("gesvd dt %d %dx%d: |USVh - A| %.3g (|A| %.3g), |UᴴU - I| %.3g, |VᴴV - I| %.3g\n", dt, m, n, res, anorm, uo, vo); }
            /* the values alone, from A again */
            RC(G->h2d(da, h, ab));
            RC(G->zero(ds, sb));
            info = -1;
            RC(G->gesvd(dt, 0, m, n, da, lda, ds, NULL, 1, NULL, 1, &info));
            CHECK(info == 0);
            RC(G->d2h(hs2, ds, sb));
            for (int i = 0; i < n; i++)
                if (fabs(creal(hget(rdt, hs2, i)) - sv[i]) > tol[dt] * anorm) { fails++; printf("gesvd values dt %d %dx%d: s[%d] %.17g want %.17g\n", dt, m, n, i, creal(hget(rdt, hs2, i)), sv[i]); }
            G->free(0, da); G->free(0, ds); G->free(0, du); G->free(0, dvt);
            free(h); free(hu); free(hvt); free(hs); free(hs2);
        }
    /* empty: info 0, nothing read or written */
    int info = -1;
    RC(G->gesvd(1, 1, 0, 0, NULL, 1, NULL, NULL, 1, NULL, 1, &info));
    CHECK(info == 0);
    info = -1;
    RC(G->gesvd(3, 1, 4, 0, NULL, 4, NULL, NULL, 4, NULL, 1, &info));
    CHECK(info == 0);
    info = -1;
    RC(G->gesvd(0, 0, 4, 0, NULL, 4, NULL, NULL, 1, NULL, 1, &info));
    CHECK(info == 0);
    /* wide: refused (the caller transposes), the device still fine */
    void *da = dalloc_copy(NULL, 8 * 3 * 5), *ds = dalloc_copy(NULL, 8 * 3), *du = dalloc_copy(NULL, 8 * 3 * 3), *dvt = dalloc_copy(NULL, 8 * 5 * 5);
    info = -7;
    CHECK(G->gesvd(1, 1, 3, 5, da, 3, ds, du, 3, dvt, 5, &info) == PB_EINTERNAL);
    CHECK(G->gesvd(1, 0, 3, 5, da, 3, ds, NULL, 1, NULL, 1, &info) == PB_EINTERNAL);
    CHECK(info == -7 && !G->failed(0));
    G->free(0, da); G->free(0, ds); G->free(0, du); G->free(0, dvt);
}

int main(void)
{
    const char *why;
    G = pb__gpu_real(&why);
    int n = G ? G->count() : 0;
    if (n <= 0) {
        printf("no CUDA device: %s\n", G ? G->last_error() : why);
        return 77;
    }
    pb_gpu_info_t info;
    RC(G->info(0, &info));
    printf("device 0: %s, %zu bytes\n", info.name, info.total_bytes);
    RC(G->thread_init(0));
    /* copies across several staging chunks */
    size_t nb = (size_t)10 << 20 | 123;
    unsigned char *h = malloc(nb), *back = malloc(nb);
    for (size_t i = 0; i < nb; i++) h[i] = (unsigned char)(i * 2654435761u >> 13);
    void *d = NULL;
    RC(G->alloc(0, nb, &d));
    CHECK(G->used(0) == nb);
    RC(G->h2d(d, h, nb));
    memset(h, 0, 16); /* h2d may return before its DMA: staging holds the data */
    RC(G->d2h(back, d, nb));
    for (size_t i = 16; i < nb; i++) if (back[i] != h[i]) { CHECK(!"h2d/d2h round trip"); break; }
    RC(G->zero(d, nb));
    RC(G->d2h(back, d, nb));
    for (size_t i = 0; i < nb; i++) if (back[i]) { CHECK(!"zero"); break; }
    G->free(0, d);
    CHECK(G->used(0) == 0);
    /* gemm f64 3x2 = (3x4)(4x2), and k = 0 */
    int m = 3, k = 4, nn = 2;
    double A[12], B[8], C[6], Cw[6], one[2] = {1, 0}, zero2[2] = {0, 0}, two[2] = {2, 0};
    for (int i = 0; i < 12; i++) A[i] = i * 0.5 - 1;
    for (int i = 0; i < 8; i++) B[i] = 1.0 / (i + 1);
    for (int i = 0; i < m; i++) for (int j = 0; j < nn; j++) { double s = 0; for (int l = 0; l < k; l++) s += A[i + l * m] * B[l + j * k]; Cw[i + j * m] = s; }
    void *dA, *dB, *dC;
    RC(G->alloc(0, sizeof A, &dA)); RC(G->alloc(0, sizeof B, &dB)); RC(G->alloc(0, sizeof C, &dC));
    RC(G->h2d(dA, A, sizeof A)); RC(G->h2d(dB, B, sizeof B));
    RC(G->gemm(1, 'N', 'N', m, nn, k, one, dA, m, dB, k, zero2, dC, m));
    RC(G->d2h(C, dC, sizeof C));
    for (int i = 0; i < 6; i++) CHECK(close_enough(C[i], Cw[i], 1e-14));
    RC(G->gemm(1, 'N', 'N', m, nn, 0, one, dA, m, dB, k, two, dC, m));
    RC(G->d2h(C, dC, sizeof C));
    for (int i = 0; i < 6; i++) CHECK(C[i] == 2 * Cw[i]);
    for (int i = 0; i < 6; i++) C[i] = NAN;
    RC(G->h2d(dC, C, sizeof C));
    RC(G->gemm(1, 'N', 'N', m, nn, 0, one, dA, m, dB, k, zero2, dC, m));
    RC(G->d2h(C, dC, sizeof C));
    for (int i = 0; i < 6; i++) CHECK(C[i] == 0);
    float Af[12], Bf[8], Cf[6];
    for (int i = 0; i < 12; i++) Af[i] = (float)A[i];
    for (int i = 0; i < 8; i++) Bf[i] = (float)B[i];
    RC(G->h2d(dA, Af, sizeof Af)); RC(G->h2d(dB, Bf, sizeof Bf));
    RC(G->gemm(0, 'T', 'N', 4, nn, 3, one, dA, m, dB, 3, zero2, dC, 4)); /* (4x3)·(3x2) */
    RC(G->d2h(Cf, dC, 8 * sizeof(float)));
    for (int i = 0; i < 4; i++) for (int j = 0; j < 2; j++) { double s = 0; for (int l = 0; l < 3; l++) s += (double)Af[l + i * 3] * Bf[l + j * 3]; CHECK(close_enough(Cf[i + j * 4], s, 1e-6)); }
    G->free(0, dA); G->free(0, dB); G->free(0, dC);
    /* bias_act, dz, row_sum against act.h on the CPU */
    size_t out = 37, batch = 301, tot = out * batch;
    for (int dt = 0; dt < 2; dt++) for (int act = 0; act < PB_NACTS; act++) for (int o = 0; o < 2; o++) {
        char order = o ? 'F' : 'C';
        size_t es = dt ? 8 : 4;
        double *y = malloc(tot * 8), *bb = malloc(out * 8), *yb = malloc(tot * 8);
        for (size_t i = 0; i < tot; i++) { y[i] = (double)((i * 7919) % 2001) / 50.0 - 20; yb[i] = 1 + (double)(i % 13) / 7; }
        for (size_t i = 0; i < out; i++) bb[i] = (double)i / 10 - 1.5;
        y[5] = NAN; y[6] = INFINITY; y[7] = -INFINITY;
        void *hy = malloc(tot * es), *hb = malloc(out * es), *hyb = malloc(tot * es), *r1 = malloc(tot * es), *r2 = malloc(tot * es), *rs = malloc(out * es);
        for (size_t i = 0; i < tot; i++) { if (dt) { ((double *)hy)[i] = y[i]; ((double *)hyb)[i] = yb[i]; } else { ((float *)hy)[i] = (float)y[i]; ((float *)hyb)[i] = (float)yb[i]; } }
        for (size_t i = 0; i < out; i++) { if (dt) ((double *)hb)[i] = bb[i]; else ((float *)hb)[i] = (float)bb[i]; }
        void *dy, *dz, *db, *dyb, *dsum;
        RC(G->alloc(0, tot * es, &dy)); RC(G->alloc(0, tot * es, &dz)); RC(G->alloc(0, out * es, &db)); RC(G->alloc(0, tot * es, &dyb)); RC(G->alloc(0, out * es, &dsum));
        RC(G->h2d(dy, hy, tot * es)); RC(G->h2d(db, hb, out * es)); RC(G->h2d(dyb, hyb, tot * es));
        RC(G->bias_act(dt, act, dy, dz, db, out, batch, order));
        RC(G->d2h(r1, dy, tot * es)); RC(G->d2h(r2, dz, tot * es));
        int bad = 0;
        for (size_t idx = 0; idx < tot && bad < 3; idx++) {
            size_t i = order == 'C' ? idx / batch : idx % out;
            double zw, vw, zg, vg;
            if (dt) { zw = y[idx] + bb[i]; vw = pb_act_value(act, zw); zg = ((double *)r2)[idx]; vg = ((double *)r1)[idx]; }
            else { float z = (float)y[idx] + (float)bb[i]; zw = z; vw = pb_act_valuef(act, z); zg = ((float *)r2)[idx]; vg = ((float *)r1)[idx]; }
            if (!close_enough(zg, zw, 0) || !close_enough(vg, vw, dt ? 1e-13 : 3e-6)) { bad++; printf("bias_act dt %d act %s order %c idx %zu: z %g/%g value %.17g want %.17g\n", dt, names[act], order, idx, zg, zw, vg, vw); }
        }
        fails += bad;
        /* dz in place over yb with s = the saved values, then row sums */
        void *s = srcs[act] == PB_ACT_FROM_Y ? dy : srcs[act] == PB_ACT_FROM_Z ? dz : NULL;
        RC(G->dz(dt, act, dyb, dyb, s, out, batch, order));
        RC(G->row_sum(dt, dyb, dsum, out, batch, order));
        RC(G->d2h(r2, dyb, tot * es)); RC(G->d2h(rs, dsum, out * es));
        void *sh = s == dy ? r1 : NULL;
        void *zh = malloc(tot * es);
        if (s == dz) { RC(G->d2h(zh, dz, tot * es)); sh = zh; }
        double *sum = calloc(out, 8);
        bad = 0;
        for (size_t idx = 0; idx < tot; idx++) {
            size_t i = order == 'C' ? idx / batch : idx % out;
            double w;
            if (dt) w = sh ? yb[idx] * pb_act_deriv(act, ((double *)sh)[idx]) : yb[idx];
            else w = sh ? (float)yb[idx] * pb_act_derivf(act, ((float *)sh)[idx]) : (float)yb[idx];
            double g = dt ? ((double *)r2)[idx] : ((float *)r2)[idx];
            sum[i] += g; /* in j order for both layouts */
            if (!close_enough(g, w, dt ? 1e-12 : 3e-5) && bad++ < 3) printf("dz dt %d act %s order %c idx %zu: %.17g want %.17g\n", dt, names[act], order, idx, g, w);
        }
        for (size_t i = 0; i < out; i++) { double g = dt ? ((double *)rs)[i] : ((float *)rs)[i], w = dt ? sum[i] : (float)sum[i]; if (!(g == w || (isnan(g) && isnan(w))) && bad++ < 6) printf("row_sum dt %d order %c row %zu: %.17g want %.17g\n", dt, order, i, g, w); }
        fails += bad;
        G->free(0, dy); G->free(0, dz); G->free(0, db); G->free(0, dyb); G->free(0, dsum);
        free(y); free(bb); free(yb); free(hy); free(hb); free(hyb); free(r1); free(r2); free(rs); free(zh); free(sum);
    }
    RC(G->sync());
    CHECK(G->used(0) == 0);
    /* alloc and free from a thread that is not a worker */
    void *p = NULL;
    pthread_t t;
    pthread_create(&t, NULL, alloc_from_other_thread, &p); void *ret; pthread_join(t, &ret);
    CHECK(ret == NULL && p != NULL && G->used(0) == 1000);
    RC(G->zero(p, 1000)); RC(G->sync());
    pthread_create(&t, NULL, free_from_other_thread, p); pthread_join(t, NULL);
    CHECK(G->used(0) == 0);
    strided_checks();
    dot_checks();
    fz_checks();
    syevd_checks();
    gesvd_checks();
    RC(G->sync());
    CHECK(G->used(0) == 0);
    CHECK(!G->failed(0));
    G->thread_fini();
    printf("%s: %d failures\n", fails ? "FAIL" : "PASS", fails);
    return fails != 0;
}
