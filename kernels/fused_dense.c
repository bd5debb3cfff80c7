/* fused_dense: y = act.(W·x .+ b), LuxLib's fused_dense_bias_activation.
 *
 * Forward is one GEMM into y and one fused bias+activation pass over it.
 * Reverse is one pass for dz = ȳ ⊙ act′ (with b̄'s row sums folded in),
 * then W̄ = dz·xᵀ and x̄ = Wᵀ·dz as GEMMs that read the operands in the
 * order they arrived.  The tape is minimal for wrt: the activation's
 * source (y, or z where act′ does not follow from y; nothing for identity)
 * when any gradient is wanted, x only for W̄, W only for x̄. */
#include <stdlib.h>
#include <string.h>

#include "../cuda/gpu_ops.h"
#include "act.h"
#include "blas.h"
#include "fused_dense.h"
#include "op.h"
#include "par.h"

enum { IN_W, IN_X, IN_B };
enum { OPT_ACT };
enum { SAVED_SRC, SAVED_X, SAVED_W };

#define PB_T_BODY "fused_dense_t.h"
#define PB_T_REAL_ONLY
#include "dtype_t.h"

typedef void bias_act_fn(int act, void *y, void *zbuf, const void *b, size_t out, size_t batch, size_t ld,
                         char order);
typedef void dz_pass_fn(int act, void *dz, const void *yb, const void *s, double *bsum, size_t out, size_t batch,
                        size_t ld, char order);
typedef void store_bsum_fn(void *dst, const double *bsum, size_t out);
static bias_act_fn *const bias_acts[PB_NDTYPES] = PB_T_FNS_REAL(bias_act_any);
static dz_pass_fn *const dz_passes[PB_NDTYPES] = PB_T_FNS_REAL(dz_pass_any);
static store_bsum_fn *const store_bsums[PB_NDTYPES] = PB_T_FNS_REAL(store_bsum);

/* A bias+activation or dz pass over at least this many elements is split
 * across idle threads (at some 2 ns an element, an exp and the memory
 * traffic, about half a millisecond, as PAR_MADDS in blas.c), in pieces of
 * at least half of it. */
#define PAR_ELEMS 2.5e5
/* Row blocks of an F-ordered dz pass start at multiples of this many
 * elements, so that each element falls in the same vector lane or
 * remainder as unsplit (libmvec's and libm's results differ in the last
 * bits) and each piece's column segments keep their alignment. */
#define PAR_ROW_BLOCK 16

/* One pass, split into pieces: whole rows of a C-ordered matrix, whole
 * columns of an F-ordered bias_act, blocks of PAR_ROW_BLOCK rows of an
 * F-ordered dz pass (so each row's b̄ sum stays in one piece, in the same
 * order, and the results are bitwise those of the unsplit pass). */
typedef struct act_split {
    pb_dtype_t d;
    int act;
    char order;
    size_t out, batch, es;
    char *y, *zbuf;               /* bias_act: y, z or NULL, */
    const char *b;                /* and b or NULL */
    const char *yb, *s;           /* dz pass: ȳ, the source or NULL (y is dz), */
    double *bsum;                 /* and b̄'s sums or NULL */
} act_split_t;

static const char *offset(const char *p, size_t elems, size_t es)
{
    return p ? p + elems * es : NULL;
}

static void bias_act_piece(void *ctx, long lo, long hi)
{
    const act_split_t *a = ctx;
    size_t l = (size_t)lo, n = (size_t)(hi - lo);
    if (a->order == 'C') /* rows [lo, hi) */
        bias_acts[a->d](a->act, a->y + l * a->batch * a->es, (char *)offset(a->zbuf, l * a->batch, a->es),
                        offset(a->b, l, a->es), n, a->batch, a->batch, 'C');
    else /* columns [lo, hi) */
        bias_acts[a->d](a->act, a->y + l * a->out * a->es, (char *)offset(a->zbuf, l * a->out, a->es), a->b, a->out,
                        n, a->out, 'F');
}

