/* What the load and fault tests share: a set of small requests whose
 * answers are computed here (the reference), packing them, checking a
 * reply against its request, the daemon's resident memory and its stats.
 * Static functions, one copy per program; the private daemon itself comes
 * from tests/test_daemon.h.
 *
 * Glossary
 *   case      one op call with fixed inputs: fused_dense (f64 or f32, a few
 *             shapes and activations, x a matrix or a vector) or tensoradd
 *             (a permutation with alpha and beta).  Its expected output and,
 *             for the cotangent ybar it carries, its expected gradients
 *             with respect to every input are computed once, in double, from
 *             the very values sent (f32 inputs are rounded first).
 *   job       what a test does with a case: forward; or augmented_forward
 *             followed by reverse (which consumes the tape) or by release.
 *
 * Tolerances: relative to the largest expected magnitude of the tensor
 * (at least 1): 1e-11 for f64, 5e-5 for f32.  A reply paired with the wrong
 * request differs in shape or by far more than that. */
#ifndef PB_LOAD_COMMON_H
#define PB_LOAD_COMMON_H

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "test_daemon.h"
#include "pullbackd.h"

#define LC_MAX_IN 3
#define LC_MAX_ELEMS 256

typedef struct lc_tensor {
    int rank;
    uint64_t shape[3];
    size_t n;
    double v[LC_MAX_ELEMS];          /* expected values, C order */
} lc_tensor_t;

typedef struct lc_case {
    const char *op;                  /* "fused_dense" or "tensoradd" */
    const char *dtype;
    const char *act;                 /* fused_dense: the activation */
    int nin;
    const char *in_name[LC_MAX_IN];
    pb_ctensor_t in[LC_MAX_IN];      /* what is sent; data points into raw */
    unsigned char raw[LC_MAX_IN][LC_MAX_ELEMS * 8];
    const char *out_name;
    lc_tensor_t y;                   /* expected output */
    pb_ctensor_t ybar;               /* the cotangent sent to reverse */
    unsigned char ybar_raw[LC_MAX_ELEMS * 8];
    lc_tensor_t grad[LC_MAX_IN];     /* expected gradients, by input */
    double tol;
} lc_case_t;

/* ---- reference ------------------------------------------------------------ */

static unsigned lc_rand_state = 12345;

static inline double lc_rand(double lo, double hi)
{
    lc_rand_state = lc_rand_state * 1103515245u + 12345u;
    return lo + (hi - lo) * ((lc_rand_state >> 8) & 0xffffff) / (double)0x1000000;
}

static inline double lc_act(const char *a, double z, double *d)
{
    if (strcmp(a, "gelu") == 0) {
        const double c = sqrt(2 / M_PI), k = 0.044715;
        double t = tanh(c * (z + k * z * z * z));
        *d = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * k * z * z);
        return 0.5 * z * (1 + t);
    }
    if (strcmp(a, "relu") == 0) {
        *d = z > 0;
        return z > 0 ? z : 0;
    }
    if (strcmp(a, "tanh") == 0) {
        double t = tanh(z);
        *d = 1 - t * t;
        return t;
    }
    if (strcmp(a, "sigmoid") == 0) {
        double s = 1 / (1 + exp(-z));
        *d = s * (1 - s);
        return s;
    }
    *d = 1;
    return z;
}

/* Fill n values of dtype at raw from random numbers in [lo, hi); vals gets
 * them as sent (rounded to f32 where the dtype is f32). */
static inline void lc_fill(const char *dtype, unsigned char *raw, double *vals, size_t n, double lo, double hi)
{
    for (size_t i = 0; i < n; i++) {
        double v = lc_rand(lo, hi);
        if (strcmp(dtype, "f32") == 0) {
            float f = (float)v;
            memcpy(raw + 4 * i, &f, 4);
            v = f;
        } else {
            memcpy(raw + 8 * i, &v, 8);
        }
        vals[i] = v;
    }
}

