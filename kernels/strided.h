/* Strided passes over tensors of any rank: the permutation, scaling,
 * accumulation and inner-product loops behind tensoradd, tensortrace,
 * the copies of tensorcontract and the reverse rules of all three.
 *
 * Glossary
 *   loop      an index space (dims) and, per operand, the stride of each
 *             index in elements.  A permutation is a loop whose source
 *             strides are the destination's, permuted; a trace gives the
 *             traced index the sum of two source strides and stride 0 in
 *             the destination; a broadcast gives the source stride 0.
 *   op(x)     x, or conj(x) when the pass is asked to conjugate.
 *
 * One body serves all four dtypes (strided_t.h).  Loops are normalised
 * first (size-1 indices dropped, indices sorted by destination stride,
 * indices that are contiguous in every operand merged).  Then the index
 * fastest in the destination and the one fastest in the source make the
 * plane of 16 KiB tiles, which a transposing pass moves through a buffer
 * in L1 so that it reads and writes whole rows.  The other indices are
 * walked around the tiles innermost first by their smaller stride in
 * either operand (as HPTT orders its loops), so consecutive tiles
 * continue the rows of one operand; and each tile prefetches the rows of
 * the next, whose misses the hardware prefetchers would not foresee.
 * A pass that moves megabytes is split along its outermost loop (or its
 * one row) across idle workers (par.h); each element is still computed
 * once, the same way, so the result does not depend on the split.
 * Nothing is allocated. */
#ifndef PB_STRIDED_H
#define PB_STRIDED_H

#include <stdbool.h>
#include <stdint.h>

#include "op.h"
#include "tensor.h"

typedef struct pb_loop {
    int rank;
    uint64_t dim[PB_MAX_RANK];
    int64_t s[3][PB_MAX_RANK]; /* operand strides in elements: see each call */
} pb_loop_t;

/* Exchange the strides of operands 0 and 1 (write through what was read). */
static inline void pb_loop_swap01(pb_loop_t *L)
{
    for (int k = 0; k < L->rank; k++) {
        int64_t tmp = L->s[0][k];
        L->s[0][k] = L->s[1][k];
        L->s[1][k] = tmp;
    }
}

/* Element strides of a dense tensor of this rank/shape in order 'C' or 'F'. */
void pb_dense_strides(int rank, const uint64_t *shape, char order, int64_t *stride);

/* On the thread's execution device (cuda/exec.h): the host, or the GPU
 * whose op runs this code.
 *
 * dst[i] = alpha·op(src[i]) + beta·src2[i] over L (strides s[0] dst,
 * s[1] src, s[2] src2); src2 NULL drops the beta term (its values are not
 * read).  dst may be src when their strides agree and src2 is NULL (in
 * place: the pass then scales, and would not read src2).  With
 * accumulate, dst[i] += alpha·op(src[i]) instead (src2 unused), and dst
 * strides may be 0 (a reduction). */
void pb_strided(pb_dtype_t d, const pb_loop_t *L, void *dst, const void *src, bool conj, pb_scalar_t alpha,
                const void *src2, pb_scalar_t beta, bool accumulate);

/* Σ conj(op(a[i]))·b[i] over L (strides s[0] a, s[1] b), accumulated in
 * double precision: the inner product ⟨op(a), b⟩ of the gradient
 * convention. */
pb_scalar_t pb_strided_dot(pb_dtype_t d, const pb_loop_t *L, const void *a, bool conj, const void *b);

/* pb_strided and pb_strided_dot on host memory whatever the thread's
 * execution device (cuda/exec.h): the host fake's device passes. */
void pb__strided_host(pb_dtype_t d, const pb_loop_t *L, void *dst, const void *src, bool conj, pb_scalar_t alpha,
                      const void *src2, pb_scalar_t beta, bool accumulate);
pb_scalar_t pb__strided_dot_host(pb_dtype_t d, const pb_loop_t *L, const void *a, bool conj, const void *b);

/* Fill a tensor's bytes with zeros. */
void pb_tensor_zero(pb_tensor_t *t);

#endif