static void dz_pass_piece(void *ctx, long lo, long hi)
{
    const act_split_t *a = ctx;
    size_t r0 = (size_t)lo, r1 = (size_t)hi, ld = a->order == 'C' ? a->batch : a->out;
    if (a->order == 'F') { /* row blocks [lo, hi) */
        r0 *= PAR_ROW_BLOCK;
        r1 = r1 * PAR_ROW_BLOCK < a->out ? r1 * PAR_ROW_BLOCK : a->out;
    }
    size_t at = a->order == 'C' ? r0 * ld : r0; /* element (r0, 0) */
    dz_passes[a->d](a->act, a->y + at * a->es, offset(a->yb, at, a->es), offset(a->s, at, a->es),
                    a->bsum ? a->bsum + r0 : NULL, r1 - r0, a->batch, ld, a->order);
}

/* Run one pass over the (out × batch) matrix, split when it is big. */
static void act_split_run(act_split_t *a, pb_par_fn piece, bool dz)
{
    double elems = (double)a->out * (double)a->batch;
    long len = a->order == 'C' ? (long)a->out : (long)a->batch;
    double per = a->order == 'C' ? (double)a->batch : (double)a->out; /* elements a unit */
    if (dz && a->order == 'F') {
        len = (long)((a->out + PAR_ROW_BLOCK - 1) / PAR_ROW_BLOCK);
        per = (double)a->batch * PAR_ROW_BLOCK;
    }
    if (elems < PAR_ELEMS) {
        piece(a, 0, len);
        return;
    }
    pb_par_for(len, (long)(PAR_ELEMS / 2 / per) + 1, piece, a);
}

void pb_fused_dense_bias_act(int dtype, int act, void *y, void *zbuf, const void *b, size_t out, size_t batch,
                             char order)
{
    bias_acts[dtype](act, y, zbuf, b, out, batch, order == 'C' ? batch : out, order);
}

void pb_fused_dense_dz(int dtype, int act, void *dz, const void *yb, const void *s, double *bsum, size_t out,
                       size_t batch, char order)
{
    dz_passes[dtype](act, dz, yb, s, bsum, out, batch, order == 'C' ? batch : out, order);
}

void pb_fused_dense_store_bsum(int dtype, void *db, const double *bsum, size_t out)
{
    store_bsums[dtype](db, bsum, out);
}

static int validate(pb_call_t *c, pb_err_t *err)
{
    const pb_tensor_t *w = &c->in[IN_W], *x = &c->in[IN_X], *b = &c->in[IN_B];
    char s1[96], s2[96];
    if (w->rank != 2)
        return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.weight",
                          "weight must be a matrix (out, in), got shape %s", pb_shape_str(w, s1, sizeof s1));
    if (x->rank != 1 && x->rank != 2)
        return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.x",
                          "x must be a matrix (in, batch) or a vector (in,), got shape %s",
                          pb_shape_str(x, s1, sizeof s1));
    uint64_t out = w->shape[0], in = w->shape[1], batch = x->rank == 2 ? x->shape[1] : 1;
    if (x->shape[0] != in)
        return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.x",
                          "x has %llu rows but weight %s has %llu columns", (unsigned long long)x->shape[0],
                          pb_shape_str(w, s1, sizeof s1), (unsigned long long)in);
    if (b->storage && (b->rank != 1 || b->shape[0] != out))
        return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.bias",
                          "bias must have shape (%llu,) to match weight %s, got %s", (unsigned long long)out,
                          pb_shape_str(w, s1, sizeof s1), pb_shape_str(b, s2, sizeof s2));
    if (out > INT32_MAX || in > INT32_MAX || batch > INT32_MAX)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs", "a dimension exceeds BLAS's 2^31-1");

    pb_tensor_t *y = &c->out_meta[0];
    memset(y, 0, sizeof *y);
    y->dtype = c->dtype;
    y->rank = x->rank;
    y->shape[0] = out;
    y->shape[1] = batch;
    y->order = c->order;
    size_t ybytes;
    if (!pb_shape_count(y->rank, y->shape, pb_dtype_size(c->dtype), NULL, &ybytes))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs", "output y would have too many elements");

    size_t tape = 0;
    if (c->taped && c->wrt) {
        if (pb_act_src[c->opt[OPT_ACT].index] != PB_ACT_FROM_NONE)
            tape += ybytes;
        if (c->wrt & (1u << IN_W))
            tape += pb_tensor_bytes(x);
        if (c->wrt & (1u << IN_X))
            tape += pb_tensor_bytes(w);
    }
    c->tape_bytes = tape;
    c->cost = 2.0 * (double)out * (double)in * (double)batch + 20.0 * (double)out * (double)batch;
    return 0;
}

