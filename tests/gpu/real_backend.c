/* cuda.real: the real GPU backend (cuda/real.cu, the module the daemon
 * loads) on cuda:0, call by call: copies across staging chunks, zero, GEMM
 * (k = 0 too), bias_act, dz and row_sum for every activation, dtype and
 * order against kernels/act.h on the CPU (relative 1e-13 f64, 3e-6 f32; z
 * and row sums exactly), allocation from a thread that is not a worker,
 * and the used-bytes count.  Exits 77 (skip) with "no CUDA device" when
 * the module is missing or finds no GPU. */
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
    CHECK(!G->failed(0));
    G->thread_fini();
    printf("%s: %d failures\n", fails ? "FAIL" : "PASS", fails);
    return fails != 0;
}
