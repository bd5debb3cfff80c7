/* unit.fused_dense: forward against a naive reference, reverse against
 * finite differences, tape sizes, for every activation, f32 and f64,
 * every wrt subset, C and F orders of W, x and the outputs, bias or not,
 * vector x, zero-size dimensions.
 *
 * Tolerances: f64 gradients against a per-element central difference of
 * the f64 forward (h = 1e-6), relative error in norm <= 1e-6; f32
 * gradients against the same f64 difference (the f32 rule measured
 * against the exact derivative), relative <= 2e-4; forward f64 <= 1e-13,
 * f32 <= 2e-6 relative to max|y| + 1.
 *
 * With the argument "cuda" (meson: cuda.fused_dense) every test runs the
 * op on cuda:0 of the GPU backend's host fake (cuda/fake.h) instead: the
 * GPU op code against the same references, its results against the CPU
 * op's, its tape in device memory only, and no device byte left behind. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fake_gpu.h"
#include "kernels/act.h"
#include "kernels/op.h"

extern const pb_op_t pb_op_fused_dense;
enum { IW, IX, IB };

static uint64_t rng = 88172645463325252ull;
static double urand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

/* A tensor of dtype d, logical matrix m (rows × cols, row-major doubles),
 * stored in order o.  cols == 0 marks a vector. */
static void make(pb_tensor_t *t, pb_dtype_t d, const double *m, size_t rows, size_t cols, char o)
{
    uint64_t shape[2] = {rows, cols};
    int rank = cols ? 2 : 1;
    size_t c = cols ? cols : 1;
    assert_int_equal(pb_tensor_alloc(t, d, rank, shape, o, false), 0);
    for (size_t i = 0; i < rows; i++)
        for (size_t j = 0; j < c; j++) {
            size_t at = rank == 1 || o == 'C' ? i * c + j : j * rows + i;
            if (d == PB_F32)
                ((float *)pb_tensor_data(t))[at] = (float)m[i * c + j];
            else
                ((double *)pb_tensor_data(t))[at] = m[i * c + j];
        }
}

/* Element (i, j) of a rank-1 or rank-2 tensor as double. */
static double at(const pb_tensor_t *t, size_t i, size_t j)
{
    size_t idx = t->rank == 1 ? i : t->order == 'C' ? i * t->shape[1] + j : j * t->shape[0] + i;
    return t->dtype == PB_F32 ? ((const float *)pb_tensor_data(t))[idx] : ((const double *)pb_tensor_data(t))[idx];
}


typedef struct {
    size_t out, in, batch; /* batch 0: vector x */
    int act;
    pb_dtype_t d;
    char ow, ox, oy;
    bool bias;
    unsigned wrt;
    double W[64], X[64], B[8], Yb[64];
} fd_case_t;

static void setup_call_on(pb_call_t *c, pb_device_t on, const fd_case_t *k, pb_dtype_t d, const double *W,
                          const double *X, const double *B, bool taped)
{
    memset(c, 0, sizeof *c);
    c->op = &pb_op_fused_dense;
    c->device = on;
    c->dtype = d;
    c->order = k->oy;
    c->taped = taped;
    c->wrt = taped ? k->wrt : 0;
    c->opt[0].given = true;
    c->opt[0].index = k->act;
    make(&c->in[IW], d, W, k->out, k->in, k->ow);
    make(&c->in[IX], d, X, k->in, k->batch, k->ox);
    if (k->bias)
        make(&c->in[IB], d, B, k->out, 0, 'C');
    pb_err_t err;
    assert_int_equal(pb_op_fused_dense.validate(c, &err), 0);
}

/* The call on the device under test. */
static void setup_call(pb_call_t *c, const fd_case_t *k, pb_dtype_t d, const double *W, const double *X,
                       const double *B, bool taped)
{
    setup_call_on(c, test_dev, k, d, W, X, B, taped);
}

/* On a GPU: the same call's result on the CPU agrees (relative to the
 * largest element: 1e-12 f64, 1e-5 f32), and a tape holds device memory
 * only. */
