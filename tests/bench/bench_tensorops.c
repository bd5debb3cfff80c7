/* bench_tensorops: tensorcontract in process against the bare GEMMs it
 * needs, and the permutation kernel against memcpy, measured in the same
 * run on one thread (OpenBLAS single threaded, as in the daemon).
 *
 *   forward ratio  = tensorcontract forward ÷ one GEMM (I×K)·(K×J) on
 *                    dense matrices of the same sizes
 *   reverse ratio  = reverse (wrt A and B) ÷ the two GEMMs G·B̂ᴴ, Âᴴ·G
 *   permutation    = memcpy time of 64 MiB ÷ time of a rank-4 permutation
 *                    of the same bytes (1.0 = memcpy speed)
 * Targets: ≤ 1.05 for "abcd,cdef->abef" (no permutation), ≤ 1.30 for
 * "abcd,dcfe->fbea", permutation ≥ 0.5.  Each figure is the median of
 * several repetitions; --quick uses dimension 16 and one repetition.
 *
 * Each repetition times the baseline right before what it is compared
 * with, so that both see the same load on a shared machine.  The bare
 * GEMMs write into tensors allocated in that repetition as the op's
 * outputs and gradients are (pb_tensor_alloc): the op must allocate what
 * it returns, and glibc hands out fresh pages for each aligned block of
 * this size rather than the ones just freed, so its first touch costs a
 * page fault per 4 KiB (about 11 ms per 20 MiB here), which a GEMM into a
 * buffer reused from the last repetition does not pay.  Timing the
 * allocation in the op alone would charge the contraction with the
 * allocator's cost. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kernels/blas.h"
#include "kernels/op.h"
#include "kernels/strided.h"

extern const pb_op_t pb_op_tensorcontract;

static void fill(pb_tensor_t *t, pb_dtype_t d, int rank, const uint64_t *shape)
{
    if (pb_tensor_alloc(t, d, rank, shape, 'C', false))
        abort();
    size_t n = pb_tensor_count(t) * (pb_dtype_is_complex(d) ? 2 : 1);
    for (size_t i = 0; i < n; i++)
        ((double *)pb_tensor_data(t))[i] = (double)((i * 2654435761u) % 1000) / 1000.0 - 0.5;
}

static void bench_contract(pb_dtype_t d, const char *spec, uint64_t n, int reps)
{
    const pb_op_t *op = &pb_op_tensorcontract;
    uint64_t sa[4] = {n, n, n, n}, sb[4] = {n, n, n, n};
    pb_call_t c;
    memset(&c, 0, sizeof c);
    c.op = op;
    c.dtype = d;
    c.order = 'C';
    fill(&c.in[0], d, 4, sa);
    fill(&c.in[1], d, 4, sb);
    pb_optval_t *o = &c.opt[pb_op_option_index(op, "spec", 4)];
    o->given = true;
    strcpy(o->text, spec);
    pb_call_defaults(&c);
    pb_err_t err = {0};
    if (op->validate(&c, &err)) {
        fprintf(stderr, "validate: %s\n", err.message);
        exit(1);
    }
    int ni = (int)(n * n), nk = (int)(n * n), nj = (int)(n * n);
    size_t item = pb_dtype_size(d);
    void *a = calloc((size_t)ni * nk, item), *b = calloc((size_t)nk * nj, item);
    void *g = calloc((size_t)ni * nj, item);
    memcpy(a, pb_tensor_data(&c.in[0]), (size_t)ni * nk * item);
    memcpy(b, pb_tensor_data(&c.in[1]), (size_t)nk * nj * item);
    /* the shapes of the products, for their fresh tensors */
    const uint64_t sm[2] = {(uint64_t)nj, (uint64_t)ni}, sa2[2] = {(uint64_t)nk, (uint64_t)ni},
                   sb2[2] = {(uint64_t)nj, (uint64_t)nk};
    double tf[16], tg[16], tr[16], t2[16];
    pb_scalar_t one = {1, 0}, zero = {0, 0};
    for (int r = 0; r < reps; r++) {
        pb_tensor_t tm, ta, tb;
        double t0 = now();
        if (pb_tensor_alloc(&tm, d, 2, sm, 'C', false))
            abort();
        pb_gemm_cm(d, 'N', 'N', ni, nj, nk, one, a, ni, b, nk, zero, pb_tensor_data(&tm), ni);
        tg[r] = now() - t0;
        pb_tensor_clear(&tm);
        t0 = now();
        if (pb_op_run_forward(&c, NULL, &err))
            exit(1);
        tf[r] = now() - t0;
        pb_tensor_clear(&c.out[0]);
        /* the two reverse GEMMs on dense matrices: Ā = G·B̂ᴴ, B̄ = Âᴴ·G */
        char ct = pb_dtype_is_complex(d) ? 'C' : 'T';
        t0 = now();
        if (pb_tensor_alloc(&ta, d, 2, sa2, 'C', false) || pb_tensor_alloc(&tb, d, 2, sb2, 'C', false))
            abort();
        pb_gemm_cm(d, 'N', ct, ni, nk, nj, one, g, ni, b, nk, zero, pb_tensor_data(&ta), ni);
        pb_gemm_cm(d, ct, 'N', nk, nj, ni, one, a, ni, g, ni, zero, pb_tensor_data(&tb), nk);
        t2[r] = now() - t0;
        pb_tensor_clear(&ta);
        pb_tensor_clear(&tb);
        c.taped = true;
        c.wrt = 3;
        pb_tapedata_t tape;
        if (pb_op_run_forward(&c, &tape, &err))
            exit(1);
        pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
        fill(&cot[0], d, c.out[0].rank, c.out[0].shape);
        pb_warnings_t w = {0};
        t0 = now();
        if (pb_op_run_reverse(&tape, cot, grad, 'C', &w, &err))
            exit(1);
        tr[r] = now() - t0;
        for (int k = 0; k < PB_MAX_IO + 2; k++)
            pb_tensor_clear(&grad[k]);
        pb_tensor_clear(&cot[0]);
        pb_tapedata_clear(&tape);
        pb_tensor_clear(&c.out[0]);
        c.taped = false;
        c.wrt = 0;
    }
    double mg = median(tg, reps), mf = median(tf, reps), m2 = median(t2, reps), mr = median(tr, reps);
    printf("%-5s %-16s n=%-3llu  forward %8.2f ms  gemm %8.2f ms  ratio %.3f   reverse %8.2f ms  2 gemms %8.2f ms  "
           "ratio %.3f\n",
           pb_dtype_name(d), spec, (unsigned long long)n, mf * 1e3, mg * 1e3, mf / mg, mr * 1e3, m2 * 1e3, mr / m2);
    free(a);
    free(b);
    free(g);
    pb_call_clear(&c);
}

