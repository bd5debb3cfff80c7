/* fused_dense's element passes, whole and on one thread, for the GPU
 * backend's host fake (cuda/fake.c): the math the CPU op runs, over a
 * dense (out × batch) matrix in order 'C' or 'F'.  dtype is f32 or f64. */
#ifndef PB_FUSED_DENSE_H
#define PB_FUSED_DENSE_H

#include <stddef.h>

/* z = y + b (b NULL: none) into zbuf when not NULL, y = act(z). */
void pb_fused_dense_bias_act(int dtype, int act, void *y, void *zbuf, const void *b, size_t out, size_t batch,
                             char order);
/* dz = ȳ ⊙ act′(s) (s NULL: ȳ), dz may be ȳ; bsum (out doubles, or
 * NULL) += each row's sum. */
void pb_fused_dense_dz(int dtype, int act, void *dz, const void *yb, const void *s, double *bsum, size_t out,
                       size_t batch, char order);
/* db = bsum, rounded to dtype. */
void pb_fused_dense_store_bsum(int dtype, void *db, const double *bsum, size_t out);

#endif