static inline pb_ctensor_t lc_ctensor(const char *dtype, const void *data, int rank, uint64_t d0, uint64_t d1, uint64_t d2)
{
    pb_ctensor_t t = {.dtype = dtype, .rank = rank, .shape = {d0, d1, d2}, .order = 'C', .data = data};
    t.nbytes = pb_ctensor_count(&t) * pb_ctensor_itemsize(dtype);
    return t;
}

static inline void lc_shape(lc_tensor_t *t, int rank, uint64_t d0, uint64_t d1, uint64_t d2)
{
    t->rank = rank;
    t->shape[0] = d0, t->shape[1] = d1, t->shape[2] = d2;
    t->n = 1;
    for (int i = 0; i < rank; i++)
        t->n *= t->shape[i];
}

/* fused_dense: W out×in, x in×batch (batch 0: a vector), bias of out. */
static inline void lc_fused_dense(lc_case_t *k, const char *dtype, const char *act, size_t out, size_t in, size_t batch)
{
    static double W[LC_MAX_ELEMS], X[LC_MAX_ELEMS], B[LC_MAX_ELEMS], Yb[LC_MAX_ELEMS];
    size_t nb = batch ? batch : 1, isz = strcmp(dtype, "f32") == 0 ? 4 : 8;
    memset(k, 0, sizeof *k);
    k->op = "fused_dense";
    k->dtype = dtype;
    k->act = act;
    k->nin = 3;
    k->in_name[0] = "weight", k->in_name[1] = "x", k->in_name[2] = "bias";
    k->out_name = "y";
    k->tol = isz == 4 ? 5e-5 : 1e-11;
    lc_fill(dtype, k->raw[0], W, out * in, -0.5, 0.5);
    lc_fill(dtype, k->raw[1], X, in * nb, -1, 1);
    lc_fill(dtype, k->raw[2], B, out, -0.5, 0.5);
    lc_fill(dtype, k->ybar_raw, Yb, out * nb, -1, 1);
    k->in[0] = lc_ctensor(dtype, k->raw[0], 2, out, in, 0);
    k->in[1] = batch ? lc_ctensor(dtype, k->raw[1], 2, in, batch, 0) : lc_ctensor(dtype, k->raw[1], 1, in, 0, 0);
    k->in[2] = lc_ctensor(dtype, k->raw[2], 1, out, 0, 0);
    k->ybar = batch ? lc_ctensor(dtype, k->ybar_raw, 2, out, batch, 0) : lc_ctensor(dtype, k->ybar_raw, 1, out, 0, 0);
    if (batch) {
        lc_shape(&k->y, 2, out, batch, 0);
        lc_shape(&k->grad[1], 2, in, batch, 0);
    } else {
        lc_shape(&k->y, 1, out, 0, 0);
        lc_shape(&k->grad[1], 1, in, 0, 0);
    }
    lc_shape(&k->grad[0], 2, out, in, 0);
    lc_shape(&k->grad[2], 1, out, 0, 0);
    double dz[LC_MAX_ELEMS];
    for (size_t i = 0; i < out; i++)
        for (size_t j = 0; j < nb; j++) {
            double z = B[i], d;
            for (size_t l = 0; l < in; l++)
                z += W[i * in + l] * X[l * nb + j];
            k->y.v[i * nb + j] = lc_act(act, z, &d);
            dz[i * nb + j] = Yb[i * nb + j] * d;
        }
    for (size_t i = 0; i < out; i++)
        for (size_t l = 0; l < in; l++) {
            double s = 0;
            for (size_t j = 0; j < nb; j++)
                s += dz[i * nb + j] * X[l * nb + j];
            k->grad[0].v[i * in + l] = s;
        }
    for (size_t l = 0; l < in; l++)
        for (size_t j = 0; j < nb; j++) {
            double s = 0;
            for (size_t i = 0; i < out; i++)
                s += W[i * in + l] * dz[i * nb + j];
            k->grad[1].v[l * nb + j] = s;
        }
    for (size_t i = 0; i < out; i++) {
        double s = 0;
        for (size_t j = 0; j < nb; j++)
            s += dz[i * nb + j];
        k->grad[2].v[i] = s;
    }
}

