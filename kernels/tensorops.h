/* What tensorcontract.c, tensoradd.c and tensortrace.c share: the
 * TensorOperations rules.
 *
 * Forward:
 *   tensorcontract  C = beta·C + alpha·permute(opA(A)·opB(B), pAB), one GEMM
 *                   (contract.c), or the einsum form `spec`;
 *   tensoradd       C = beta·C + alpha·permute(opA(A), pA), one strided pass;
 *   tensortrace     C = beta·C + alpha·Σ_k A[p…, q1=k, q2=k], a scaling pass
 *                   and an accumulating pass whose traced index walks A's
 *                   diagonal (stride q1 + stride q2).
 * Reverse, in the convention dL = Re Σ conj(X̄)·dX, with G = C̄:
 *   Ā  = conj(α)·(G·B̂ᴴ, unpermuted)     (conjA: α·conj(…)),
 *   B̄  = conj(α)·(Âᴴ·G, unpermuted)     (conjB: α·conj(…)),
 *   C̄  = conj(β)·G,  ᾱ = ⟨permute(opA(A)·opB(B)), G⟩,  β̄ = ⟨C, G⟩,
 * and for add and trace the same with the GEMM replaced by the pass.  ᾱ
 * and β̄ are real when the dtype is real or the scalar was sent as a real
 * number (their gradient projected onto the reals, as for a Real in Julia).
 *
 * ᾱ = ⟨M, G⟩ with M = permute(opA(A)·opB(B)) (add: permute(opA(A)),
 * trace: the trace of opA(A)), the result before alpha and beta.  Either
 * the tape keeps M, or it keeps what M is made of and the reverse makes
 * it again: for tensorcontract ⟨M, G⟩ = ⟨Â, G·B̂ᴴ⟩, and G·B̂ᴴ is the GEMM Ā
 * needs anyway, so with Ā in wrt ᾱ costs one inner product over A (with B̄
 * only, symmetrically over B); with neither it costs one GEMM of the
 * forward's size.  The tape takes whichever adds fewer bytes (the minimal
 * tape): M when it is smaller than the inputs that Ā and B̄ do not keep
 * anyway (ᾱ alone with an I×J product smaller than A and B, a trace).  So
 * the tape holds C only for β̄, A for B̄, B for Ā, and for ᾱ either M or
 * A and B (add: A, as large as M; trace: M when smaller than A). */
#ifndef PB_TENSOROPS_H
#define PB_TENSOROPS_H

#include <stdbool.h>
#include <stddef.h>

#include "../cuda/gpu_ops.h"
#include "contract.h"
#include "op.h"
#include "strided.h"

/* Inputs of tensoradd and tensortrace (A, C) and their wrt slots; the
 * tape slots of all three. */
enum { TA_A, TA_C };
enum { T1_WALPHA = 2, T1_WBETA = 3 };
enum { SAVED_A, SAVED_B, SAVED_C, SAVED_M };

static inline pb_scalar_t sc(const pb_optval_t *v) { return (pb_scalar_t){v->re, v->im}; }
static inline pb_scalar_t sconj(pb_scalar_t s) { return (pb_scalar_t){s.re, -s.im}; }
static inline bool nonzero(pb_scalar_t s) { return s.re != 0 || s.im != 0; }
static inline double flops_per(pb_dtype_t d) { return pb_dtype_is_complex(d) ? 4.0 : 1.0; }
static const pb_scalar_t ONE = {1, 0}, ZERO = {0, 0};

/* "[0, 2, 1]" into buf. */
const char *pb__tops_axes_str(const signed char *ax, int n, char *buf, size_t len);
/* Are a ++ b (lengths na, nb) a permutation of 0..rank-1? */
bool pb__tops_is_perm(const signed char *a, int na, const signed char *b, int nb, int rank);
/* t's shape is shape, else shape_mismatch naming arg ("inputs.X"). */
int pb__tops_need_shape(const pb_tensor_t *t, int rank, const uint64_t *shape, const char *arg, pb_err_t *err);
/* The output's metadata and size check. */
int pb__tops_set_output(pb_call_t *c, int rank, const uint64_t *shape, pb_err_t *err);
/* C: present when beta ≠ 0 or beta is in wrt; its shape that of the output. */
int pb__tops_check_c(pb_call_t *c, int ic, int obeta, int wbeta, pb_err_t *err);
/* The bytes the tape keeps: A (a), B (b), C (cin), by input index. */
size_t pb__tops_tape_of(const pb_call_t *c, bool a, bool b, bool cin, int ia, int ib, int ic);
/* Save what the reverse needs for wrt: A, B, C as the minimal tape says. */
int pb__tops_save(pb_call_t *c, pb_tapedata_t *tape, bool a, bool b, bool cin, int ia, int ib, int ic);
int pb__tops_oom(pb_err_t *err, const char *op);
/* Allocate the wanted gradients (zeroed when there is no cotangent). */
int pb__tops_alloc_grads(const pb_tapedata_t *t, int ninputs, pb_tensor_t *grad, char order, bool zero);
/* A scalar gradient into its rank-0 tensor, real-projected when the
 * scalar was real. */
void pb__tops_put_scalar(pb_tensor_t *g, pb_scalar_t v, const pb_optval_t *opt);
/* A loop over all axes of one tensor, read through two stride sets. */
void pb__tops_loop_same(pb_loop_t *L, const pb_tview_t *a, const pb_tview_t *b);
/* dst = s·op(src) elementwise over one shape (dst may be src). */
void pb__tops_scale_into(pb_dtype_t d, pb_tensor_t *dst, const pb_tensor_t *src, pb_scalar_t s, bool conj);
pb_scalar_t pb__tops_dot_of(pb_dtype_t d, const pb_tensor_t *a, bool conj, const pb_tensor_t *b);
/* C̄ = conj(β)·G and β̄ = ⟨C, G⟩, shared by the three ops. */
void pb__tops_grads_c_beta(const pb_tapedata_t *t, const pb_tensor_t *G, pb_tensor_t *grad, int ic, int obeta,
                           int wbeta);

/* What the ops' rows share. */
#define TOPS_SCALAR(nm, def) {.name = nm, .type = PB_OPT_SCALAR, .def_re = def}
extern const pb_io_spec_t pb__tops_t1_inputs[2];
extern const char *const pb__tops_c_outputs[1];
extern const char *const pb__tops_t1_wrt[4];

#endif
