/* The per-dtype helpers the factorization families share, declared for
 * one dtype (a body for dtype_t.h, included by factor_common.h).  Defined
 * in factor_common_t.h, except qr_factor (factor_qr_t.h) and svd_factor
 * (factor_svd_t.h), which other families build on. */

/* Zeroed work arrays of n elements (never 0 bytes, so never NULL for a
 * zero-size matrix), with the tail slack LAPACK's over-reads need
 * (mem.h); freed with pb__fz_free() (on the execution device: device
 * memory, factor_common.h). */
T *FZ(zalloc)(size_t n);
RT *FZ(ralloc)(size_t n);
/* The m×n matrix src (leading dimension lds) into dst (ldd); nothing when
 * they are the same array. */
void FZ(copy)(T *dst, int ldd, const T *src, int lds, int m, int n);
/* The leading dimension LAPACK works with for a matrix of m rows: m, or
 * for a column of 512 bytes or more, m rounded up to an odd number of
 * 64-byte cache lines (factor_common.h says why). */
int FZ(lapack_ld)(int m);
/* LAPACK's copy of the m×n matrix M (leading dimension m): M itself when
 * *ld = FZ(lapack_ld)(m) is m, else a zeroed work array of leading
 * dimension *ld holding M's values when `copy` is set (NULL when out of
 * memory).  FZ(unpad) copies it back into M when `copy` is set and frees
 * it; both do nothing to P when P is M. */
T *FZ(pad)(T *M, int m, int n, bool copy, int *ld);
void FZ(unpad)(T *P, int ld, T *M, int m, int n, bool copy);
/* The m×n matrix A (leading dimension m) moved in place to leading
 * dimension FZ(lapack_ld)(m), which it returns: A must have room for
 * that many columns' worth (the forward's work array has). */
int FZ(pad_here)(T *A, int m, int n);
/* c = alpha·op(a)·op(b) + beta·c, op 'N', 'T' or 'C'. */
void FZ(gemm)(char ta, char tb, int m, int n, int k, T alpha, const T *a, int lda, const T *b, int ldb, T beta, T *c,
              int ldc);
/* The matrix kernel k (cuda/gpu.h) on the host: what the CPU runs, and
 * the fake GPU on its device memory (pb__fz_kernel picks). */
void FZ(kernel_host)(const pb_gpu_fz_t *k, double out[2]);
/* Y (n×m) = Xᴴ for X m×n. */
void FZ(adjoint)(const T *X, int m, int n, T *Y);
/* The largest |entry| of the r×c block at (i0, j0) of M (ld). */
double FZ(maxabs)(const T *M, int ld, int i0, int r, int j0, int c);
/* The largest |entry| of the anti-Hermitian part of the square X (n×n). */
double FZ(maxantiherm)(const T *X, int n);
/* X ← (X − Xᴴ)/2 in place. */
void FZ(antiherm)(T *X, int n);
/* A tensor's values as a column-major m×n array (a vector: n = 1). */
void FZ(load)(const pb_tensor_t *t, T *dst, int m, int n);
/* A cotangent as a fresh column-major array (NULL when absent: zero);
 * load_cot_r for the real-valued ones (S, D of eigh). */
int FZ(load_cot)(const pb_tensor_t *t, int m, int n, T **out);
int FZ(load_cot_r)(const pb_tensor_t *t, int n, RT **out);
/* A new zeroed F-ordered m×n tensor of dtype DT (a vector when n < 0);
 * newvec_r: a vector of RDT. */
T *FZ(newmat)(pb_tensor_t *t, int m, int n);
RT *FZ(newvec_r)(pb_tensor_t *t, int n);
/* Multiply column j of V (m×c) by the unit phase that makes its largest-
 * magnitude entry (the first, on a tie) real and positive; ph[j] gets that
 * phase's conjugate (what a matching row of Vᴴ is multiplied by), when ph
 * is not NULL. */
void FZ(fix_phases)(T *V, int m, int c, T *ph);
/* The n values v (of the real dtype) where the host can read them: v
 * itself, or on a GPU (cuda/exec.h) a host copy in *copy, which the
 * caller frees with pb_mem_free; NULL when out of memory. */
const RT *FZ(host_r)(const RT *v, int n, RT **copy);
/* A LAPACK info as invalid (< 0: internal) or not converged (numerical). */
int FZ(lapack_fail)(const char *what, lapack_int info, pb_err_t *err);

/* For the finite-difference check's projections: the options as the
 * forward resolved them; */
int FZ(fd_opts)(const pb_call_t *c, fz_opts_t *op);
/* per column j of V (m×c): ΔV_j −= i·v_j·Im(v_jᴴΔV_j), plus extra[j] when
 * given (the unit-modulus phase direction of each column); */
void FZ(drop_phase)(const T *V, int m, int c, T *dV, const double *extra);
/* dX (m×c) columns [j0, c) ← their projection onto span(Q[:, :p]); */
void FZ(onto_span)(const T *Q, int m, int p, T *dX, int j0, int c);
/* an F-ordered array written back into a tensor of either order; */
void FZ(store_back)(pb_tensor_t *t, const T *src, int m, int n);
/* output i of c (any order) as a fresh F-ordered array. */
T *FZ(out_arr)(const pb_call_t *c, int i);

/* For LAPACK routines that do not scale their input (geqrf, gelqf: their
 * Householder norms may square entries, as some of OpenBLAS's nrm2 kernels
 * do): when max|M_ij| (M m×n, leading dimension ld) lies outside
 * [2^-lim, 2^lim] (lim 250 in double, 30 in single), M is multiplied by
 * the power of two 2^-e that brings it to [1, 2); returns e (0: M left as
 * it was).  pow2_mul multiplies by 2^e, exactly where nothing over- or
 * underflows. */
int FZ(pow2_normalise)(T *M, int ld, int m, int n);
void FZ(pow2_mul)(T *M, int ld, int m, int n, int e);

/* A = Q·R with diag(R) real and ≥ 0.  A (m×n) is overwritten; Q is m×nq
 * (nq = k or m), R is nq×n, both zeroed by the caller. */
int FZ(qr_factor)(T *A, int m, int n, int nq, T *Q, T *Rm, pb_err_t *err);
/* A = U·diag(S)·Vh, compact (U m×k, Vh k×n), S descending; A is left as it
 * was.  Columns of U have their largest entry real positive, rows of Vh
 * the matching phase. */
int FZ(svd_factor)(const T *A, int m, int n, T *U, RT *S, T *Vh, pb_err_t *err);

/* A family's forward, given A (m×n, column-major, its to overwrite, with
 * room to be padded in place by FZ(pad_here)) and the resolved options:
 * outputs into o[], what the tape keeps into sv[] (factor_common.h's
 * pb__fz_finish orders and stores them). */
typedef int FZ(factor_fn)(const pb_call_t *c, T *A, const fz_opts_t *op, pb_tensor_t *o, pb_tensor_t *sv,
                          pb_err_t *err);
/* A family's pullback: dA (m×n, zeroed) += the gradient from the
 * cotangents and the tape, *gauge the size of their gauge-dependent part. */
typedef int FZ(pullback_fn)(const pb_tapedata_t *t, const pb_tensor_t *cot, const fz_opts_t *op, T *dA,
                            double *gauge, pb_err_t *err);
/* The forward and reverse around them: A loaded and checked, options
 * resolved, outputs ordered and the tape filled; the gauge checked and
 * grad[0] made. */
int FZ(forward)(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err, FZ(factor_fn) *factor);
int FZ(reverse)(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order, pb_warnings_t *warn,
                pb_err_t *err, FZ(pullback_fn) *pullback);