#define LC_TA_ALPHA 0.5
#define LC_TA_BETA 2.0
/* tensoradd: C = beta·C + alpha·permute(A, [2, 0, 1]), A a×b×c, C c×a×b. */
static inline void lc_tensoradd(lc_case_t *k, const char *dtype, size_t a, size_t b, size_t c)
{
    static double A[LC_MAX_ELEMS], C[LC_MAX_ELEMS], G[LC_MAX_ELEMS];
    memset(k, 0, sizeof *k);
    k->op = "tensoradd";
    k->dtype = dtype;
    k->nin = 2;
    k->in_name[0] = "A", k->in_name[1] = "C";
    k->out_name = "C";
    k->tol = strcmp(dtype, "f32") == 0 ? 5e-5 : 1e-11;
    size_t n = a * b * c;
    lc_fill(dtype, k->raw[0], A, n, -1, 1);
    lc_fill(dtype, k->raw[1], C, n, -1, 1);
    lc_fill(dtype, k->ybar_raw, G, n, -1, 1);
    k->in[0] = lc_ctensor(dtype, k->raw[0], 3, a, b, c);
    k->in[1] = lc_ctensor(dtype, k->raw[1], 3, c, a, b);
    k->ybar = lc_ctensor(dtype, k->ybar_raw, 3, c, a, b);
    lc_shape(&k->y, 3, c, a, b);
    lc_shape(&k->grad[0], 3, a, b, c);
    lc_shape(&k->grad[1], 3, c, a, b);
    /* out[i0, i1, i2] = A[i1, i2, i0] */
    for (size_t i0 = 0; i0 < c; i0++)
        for (size_t i1 = 0; i1 < a; i1++)
            for (size_t i2 = 0; i2 < b; i2++) {
                size_t o = (i0 * a + i1) * b + i2, ai = (i1 * b + i2) * c + i0;
                k->y.v[o] = LC_TA_BETA * C[o] + LC_TA_ALPHA * A[ai];
                k->grad[0].v[ai] = LC_TA_ALPHA * G[o];
                k->grad[1].v[o] = LC_TA_BETA * G[o];
            }
}

/* The case table of the load test: a mix of ops, dtypes, shapes and
 * activations, all small (the daemon runs most of them on its loop
 * thread, the larger ones on workers). */
#define LC_NCASES 12
static lc_case_t lc_cases[LC_NCASES];

static inline void lc_cases_init(void)
{
    lc_fused_dense(&lc_cases[0], "f64", "gelu", 3, 4, 2);
    lc_fused_dense(&lc_cases[1], "f32", "gelu", 8, 16, 4);
    lc_fused_dense(&lc_cases[2], "f64", "relu", 16, 16, 8);
    lc_fused_dense(&lc_cases[3], "f32", "tanh", 5, 7, 0);
    lc_fused_dense(&lc_cases[4], "f64", "sigmoid", 8, 8, 8);
    lc_fused_dense(&lc_cases[5], "f64", "identity", 2, 2, 2);
    lc_fused_dense(&lc_cases[6], "f32", "relu", 16, 12, 10);
    lc_fused_dense(&lc_cases[7], "f64", "tanh", 6, 3, 0);
    lc_tensoradd(&lc_cases[8], "f64", 3, 4, 5);
    lc_tensoradd(&lc_cases[9], "f32", 2, 3, 4);
    lc_tensoradd(&lc_cases[10], "f64", 4, 4, 4);
    lc_fused_dense(&lc_cases[11], "f64", "gelu", 12, 16, 6);
}

/* ---- requests --------------------------------------------------------------- */

