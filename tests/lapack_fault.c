/* LAPACK failures on demand, for the tests of the paths no real input
 * reaches: a driver that does not converge (info > 0), and the SVD's
 * gesdd → gesvd fallback.
 *
 * This file defines the LAPACKE drivers the factorizations call; each
 * looks up the failure spec and either returns the info it names or calls
 * the real driver (dlsym RTLD_NEXT).  It is linked into unit_factor, where
 * lapack_fault_set() sets the spec, and built as a module that a test
 * preloads into pullbackd (LD_PRELOAD), where $PB_LAPACK_FAULT does.
 *
 * Spec: comma-separated entries NAME[/N]=INFO, e.g. "zgesdd=3" (every
 * zgesdd call returns 3) or "dgesdd/7=5,dgesvd/7=2" (only calls whose
 * order n, the column count, is 7).  INFO "hang" makes the call never
 * return (it sleeps): a worker stuck in LAPACK, for the tests of what a
 * stop does about one.  lapack_fault_calls(NAME) counts the
 * calls of NAME since the last lapack_fault_set, lapack_fault_lda(NAME)
 * the leading dimension of A its last call passed and lapack_fault_job(NAME)
 * the job argument that asks for vectors (jobz, jobu or jobvr). */
#define _GNU_SOURCE
#include "lapack_fault.h"

#include <dlfcn.h>
#include <lapacke.h>
#include <stdatomic.h>
#include <stdio.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *set_spec; /* lapack_fault_set's spec; NULL: the environment's */
static int counting;          /* set by lapack_fault_set: single-threaded tests only */

#define NCOUNT 64
static struct {
    char name[16];
    atomic_int n, lda, job;
} counts[NCOUNT];

void lapack_fault_set(const char *spec)
{
    set_spec = spec;
    counting = 1;
    for (int i = 0; i < NCOUNT; i++) {
        counts[i].name[0] = 0;
        atomic_store(&counts[i].n, 0);
        atomic_store(&counts[i].lda, 0);
        atomic_store(&counts[i].job, 0);
    }
}

int lapack_fault_calls(const char *name)
{
    for (int i = 0; i < NCOUNT && counts[i].name[0]; i++)
        if (strcmp(counts[i].name, name) == 0)
            return atomic_load(&counts[i].n);
    return 0;
}

int lapack_fault_lda(const char *name)
{
    for (int i = 0; i < NCOUNT && counts[i].name[0]; i++)
        if (strcmp(counts[i].name, name) == 0)
            return atomic_load(&counts[i].lda);
    return 0;
}

char lapack_fault_job(const char *name)
{
    for (int i = 0; i < NCOUNT && counts[i].name[0]; i++)
        if (strcmp(counts[i].name, name) == 0)
            return (char)atomic_load(&counts[i].job);
    return 0;
}

static void count(const char *name, lapack_int lda, char job)
{
    if (!counting) /* in the daemon (many threads): not counted */
        return;
    for (int i = 0; i < NCOUNT; i++) {
        if (counts[i].name[0] == 0)
            snprintf(counts[i].name, sizeof counts[i].name, "%s", name);
        if (strcmp(counts[i].name, name) == 0) {
            atomic_fetch_add(&counts[i].n, 1);
            atomic_store(&counts[i].lda, (int)lda);
            atomic_store(&counts[i].job, job);
            return;
        }
    }
}

/* What fault_info returns for "hang". */
#define HANG INT_MIN

static void hang(void)
{
    for (;;)
        sleep(1000);
}

/* The info the spec names for a call of `name` with order n (and A's
 * leading dimension lda, its job argument), HANG, or 0. */
static lapack_int fault_info(const char *name, lapack_int n, lapack_int lda, char job)
{
    count(name, lda, job);
    const char *s = set_spec ? set_spec : getenv("PB_LAPACK_FAULT");
    size_t len = strlen(name);
    while (s && *s) {
        if (strncmp(s, name, len) == 0 && (s[len] == '=' || s[len] == '/')) {
            const char *p = s + len;
            long want = -1;
            if (*p == '/')
                want = strtol(p + 1, (char **)&p, 10);
            if (*p == '=' && (want < 0 || want == (long)n))
                return strncmp(p + 1, "hang", 4) == 0 ? HANG : (lapack_int)strtol(p + 1, NULL, 10);
        }
        s = strchr(s, ',');
        s = s ? s + 1 : NULL;
    }
    return 0;
}

/* The real driver, looked up once. */
static void *real(const char *name, _Atomic(void *) *slot)
{
    void *f = atomic_load(slot);
    if (f == NULL) {
        f = dlsym(RTLD_NEXT, name);
        if (f == NULL) {
            fprintf(stderr, "lapack_fault: %s not found: %s\n", name, dlerror());
            abort();
        }
        atomic_store(slot, f);
    }
    return f;
}

/* WRAP(name, n-argument, job argument (the one that asks for vectors) or
 * 0, (parameters, a and lda among them), (arguments)).
 * A failing call leaves A (its n columns) overwritten with NaN, as a
 * driver that fails part way may leave it: a fallback that forgets to
 * reload A fails its test. */
