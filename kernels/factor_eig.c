/* The eig family: eig_{full,vals} of a general square A, through geev
 * (factor_eig_t.h holds the math for one dtype). */
#include "factor_common.h"

#define PB_T_BODY "factor_eig_t.h"
#include "dtype_t.h"

FZ_FORWARD(eig_forward)
FZ_REVERSE(eig_reverse)
FZ_FD(eig_fd)

/* D (m) and V (m×m), complex whatever A is; the tape keeps both, but for
 * eig_vals, which keeps V. */
static int eig_validate(pb_call_t *c, pb_err_t *err)
{
    int rc = pb__fz_check(c, true, err);
    if (rc)
        return rc;
    const uint64_t m = c->in[0].shape[0];
    const pb_dtype_t cd = pb_dtype_complex(c->dtype);
    pb__fz_meta(c, 0, cd, m, -1);
    size_t tape = pb__fz_bytes(cd, m, m);
    if (c->op->variant == FZ_FULL) {
        pb__fz_meta(c, 1, cd, m, (int64_t)m);
        tape += pb__fz_bytes(cd, m, 1);
    }
    pb__fz_sized(c, tape, true);
    return 0;
}

static const pb_opt_spec_t o_eig[] = {FZ_AUTO("degeneracy_atol"), FZ_AUTO("gauge_atol"), FZ_STRICT};
static const char *const out_DV[] = {"D", "V"}, *const out_D[] = {"D"};

const pb_op_t pb_fz_eig_ops[] = {
    FZ_ROW("eig_full", FZ_FULL, out_DV, o_eig, NELEM(o_eig), eig_validate, eig_forward, eig_reverse, eig_fd, NULL),
    FZ_ROW("eig_vals", FZ_VALS, out_D, NULL, 0, eig_validate, eig_forward, eig_reverse, NULL, NULL),
};
const int pb_fz_eig_nops = NELEM(pb_fz_eig_ops);
