/* bench_gpu: the GPU rules' device work against the bare cuBLAS calls they
 * need, in process, on cuda:0 of the real backend (the module the daemon
 * loads), with every operand already in device memory:
 *   - fused_dense forward (GEMM + the bias+activation kernel) ÷ its GEMM,
 *     and reverse (dz kernel, two GEMMs, row sum) ÷ its two GEMMs, at
 *     (out, in, batch) = (4096, 4096, 1024) and (8192, 8192, 256), f32 and
 *     f64, gelu (issue 12: each ≤ 1.10);
 *   - tensorcontract abcd,dcfe->fbea (f64 and c128, operands of about
 *     1 GiB; --quick: 8 MiB), the op's own forward on the device (its
 *     permutations and GEMM, cuda/exec.h) ÷ the GEMM of the same sizes
 *     (issue 12: ≤ 1.15);
 *   - the permutation pass (pb_gpu->strided, a rank-4 transpose
 *     abcd -> dcba) against a contiguous pass of the same bytes (≥ 0.7 of
 *     its bandwidth);
 *   - a whole forward through the op (pb_op_run_forward on cuda, inputs
 *     and output through the host staging) beside them, for what a
 *     request adds;
 *   - the factorizations: eigh_full (4096², f64, f32, c128), svd_compact
 *     (4096² f64 and f32, 8192×1024 f64) and left_polar (8192×1024 f64),
 *     the op's device work (its checks, phases, kernels and the solver,
 *     cuda/exec.h) ÷ the bare Xsyevd or Xgesvd it needs (issue 13: ≤
 *     1.15), its reverse ÷ its forward (≤ 1.0 for eigh and the SVD), and
 *     for f64 4096² forward + reverse on the CPU (one call each, OpenBLAS
 *     with this process's threads) ÷ the same on the GPU: the speed-up.
 * Each figure is the median of 5 runs after a warm-up (the factorizations:
 * of 3).  Exits 77 with "no
 * CUDA device" where the module or a GPU is missing.  With
 * PULLBACKD_FAKE_CUDA set it runs the quick shapes through the host fake
 * instead: figures of nothing, a check that the program works before a
 * GPU's minutes are spent on it.
 *
 *   bench_gpu [--quick]     (--quick: the smaller shape only) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "cuda/exec.h"
#include "cuda/gpu.h"
#include "cuda/gpu_ops.h"
#include "kernels/act.h"
#include "kernels/op.h"

extern const pb_op_t pb_op_fused_dense, pb_op_tensorcontract;

static const pb_gpu_backend_t *G;

static void ok(int rc, const char *what)
{
    if (rc) {
        fprintf(stderr, "%s failed (%d): %s\n", what, rc, G->last_error());
        exit(1);
    }
}

static void *dalloc(size_t bytes)
{
    void *p;
    ok(G->alloc(0, bytes, &p), "alloc");
    return p;
}

typedef struct {
    int dtype;
    long out, in, batch;
    void *W, *x, *b, *y, *z, *dz, *gW, *gx, *gb;
} fd_t;

static const double ONE[2] = {1, 0}, ZERO[2] = {0, 0};

/* y = W·x (row-major W (out × in), x (in × batch), y (out × batch) as the
 * column-major transposes: yᵀ = xᵀ·Wᵀ). */
static void gemm_fwd(fd_t *f)
{
    ok(G->gemm(f->dtype, 'N', 'N', (int)f->batch, (int)f->out, (int)f->in, ONE, f->x, (int)f->batch, f->W,
               (int)f->in, ZERO, f->y, (int)f->batch),
       "gemm");
}

static void forward(fd_t *f)
{
    gemm_fwd(f);
    ok(G->bias_act(f->dtype, PB_ACT_GELU, f->y, f->z, f->b, (size_t)f->out, (size_t)f->batch, 'C'), "bias_act");
}

/* W̄ = dz·xᵀ, x̄ = Wᵀ·dz, in the same column-major reading. */
static void gemms_rev(fd_t *f)
{
    ok(G->gemm(f->dtype, 'T', 'N', (int)f->in, (int)f->out, (int)f->batch, ONE, f->x, (int)f->batch, f->dz,
               (int)f->batch, ZERO, f->gW, (int)f->in),
       "gemm W̄");
    ok(G->gemm(f->dtype, 'N', 'T', (int)f->batch, (int)f->in, (int)f->out, ONE, f->dz, (int)f->batch, f->W,
               (int)f->in, ZERO, f->gx, (int)f->batch),
       "gemm x̄");
}