static void same_as_cpu(const pb_tensor_t *got, const pb_tensor_t *cpu, const char *what)
{
    if (test_dev.kind == PB_DEV_CPU)
        return;
    assert_true(pb_tensor_same_shape(got, cpu));
    assert_int_equal(got->storage->kind, PB_STORAGE_HEAP);
    size_t rows = got->shape[0], cols = got->rank == 2 ? got->shape[1] : 1;
    double big = 0, diff = 0;
    for (size_t i = 0; i < rows; i++)
        for (size_t j = 0; j < cols; j++) {
            big = fmax(big, fabs(at(cpu, i, j)));
            diff = fmax(diff, fabs(at(got, i, j) - at(cpu, i, j)));
        }
    if (diff > (got->dtype == PB_F32 ? 1e-5 : 1e-12) * fmax(big, 1e-300) && diff > 0)
        fail_msg("%s: cuda:0 differs from the CPU by %g (largest %g)", what, diff, big);
}

static void tape_on_device(const pb_tapedata_t *t)
{
    if (test_dev.kind == PB_DEV_CPU)
        return;
    for (int i = 0; i < PB_MAX_SAVED; i++)
        if (t->saved[i].storage) {
            assert_int_equal(t->saved[i].storage->kind, PB_STORAGE_DEVICE);
            assert_int_equal(t->saved[i].storage->device.kind, PB_DEV_CUDA);
        }
}

/* L = Σ ȳ ⊙ f(W, x, b) in double precision. */
static double loss(const fd_case_t *k, const double *W, const double *X, const double *B)
{
    pb_call_t c;
    pb_err_t err;
    setup_call_on(&c, (pb_device_t){PB_DEV_CPU, 0}, k, PB_F64, W, X, B, false);
    assert_int_equal(pb_op_run_forward(&c, NULL, &err), 0);
    size_t nb = k->batch ? k->batch : 1;
    double l = 0;
    for (size_t i = 0; i < k->out; i++)
        for (size_t j = 0; j < nb; j++)
            l += k->Yb[i * nb + j] * at(&c.out[0], i, j);
    pb_call_clear(&c);
    return l;
}

static double ref_act(int act, double z)
{
    switch (act) {
    case PB_ACT_IDENTITY: return z;
    case PB_ACT_RELU: return z > 0 ? z : 0;
    case PB_ACT_LEAKYRELU: return z > 0 ? z : 0.01 * z;
    case PB_ACT_SIGMOID: return 1 / (1 + exp(-z));
    case PB_ACT_TANH: return tanh(z);
    case PB_ACT_GELU: return 0.5 * z * (1 + tanh(sqrt(2 / M_PI) * (z + 0.044715 * z * z * z)));
    case PB_ACT_GELU_ERF: return 0.5 * z * (1 + erf(z / sqrt(2.0)));
    case PB_ACT_SILU: return z / (1 + exp(-z));
    case PB_ACT_SOFTPLUS: return log1p(exp(z));
    case PB_ACT_ELU: return z > 0 ? z : expm1(z);
    }
    return NAN;
}

static size_t expected_tape(const fd_case_t *k)
{
    size_t isz = k->d == PB_F32 ? 4 : 8, nb = k->batch ? k->batch : 1;
    size_t n = 0;
    if (!k->wrt)
        return 0;
    if (pb_act_src[k->act] != PB_ACT_FROM_NONE)
        n += k->out * nb * isz;
    if (k->wrt & (1u << IW))
        n += k->in * nb * isz;
    if (k->wrt & (1u << IX))
        n += k->out * k->in * isz;
    return n;
}

