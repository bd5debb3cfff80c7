/* The polar family: left_polar (A = W·P, m ≥ n) and right_polar (A = P·Wh,
 * m ≤ n), through the SVD (factor_polar_t.h holds the math for one
 * dtype).  The gauge-free outputs need no finite-difference projection. */
#include "factor_common.h"
#include "../cuda/gpu_ops.h"

#include <float.h>

#define PB_T_BODY "factor_polar_t.h"
#include "dtype_t.h"

FZ_FORWARD(left_polar_forward)
FZ_FORWARD(right_polar_forward)
FZ_REVERSE(left_polar_reverse)
FZ_REVERSE(right_polar_reverse)

/* W (m×n) and P (n×n) for left_polar, P (m×m) and Wh (m×n) for
 * right_polar; the tape keeps W, V and S. */
static int polar_validate(pb_call_t *c, bool right, pb_err_t *err)
{
    int rc = pb__fz_check(c, false, err);
    if (rc)
        return rc;
    const pb_tensor_t *A = &c->in[0];
    const uint64_t m = A->shape[0], n = A->shape[1];
    const pb_dtype_t d = c->dtype, rd = pb_dtype_real(d);
    char s1[96];
    if (!right && m < n)
        return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.A",
                          "left_polar needs m >= n (A = W·P with W m×n), got shape %s; use right_polar",
                          pb_shape_str(A, s1, sizeof s1));
    if (right && m > n)
        return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.A",
                          "right_polar needs m <= n (A = P·Wh with Wh m×n), got shape %s; use left_polar",
                          pb_shape_str(A, s1, sizeof s1));
    const uint64_t p = right ? m : n; /* P is p×p */
    pb__fz_meta(c, right ? 1 : 0, d, m, (int64_t)n);
    pb__fz_meta(c, right ? 0 : 1, d, p, (int64_t)p);
    pb__fz_sized(c, pb__fz_bytes(d, m, n) + pb__fz_bytes(d, p, p) + pb__fz_bytes(rd, p, 1), false);
    return 0;
}

static int left_validate(pb_call_t *c, pb_err_t *err) { return polar_validate(c, false, err); }
static int right_validate(pb_call_t *c, pb_err_t *err) { return polar_validate(c, true, err); }

static const char *const out_WP[] = {"W", "P"}, *const out_PWh[] = {"P", "Wh"};

/* W is thin (m×n or its adjoint), as a compact factor is.  On the GPUs
 * too: the body runs there unchanged (factor_common.h). */
const pb_op_t pb_fz_polar_ops[] = {
    FZ_ROW_GPU("left_polar", FZ_COMPACT, out_WP, NULL, 0, left_validate, left_polar_forward, left_polar_reverse, NULL,
               NULL),
    FZ_ROW_GPU("right_polar", FZ_COMPACT, out_PWh, NULL, 0, right_validate, right_polar_forward, right_polar_reverse,
               NULL, NULL),
};
const int pb_fz_polar_nops = NELEM(pb_fz_polar_ops);