static void reverse(fd_t *f)
{
    ok(G->dz(f->dtype, PB_ACT_GELU, f->dz, f->y, f->z, (size_t)f->out, (size_t)f->batch, 'C'), "dz");
    gemms_rev(f);
    ok(G->row_sum(f->dtype, f->dz, f->gb, (size_t)f->out, (size_t)f->batch, 'C'), "row_sum");
}

/* Median seconds of reps runs of fn (1 to 5, after one warm-up), each
 * synchronised. */
static double timed_n(void (*fn)(fd_t *), fd_t *f, int reps)
{
    double t[5];
    reps = reps < 1 ? 1 : reps > 5 ? 5 : reps;
    fn(f);
    ok(G->sync(), "sync");
    for (int i = 0; i < reps; i++) {
        double t0 = now();
        fn(f);
        ok(G->sync(), "sync");
        t[i] = now() - t0;
    }
    return median(t, reps);
}

static double timed(void (*fn)(fd_t *), fd_t *f)
{
    return timed_n(fn, f, 5);
}

static void bench_fused_dense(int dtype, long out, long in, long batch)
{
    size_t es = dtype ? 8 : 4;
    fd_t f = {.dtype = dtype, .out = out, .in = in, .batch = batch};
    f.W = dalloc(es * (size_t)(out * in));
    f.x = dalloc(es * (size_t)(in * batch));
    f.b = dalloc(es * (size_t)out);
    f.y = dalloc(es * (size_t)(out * batch));
    f.z = dalloc(es * (size_t)(out * batch));
    f.dz = dalloc(es * (size_t)(out * batch));
    f.gW = dalloc(es * (size_t)(out * in));
    f.gx = dalloc(es * (size_t)(in * batch));
    f.gb = dalloc(es * (size_t)out);
    void *pieces[] = {f.W, f.x, f.b, f.y, f.z, f.dz};
    size_t sizes[] = {(size_t)(out * in), (size_t)(in * batch), (size_t)out, (size_t)(out * batch),
                      (size_t)(out * batch), (size_t)(out * batch)};
    for (int i = 0; i < 6; i++) { /* small values: nothing overflows */
        size_t n = sizes[i] * es;
        char *h = malloc(n);
        for (size_t k = 0; k < sizes[i]; k++)
            if (dtype)
                ((double *)h)[k] = (double)(k % 17) / 64.0 - 0.125;
            else
                ((float *)h)[k] = (float)(k % 17) / 64.0f - 0.125f;
        ok(G->h2d(pieces[i], h, n), "h2d");
        ok(G->sync(), "sync");
        free(h);
    }
    double g = timed(gemm_fwd, &f), fw = timed(forward, &f), g2 = timed(gemms_rev, &f), rv = timed(reverse, &f);
    printf("fused_dense %s (%ld, %ld, %ld) gelu: GEMM %.3f ms, forward %.3f ms: %.3f | two GEMMs %.3f ms, "
           "reverse %.3f ms: %.3f\n",
           dtype ? "f64" : "f32", out, in, batch, g * 1e3, fw * 1e3, fw / g, g2 * 1e3, rv * 1e3, rv / g2);
    void *all[] = {f.W, f.x, f.b, f.y, f.z, f.dz, f.gW, f.gx, f.gb};
    for (int i = 0; i < 9; i++)
        G->free(0, all[i]);
}