#define WRAP(NAME, N, JOB, PARAMS, ARGS)                                                                              \
    lapack_int LAPACKE_##NAME PARAMS                                                                                  \
    {                                                                                                                 \
        static _Atomic(void *) slot;                                                                                  \
        lapack_int info = fault_info(#NAME, N, lda, JOB);                                                             \
        if (info == HANG)                                                                                             \
            hang();                                                                                                   \
        if (info) {                                                                                                   \
            if (a && N > 0 && lda > 0)                                                                                \
                memset(a, 0xff, sizeof *a * (size_t)lda * (size_t)N);                                                 \
            return info;                                                                                              \
        }                                                                                                             \
        lapack_int(*f) PARAMS = (lapack_int(*) PARAMS)real("LAPACKE_" #NAME, &slot);                                  \
        return f ARGS;                                                                                                \
    }

#define SVD_FAMILY(L, T, RT)                                                                                          \
    WRAP(L##gesdd, n, jobz,                                                                                           \
         (int layout, char jobz, lapack_int m, lapack_int n, T *a, lapack_int lda, RT *s, T *u, lapack_int ldu,       \
          T *vt, lapack_int ldvt),                                                                                    \
         (layout, jobz, m, n, a, lda, s, u, ldu, vt, ldvt))                                                           \
    WRAP(L##gesvd, n, jobu,                                                                                           \
         (int layout, char jobu, char jobvt, lapack_int m, lapack_int n, T *a, lapack_int lda, RT *s, T *u,           \
          lapack_int ldu, T *vt, lapack_int ldvt, RT *superb),                                                        \
         (layout, jobu, jobvt, m, n, a, lda, s, u, ldu, vt, ldvt, superb))                                            \
    WRAP(L##geqrf, n, 0, (int layout, lapack_int m, lapack_int n, T *a, lapack_int lda, T *tau),                      \
         (layout, m, n, a, lda, tau))                                                                                 \
    WRAP(L##gelqf, n, 0, (int layout, lapack_int m, lapack_int n, T *a, lapack_int lda, T *tau),                      \
         (layout, m, n, a, lda, tau))                                                                                 \
    WRAP(L##potrf, n, 0, (int layout, char uplo, lapack_int n, T *a, lapack_int lda), (layout, uplo, n, a, lda))      \
    WRAP(L##getrf, n, 0, (int layout, lapack_int m, lapack_int n, T *a, lapack_int lda, lapack_int *ipiv),            \
         (layout, m, n, a, lda, ipiv))

#define Q_FAMILY(NAME, T)                                                                                             \
    WRAP(NAME, n, 0, (int layout, lapack_int m, lapack_int n, lapack_int k, T *a, lapack_int lda, const T *tau),      \
         (layout, m, n, k, a, lda, tau))

SVD_FAMILY(s, float, float)
SVD_FAMILY(d, double, double)
SVD_FAMILY(c, lapack_complex_float, float)
SVD_FAMILY(z, lapack_complex_double, double)
Q_FAMILY(sorgqr, float)
Q_FAMILY(dorgqr, double)
Q_FAMILY(cungqr, lapack_complex_float)
Q_FAMILY(zungqr, lapack_complex_double)
Q_FAMILY(sorglq, float)
Q_FAMILY(dorglq, double)
Q_FAMILY(cunglq, lapack_complex_float)
Q_FAMILY(zunglq, lapack_complex_double)

WRAP(ssyevd, n, jobz, (int layout, char jobz, char uplo, lapack_int n, float *a, lapack_int lda, float *w),
     (layout, jobz, uplo, n, a, lda, w))
WRAP(dsyevd, n, jobz, (int layout, char jobz, char uplo, lapack_int n, double *a, lapack_int lda, double *w),
     (layout, jobz, uplo, n, a, lda, w))
WRAP(cheevd, n, jobz,
     (int layout, char jobz, char uplo, lapack_int n, lapack_complex_float *a, lapack_int lda, float *w),
     (layout, jobz, uplo, n, a, lda, w))
WRAP(zheevd, n, jobz,
     (int layout, char jobz, char uplo, lapack_int n, lapack_complex_double *a, lapack_int lda, double *w),
     (layout, jobz, uplo, n, a, lda, w))

WRAP(sgeev, n, jobvr,
     (int layout, char jobvl, char jobvr, lapack_int n, float *a, lapack_int lda, float *wr, float *wi, float *vl,
      lapack_int ldvl, float *vr, lapack_int ldvr),
     (layout, jobvl, jobvr, n, a, lda, wr, wi, vl, ldvl, vr, ldvr))
WRAP(dgeev, n, jobvr,
     (int layout, char jobvl, char jobvr, lapack_int n, double *a, lapack_int lda, double *wr, double *wi,
      double *vl, lapack_int ldvl, double *vr, lapack_int ldvr),
     (layout, jobvl, jobvr, n, a, lda, wr, wi, vl, ldvl, vr, ldvr))
WRAP(cgeev, n, jobvr,
     (int layout, char jobvl, char jobvr, lapack_int n, lapack_complex_float *a, lapack_int lda,
      lapack_complex_float *w, lapack_complex_float *vl, lapack_int ldvl, lapack_complex_float *vr,
      lapack_int ldvr),
     (layout, jobvl, jobvr, n, a, lda, w, vl, ldvl, vr, ldvr))
WRAP(zgeev, n, jobvr,
     (int layout, char jobvl, char jobvr, lapack_int n, lapack_complex_double *a, lapack_int lda,
      lapack_complex_double *w, lapack_complex_double *vl, lapack_int ldvl, lapack_complex_double *vr,
      lapack_int ldvr),
     (layout, jobvl, jobvr, n, a, lda, w, vl, ldvl, vr, ldvr))
