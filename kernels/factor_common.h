/* What the factorization families share: the MatrixAlgebraKit
 * factorizations with exact pullbacks, on the CPU, one family per file:
 *   factor_qr.c     qr_{compact,full,null}, lq_{compact,full,null}
 *   factor_eigh.c   eigh_{full,vals,trunc}
 *   factor_eig.c    eig_{full,vals}
 *   factor_svd.c    svd_{compact,full,vals,trunc}
 *   factor_polar.c  {left,right}_polar
 * Each family exports its op-table rows (pb_fz_<family>_ops and their
 * count); a row names the family's validate, forward, reverse and
 * finite-difference functions and, in `variant`, which form it is
 * (fz_variant_t).  Those functions look up their dtype's instance of the
 * family body (factor_<family>_t.h, dtype_t.h's convention) by c->dtype.
 *
 * The forward copies A into a column-major work array (LAPACK overwrites
 * it), refuses NaN and Inf, and returns outputs in the order asked for;
 * the tape keeps column-major copies of what the pullback reads (saved[],
 * per family) and max|A_ij| in scalars[0].  Tolerances with a default of
 * their own (rank_atol, degeneracy_atol, herm_atol, gauge_atol) are
 * resolved per call from max|A_ij| and the cotangents' norm (pb__fz_resolve).
 *
 * Glossary
 *   gauge      the freedom a factorization leaves (phases of vectors,
 *              rotations of degenerate blocks and of completions); a
 *              cotangent that depends on it gets a warning or, with
 *              strict_gauge, gauge_dependent.
 *   completion the columns a full form adds past min(m, n) (qr_full's Q₂,
 *              svd_full's U₂ and V₂, the null spaces).
 *   rank       the numerical rank: how many diagonal entries of R (or
 *              singular values) reach rank_atol.
 *
 * Every matrix is column-major with its leading dimension equal to its
 * row count (E(M, ld, i, j)); 0-size dimensions are allowed and every work
 * array has room for at least one element.  The one exception is what
 * LAPACK's drivers work on (FZ(pad), FZ(pad_here)): from 512 bytes a
 * column, the columns an odd number of 64-byte lines apart.  A stride that
 * is a multiple of a large power of two (1024 f64 rows: 8 KiB) puts the
 * entries of a row in the same few cache sets, and the reductions walk
 * rows.  Measured in process on 1024² f64 (Haswell kernels, one thread):
 * gesdd without vectors 197 → 151 ms, with them 427 → 347, geev 955-1077
 * → 583-589, geqrf 48 → 39; syevd gains nothing and is left as it is.
 * The price is memory while a driver runs: a copy of A for QR and LQ
 * (svd_vals and eig pad the forward's work array in place, the SVD with
 * vectors copied A already) and of the vectors LAPACK writes (U and Vh,
 * Q, V), each freed as soon as it is copied out.
 *
 * Functions return 0 or a negative PB_E* code; PB_ENOMEM may come back
 * without err filled (the family's entry point says "out of memory in
 * ..."). */
#ifndef PB_FACTOR_COMMON_H
#define PB_FACTOR_COMMON_H

#include <cblas.h>
#include "cmplx.h"
#include <lapacke.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../cuda/exec.h"
#include "../cuda/gpu.h"
#include "blas.h"
#include "dtype_t.h"
#include "op.h"

/* The forms of a family's ops: pb_op_t.variant. */
typedef enum fz_variant {
    FZ_COMPACT, /* thin factors: k = min(m, n) vectors */
    FZ_FULL,    /* square unitaries, completed past k */
    FZ_NULL,    /* the null space only */
    FZ_VALS,    /* values only */
    FZ_TRUNC,   /* the kept part of a full decomposition (maxrank, atol, rtol) */
} fz_variant_t;

/* Options resolved for one call. */
typedef struct fz_opts {
    double rank_atol, deg_atol, gauge_atol, herm_atol, atol, rtol;
    long long maxrank;
    bool strict;
} fz_opts_t;

#define E(M, ld, i, j) (M)[(size_t)(j) * (size_t)(ld) + (size_t)(i)]
#define LD(x) ((x) > 1 ? (x) : 1)
#define NELEM(a) ((int)(sizeof(a) / sizeof((a)[0])))
/* Inside a family body: the dtype's instance of a shared helper, and that
 * of its complex partner (CT). */
#define FZ(name) PB_CAT(pb__fz_, PB_CAT(name, SFX))
#define FZC(name) PB_CAT(pb__fz_, PB_CAT(name, CSFX))