static void run_case(fd_case_t *k)
{
    size_t nb = k->batch ? k->batch : 1;
    /* Keep z away from the kinks at 0 so differences are smooth. */
    for (int tries = 0;; tries++) {
        for (size_t i = 0; i < k->out * k->in; i++)
            k->W[i] = urand();
        for (size_t i = 0; i < k->in * nb; i++)
            k->X[i] = urand() * 1.5;
        for (size_t i = 0; i < k->out; i++)
            k->B[i] = k->bias ? urand() : 0;
        for (size_t i = 0; i < k->out * nb; i++)
            k->Yb[i] = urand();
        double zmin = INFINITY;
        for (size_t i = 0; i < k->out; i++)
            for (size_t j = 0; j < nb; j++) {
                double z = k->B[i];
                for (size_t l = 0; l < k->in; l++)
                    z += k->W[i * k->in + l] * k->X[l * nb + j];
                zmin = fmin(zmin, fabs(z));
            }
        if (zmin > 1e-2 || tries > 100)
            break;
    }
    pb_call_t c;
    pb_tapedata_t tape;
    pb_err_t err;
    setup_call(&c, k, k->d, k->W, k->X, k->B, true);
    assert_int_equal(c.tape_bytes, expected_tape(k));
    assert_int_equal(pb_op_run_forward(&c, &tape, &err), 0);
    assert_int_equal(pb_tapedata_bytes(&tape), expected_tape(k));
    tape_on_device(&tape);
    pb_call_t ref;
    pb_tapedata_t ref_tape;
    setup_call_on(&ref, (pb_device_t){PB_DEV_CPU, 0}, k, k->d, k->W, k->X, k->B, true);
    assert_int_equal(pb_op_run_forward(&ref, &ref_tape, &err), 0);
    same_as_cpu(&c.out[0], &ref.out[0], "y");

    /* Forward against the naive reference. */
    double ymax = 0, yerr = 0;
    for (size_t i = 0; i < k->out; i++)
        for (size_t j = 0; j < nb; j++) {
            double z = k->B[i];
            for (size_t l = 0; l < k->in; l++) {
                double w = k->W[i * k->in + l], x = k->X[l * nb + j];
                if (k->d == PB_F32)
                    w = (float)w, x = (float)x;
                z += w * x;
            }
            if (k->d == PB_F32)
                z += (float)k->B[i] - k->B[i];
            double r = ref_act(k->act, z);
            ymax = fmax(ymax, fabs(r));
            yerr = fmax(yerr, fabs(at(&c.out[0], i, j) - r));
        }
    double ytol = k->d == PB_F32 ? 2e-6 : 1e-13;
    if (yerr > ytol * (ymax + 1))
        fail_msg("forward %s %s: error %g", pb_act_names[k->act], k->d == PB_F32 ? "f32" : "f64", yerr);
    assert_int_equal(c.out[0].order, k->batch ? k->oy : c.out[0].order);

    /* Reverse. */
    pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
    /* ȳ in the output's order for odd wrt sets, in the other order (so it is
     * reordered first) for even ones. */
    make(&cot[0], k->d, k->Yb, k->out, k->batch, (k->wrt & 1) ? k->oy : k->oy == 'C' ? 'F' : 'C');
    pb_warnings_t warn = {0};
    assert_int_equal(pb_op_run_reverse(&tape, cot, grad, k->oy, &warn, &err), 0);
    pb_tensor_t ref_grad[PB_MAX_IO + 2] = {{0}};
    assert_int_equal(pb_op_run_reverse(&ref_tape, cot, ref_grad, k->oy, &warn, &err), 0);
    for (int a = 0; a < 3; a++)
        if (k->wrt & (1u << a))
            same_as_cpu(&grad[a], &ref_grad[a], pb_op_fused_dense.inputs[a].name);

    const double h = 1e-6;
    double *args[3] = {k->W, k->X, k->B};
    size_t rows[3] = {k->out, k->in, k->out}, cols[3] = {k->in, nb, 1};
    for (int a = 0; a < 3; a++) {
        if (!(k->wrt & (1u << a))) {
            assert_null(grad[a].storage);
            continue;
        }
        assert_non_null(grad[a].storage);
        assert_int_equal(grad[a].dtype, k->d);
        assert_true(pb_tensor_same_shape(&grad[a], &c.in[a]));
        double num = 0, den = 0;
        for (size_t i = 0; i < rows[a]; i++)
            for (size_t j = 0; j < cols[a]; j++) {
                double *p = &args[a][i * cols[a] + j], keep = *p;
                *p = keep + h;
                double lp = loss(k, k->W, k->X, k->B);
                *p = keep - h;
                double lm = loss(k, k->W, k->X, k->B);
                *p = keep;
                double fd = (lp - lm) / (2 * h), g = at(&grad[a], i, j);
                num += (g - fd) * (g - fd);
                den += fd * fd;
            }
        double rel = sqrt(num) / fmax(sqrt(den), 1e-300);
        double tol = k->d == PB_F32 ? 2e-4 : 1e-6;
        if (den == 0 && num == 0)
            rel = 0;
        if (rel > tol)
            fail_msg("%s %s wrt %s (W %c x %c y %c bias %d vec %d): relative error %g", pb_act_names[k->act],
                     k->d == PB_F32 ? "f32" : "f64", pb_op_fused_dense.inputs[a].name, k->ow, k->ox, k->oy, k->bias,
                     k->batch == 0, rel);
    }
    for (int i = 0; i < PB_MAX_IO + 2; i++) {
        pb_tensor_clear(&grad[i]);
        pb_tensor_clear(&ref_grad[i]);
    }
    pb_tensor_clear(&cot[0]);
    pb_tapedata_clear(&tape);
    pb_tapedata_clear(&ref_tape);
    pb_call_clear(&c);
    pb_call_clear(&ref);
}

