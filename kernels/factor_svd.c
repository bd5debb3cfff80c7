/* The SVD family: svd_{compact,full,vals,trunc} (factor_svd_t.h holds the
 * math for one dtype; its svd_factor also serves the polar family). */
#include "factor_common.h"
#include "../cuda/gpu_ops.h"

#define PB_T_BODY "factor_svd_t.h"
#include "dtype_t.h"

FZ_FORWARD(svd_forward)
FZ_REVERSE(svd_reverse)
FZ_FD(svd_fd)

/* U (m×k, or m×m full), S (k), Vh (k×n, or n×n full); svd_trunc keeps at
 * most k, the forward sets the shapes; svd_vals returns S and its tape
 * keeps U, S and Vh. */
static int svd_validate(pb_call_t *c, pb_err_t *err)
{
    int rc = pb__fz_check(c, false, err);
    if (rc)
        return rc;
    const uint64_t m = c->in[0].shape[0], n = c->in[0].shape[1], k = m < n ? m : n;
    const pb_dtype_t d = c->dtype, rd = pb_dtype_real(d);
    const bool full = c->op->variant == FZ_FULL;
    size_t tape;
    if (c->op->variant == FZ_VALS) {
        pb__fz_meta(c, 0, rd, k, -1);
        tape = pb__fz_bytes(d, m, k) + pb__fz_bytes(rd, k, 1) + pb__fz_bytes(d, k, n);
    } else {
        uint64_t nu = full ? m : k, nv = full ? n : k;
        pb__fz_meta(c, 0, d, m, (int64_t)nu);
        pb__fz_meta(c, 1, rd, k, -1);
        pb__fz_meta(c, 2, d, nv, (int64_t)n);
        tape = pb__fz_bytes(d, m, nu) + pb__fz_bytes(rd, k, 1) + pb__fz_bytes(d, nv, n);
    }
    pb__fz_sized(c, tape, false);
    return 0;
}

static const pb_opt_spec_t o_svd[] = {FZ_AUTO("rank_atol"), FZ_AUTO("degeneracy_atol"), FZ_AUTO("gauge_atol"),
                                      FZ_STRICT};
static const pb_opt_spec_t o_svd_trunc[] = {FZ_AUTO("rank_atol"), FZ_AUTO("degeneracy_atol"), FZ_AUTO("gauge_atol"),
                                            FZ_STRICT, FZ_TRUNC_OPTS};
static const pb_opt_spec_t o_svd_vals[] = {FZ_AUTO("rank_atol")};
static const char *const out_USV[] = {"U", "S", "Vh"}, *const out_S[] = {"S"};

#define SVD_ROW(nm, var, outs, opts, nopts)                                                                            \
    FZ_ROW(nm, var, outs, opts, nopts, svd_validate, svd_forward, svd_reverse, svd_fd, NULL)
/* On the GPUs too (cuSOLVER's gesvd; the body runs there unchanged,
 * factor_common.h), but for svd_full, whose completions need the QR. */
#define SVD_ROW_GPU(nm, var, outs, opts, nopts)                                                                        \
    FZ_ROW_GPU(nm, var, outs, opts, nopts, svd_validate, svd_forward, svd_reverse, svd_fd, NULL)
const pb_op_t pb_fz_svd_ops[] = {
    SVD_ROW_GPU("svd_compact", FZ_COMPACT, out_USV, o_svd, NELEM(o_svd)),
    SVD_ROW("svd_full", FZ_FULL, out_USV, o_svd, NELEM(o_svd)),
    SVD_ROW_GPU("svd_vals", FZ_VALS, out_S, o_svd_vals, NELEM(o_svd_vals)),
    SVD_ROW_GPU("svd_trunc", FZ_TRUNC, out_USV, o_svd_trunc, NELEM(o_svd_trunc)),
};
const int pb_fz_svd_nops = NELEM(pb_fz_svd_ops);
