#include "check.h"

#include <math.h>
#include <string.h>

/* xorshift64* and Box-Muller: reproducible normal deviates from a seed. */
static double rnd_unit(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return (double)((*s * 2685821657736338717ull) >> 11) * 0x1.0p-53;
}

static double rnd_normal(uint64_t *s)
{
    double u = rnd_unit(s), v = rnd_unit(s);
    return sqrt(-2.0 * log(u + 0x1.0p-60)) * cos(6.283185307179586 * v);
}

/* Number of real components of a tensor. */
static size_t ncomp(const pb_tensor_t *t)
{
    return pb_tensor_count(t) * (pb_dtype_is_complex(t->dtype) ? 2 : 1);
}

static bool single(pb_dtype_t d) { return d == PB_F32 || d == PB_C64; }

static double comp_get(const pb_tensor_t *t, size_t i)
{
    const void *p = pb_tensor_data(t);
    return single(t->dtype) ? ((const float *)p)[i] : ((const double *)p)[i];
}

static void comp_set(pb_tensor_t *t, size_t i, double v)
{
    void *p = pb_tensor_data(t);
    if (single(t->dtype))
        ((float *)p)[i] = (float)v;
    else
        ((double *)p)[i] = v;
}

/* dst = a new tensor of dtype d (and a's shape/order) holding a + t·v. */
static int axpy_to(pb_tensor_t *dst, pb_dtype_t d, const pb_tensor_t *a, double t, const pb_tensor_t *v)
{
    int rc = pb_tensor_alloc(dst, d, a->rank, a->shape, a->order, false);
    if (rc)
        return rc;
    size_t n = ncomp(a);
    for (size_t i = 0; i < n; i++)
        comp_set(dst, i, comp_get(a, i) + (v ? t * comp_get(v, i) : 0.0));
    return 0;
}

static int random_like(pb_tensor_t *dst, const pb_tensor_t *meta, char order, uint64_t *s)
{
    int rc = pb_tensor_alloc(dst, meta->dtype, meta->rank, meta->shape, order, false);
    if (rc)
        return rc;
    size_t n = ncomp(dst);
    for (size_t i = 0; i < n; i++)
        comp_set(dst, i, rnd_normal(s));
    return 0;
}

/* In long double: a gradient of 1e200 (Q of a QR at 1e-200 has one) still
 * squares into range, where the double would overflow and every error
 * divided by it would read 0.  (x86-64's 80-bit long double, or aarch64's
 * quad; where long double is double, the old overflow is back.) */
static long double dot(const pb_tensor_t *a, const pb_tensor_t *b)
{
    size_t n = ncomp(a);
    long double s = 0;
    for (size_t i = 0; i < n; i++)
        s += (long double)comp_get(a, i) * comp_get(b, i);
    return s;
}

/* L = Re⟨ȳ, f(inputs of c with input k moved by t·v)⟩, in double. */
static int loss_at(const pb_call_t *c, pb_dtype_t hd, int k, double t, const pb_tensor_t *v,
                   const pb_tensor_t *cot, double *out, pb_err_t *err)
{
    pb_call_t h = {0};
    h.op = c->op;
    h.device = c->device;
    h.dtype = hd;
    h.order = 'C';
    memcpy(h.opt, c->opt, sizeof h.opt);
    if (k >= c->op->ninputs) { /* alpha or beta moved by t·v (v rank 0) */
        pb_optval_t *o = &h.opt[pb_op_option_index(c->op, c->op->wrt_names[k], strlen(c->op->wrt_names[k]))];
        o->re += t * comp_get(v, 0);
        if (pb_dtype_is_complex(v->dtype))
            o->im += t * comp_get(v, 1);
    }
    int rc = 0;
    for (int i = 0; i < c->op->ninputs && rc == 0; i++)
        if (c->in[i].storage)
            rc = axpy_to(&h.in[i], hd, &c->in[i], t, i == k ? v : NULL);
    if (rc == 0)
        rc = c->op->validate(&h, err);
    if (rc == 0)
        rc = pb_op_run_forward(&h, NULL, err);
    double l = 0;
    for (int o = 0; rc == 0 && o < c->op->noutputs; o++) {
        pb_tensor_t ch = {0};
        if (!pb_tensor_same_shape(&h.out[o], &cot[o]))
            rc = pb_err_set(err, PB_ENUMERICAL, "inputs",
                            "output %s changed shape under the finite-difference step (a truncation moved)",
                            c->op->outputs[o]);
        else if ((rc = pb_tensor_to_order(&ch, &h.out[o], cot[o].order)) == 0) {
            size_t n = ncomp(&ch);
            for (size_t i = 0; i < n; i++)
                l += comp_get(&cot[o], i) * comp_get(&ch, i);
        }
        pb_tensor_clear(&ch);
    }
    pb_call_clear(&h);
    if (rc)
        return rc;
    *out = l;
    return 0;
}