static void fd_all(void **state)
{
    (void)state;
    static const char ords[2] = {'C', 'F'};
    int n = 0;
    for (int act = 0; act < PB_NACTS; act++)
        for (int d = 0; d < 2; d++)
            for (unsigned wrt = 1; wrt < 8; wrt++)
                for (int v = 0; v < 4; v++) {
                    fd_case_t k = {0};
                    k.act = act;
                    k.d = d ? PB_F64 : PB_F32;
                    k.wrt = wrt;
                    k.out = 3;
                    k.in = 4;
                    k.batch = v == 3 ? 0 : 5;
                    k.ow = ords[v & 1];
                    k.ox = ords[(v >> 1) & 1];
                    k.oy = ords[(v + wrt) & 1];
                    k.bias = (v + act) % 3 != 0 || wrt & 4;
                    if (!k.bias && (wrt & 4))
                        continue;
                    run_case(&k);
                    n++;
                }
    assert_true(n > 400);
}

/* Empty wrt: no tape bytes at all, for every activation. */
static void empty_wrt(void **state)
{
    (void)state;
    for (int act = 0; act < PB_NACTS; act++) {
        fd_case_t k = {.out = 2, .in = 2, .batch = 2, .act = act, .d = PB_F64, .ow = 'C', .ox = 'C', .oy = 'C',
                       .bias = true, .wrt = 0};
        pb_call_t c;
        pb_tapedata_t tape;
        pb_err_t err;
        for (int i = 0; i < 4; i++)
            k.W[i] = k.X[i] = 0.5;
        setup_call(&c, &k, PB_F64, k.W, k.X, k.B, true);
        assert_int_equal(c.tape_bytes, 0);
        assert_int_equal(pb_op_run_forward(&c, &tape, &err), 0);
        assert_int_equal(pb_tapedata_bytes(&tape), 0);
        pb_tapedata_clear(&tape);
        pb_call_clear(&c);
    }
}

/* Zero-size dimensions give zero-size results and zero gradients. */
static void zero_sizes(void **state)
{
    (void)state;
    const size_t dims[3][3] = {{0, 3, 2}, {2, 0, 3}, {2, 3, 0}};
    for (int z = 0; z < 3; z++) {
        fd_case_t k = {.out = dims[z][0], .in = dims[z][1], .batch = dims[z][2], .act = PB_ACT_GELU, .d = PB_F64,
                       .ow = 'C', .ox = 'F', .oy = 'C', .bias = true, .wrt = 7};
        for (int i = 0; i < 8; i++)
            k.B[i] = 0.25 * i;
        pb_call_t c;
        pb_tapedata_t tape;
        pb_err_t err;
        memset(&c, 0, sizeof c);
        c.op = &pb_op_fused_dense;
        c.device = test_dev;
        c.dtype = PB_F64;
        c.order = 'C';
        c.taped = true;
        c.wrt = 7;
        c.opt[0].given = true;
        c.opt[0].index = k.act;
        uint64_t ws[2] = {k.out, k.in}, xs[2] = {k.in, k.batch}, bs[1] = {k.out};
        assert_int_equal(pb_tensor_alloc(&c.in[IW], PB_F64, 2, ws, 'C', true), 0);
        assert_int_equal(pb_tensor_alloc(&c.in[IX], PB_F64, 2, xs, 'F', true), 0);
        assert_int_equal(pb_tensor_alloc(&c.in[IB], PB_F64, 1, bs, 'C', false), 0);
        for (size_t i = 0; i < k.out; i++)
            ((double *)pb_tensor_data(&c.in[IB]))[i] = k.B[i];
        assert_int_equal(pb_op_fused_dense.validate(&c, &err), 0);
        assert_int_equal(pb_op_run_forward(&c, &tape, &err), 0);
        assert_int_equal(c.out[0].shape[0], k.out);
        assert_int_equal(c.out[0].shape[1], k.batch);
        if (k.in == 0) /* y = gelu(b) broadcast */
            for (size_t i = 0; i < k.out; i++)
                for (size_t j = 0; j < k.batch; j++)
                    assert_true(fabs(at(&c.out[0], i, j) - ref_act(PB_ACT_GELU, k.B[i])) < 1e-15);
        pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
        assert_int_equal(pb_tensor_alloc(&cot[0], PB_F64, 2, c.out[0].shape, 'C', true), 0);
        pb_warnings_t warn = {0};
        assert_int_equal(pb_op_run_reverse(&tape, cot, grad, 'C', &warn, &err), 0);
        for (int a = 0; a < 3; a++) {
            assert_true(pb_tensor_same_shape(&grad[a], &c.in[a]));
            for (size_t i = 0; i < pb_tensor_count(&grad[a]); i++)
                assert_true(((double *)pb_tensor_data(&grad[a]))[i] == 0);
            pb_tensor_clear(&grad[a]);
        }
        pb_tensor_clear(&cot[0]);
        pb_tapedata_clear(&tape);
        pb_call_clear(&c);
    }
}

