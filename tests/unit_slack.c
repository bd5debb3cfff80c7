/* unit.slack: the tail slack of the kernels' allocators (PB_TAIL_SLACK,
 * kernels/tensor.h) covers what OpenBLAS's LAPACK reads past its operands.
 *
 * Every operand the factorizations hand to a LAPACKE driver is placed so
 * that its block plus PB_TAIL_SLACK ends exactly at a PROT_NONE page; a
 * read past the slack is a SIGSEGV, caught and failed with the driver and
 * shape.  Without the slack most LQ and SVD shapes fail here (zgemv_n in
 * gelq2/ungl2/gebd2 reads up to about a column past the matrix).  Shapes
 * 1..40 in a sparse grid and a few larger ones; f32, f64, c64, c128.
 * Skipped under AddressSanitizer, whose own SIGSEGV handler and redzones
 * get in the way (the valgrind and plain runs cover it). */
#include "kernels/cmplx.h"
#include <complex.h>
#include <lapacke.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "kernels/blas.h"
#include "kernels/tensor.h"

#if defined(__SANITIZE_ADDRESS__)
#define PB_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PB_ASAN 1
#endif
#endif

static sigjmp_buf jump;
static void on_segv(int sig)
{
    (void)sig;
    siglongjmp(jump, 1);
}

/* A block of bytes whose end + PB_TAIL_SLACK(bytes) is a PROT_NONE page. */
typedef struct {
    void *base;
    size_t len;
} region_t;

static void *guarded(size_t bytes, region_t *r)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE), need = bytes + PB_TAIL_SLACK(bytes) + 16;
    r->len = (need + pg - 1) / pg * pg + pg;
    char *b = mmap(NULL, r->len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(b != MAP_FAILED);
    assert_int_equal(mprotect(b + r->len - pg, pg, PROT_NONE), 0);
    r->base = b;
    uintptr_t p = (uintptr_t)(b + r->len - pg) - PB_TAIL_SLACK(bytes) - bytes;
    return (void *)(p & ~(uintptr_t)15);
}

static void fill(void *p, size_t nreal)
{
    for (size_t i = 0; i < nreal; i++)
        ((double *)p)[i] = (double)((i * 2654435761u) % 997) / 997.0 - 0.5;
}

static void fillf(void *p, size_t nreal)
{
    for (size_t i = 0; i < nreal; i++)
        ((float *)p)[i] = (float)((i * 2654435761u) % 997) / 997.0f - 0.5f;
}

enum { QR, LQ, SDD, SVD, EVD, GEEV, NDRIVERS };
static const char *const driver_names[NDRIVERS] = {"geqrf+orgqr", "gelqf+orglq", "gesdd", "gesvd", "syevd/heevd",
                                                   "geev"};

/* One driver on one m×n shape of element type t (s, d, c, z), every
 * operand guarded.  False when it read past the slack. */