static inline void lc_pack_call(msgpack_packer *pk, const lc_case_t *k, bool taped)
{
    msgpack_pack_map(pk, taped ? 4 : 3);
    pb_pack_kv_str(pk, "op", k->op);
    pb_pack_str(pk, "inputs");
    msgpack_pack_map(pk, (size_t)k->nin);
    for (int i = 0; i < k->nin; i++) {
        pb_pack_str(pk, k->in_name[i]);
        pb_pack_tensor(pk, &k->in[i]);
    }
    pb_pack_str(pk, "options");
    if (strcmp(k->op, "fused_dense") == 0) {
        msgpack_pack_map(pk, 1);
        pb_pack_kv_str(pk, "act", k->act);
    } else {
        msgpack_pack_map(pk, 3);
        pb_pack_str(pk, "pA");
        msgpack_pack_array(pk, 3);
        msgpack_pack_int(pk, 2);
        msgpack_pack_int(pk, 0);
        msgpack_pack_int(pk, 1);
        pb_pack_str(pk, "alpha");
        msgpack_pack_double(pk, LC_TA_ALPHA);
        pb_pack_str(pk, "beta");
        msgpack_pack_double(pk, LC_TA_BETA);
    }
    if (taped) {
        pb_pack_str(pk, "wrt");
        msgpack_pack_array(pk, (size_t)k->nin);
        for (int i = 0; i < k->nin; i++)
            pb_pack_str(pk, k->in_name[i]);
    }
}

/* Begin (not send) a forward or augmented_forward of k. */
static inline void lc_begin_call(pb_client_t *c, const lc_case_t *k, bool taped)
{
    lc_pack_call(pb_client_begin(c, taped ? "augmented_forward" : "forward"), k, taped);
}

static inline void lc_begin_reverse(pb_client_t *c, const lc_case_t *k, uint64_t tape)
{
    msgpack_packer *pk = pb_client_begin(c, "reverse");
    msgpack_pack_map(pk, 2);
    pb_pack_str(pk, "tape");
    msgpack_pack_uint64(pk, tape);
    pb_pack_str(pk, "cotangents");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, k->out_name);
    pb_pack_tensor(pk, &k->ybar);
}

static inline void lc_begin_release(pb_client_t *c, uint64_t tape)
{
    msgpack_packer *pk = pb_client_begin(c, "release");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "tape");
    msgpack_pack_uint64(pk, tape);
}

/* ---- checking replies ---------------------------------------------------- */

/* Does tensor o match want (dtype of k, shape, values within k->tol)?  On a
 * mismatch, say why in why. */
static inline bool lc_tensor_ok(const lc_case_t *k, const msgpack_object *o, const lc_tensor_t *want, char *why,
                         size_t len)
{
    pb_ctensor_t t;
    double v[LC_MAX_ELEMS];
    if (o == NULL || pb_obj_tensor(o, &t) < 0) {
        snprintf(why, len, "missing or malformed tensor");
        return false;
    }
    if (strcmp(t.dtype, k->dtype) != 0 || t.rank != want->rank || t.order == 'F') {
        snprintf(why, len, "dtype %s rank %d order %c, expected %s rank %d order C", t.dtype, t.rank,
                 t.order ? t.order : 'C', k->dtype, want->rank);
        return false;
    }
    for (int i = 0; i < t.rank; i++)
        if (t.shape[i] != want->shape[i]) {
            snprintf(why, len, "dimension %d is %llu, expected %llu", i, (unsigned long long)t.shape[i],
                     (unsigned long long)want->shape[i]);
            return false;
        }
    if (pb_ctensor_copy_f64(&t, v, LC_MAX_ELEMS) < 0) {
        snprintf(why, len, "cannot read the values");
        return false;
    }
    double scale = 1;
    for (size_t i = 0; i < want->n; i++)
        scale = fmax(scale, fabs(want->v[i]));
    for (size_t i = 0; i < want->n; i++)
        if (!(fabs(v[i] - want->v[i]) <= k->tol * scale)) {
            snprintf(why, len, "element %zu is %.17g, expected %.17g", i, v[i], want->v[i]);
            return false;
        }
    return true;
}

/* The output of a forward or augmented_forward of k. */
static inline bool lc_outputs_ok(const lc_case_t *k, const msgpack_object *result, char *why, size_t len)
{
    const msgpack_object *outs = pb_obj_get(result, "outputs");
    if (outs == NULL || outs->type != MSGPACK_OBJECT_MAP || outs->via.map.size != 1) {
        snprintf(why, len, "outputs is not a map of one tensor");
        return false;
    }
    return lc_tensor_ok(k, pb_obj_get(outs, k->out_name), &k->y, why, len);
}

