/* Body of fused_dense for one real type: a PB_T_REAL_ONLY body for
 * dtype_t.h (T, MSFX picks act.h's float or double functions). */

#define FD_VALUE PB_CAT(pb_act_value, MSFX)
#define FD_DERIV PB_CAT(pb_act_deriv, MSFX)

/* y = act(y + b) over an (out × batch) matrix in order `order` with
 * leading dimension ld (y and zbuf alike), saving z into zbuf when it is
 * not NULL.  Instantiated per activation so the activation's switch folds
 * away and the loop vectorises where it can. */
PB_KERNEL_CLONES static void FN(bias_act)(int act, T *restrict y, T *restrict zbuf, const T *restrict b, size_t out,
                            size_t batch, size_t ld, char order)
{
#define FD_LOOP(A)                                                                    \
    if (order == 'C') {                                                               \
        for (size_t i = 0; i < out; i++) {                                            \
            T bi = b ? b[i] : (T)0;                                                   \
            T *row = y + i * ld, *zr = zbuf ? zbuf + i * ld : NULL;                   \
            if (zr)                                                                   \
                PB_OMP_SIMD for (size_t j = 0; j < batch; j++) {                                  \
                    T z = row[j] + bi;                                                \
                    zr[j] = z;                                                        \
                    row[j] = FD_VALUE(A, z);                                          \
                }                                                                     \
            else                                                                      \
                PB_OMP_SIMD for (size_t j = 0; j < batch; j++)                                    \
                    row[j] = FD_VALUE(A, row[j] + bi);                                \
        }                                                                             \
    } else {                                                                          \
        for (size_t j = 0; j < batch; j++) {                                          \
            T *col = y + j * ld, *zc = zbuf ? zbuf + j * ld : NULL;                   \
            if (zc)                                                                   \
                PB_OMP_SIMD for (size_t i = 0; i < out; i++) {                                    \
                    T z = col[i] + (b ? b[i] : (T)0);                                 \
                    zc[i] = z;                                                        \
                    col[i] = FD_VALUE(A, z);                                          \
                }                                                                     \
            else if (b)                                                               \
                PB_OMP_SIMD for (size_t i = 0; i < out; i++)                                      \
                    col[i] = FD_VALUE(A, col[i] + b[i]);                              \
            else                                                                      \
                PB_OMP_SIMD for (size_t i = 0; i < out; i++)                                      \
                    col[i] = FD_VALUE(A, col[i]);                                     \
        }                                                                             \
    }
    PB_ACT_DISPATCH(act, FD_LOOP)
#undef FD_LOOP
}

/* dz = ȳ ⊙ act′(s), with b̄ += row sums of dz (bsum may be NULL).  dz, ȳ
 * and s in the same order and leading dimension ld; dz may be ȳ itself
 * (in place).  Each row's sum runs over j in order. */
PB_KERNEL_CLONES static void FN(dz_pass)(int act, T *dz, const T *yb, const T *restrict s, double *restrict bsum,
                                            size_t out, size_t batch, size_t ld, char order)
{
#define FD_LOOP(A)                                                                    \
    if (order == 'C') {                                                               \
        for (size_t i = 0; i < out; i++) {                                            \
            T *r = dz + i * ld;                                                       \
            const T *g = yb + i * ld;                                                 \
            const T *sr = s ? s + i * ld : NULL;                                      \
            double acc = 0;                                                           \
            PB_OMP_SIMD_SUM(acc) for (size_t j = 0; j < batch; j++) {                                      \
                T v = sr ? g[j] * FD_DERIV(A, sr[j]) : g[j];                          \
                r[j] = v;                                                             \
                acc += v;                                                             \
            }                                                                         \
            if (bsum)                                                                 \
                bsum[i] += acc;                                                       \
        }                                                                             \
    } else {                                                                          \
        for (size_t j = 0; j < batch; j++) {                                          \
            T *c = dz + j * ld;                                                       \
            const T *g = yb + j * ld;                                                 \
            const T *sc = s ? s + j * ld : NULL;                                      \
            PB_OMP_SIMD for (size_t i = 0; i < out; i++) {                                        \
                T v = sc ? g[i] * FD_DERIV(A, sc[i]) : g[i];                          \
                c[i] = v;                                                             \
                if (bsum)                                                             \
                    bsum[i] += v;                                                     \
            }                                                                         \
        }                                                                             \
    }
    PB_ACT_DISPATCH(act, FD_LOOP)
#undef FD_LOOP
}

static void FN(store_bsum)(void *dst, const double *bsum, size_t out)
{
    T *b = dst;
    for (size_t i = 0; i < out; i++)
        b[i] = (T)bsum[i];
}

/* The untyped entry points fused_dense.c's tables hold. */
static void FN(bias_act_any)(int act, void *y, void *zbuf, const void *b, size_t out, size_t batch, size_t ld,
                             char order)
{
    FN(bias_act)(act, y, zbuf, b, out, batch, ld, order);
}

static void FN(dz_pass_any)(int act, void *dz, const void *yb, const void *s, double *bsum, size_t out, size_t batch,
                            size_t ld, char order)
{
    FN(dz_pass)(act, dz, yb, s, bsum, out, batch, ld, order);
}

#undef FD_VALUE
#undef FD_DERIV