/* The whole op through pb_op_run_forward on cuda:0: host inputs in, y out. */
static void bench_op(int dtype, long out, long in, long batch)
{
    pb_call_t c;
    memset(&c, 0, sizeof c);
    c.op = &pb_op_fused_dense;
    c.device = (pb_device_t){PB_DEV_CUDA, 0};
    c.dtype = dtype ? PB_F64 : PB_F32;
    c.order = 'C';
    c.opt[0].given = true;
    c.opt[0].index = PB_ACT_GELU;
    uint64_t ws[2] = {(uint64_t)out, (uint64_t)in}, xs[2] = {(uint64_t)in, (uint64_t)batch};
    ok(pb_tensor_alloc(&c.in[0], c.dtype, 2, ws, 'C', true), "host W");
    ok(pb_tensor_alloc(&c.in[1], c.dtype, 2, xs, 'C', true), "host x");
    pb_err_t err;
    ok(pb_op_fused_dense.validate(&c, &err), "validate");
    double t[5];
    for (int i = -1; i < 5; i++) {
        double t0 = now();
        ok(pb_op_run_forward(&c, NULL, &err), err.message);
        if (i >= 0)
            t[i] = now() - t0;
        pb_tensor_clear(&c.out[0]);
    }
    printf("  the op's forward with its copies in and out (%s): %.3f ms\n", dtype ? "f64" : "f32",
           median(t, 5) * 1e3);
    pb_call_clear(&c);
}

/* tensorcontract on device-resident operands: the call (its inputs device
 * tensors, made while the thread executes on cuda:0), and the GEMM of
 * the same sizes on buffers of its own. */
typedef struct {
    pb_call_t call;
    int dtype;
    long m, n, k;
    void *a, *b, *c;
} tc_t;

static tc_t TC;

static void run_contract(fd_t *f)
{
    (void)f;
    pb_err_t err;
    pb_exec_enter(0);
    int rc = pb_op_tensorcontract.forward[PB_DEV_CPU](&TC.call, NULL, &err);
    int failed = pb_exec_leave();
    ok(rc ? rc : failed, "tensorcontract");
    pb_tensor_clear(&TC.call.out[0]);
}

static void run_contract_gemm(fd_t *f)
{
    (void)f;
    ok(G->gemm(TC.dtype, 'N', 'N', (int)TC.m, (int)TC.n, (int)TC.k, ONE, TC.a, (int)TC.m, TC.b, (int)TC.k, ZERO,
               TC.c, (int)TC.m),
       "gemm");
}

static void bench_contract(pb_dtype_t d, long s)
{
    pb_call_t *c = &TC.call;
    memset(c, 0, sizeof *c);
    c->op = &pb_op_tensorcontract;
    c->device = (pb_device_t){PB_DEV_CUDA, 0};
    c->dtype = d;
    c->order = 'C';
    uint64_t shape[4] = {(uint64_t)s, (uint64_t)s, (uint64_t)s, (uint64_t)s};
    pb_exec_enter(0); /* the inputs are device tensors */
    int rc = pb_tensor_alloc(&c->in[0], d, 4, shape, 'C', true);
    if (rc == 0)
        rc = pb_tensor_alloc(&c->in[1], d, 4, shape, 'C', true);
    ok(rc ? rc : pb_exec_leave(), "device operands");
    for (int k = 0; k < pb_op_tensorcontract.noptions; k++)
        if (strcmp(pb_op_tensorcontract.options[k].name, "spec") == 0) {
            c->opt[k].given = true;
            snprintf(c->opt[k].text, sizeof c->opt[k].text, "abcd,dcfe->fbea");
        }
    pb_call_defaults(c);
    pb_err_t err;
    if (pb_op_tensorcontract.validate(c, &err)) {
        fprintf(stderr, "tensorcontract: %s\n", err.message);
        exit(1);
    }
    size_t es = pb_dtype_size(d);
    TC.dtype = (int)d;
    TC.m = TC.n = TC.k = s * s;
    TC.a = dalloc(es * (size_t)(TC.m * TC.k));
    TC.b = dalloc(es * (size_t)(TC.k * TC.n));
    TC.c = dalloc(es * (size_t)(TC.m * TC.n));
    ok(G->zero(TC.a, es * (size_t)(TC.m * TC.k)), "zero");
    ok(G->zero(TC.b, es * (size_t)(TC.k * TC.n)), "zero");
    double g = timed(run_contract_gemm, NULL), t = timed(run_contract, NULL);
    printf("tensorcontract abcd,dcfe->fbea %s, sides %ld (%zu MiB an operand): GEMM %.3f ms, forward %.3f ms: "
           "%.3f\n",
           pb_dtype_name(d), s, es * (size_t)(TC.m * TC.k) >> 20, g * 1e3, t * 1e3, t / g);
    G->free(0, TC.a);
    G->free(0, TC.b);
    G->free(0, TC.c);
    pb_call_clear(c);
}