static int forward_cpu(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    const pb_tensor_t *w = &c->in[IN_W], *x = &c->in[IN_X], *b = &c->in[IN_B];
    int act = c->opt[OPT_ACT].index;
    const pb_tensor_t *ym = &c->out_meta[0];
    size_t out = ym->shape[0], batch = ym->rank == 2 ? ym->shape[1] : 1;
    bool save_z = tape && c->wrt && pb_act_src[act] == PB_ACT_FROM_Z;
    pb_tensor_t y = {0}, z = {0};
    int rc = pb_tensor_alloc(&y, c->dtype, ym->rank, ym->shape, c->order, w->shape[1] == 0);
    if (rc == 0 && save_z)
        rc = pb_tensor_alloc(&z, c->dtype, ym->rank, ym->shape, c->order, false);
    if (rc)
        goto fail;

    pb_mview_t yv = pb_mview_of(&y);
    pb_gemm(c->dtype, 1.0, pb_mview_of(w), pb_mview_of(x), 0.0, yv);
    const void *bp = b->storage ? pb_tensor_data(b) : NULL;
    char o = ym->rank == 1 ? 'F' : c->order;
    act_split_t sp = {.d = c->dtype, .act = act, .order = o, .out = out, .batch = batch,
                      .es = pb_dtype_size(c->dtype), .y = pb_tensor_data(&y),
                      .zbuf = save_z ? pb_tensor_data(&z) : NULL, .b = bp};
    act_split_run(&sp, bias_act_piece, false);

    if (tape && c->wrt) {
        if (pb_act_src[act] == PB_ACT_FROM_Y)
            pb_tensor_ref(&tape->saved[SAVED_SRC], &y);
        else if (save_z) {
            tape->saved[SAVED_SRC] = z;
            z = (pb_tensor_t){0};
        }
        if ((c->wrt & (1u << IN_W)) && (rc = pb_tape_keep(&tape->saved[SAVED_X], x)))
            goto fail;
        if ((c->wrt & (1u << IN_X)) && (rc = pb_tape_keep(&tape->saved[SAVED_W], w)))
            goto fail;
    }
    c->out[0] = y;
    return 0;
fail:
    pb_tensor_clear(&y);
    pb_tensor_clear(&z);
    return pb_err_set(err, rc, NULL, "out of memory in fused_dense forward");
}