/* The option's index in op, or -1. */
int pb__fz_opt(const pb_op_t *op, const char *name);
/* Given options, else the contract's defaults: rank_atol = degeneracy_atol
 * = eps(max|A_ij|)^(3/4), herm_atol = √eps·max|A_ij|, maxrank = k.  The
 * default gauge_atol needs the cotangents and is set by the reverse. */
void pb__fz_resolve(const pb_op_t *op, const pb_optval_t *opt, double amax, pb_dtype_t d, int k, fz_opts_t *o);

/* False when one of the n values of dtype d at x is NaN or Inf;
 * all_finite: the same for a tensor (true for an absent one). */
bool pb__fz_finite(const void *x, size_t n, pb_dtype_t d);
bool pb__fz_all_finite(const pb_tensor_t *t);

/* Where a family runs on a GPU (cuda/exec.h: the thread's execution
 * device), its work arrays, copies and matrix passes are on that device.
 * zalloc: n zeroed elements of size bytes (never 0 bytes; with
 * mem.h's tail slack on the CPU); free: what zalloc gave (NULL is
 * nothing); move: count elements of dtype d from src to dst. */
void *pb__fz_zalloc(size_t n, size_t size);
void pb__fz_free(void *p);
void pb__fz_move(pb_dtype_t d, void *dst, const void *src, size_t count);
/* One matrix kernel (cuda/gpu.h's pb_gpu_fz_t: what each kind does) on the
 * execution device, for k->dtype: nothing for a zero-size matrix.
 * Returns out[0] (out may be NULL), which for a reducing kind is its
 * result: out[0] = 0 and out[1] = 1 when nothing ran. */
double pb__fz_kernel(const pb_gpu_fz_t *k, double out[2]);
/* The same on the host whatever the thread: what the fake GPU runs. */
void pb__fz_kernel_host(const pb_gpu_fz_t *k, double out[2]);
/* In a family body: a kernel of the body's dtype. */
#define FZ_KERNEL(out, ...) pb__fz_kernel(&(pb_gpu_fz_t){.dtype = DT, __VA_ARGS__}, out)

/* Once per process, before LAPACK runs: LAPACKE's NaN check off (why:
 * factor_common.c). */
void pb__fz_lapack_setup(void);

/* Validation, shared: A a matrix small enough for LAPACK (square when
 * asked), maxrank and the tolerances in range. */
/* The longest side of a square matrix a factorization makes: (s + 64)² <
 * 2^31 (pb__fz_check says why). */
#define PB_FZ_MAX_SIDE 46276
int pb__fz_check(pb_call_t *c, bool square, pb_err_t *err);
/* out_meta[i]: an r×cols matrix of dtype d (a vector of r when cols < 0). */
void pb__fz_meta(pb_call_t *c, int i, pb_dtype_t d, uint64_t r, int64_t cols);
size_t pb__fz_bytes(pb_dtype_t d, uint64_t r, uint64_t cols);
/* tape_bytes (when the call is taped for A) and the cost estimate. */
void pb__fz_sized(pb_call_t *c, size_t tape, bool square);

/* The forward's end, shared: with rc 0, the outputs o[] in the order
 * asked, their shapes into out_meta (truncations know them only now), and
 * sv[] into the tape's saved[] when it is kept for A; else o and sv are
 * dropped and rc returned (PB_ENOMEM with its message). */
int pb__fz_finish(pb_call_t *c, pb_tapedata_t *tape, pb_tensor_t *o, pb_tensor_t *sv, int rc, pb_err_t *err);
/* The reverse's end, shared: rc, else the gauge check (warning, or
 * gauge_dependent with strict_gauge) and grad[0] from the m×n
 * column-major dA in `order`.  Frees dA. */
int pb__fz_rev_finish(const pb_tapedata_t *t, int rc, void *dA, double gauge, const fz_opts_t *op, pb_tensor_t *grad,
                      char order, pb_warnings_t *warn, pb_err_t *err);
/* Columns (or, with rows set, rows) sel[0..r) of the F-ordered X as a new
 * tensor of X's dtype. */
int pb__fz_take(pb_tensor_t *dst, const pb_tensor_t *X, const int *sel, int r, bool rows);

typedef int fz_forward_fn(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err);
typedef int fz_reverse_fn(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                          pb_warnings_t *warn, pb_err_t *err);
typedef int fz_fd_fn(const pb_call_t *c, pb_tensor_t *cot);

