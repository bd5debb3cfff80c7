/* bench_fused_dense: fused_dense in process against the BLAS calls it
 * needs, measured in the same run on the same thread (OpenBLAS single
 * threaded, as in the daemon's workers).
 *
 *   forward ratio  = fused_dense forward ÷ the one GEMM W·x
 *   reverse ratio  = fused_dense reverse (wrt W, x, b) ÷ the two GEMMs
 *                    dz·xᵀ and Wᵀ·dz
 * Target: ≤ 1.10 at the two large shapes.  Each figure is the median of
 * several repetitions.  --quick runs one repetition of the small shape.
 * --wide fills W, x and ȳ with unit-variance values (as randn data), so
 * that |z| ~ √in (about 30 at in = 1024) and the exps of the activations
 * underflow for most elements, as in a real layer; without it the values
 * are in ±0.5 and |z| stays near 3. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "bench_util.h"
#include "kernels/act.h"
#include "kernels/blas.h"
#include "kernels/op.h"

extern const pb_op_t pb_op_fused_dense;

static double scale = 1; /* --wide: √12, unit variance */

static void fill(pb_tensor_t *t, pb_dtype_t d, int rank, const uint64_t *shape)
{
    if (pb_tensor_alloc(t, d, rank, shape, 'C', false))
        abort();
    size_t n = pb_tensor_count(t);
    for (size_t i = 0; i < n; i++) {
        double v = scale * ((double)((i * 2654435761u) % 1000) / 1000.0 - 0.5);
        if (d == PB_F32)
            ((float *)pb_tensor_data(t))[i] = (float)v;
        else
            ((double *)pb_tensor_data(t))[i] = v;
    }
}

#define WARMUP 1

static void bench(pb_dtype_t d, size_t out, size_t in, size_t batch, int reps)
{
    uint64_t ws[2] = {out, in}, xs[2] = {in, batch}, bs[1] = {out}, ys[2] = {out, batch};
    pb_call_t c;
    memset(&c, 0, sizeof c);
    c.op = &pb_op_fused_dense;
    c.dtype = d;
    c.order = 'C';
    c.opt[0].given = true;
    c.opt[0].index = PB_ACT_GELU;
    fill(&c.in[0], d, 2, ws);
    fill(&c.in[1], d, 2, xs);
    fill(&c.in[2], d, 1, bs);
    pb_tensor_t yb, scratch;
    fill(&yb, d, 2, ys);
    fill(&scratch, d, 2, ys);
    pb_tensor_t gw, gx;
    fill(&gw, d, 2, ws);
    fill(&gx, d, 2, xs);
    pb_err_t err;
    double tg[16], tf[16], tg2[16], tr[16];
    /* One round run but not counted: the first touches every page of the
     * heap it grows to, which a daemon serving requests did long ago. */
    for (int r = -WARMUP; r < reps; r++) {
        /* Baseline: the GEMM the forward needs. */
        double t0 = now();
        pb_gemm(d, 1.0, pb_mview_of(&c.in[0]), pb_mview_of(&c.in[1]), 0.0, pb_mview_of(&scratch));
        tg[r < 0 ? 0 : r] = now() - t0;

        c.taped = false;
        c.wrt = 0;
        if (c.op->validate(&c, &err))
            abort();
        t0 = now();
        if (pb_op_run_forward(&c, NULL, &err))
            abort();
        tf[r < 0 ? 0 : r] = now() - t0;
        pb_tensor_clear(&c.out[0]);

        /* Baseline: the two GEMMs the reverse needs. */
        t0 = now();
        pb_gemm(d, 1.0, pb_mview_of(&yb), pb_mview_transpose(pb_mview_of(&c.in[1])), 0.0, pb_mview_of(&gw));
        pb_gemm(d, 1.0, pb_mview_transpose(pb_mview_of(&c.in[0])), pb_mview_of(&yb), 0.0, pb_mview_of(&gx));
        tg2[r < 0 ? 0 : r] = now() - t0;

        c.taped = true;
        c.wrt = 7;
        if (c.op->validate(&c, &err))
            abort();
        pb_tapedata_t tape;
        if (pb_op_run_forward(&c, &tape, &err))
            abort();
        pb_tensor_clear(&c.out[0]);
        pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
        pb_tensor_ref(&cot[0], &yb);
        pb_warnings_t warn = {0};
        t0 = now();
        if (pb_op_run_reverse(&tape, cot, grad, 'C', &warn, &err))
            abort();
        tr[r < 0 ? 0 : r] = now() - t0;
        for (int i = 0; i < PB_MAX_IO + 2; i++)
            pb_tensor_clear(&grad[i]);
        pb_tensor_clear(&cot[0]);
        pb_tapedata_clear(&tape);
    }
    double g = median(tg, reps), f = median(tf, reps), g2 = median(tg2, reps), rv = median(tr, reps);
    printf("%-4s (%5zu, %5zu, %4zu)  gemm %8.3f ms  forward %8.3f ms  ratio %.3f   2 gemms %8.3f ms  reverse %8.3f ms  ratio %.3f\n",
           pb_dtype_name(d), out, in, batch, g * 1e3, f * 1e3, f / g, g2 * 1e3, rv * 1e3, rv / g2);
    pb_call_clear(&c);
    pb_tensor_clear(&yb);
    pb_tensor_clear(&scratch);
    pb_tensor_clear(&gw);
    pb_tensor_clear(&gx);
}

int main(int argc, char **argv)
{
    bool quick = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            quick = true;
        else if (strcmp(argv[i], "--wide") == 0)
            scale = 3.4641016151377546; /* √12 */
        else {
            fprintf(stderr, "usage: %s [--quick] [--wide]\n", argv[0]);
            return 2;
        }
    }
    pb_blas_init_threads(1);
    pb_alloc_init(); /* as the daemon does */
    printf("fused_dense, act gelu, one thread (OpenBLAS single-threaded as in the workers); medians%s\n",
           scale != 1 ? "; unit-variance inputs" : "");
    const size_t shapes[3][3] = {{1024, 1024, 256}, {4096, 4096, 64}, {256, 256, 32}};
    for (int d = 0; d < 2; d++)
        for (int s = quick ? 2 : 0; s < 3; s++)
            bench(d ? PB_F64 : PB_F32, shapes[s][0], shapes[s][1], shapes[s][2], quick ? 1 : s == 2 ? 15 : 9);
    return 0;
}