/* A missing cotangent is zero: zero gradients of the right shapes. */
static void missing_cotangent(void **state)
{
    (void)state;
    fd_case_t k = {.out = 3, .in = 2, .batch = 4, .act = PB_ACT_TANH, .d = PB_F32, .ow = 'F', .ox = 'C',
                   .oy = 'C', .bias = true, .wrt = 7};
    for (int i = 0; i < 12; i++)
        k.W[i] = k.X[i] = 0.1 * i;
    pb_call_t c;
    pb_tapedata_t tape;
    pb_err_t err;
    setup_call(&c, &k, PB_F32, k.W, k.X, k.B, true);
    assert_int_equal(pb_op_run_forward(&c, &tape, &err), 0);
    pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
    pb_warnings_t warn = {0};
    assert_int_equal(pb_op_run_reverse(&tape, cot, grad, 'F', &warn, &err), 0);
    for (int a = 0; a < 3; a++) {
        assert_true(pb_tensor_same_shape(&grad[a], &c.in[a]));
        for (size_t i = 0; i < pb_tensor_count(&grad[a]); i++)
            assert_true(((float *)pb_tensor_data(&grad[a]))[i] == 0);
        pb_tensor_clear(&grad[a]);
    }
    pb_tapedata_clear(&tape);
    pb_call_clear(&c);
}

/* NaN and Inf are values: they propagate through forward. */
static void nan_propagates(void **state)
{
    (void)state;
    for (int act = 0; act < PB_NACTS; act++) {
        fd_case_t k = {.out = 2, .in = 2, .batch = 2, .act = act, .d = PB_F64, .ow = 'C', .ox = 'C', .oy = 'C',
                       .bias = false, .wrt = 0};
        k.W[0] = NAN, k.W[1] = 1, k.W[2] = 1, k.W[3] = 1;
        k.X[0] = 1, k.X[1] = 1, k.X[2] = 1, k.X[3] = 1;
        pb_call_t c;
        pb_err_t err;
        setup_call(&c, &k, PB_F64, k.W, k.X, k.B, false);
        assert_int_equal(pb_op_run_forward(&c, NULL, &err), 0);
        assert_true(isnan(at(&c.out[0], 0, 0)));
        assert_false(isnan(at(&c.out[0], 1, 0)));
        pb_call_clear(&c);
    }
}

int main(int argc, char **argv)
{
#define T(f) cmocka_unit_test_teardown(f, fake_gpu_after)
    const struct CMUnitTest tests[] = {
        T(fd_all), T(empty_wrt), T(zero_sizes), T(missing_cotangent), T(nan_propagates),
    };
    if (fake_gpu_mode(argc, argv))
        return cmocka_run_group_tests_name("cuda.fused_dense (the host fake's cuda:0)", tests, NULL, NULL);
    return cmocka_run_group_tests_name("unit.fused_dense", tests, NULL, NULL);
}