int pb_check_run(pb_call_t *c, uint64_t seed, double *max_rel, double per_input[PB_MAX_IO + 2], pb_err_t *err)
{
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
    if (s == 0)
        s = 1;
    pb_dtype_t hd = c->dtype == PB_F32 ? PB_F64 : c->dtype == PB_C64 ? PB_C128 : c->dtype;
    pb_tapedata_t tape;
    pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}}, dir = {0};
    pb_warnings_t warn = {0};
    double worst = 0;
    c->taped = true;
    int rc = pb_op_run_forward(c, &tape, err);
    if (rc)
        return rc;
    for (int o = 0; o < c->op->noutputs && rc == 0; o++)
        rc = random_like(&cot[o], &tape.out_meta[o], 'C', &s);
    if (rc == 0 && c->op->fd_cotangents)
        rc = c->op->fd_cotangents(c, cot);
    if (rc == 0)
        rc = pb_op_run_reverse(&tape, cot, grad, 'C', &warn, err);
    for (int k = 0; rc == 0 && k < c->op->nwrt; k++) {
        per_input[k] = 0;
        if (!(c->wrt & (1u << k)))
            continue;
        pb_tensor_t gc = {0};
        const pb_tensor_t *x = k < c->op->ninputs ? &c->in[k] : &grad[k];
        if ((rc = random_like(&dir, x, x->order, &s)) || (rc = pb_tensor_to_order(&gc, &grad[k], x->order))) {
            pb_tensor_clear(&gc);
            break;
        }
        if (c->op->fd_direction && k < c->op->ninputs)
            c->op->fd_direction(c, k, &dir);
        double amax = 0;
        if (k >= c->op->ninputs) {
            /* a scalar: a real one (sent as a number) moves along the reals */
            const pb_optval_t *o =
                &c->opt[pb_op_option_index(c->op, c->op->wrt_names[k], strlen(c->op->wrt_names[k]))];
            if (pb_dtype_is_complex(dir.dtype) && !o->cplx)
                comp_set(&dir, 1, 0.0);
            amax = hypot(o->re, o->im);
        } else
            for (size_t i = 0; i < ncomp(x); i++)
                amax = fmax(amax, fabs(comp_get(x, i)));
        /* Two steps for an input under 1 in size: one relative to it (an
         * absolute step would pass an input of 1e-20 altogether) and the
         * step of size 1 (a relative one drowns in the rounding of a loss
         * that other inputs make large); the error is the smaller.  Either
         * difference is accurate where it applies, so a wrong rule fails
         * both and a right one passes one.  (The relative step goes first:
         * the other may move a truncation, which gives it no estimate.) */
        const double step = c->op->fd_step > 0 ? c->op->fd_step : 1e-3;
        const bool small = amax > 0 && amax < 1;
        const double hs[2] = {step * (small ? amax : fmax(1.0, amax)), step};
        const long double an = dot(&gc, &dir), scale = sqrtl(dot(&gc, &gc) * dot(&dir, &dir));
        double e = INFINITY;
        for (int t = 0; t < (small ? 2 : 1) && rc == 0; t++) {
            double h = hs[t], l[4];
            const double ts[4] = {h, -h, 2 * h, -2 * h};
            for (int j = 0; j < 4 && rc == 0; j++)
                rc = loss_at(c, hd, k, ts[j], &dir, cot, &l[j], err);
            if (rc && t == 1) { /* a step past the input's scale may move a truncation: no estimate */
                rc = 0;
                break;
            }
            if (rc)
                break;
            long double fd = (8.0L * (l[0] - l[1]) - (l[2] - l[3])) / (12.0L * h);
            e = fmin(e, scale == 0 ? (fabsl(fd) > 0 ? 1.0 : 0.0) : (double)(fabsl(an - fd) / scale));
        }
        if (rc == 0) {
            per_input[k] = e;
            worst = fmax(worst, e);
        }
        pb_tensor_clear(&gc);
        pb_tensor_clear(&dir);
    }
    pb_tapedata_clear(&tape);
    for (int i = 0; i < PB_MAX_IO; i++)
        pb_tensor_clear(&cot[i]);
    for (int i = 0; i < PB_MAX_IO + 2; i++)
        pb_tensor_clear(&grad[i]);
    if (rc)
        return rc;
    *max_rel = worst;
    return 0;
}
