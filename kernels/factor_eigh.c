/* The eigh family: eigh_{full,vals,trunc} of a Hermitian A (factor_eigh_t.h
 * holds the math for one dtype). */
#include "factor_common.h"
#include "../cuda/gpu_ops.h"

#define PB_T_BODY "factor_eigh_t.h"
#include "dtype_t.h"

FZ_FORWARD(eigh_forward)
FZ_REVERSE(eigh_reverse)
FZ_FD(eigh_fd)

/* eigh takes Hermitian matrices: the check's directions are replaced by
 * their Hermitian part. */
static void eigh_direction(const pb_call_t *c, int k, pb_tensor_t *dir)
{
    static void (*const fns[PB_NDTYPES])(pb_tensor_t *) = PB_T_FNS(eigh_direction);
    (void)c, (void)k;
    fns[dir->dtype](dir);
}

/* D (m) and V (m×m; eigh_trunc: at most m kept, the forward sets the
 * shapes); the tape keeps both but for eigh_vals, which keeps V. */
static int eigh_validate(pb_call_t *c, pb_err_t *err)
{
    int rc = pb__fz_check(c, true, err);
    if (rc)
        return rc;
    const uint64_t m = c->in[0].shape[0];
    const pb_dtype_t d = c->dtype, rd = pb_dtype_real(d);
    pb__fz_meta(c, 0, rd, m, -1);
    size_t tape = pb__fz_bytes(d, m, m);
    if (c->op->variant != FZ_VALS) {
        pb__fz_meta(c, 1, d, m, (int64_t)m);
        tape += pb__fz_bytes(rd, m, 1);
    }
    pb__fz_sized(c, tape, true);
    return 0;
}

static const pb_opt_spec_t o_eigh[] = {FZ_AUTO("herm_atol"), FZ_AUTO("degeneracy_atol"), FZ_AUTO("gauge_atol"),
                                       FZ_STRICT};
static const pb_opt_spec_t o_eigh_vals[] = {FZ_AUTO("herm_atol")};
static const pb_opt_spec_t o_eigh_trunc[] = {FZ_AUTO("herm_atol"), FZ_AUTO("degeneracy_atol"), FZ_AUTO("gauge_atol"),
                                             FZ_STRICT, FZ_TRUNC_OPTS};
static const char *const out_DV[] = {"D", "V"}, *const out_D[] = {"D"};

/* On the GPUs too: the body runs there unchanged (factor_common.h). */
#define EIGH_ROW(nm, var, outs, opts, fd)                                                                              \
    FZ_ROW_GPU(nm, var, outs, opts, NELEM(opts), eigh_validate, eigh_forward, eigh_reverse, fd, eigh_direction)
const pb_op_t pb_fz_eigh_ops[] = {
    EIGH_ROW("eigh_full", FZ_FULL, out_DV, o_eigh, eigh_fd),
    EIGH_ROW("eigh_vals", FZ_VALS, out_D, o_eigh_vals, NULL),
    EIGH_ROW("eigh_trunc", FZ_TRUNC, out_DV, o_eigh_trunc, eigh_fd),
};
const int pb_fz_eigh_nops = NELEM(pb_fz_eigh_ops);