static inline bool lc_gradients_ok(const lc_case_t *k, const msgpack_object *result, char *why, size_t len)
{
    const msgpack_object *g = pb_obj_get(result, "gradients");
    if (g == NULL || g->type != MSGPACK_OBJECT_MAP || g->via.map.size != (uint32_t)k->nin) {
        snprintf(why, len, "gradients is not a map of %d tensors", k->nin);
        return false;
    }
    for (int i = 0; i < k->nin; i++) {
        char sub[200];
        if (!lc_tensor_ok(k, pb_obj_get(g, k->in_name[i]), &k->grad[i], sub, sizeof sub)) {
            snprintf(why, len, "gradient %s: %s", k->in_name[i], sub);
            return false;
        }
    }
    return true;
}

/* ---- the daemon from outside -------------------------------------------- */

/* VmRSS of pid in bytes, 0 when unreadable. */
static inline uint64_t lc_rss(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    uint64_t v = 0;
    while (fgets(line, sizeof line, f) != NULL) {
        unsigned long long kb;
        if (sscanf(line, "VmRSS: %llu kB", &kb) == 1) {
            v = (uint64_t)kb * 1024;
            break;
        }
    }
    fclose(f);
    return v;
}

typedef struct lc_stats {
    uint64_t tapes, tape_bytes, connections, requests_served, requests_in_flight;
} lc_stats_t;

/* One stats call; -1 when it failed. */
static inline int lc_get_stats(pb_client_t *c, lc_stats_t *s)
{
    pb_reply_t r;
    msgpack_pack_map(pb_client_begin(c, "stats"), 0);
    if (pb_client_call(c, &r) < 0)
        return -1;
    int rc = r.error != NULL ||
             pb_obj_uint(pb_obj_get(r.result, "tapes"), &s->tapes) < 0 ||
             pb_obj_uint(pb_obj_get(r.result, "tape_bytes"), &s->tape_bytes) < 0 ||
             pb_obj_uint(pb_obj_get(r.result, "connections"), &s->connections) < 0 ||
             pb_obj_uint(pb_obj_get(r.result, "requests_served"), &s->requests_served) < 0 ||
             pb_obj_uint(pb_obj_get(r.result, "requests_in_flight"), &s->requests_in_flight) < 0
                 ? -1 : 0;
    pb_reply_free(&r);
    return rc;
}

/* Wait (up to timeout_ms) until the daemon is quiet: conns connections
 * open (the caller's included), nothing in flight, no tape held.  0 when it
 * got there; -1 with the last stats in *s otherwise. */
static inline int lc_wait_quiet(pb_client_t *c, uint64_t conns, int timeout_ms, lc_stats_t *s)
{
    uint64_t deadline = now_ns() + (uint64_t)timeout_ms * 1000000u;
    for (;;) {
        if (lc_get_stats(c, s) < 0)
            return -1;
        if (s->connections == conns && s->requests_in_flight == 0 && s->tapes == 0)
            return 0;
        if (now_ns() > deadline)
            return -1;
        usleep(2000);
    }
}

/* ---- failures, from any thread -------------------------------------------- */

static atomic_int lc_failures;
static pthread_mutex_t lc_fail_lock = PTHREAD_MUTEX_INITIALIZER;

/* Count a failure and print the first few. */
static inline void lc_fail(const char *fmt, ...)
{
    int n = atomic_fetch_add(&lc_failures, 1);
    if (n >= 10)
        return;
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&lc_fail_lock);
    fprintf(stderr, "FAIL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    pthread_mutex_unlock(&lc_fail_lock);
    va_end(ap);
}

/* Built with AddressSanitizer or ThreadSanitizer (and the daemon with it)?
 * ASan's quarantine keeps freed memory resident on purpose, TSan maps
 * shadow memory for what the daemon touches: resident-memory bounds are
 * reported but not enforced. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define LC_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define LC_ASAN 1
#endif
#endif
#ifndef LC_ASAN
#define LC_ASAN 0
#endif

#endif