typedef struct {
    pb_gpu_loop_t perm, flat;
    void *src, *dst;
} perm_t;

static perm_t P;

static void run_perm(fd_t *f)
{
    (void)f;
    ok(G->strided(1, &P.perm, P.dst, P.src, 0, ONE, NULL, ZERO, 0), "strided");
}

static void run_flat(fd_t *f)
{
    (void)f;
    ok(G->strided(1, &P.flat, P.dst, P.src, 0, ONE, NULL, ZERO, 0), "strided");
}

static void bench_permute(long n)
{
    /* f64 abcd -> dcba, each side n: n⁴ elements */
    size_t count = (size_t)(n * n * n * n), bytes = count * 8;
    P.src = dalloc(bytes);
    P.dst = dalloc(bytes);
    ok(G->zero(P.src, bytes), "zero");
    memset(&P.perm, 0, sizeof P.perm);
    P.perm.rank = 4;
    for (int k = 0; k < 4; k++) {
        long long st = 1;
        for (int j = k + 1; j < 4; j++)
            st *= n;
        P.perm.dim[k] = (unsigned long long)n;
        P.perm.s[0][k] = st;         /* dst C order over (a, b, c, d)... */
        P.perm.s[1][3 - k] = st;     /* ...src read reversed */
    }
    memset(&P.flat, 0, sizeof P.flat);
    P.flat.rank = 1;
    P.flat.dim[0] = count;
    P.flat.s[0][0] = P.flat.s[1][0] = 1;
    double tf = timed(run_flat, NULL), tp = timed(run_perm, NULL);
    printf("permutation abcd->dcba f64, %zu MiB: contiguous pass %.1f GB/s, permutation %.1f GB/s: %.2f of it\n",
           bytes >> 20, 2.0 * (double)bytes / tf * 1e-9, 2.0 * (double)bytes / tp * 1e-9, tf / tp);
    G->free(0, P.src);
    G->free(0, P.dst);
}

/* ---- the factorizations ---- */

typedef struct {
    pb_call_t call;
    pb_tapedata_t tape;
    pb_tensor_t cot[PB_MAX_IO];
    void *a, *work, *w, *u, *vt; /* u, vt: gesvd's, allocated once */
    size_t bytes;
} factor_t;

static factor_t FB;

/* The bare cuSOLVER call an op needs, on a copy of A (the solvers
 * overwrite their input): Xsyevd for eigh, Xgesvd (m ≥ n) for the SVD and
 * polar. */
static void run_solver(fd_t *f)
{
    (void)f;
    const int m = (int)FB.call.in[0].shape[0], n = (int)FB.call.in[0].shape[1], dt = (int)FB.call.dtype;
    pb_gpu_loop_t L = {.rank = 1, .dim = {FB.bytes / 4}, .s = {{1}, {1}}};
    ok(G->strided(0, &L, FB.work, FB.a, 0, ONE, NULL, ZERO, 0), "copy");
    int info = 0;
    if (strncmp(FB.call.op->name, "eigh", 4) == 0)
        ok(G->syevd(dt, 1, m, FB.work, m, FB.w, &info), "syevd");
    else
        ok(G->gesvd(dt, 1, m, n, FB.work, m, FB.w, FB.u, m, FB.vt, n, &info), "gesvd");
    ok(info, "the solver's info");
}

/* The op's forward (keeping its tape) or reverse on the execution
 * device, or on the CPU when gpu < 0. */
static void factor_run(bool reverse, int gpu)
{
    pb_err_t err = {0};
    pb_tensor_t grad[PB_MAX_IO + 2] = {{0}};
    pb_warnings_t warn = {0};
    if (!reverse) {
        pb_tapedata_clear(&FB.tape);
        pb_tapedata_init(&FB.tape, &FB.call);
    }
    if (gpu >= 0)
        pb_exec_enter(gpu);
    int rc = reverse ? FB.call.op->reverse[PB_DEV_CPU](&FB.tape, FB.cot, grad, 'F', &warn, &err)
                     : FB.call.op->forward[PB_DEV_CPU](&FB.call, &FB.tape, &err);
    int failed = gpu >= 0 ? pb_exec_leave() : 0;
    if (rc || failed) {
        fprintf(stderr, "%s %s: %s\n", FB.call.op->name, reverse ? "reverse" : "forward",
                rc ? err.message : G->last_error());
        exit(1);
    }
    for (int i = 0; i < PB_MAX_IO + 2; i++)
        pb_tensor_clear(&grad[i]);
    for (int i = 0; i < PB_MAX_IO && !reverse; i++)
        pb_tensor_clear(&FB.call.out[i]);
}

