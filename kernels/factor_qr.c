/* The QR family: qr_{compact,full,null} and lq_{compact,full,null}, the
 * LQ forms through the adjoint where their pullback is QR's of Aᴴ
 * (factor_qr_t.h holds the math for one dtype). */
#include "factor_common.h"

#define PB_T_BODY "factor_qr_t.h"
#include "dtype_t.h"

FZ_FORWARD(qr_forward)
FZ_FORWARD(lq_forward)
FZ_REVERSE(qr_reverse)
FZ_REVERSE(lq_reverse)
FZ_FD(qr_fd)
FZ_FD(lq_fd)

/* Q (m×nq) and R (nq×n), nq = k or m; L (m×nl) and Q (nl×n), nl = k or n;
 * the null spaces N (m×(m−k)) and Nᴴ-shaped ((n−k)×n), whose tape also
 * keeps A. */
static int qrlq_validate(pb_call_t *c, bool lq, pb_err_t *err)
{
    int rc = pb__fz_check(c, false, err);
    if (rc)
        return rc;
    const uint64_t m = c->in[0].shape[0], n = c->in[0].shape[1], k = m < n ? m : n;
    const pb_dtype_t d = c->dtype;
    const bool full = c->op->variant == FZ_FULL;
    size_t tape;
    if (c->op->variant == FZ_NULL) {
        uint64_t r = lq ? n - k : m, cols = lq ? n : m - k;
        pb__fz_meta(c, 0, d, r, (int64_t)cols);
        tape = pb__fz_bytes(d, m, n) + pb__fz_bytes(d, r, cols);
    } else {
        uint64_t mid = full ? (lq ? n : m) : k;
        pb__fz_meta(c, 0, d, m, (int64_t)mid);
        pb__fz_meta(c, 1, d, mid, (int64_t)n);
        tape = pb__fz_bytes(d, m, mid) + pb__fz_bytes(d, mid, n);
    }
    pb__fz_sized(c, tape, false);
    return 0;
}

static int qr_validate(pb_call_t *c, pb_err_t *err) { return qrlq_validate(c, false, err); }
static int lq_validate(pb_call_t *c, pb_err_t *err) { return qrlq_validate(c, true, err); }

static const pb_opt_spec_t o_qr[] = {FZ_AUTO("rank_atol"), FZ_AUTO("gauge_atol"), FZ_STRICT};
static const char *const out_QR[] = {"Q", "R"}, *const out_LQ[] = {"L", "Q"}, *const out_N[] = {"N"};

#define QR_ROW(nm, var, outs, val, fwd, rev, fd) FZ_ROW(nm, var, outs, o_qr, NELEM(o_qr), val, fwd, rev, fd, NULL)
const pb_op_t pb_fz_qr_ops[] = {
    QR_ROW("qr_compact", FZ_COMPACT, out_QR, qr_validate, qr_forward, qr_reverse, qr_fd),
    QR_ROW("qr_full", FZ_FULL, out_QR, qr_validate, qr_forward, qr_reverse, qr_fd),
    QR_ROW("qr_null", FZ_NULL, out_N, qr_validate, qr_forward, qr_reverse, qr_fd),
    QR_ROW("lq_compact", FZ_COMPACT, out_LQ, lq_validate, lq_forward, lq_reverse, lq_fd),
    QR_ROW("lq_full", FZ_FULL, out_LQ, lq_validate, lq_forward, lq_reverse, lq_fd),
    QR_ROW("lq_null", FZ_NULL, out_N, lq_validate, lq_forward, lq_reverse, lq_fd),
};
const int pb_fz_qr_nops = NELEM(pb_fz_qr_ops);
