/* Tensor contraction as transpose-transpose-GEMM.
 *
 * Glossary
 *   tview     a strided view of a tensor: data pointer, shape and element
 *             strides (what a pb_tensor_t of either order looks like).
 *   groups    the open axes of A (I), the open axes of B (J) and the
 *             contracted pairs (K).  M = Â·B̂ is I×J; the output's axis d
 *             is M's axis pAB[d].
 *
 * pb_contract looks for a way to hand every operand to one GEMM as it is
 * lies: BLAS reads a matrix stored either way round (op N or T) and, when
 * it is transposed, conjugated too (op C); computing Mᵀ = B̂ᵀ·Âᵀ instead
 * of M swaps which operands need the transposed read.  It tries both
 * products and, for the axis order inside each group, the order in which
 * one or the other operand is contiguous, and picks the plan that copies
 * the fewest elements.  An operand no plan can read is copied once by a
 * cache-blocked permutation (conjugating on the way) into GEMM order; an
 * output no plan can write takes the product in a temporary and a second
 * permutation pass.  alpha goes into the GEMM; beta into it too when the
 * output is written directly.  Temporaries are the call's, freed before
 * it returns. */
#ifndef PB_CONTRACT_H
#define PB_CONTRACT_H

#include <stdbool.h>

#include "op.h"
#include "tensor.h"

typedef struct pb_tview {
    void *p;
    int rank;
    uint64_t shape[PB_MAX_RANK];
    int64_t stride[PB_MAX_RANK];
} pb_tview_t;

typedef struct pb_cspec {
    int noA, nc, noB;
    signed char oA[PB_MAX_RANK], cA[PB_MAX_RANK]; /* axes of A */
    signed char cB[PB_MAX_RANK], oB[PB_MAX_RANK]; /* axes of B; cB[v] pairs with cA[v] */
    signed char pAB[PB_MAX_RANK];                 /* output axis d = M axis pAB[d] */
} pb_cspec_t;

pb_tview_t pb_tview_of(const pb_tensor_t *t);

/* tensorcontract's options (pA, pB, pAB or spec) as a pb_cspec_t, checked
 * against A's and B's shapes: 0, or the error naming the option. */
int pb_tensorcontract_spec(const pb_optval_t *opt, const pb_tensor_t *A, const pb_tensor_t *B, pb_cspec_t *s,
                           pb_err_t *err);

/* out = beta·C + alpha·permute(opA(A)·opB(B), pAB).  C is read only when
 * beta ≠ 0 (pass NULL otherwise).  Shapes were checked by the caller.
 * 0, or PB_ENOMEM. */
int pb_contract(pb_dtype_t d, const pb_cspec_t *s, pb_scalar_t alpha, const pb_tview_t *A, bool conjA,
                const pb_tview_t *B, bool conjB, pb_scalar_t beta, const pb_tview_t *C, const pb_tview_t *out);

#endif