static void factor_fwd_gpu(fd_t *f) { (void)f, factor_run(false, 0); }
static void factor_rev_gpu(fd_t *f) { (void)f, factor_run(true, 0); }

/* A random m×n A, Hermitian when herm (eigh takes only those). */
static void factor_input(pb_tensor_t *A, pb_dtype_t d, long m, long n, bool herm)
{
    uint64_t shape[2] = {(uint64_t)m, (uint64_t)n};
    ok(pb_tensor_alloc(A, d, 2, shape, 'F', true), "A");
    bool single = d == PB_F32 || d == PB_C64, cplx = pb_dtype_is_complex(d);
    char *a = pb_tensor_data(A);
    unsigned long long r = 88172645463325252ull;
    for (long j = 0; j < n; j++)
        for (long i = 0; i < m; i++) {
            if (herm && i > j)
                continue; /* the lower half mirrors the upper */
            double v[2];
            for (int k = 0; k < 2; k++) {
                r ^= r << 13, r ^= r >> 7, r ^= r << 17;
                v[k] = (double)(r >> 11) * 0x1.0p-53 - 0.5;
            }
            if (!cplx || (herm && i == j))
                v[1] = 0;
            for (int t = 0; t < (herm && i != j ? 2 : 1); t++) { /* (i, j), then (j, i) conjugated */
                size_t o = t ? (size_t)i * m + j : (size_t)j * m + i;
                double im = t ? -v[1] : v[1];
                if (single) {
                    float *p = (float *)(a + o * pb_dtype_size(d));
                    p[0] = (float)v[0];
                    if (cplx)
                        p[1] = (float)im;
                } else {
                    double *p = (double *)(a + o * pb_dtype_size(d));
                    p[0] = v[0];
                    if (cplx)
                        p[1] = im;
                }
            }
        }
}

/* op on an m×n A: its device work (forward, then reverse with zero
 * vector cotangents and ones for the values: every term of the pullback
 * runs) against the bare solver call; with cpu, forward + reverse once on
 * the CPU too (OpenBLAS with this process's threads). */