static int reverse_cpu(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                       pb_warnings_t *warn, pb_err_t *err)
{
    (void)warn;
    int act = t->opt[OPT_ACT].index;
    const pb_tensor_t *ym = &t->out_meta[0];
    size_t out = ym->shape[0], batch = ym->rank == 2 ? ym->shape[1] : 1;
    const pb_tensor_t *src = &t->saved[SAVED_SRC];
    pb_dtype_t d = t->dtype;
    pb_tensor_t dz = {0};
    double *bsum = NULL;
    int rc = 0;

    for (int k = 0; k < 3; k++) {
        if (!(t->wrt & (1u << k)))
            continue;
        const pb_tensor_t *m = &t->in_meta[k];
        if ((rc = pb_tensor_alloc(&grad[k], d, m->rank, m->shape, order, cot[0].storage == NULL)))
            goto fail;
    }
    if (cot[0].storage == NULL)
        return 0; /* ȳ = 0: every gradient is zero */

    /* dz in the order of the saved source (any order for identity). */
    char o = src->storage ? src->order : cot[0].order;
    if (ym->rank == 1)
        o = cot[0].order; /* vectors have no order */
    /* ȳ in the source's order is read as it is, so dz costs one pass;
     * otherwise it is reordered first and dz computed in place. */
    bool same = cot[0].order == o || ym->rank == 1;
    rc = same ? pb_tensor_alloc(&dz, d, ym->rank, ym->shape, o, false) : pb_tensor_to_order(&dz, &cot[0], o);
    if (rc)
        goto fail;
    const void *yb = same ? pb_tensor_data(&cot[0]) : pb_tensor_data(&dz);
    if (t->wrt & (1u << IN_B)) {
        bsum = calloc(out ? out : 1, sizeof *bsum);
        if (bsum == NULL) {
            rc = PB_ENOMEM;
            goto fail;
        }
    }
    char po = ym->rank == 1 ? 'F' : o;
    const void *sp = src->storage ? pb_tensor_data(src) : NULL;
    act_split_t dzs = {.d = d, .act = act, .order = po, .out = out, .batch = batch, .es = pb_dtype_size(d),
                       .y = pb_tensor_data(&dz), .yb = yb, .s = sp, .bsum = bsum};
    act_split_run(&dzs, dz_pass_piece, true);

    pb_mview_t dzv = pb_mview_of(&dz);
    if (t->wrt & (1u << IN_W)) /* W̄ = dz·xᵀ */
        pb_gemm(d, 1.0, dzv, pb_mview_transpose(pb_mview_of(&t->saved[SAVED_X])), 0.0, pb_mview_of(&grad[IN_W]));
    if (t->wrt & (1u << IN_X)) /* x̄ = Wᵀ·dz */
        pb_gemm(d, 1.0, pb_mview_transpose(pb_mview_of(&t->saved[SAVED_W])), dzv, 0.0, pb_mview_of(&grad[IN_X]));
    if (bsum)
        store_bsums[d](pb_tensor_data(&grad[IN_B]), bsum, out);
    free(bsum);
    pb_tensor_clear(&dz);
    return 0;
fail:
    free(bsum);
    pb_tensor_clear(&dz);
    for (int k = 0; k < 3; k++)
        pb_tensor_clear(&grad[k]);
    return pb_err_set(err, rc, NULL, "out of memory in fused_dense reverse");
}

static const pb_io_spec_t inputs[] = {{"weight", true}, {"x", true}, {"bias", false}};
static const char *const outputs[] = {"y"};
static const char *const wrt_names[] = {"weight", "x", "bias"};
static const pb_opt_spec_t options[] = {
    {.name = "act", .type = PB_OPT_STR, .values = pb_act_names, .def_index = PB_ACT_IDENTITY},
};

const pb_op_t pb_op_fused_dense = {
    .name = "fused_dense",
    .inputs = inputs,
    .ninputs = 3,
    .outputs = outputs,
    .noutputs = 1,
    .options = options,
    .noptions = 1,
    .wrt_names = wrt_names,
    .nwrt = 3,
    .dtypes = PB_DTYPES_REAL,
    .devices = 1u << PB_DEV_CPU | 1u << PB_DEV_CUDA,
    .validate = validate,
    .forward = {[PB_DEV_CPU] = forward_cpu, [PB_DEV_CUDA] = pb_gpu_fused_dense_forward},
    .reverse = {[PB_DEV_CPU] = reverse_cpu, [PB_DEV_CUDA] = pb_gpu_fused_dense_reverse},
};