/* A family's entry points: `name` looks up name_s, name_d, name_c or
 * name_z by dtype (dtype_t.h) and calls it. */
#define FZ_FORWARD(name)                                                                                              \
    static int name(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)                                                 \
    {                                                                                                                 \
        static fz_forward_fn *const fns[PB_NDTYPES] = PB_T_FNS(name);                                                 \
        return fns[c->dtype](c, tape, err);                                                                           \
    }
#define FZ_REVERSE(name)                                                                                              \
    static int name(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,                  \
                    pb_warnings_t *warn, pb_err_t *err)                                                               \
    {                                                                                                                 \
        static fz_reverse_fn *const fns[PB_NDTYPES] = PB_T_FNS(name);                                                 \
        return fns[t->dtype](t, cot, grad, order, warn, err);                                                         \
    }
#define FZ_FD(name)                                                                                                   \
    static int name(const pb_call_t *c, pb_tensor_t *cot)                                                             \
    {                                                                                                                 \
        static fz_fd_fn *const fns[PB_NDTYPES] = PB_T_FNS(name);                                                      \
        return fns[c->dtype](c, cot);                                                                                 \
    }

/* A row of a family's table: one op on the matrix A, on the CPU.  A small
 * finite-difference step (1e-6): eigen- and singular vectors vary like
 * 1/gap, and the Householder completions jump where LAPACK's reflector
 * changes sign, so the check's four evaluations stay within 2e-6·max|A|
 * of A; rounding stays near 1e-10 of the derivative. */
extern const pb_io_spec_t pb__fz_in_A[1];
extern const char *const pb__fz_wrt_A[1];
#define FZ_ROW(nm, var, outs, opts, nopts, val, fwd, rev, fdc, fdd)                                                        \
    FZ_ROW_ON(nm, var, outs, opts, nopts, val, fwd, rev, fdc, fdd, 1u << PB_DEV_CPU, NULL, NULL)
/* The same on the CPU and the GPUs: a family whose body runs on a GPU's
 * execution device (cuda/exec.h) gives pb_gpu_shared_forward/_reverse
 * (FZ_ROW_GPU; gpu_ops.h declares them). */
#define FZ_ROW_GPU(nm, var, outs, opts, nopts, val, fwd, rev, fdc, fdd)                                                \
    FZ_ROW_ON(nm, var, outs, opts, nopts, val, fwd, rev, fdc, fdd, (1u << PB_DEV_CPU) | (1u << PB_DEV_CUDA),          \
              pb_gpu_shared_forward, pb_gpu_shared_reverse)
#define FZ_ROW_ON(nm, var, outs, opts, nopts, val, fwd, rev, fdc, fdd, devs, gfwd, grev)                                \
    {                                                                                                                 \
        .name = nm, .variant = var, .inputs = pb__fz_in_A, .ninputs = 1, .outputs = outs, .noutputs = NELEM(outs),    \
        .options = opts, .noptions = nopts, .wrt_names = pb__fz_wrt_A, .nwrt = 1, .dtypes = PB_DTYPES_ALL,            \
        .devices = devs, .validate = val, .forward = {[PB_DEV_CPU] = fwd, [PB_DEV_CUDA] = gfwd},                      \
        .reverse = {[PB_DEV_CPU] = rev, [PB_DEV_CUDA] = grev}, .fd_step = 1e-6, .fd_cotangents = fdc,                 \
        .fd_direction = fdd,                                                                                          \
    }
/* The options rows take. */
#define FZ_AUTO(nm) {.name = nm, .type = PB_OPT_FLOAT, .def_auto = true}
#define FZ_STRICT {.name = "strict_gauge", .type = PB_OPT_BOOL}
#define FZ_TRUNC_OPTS                                                                                                  \
    {.name = "maxrank", .type = PB_OPT_INT, .def_auto = true}, {.name = "atol", .type = PB_OPT_FLOAT},               \
        {.name = "rtol", .type = PB_OPT_FLOAT}

/* The families' rows, for op.c. */
extern const pb_op_t pb_fz_qr_ops[], pb_fz_eigh_ops[], pb_fz_eig_ops[], pb_fz_svd_ops[], pb_fz_polar_ops[];
extern const int pb_fz_qr_nops, pb_fz_eigh_nops, pb_fz_eig_nops, pb_fz_svd_nops, pb_fz_polar_nops;

/* The per-dtype helpers (factor_common_t.h), declared for each dtype. */
#define PB_T_BODY "factor_common_p.h"
#include "blas.h"
#include "dtype_t.h"

#endif