static void bench_factor(const char *op, pb_dtype_t d, long m, long n, bool cpu, int reps)
{
    pb_call_t *c = &FB.call;
    memset(&FB, 0, sizeof FB);
    c->op = pb_op_find(op, strlen(op));
    c->device = (pb_device_t){PB_DEV_CUDA, 0};
    c->dtype = d;
    c->order = 'F';
    c->wrt = 1;
    c->taped = true;
    pb_tensor_t A = {0}, hcot[PB_MAX_IO] = {{0}};
    bool eigh = strncmp(op, "eigh", 4) == 0;
    if (!eigh && m < n) { /* Xgesvd takes m ≥ n: the bench's shapes are tall */
        fprintf(stderr, "%s %ld×%ld: give bench_factor a tall shape\n", op, m, n);
        exit(1);
    }
    factor_input(&A, d, m, n, eigh);
    pb_call_defaults(c);
    c->in[0] = A;
    pb_err_t err;
    if (c->op->validate(c, &err)) {
        fprintf(stderr, "%s: %s\n", op, err.message);
        exit(1);
    }
    for (int k = 0; k < c->op->noutputs; k++) {
        const pb_tensor_t *o = &c->out_meta[k];
        ok(pb_tensor_alloc(&hcot[k], o->dtype, o->rank, o->shape, 'F', true), "cotangent");
        for (size_t i = 0; o->rank == 1 && i < o->shape[0]; i++) { /* the values' cotangent: ones */
            if (o->dtype == PB_F32)
                ((float *)pb_tensor_data(&hcot[k]))[i] = 1.0f;
            else
                ((double *)pb_tensor_data(&hcot[k]))[i] = 1.0;
        }
    }
    double tcpu = 0;
    if (cpu) {
        memcpy(FB.cot, hcot, sizeof hcot);
        double t0 = now();
        factor_run(false, -1);
        factor_run(true, -1);
        tcpu = now() - t0;
    }
    pb_tensor_t dA = {0};
    ok(pb_gpu_upload(&dA, 0, &A), "upload A");
    c->in[0] = dA;
    for (int k = 0; k < c->op->noutputs; k++)
        ok(pb_gpu_upload(&FB.cot[k], 0, &hcot[k]), "upload cotangents");
    FB.bytes = pb_tensor_bytes(&dA);
    FB.a = pb_tensor_data(&dA);
    FB.work = dalloc(FB.bytes);
    FB.w = dalloc((size_t)n * pb_dtype_size(pb_dtype_real(d)));
    if (!eigh) {
        FB.u = dalloc((size_t)m * n * pb_dtype_size(d));
        FB.vt = dalloc((size_t)n * n * pb_dtype_size(d));
    }
    double ts = timed_n(run_solver, NULL, reps), tf = timed_n(factor_fwd_gpu, NULL, reps),
           tr = timed_n(factor_rev_gpu, NULL, reps);
    printf("%s %s %ld×%ld: %s %.1f ms, forward %.1f ms: %.3f; reverse %.1f ms: %.3f of the forward", op,
           pb_dtype_name(d), m, n, strncmp(op, "eigh", 4) ? "Xgesvd" : "Xsyevd", ts * 1e3, tf * 1e3, tf / ts,
           tr * 1e3, tr / tf);
    if (cpu)
        printf("; CPU forward + reverse %.0f ms: the GPU %.1f× as fast", tcpu * 1e3, tcpu / (tf + tr));
    printf("\n");
    pb_tapedata_clear(&FB.tape);
    G->free(0, FB.work);
    G->free(0, FB.w);
    G->free(0, FB.u);
    G->free(0, FB.vt);
    for (int i = 0; i < PB_MAX_IO; i++) {
        pb_tensor_clear(&FB.cot[i]);
        pb_tensor_clear(&hcot[i]);
    }
    pb_tensor_clear(&A);
    pb_call_clear(c);
}

int main(int argc, char **argv)
{
    bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    char why[200] = "";
    int n = pb_gpu_init(why, sizeof why);
    if (n > 0 && strcmp(pb_gpu->name, "fake") == 0) {
        printf("the host fake (PULLBACKD_FAKE_CUDA): these figures say nothing of a GPU\n");
        quick = true;
    } else if (n <= 0) {
        const char *whynot;
        const pb_gpu_backend_t *real = pb__gpu_real(&whynot);
        printf("no CUDA device: %s\n", n < 0 ? why : real ? real->last_error() : whynot);
        return 77;
    }
    G = pb_gpu;
    pb_gpu_info_t info;
    ok(G->info(0, &info), "info");
    printf("cuda:0: %s, %zu MiB\n", info.name, info.total_bytes >> 20);
    ok(G->thread_init(0), "thread_init");
    static const long shapes[3][3] = {{512, 512, 128}, {4096, 4096, 1024}, {8192, 8192, 256}};
    for (int s = quick ? 0 : 1; s < (quick ? 1 : 3); s++)
        for (int dtype = 0; dtype < 2; dtype++) {
            bench_fused_dense(dtype, shapes[s][0], shapes[s][1], shapes[s][2]);
            bench_op(dtype, shapes[s][0], shapes[s][1], shapes[s][2]);
        }
    bench_contract(PB_F64, quick ? 32 : 107);
    bench_contract(PB_C128, quick ? 24 : 90);
    bench_permute(quick ? 64 : 128);
    /* issue 13's shapes, each solver a few seconds at most on an H200:
     * the median of 3 */
    long sq = quick ? 64 : 4096, tall = quick ? 96 : 8192, thin = quick ? 24 : 1024;
    bench_factor("eigh_full", PB_F64, sq, sq, true, 3);
    bench_factor("eigh_full", PB_F32, sq, sq, false, 3);
    bench_factor("eigh_full", PB_C128, sq, sq, false, 3);
    bench_factor("svd_compact", PB_F64, sq, sq, true, 3);
    bench_factor("svd_compact", PB_F32, sq, sq, false, 3);
    bench_factor("svd_compact", PB_F64, tall, thin, false, 3);
    bench_factor("left_polar", PB_F64, tall, thin, false, 3);
    G->thread_fini();
    return 0;
}