static void bench_permute(pb_dtype_t d, uint64_t mib, int reps)
{
    size_t item = pb_dtype_size(d), n = (mib << 20) / item;
    /* a rank-4 shape of n elements: 64 × 64 × 64 × rest */
    uint64_t sh[4] = {64, 64, 64, n / (64 * 64 * 64)};
    size_t bytes = 64 * 64 * 64 * sh[3] * item;
    void *src = malloc(bytes), *dst = malloc(bytes);
    memset(src, 1, bytes);
    memset(dst, 0, bytes);
    static const int perms[][4] = {{3, 2, 1, 0}, {1, 0, 3, 2}, {0, 2, 1, 3}, {2, 3, 0, 1}, {0, 1, 3, 2}};
    for (size_t p = 0; p < sizeof perms / sizeof perms[0]; p++) {
        uint64_t shy[4];
        for (int k = 0; k < 4; k++)
            shy[k] = sh[perms[p][k]];
        int64_t ss[4], sy[4];
        pb_dense_strides(4, sh, 'C', ss);
        pb_dense_strides(4, shy, 'C', sy);
        pb_loop_t L = {.rank = 4};
        for (int k = 0; k < 4; k++) {
            L.dim[k] = shy[k];
            L.s[0][k] = sy[k];
            L.s[1][k] = ss[perms[p][k]];
        }
        /* Each timed pass follows an untimed one of its own kind: a pass
         * leaves dirty lines in the caches that the next one writes back,
         * and memcpy (non-temporal at this size) leaves fewer than the
         * permutation. */
        double tm[16], tp[16];
        for (int r = 0; r < reps; r++) {
            memcpy(dst, src, bytes);
            double t0 = now();
            memcpy(dst, src, bytes);
            tm[r] = now() - t0;
            pb_strided(d, &L, dst, src, false, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, false);
            t0 = now();
            pb_strided(d, &L, dst, src, false, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, false);
            tp[r] = now() - t0;
        }
        double mm = median(tm, reps), mp = median(tp, reps);
        printf("permute %-4s %llu MiB [%d,%d,%d,%d]  %7.2f ms  memcpy %7.2f ms  %5.2f GB/s  of memcpy %.2f\n",
               pb_dtype_name(d), (unsigned long long)(bytes >> 20), perms[p][0], perms[p][1], perms[p][2], perms[p][3],
               mp * 1e3, mm * 1e3, 2.0 * (double)bytes / mp * 1e-9, mm / mp);
    }
    free(src);
    free(dst);
}

int main(int argc, char **argv)
{
    bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    pb_alloc_init();
    pb_blas_init_threads(1);
    uint64_t n = quick ? 16 : 40;
    int reps = quick ? 1 : 5;
    static const pb_dtype_t ds[2] = {PB_F64, PB_C128};
    for (int i = 0; i < 2; i++) {
        bench_contract(ds[i], "abcd,cdef->abef", n, reps);
        bench_contract(ds[i], "abcd,dcfe->fbea", n, reps);
    }
    bench_permute(PB_F64, quick ? 8 : 64, quick ? 1 : 5);
    bench_permute(PB_C128, quick ? 8 : 64, quick ? 1 : 5);
    return 0;
}