static bool run(int drv, char t, int m, int n)
{
    int k = m < n ? m : n;
    size_t e = t == 's' ? 4 : t == 'd' || t == 'c' ? 8 : 16, re = t == 's' || t == 'c' ? 4 : 8;
    bool cx = t == 'c' || t == 'z';
    region_t r[6];
    void *A = guarded(e * m * n, &r[0]), *tau = guarded(e * (size_t)k, &r[1]);
    /* exact sizes, so that the slack is all there is past each block:
     * U m×k (geev: m×m), V k×n (gesdd's Vh, or orglq's Q) */
    void *U = guarded(e * (size_t)m * (size_t)(drv == GEEV ? m : k), &r[2]), *V = guarded(e * (size_t)k * n, &r[3]);
    void *S = guarded(re * (size_t)(m + n), &r[4]), *X = guarded(e * (size_t)(m + n) * 2, &r[5]);
    if (re == 4)
        fillf(A, (size_t)m * n * (cx ? 2 : 1));
    else
        fill(A, (size_t)m * n * (cx ? 2 : 1));
    volatile bool ok = true;
    if (sigsetjmp(jump, 1) == 0) {
        switch (drv) {
        case QR:
            if (t == 'd') {
                LAPACKE_dgeqrf(LAPACK_COL_MAJOR, m, n, A, m, tau);
                LAPACKE_dorgqr(LAPACK_COL_MAJOR, m, k, k, A, m, tau);
            } else if (t == 's') {
                LAPACKE_sgeqrf(LAPACK_COL_MAJOR, m, n, A, m, tau);
                LAPACKE_sorgqr(LAPACK_COL_MAJOR, m, k, k, A, m, tau);
            } else if (t == 'z') {
                LAPACKE_zgeqrf(LAPACK_COL_MAJOR, m, n, A, m, tau);
                LAPACKE_zungqr(LAPACK_COL_MAJOR, m, k, k, A, m, tau);
            } else {
                LAPACKE_cgeqrf(LAPACK_COL_MAJOR, m, n, A, m, tau);
                LAPACKE_cungqr(LAPACK_COL_MAJOR, m, k, k, A, m, tau);
            }
            break;
        case LQ: /* gelqf on A, then orglq/unglq on Q = A's first k rows (k×n) */
            if (t == 'd') {
                LAPACKE_dgelqf(LAPACK_COL_MAJOR, m, n, A, m, tau);
                LAPACKE_dlacpy(LAPACK_COL_MAJOR, 'A', k, n, A, m, V, k);
                LAPACKE_dorglq(LAPACK_COL_MAJOR, k, n, k, V, k, tau);
            } else if (t == 's') {
                LAPACKE_sgelqf(LAPACK_COL_MAJOR, m, n, A, m, tau);
                LAPACKE_slacpy(LAPACK_COL_MAJOR, 'A', k, n, A, m, V, k);
                LAPACKE_sorglq(LAPACK_COL_MAJOR, k, n, k, V, k, tau);
            } else if (t == 'z') {
                LAPACKE_zgelqf(LAPACK_COL_MAJOR, m, n, A, m, tau);
                LAPACKE_zlacpy(LAPACK_COL_MAJOR, 'A', k, n, A, m, V, k);
                LAPACKE_zunglq(LAPACK_COL_MAJOR, k, n, k, V, k, tau);
            } else {
                LAPACKE_cgelqf(LAPACK_COL_MAJOR, m, n, A, m, tau);
                LAPACKE_clacpy(LAPACK_COL_MAJOR, 'A', k, n, A, m, V, k);
                LAPACKE_cunglq(LAPACK_COL_MAJOR, k, n, k, V, k, tau);
            }
            break;
        case SDD:
            if (t == 'd')
                LAPACKE_dgesdd(LAPACK_COL_MAJOR, 'S', m, n, A, m, S, U, m, V, k);
            else if (t == 's')
                LAPACKE_sgesdd(LAPACK_COL_MAJOR, 'S', m, n, A, m, S, U, m, V, k);
            else if (t == 'z')
                LAPACKE_zgesdd(LAPACK_COL_MAJOR, 'S', m, n, A, m, S, U, m, V, k);
            else
                LAPACKE_cgesdd(LAPACK_COL_MAJOR, 'S', m, n, A, m, S, U, m, V, k);
            break;
        case SVD:
            if (t == 'd')
                LAPACKE_dgesvd(LAPACK_COL_MAJOR, 'S', 'S', m, n, A, m, S, U, m, V, k, X);
            else if (t == 's')
                LAPACKE_sgesvd(LAPACK_COL_MAJOR, 'S', 'S', m, n, A, m, S, U, m, V, k, X);
            else if (t == 'z')
                LAPACKE_zgesvd(LAPACK_COL_MAJOR, 'S', 'S', m, n, A, m, S, U, m, V, k, X);
            else
                LAPACKE_cgesvd(LAPACK_COL_MAJOR, 'S', 'S', m, n, A, m, S, U, m, V, k, X);
            break;
        case EVD:
            if (t == 'd')
                LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'V', 'L', m, A, m, S);
            else if (t == 's')
                LAPACKE_ssyevd(LAPACK_COL_MAJOR, 'V', 'L', m, A, m, S);
            else if (t == 'z')
                LAPACKE_zheevd(LAPACK_COL_MAJOR, 'V', 'L', m, A, m, S);
            else
                LAPACKE_cheevd(LAPACK_COL_MAJOR, 'V', 'L', m, A, m, S);
            break;
        case GEEV:
            if (t == 'd')
                LAPACKE_dgeev(LAPACK_COL_MAJOR, 'N', 'V', m, A, m, S, (double *)S + m, NULL, 1, U, m);
            else if (t == 's')
                LAPACKE_sgeev(LAPACK_COL_MAJOR, 'N', 'V', m, A, m, S, (float *)S + m, NULL, 1, U, m);
            else if (t == 'z')
                LAPACKE_zgeev(LAPACK_COL_MAJOR, 'N', 'V', m, A, m, X, NULL, 1, U, m);
            else
                LAPACKE_cgeev(LAPACK_COL_MAJOR, 'N', 'V', m, A, m, X, NULL, 1, U, m);
            break;
        }
    } else
        ok = false;
    for (int i = 0; i < 6; i++)
        munmap(r[i].base, r[i].len);
    return ok;
}

static void drivers_stay_in_slack(void **state)
{
    (void)state;
#ifdef PB_ASAN
    skip();
#endif
    static const int dims[] = {1, 2, 3, 5, 8, 13, 17, 24, 31, 40, 64, 129};
    const int nd = (int)(sizeof dims / sizeof dims[0]);
    static const char types[4] = {'s', 'd', 'c', 'z'};
    pb_blas_init_threads(1);
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_segv;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_NODEFER;
    assert_int_equal(sigaction(SIGSEGV, &sa, &old), 0);
    int bad = 0;
    for (int drv = 0; drv < NDRIVERS; drv++)
        for (int ti = 0; ti < 4; ti++)
            for (int a = 0; a < nd; a++)
                for (int b = 0; b < nd; b++) {
                    int m = dims[a], n = dims[b];
                    if ((drv == EVD || drv == GEEV) && m != n)
                        continue;
                    if (!run(drv, types[ti], m, n)) {
                        if (bad++ < 10)
                            fprintf(stderr, "%c%s %dx%d read past its operands' tail slack\n", types[ti],
                                    driver_names[drv], m, n);
                    }
                }
    sigaction(SIGSEGV, &old, NULL);
    if (bad)
        fail_msg("%d driver runs read past PB_TAIL_SLACK", bad);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(drivers_stay_in_slack)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
