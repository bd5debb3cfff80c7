/* The strided passes for one element type: a body for dtype_t.h (T, ACC,
 * CPLX, CONJ, WORD, LANES, TSCALAR).  pass and dot_scalar are what
 * strided.c dispatches to by dtype. */
#if CPLX
#define OPC(x) (cj ? CONJ(x) : (x))
#else
#define OPC(x) (x)
#endif

/* The transposing buffer: TB1 rows (a tile's side along src's fastest
 * index), each a line longer than PB__TB0 elements so that a column of
 * it does not fall into one cache set. */
#define TB1 (PB__TB1_BYTES / (int64_t)sizeof(T))
#define BS (PB__TB0 + 64 / (int64_t)sizeof(T))

/* *dp = alpha·op(*sp) + beta·*s2, or *dp += alpha·op(*sp).  The flags are
 * constants wherever this is expanded, and s2 is evaluated only with
 * two. */
#define ELEM(dp, sp, s2)                                                                                               \
    do {                                                                                                               \
        T v_ = OPC(*(sp));                                                                                             \
        if (!one)                                                                                                      \
            v_ = alpha * v_;                                                                                           \
        if (two)                                                                                                       \
            v_ += beta * *(s2);                                                                                        \
        if (acc)                                                                                                       \
            *(dp) += v_;                                                                                               \
        else                                                                                                           \
            *(dp) = v_;                                                                                                \
    } while (0)

/* Prefetch the lines of n elements from p: into L1 for what is about to
 * be written, into L2 for what is read (a whole tile of it would crowd L1
 * while the current one is worked on). */
static inline __attribute__((always_inline)) void FN(fetch)(const T *p, int64_t n, const int write)
{
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)63, e = (uintptr_t)(p + n);
    for (; a < e; a += 64) {
        if (write)
            __builtin_prefetch((const void *)a, 1, 3);
        else
            __builtin_prefetch((const void *)a, 0, 2);
    }
}

/* A tile of m1 rows of m0 elements, index 0 innermost in every operand.
 * With unit, index 0 has stride 1 everywhere (the compiler vectorises
 * the row), and the rows of the next tile (nx, at nd and ns; nx NULL at
 * the last or where the hardware prefetchers do better) are prefetched
 * as the tile goes. */
static inline __attribute__((always_inline)) void FN(row_k)(T *restrict dst, const T *restrict src,
                                                           const T *restrict src2, int64_t m0, int64_t m1,
                                                           const int64_t *st, T alpha, T beta, const int cj,
                                                           const int one, const int two, const int acc, const int unit,
                                                           const walk_cur_t *nx, const T *nd, const T *ns)
{
    (void)cj;
    const int64_t d0 = unit ? 1 : st[0], a0 = unit ? 1 : st[2], b0 = unit ? 1 : st[4];
    for (int64_t i1 = 0; i1 < m1; i1++) {
        T *dp = dst + i1 * st[1];
        const T *sp = src + i1 * st[3];
        const T *s2 = two ? src2 + i1 * st[5] : NULL;
        if (unit && nx && i1 < nx->m1) {
            FN(fetch)(nd + i1 * st[1], nx->m0, 1);
            FN(fetch)(ns + i1 * st[3], nx->m0, 0);
        }
        for (int64_t i0 = 0; i0 < m0; i0++)
            ELEM(dp + i0 * d0, sp + i0 * a0, s2 + i0 * b0);
    }
}

/* A transposing tile with any strides: dst is fastest along index 0, src
 * along index 1.  It goes in 8 × 8 blocks, so the lines a block touches
 * are used whole while in L1. */
static inline __attribute__((always_inline)) void FN(tr_k)(T *restrict dst, const T *restrict src,
                                                          const T *restrict src2, int64_t m0, int64_t m1,
                                                          const int64_t *st, T alpha, T beta, const int cj,
                                                          const int one, const int two, const int acc)
{
    (void)cj;
    const int64_t d0 = st[0], d1 = st[1], a0 = st[2], a1 = st[3], b0 = st[4], b1 = st[5];
    int64_t i0, i1;
    for (i1 = 0; i1 + 8 <= m1; i1 += 8) {
        for (i0 = 0; i0 + 8 <= m0; i0 += 8) {
            T *dp = dst + i0 * d0 + i1 * d1;
            const T *sp = src + i0 * a0 + i1 * a1;
            const T *s2 = two ? src2 + i0 * b0 + i1 * b1 : NULL;
            for (int v = 0; v < 8; v++)
                for (int u = 0; u < 8; u++)
                    ELEM(dp + v * d1 + u * d0, sp + u * a0 + v * a1, s2 + u * b0 + v * b1);
        }
        for (; i0 < m0; i0++) /* the ragged edge along index 0 */
            for (int v = 0; v < 8; v++)
                ELEM(dst + i0 * d0 + (i1 + v) * d1, src + i0 * a0 + (i1 + v) * a1, src2 + i0 * b0 + (i1 + v) * b1);
    }
    for (; i1 < m1; i1++) /* and along index 1 */
        for (i0 = 0; i0 < m0; i0++)
            ELEM(dst + i0 * d0 + i1 * d1, src + i0 * a0 + i1 * a1, src2 + i0 * b0 + i1 * b1);
}

/* dp[v·ds + u] = sp[u·a0 + v] for an 8 × 8 block: a pure move of
 * bits, whatever the pass does to the elements afterwards.  Where the
 * compiler has vector shuffles, it goes in LANES × LANES transposes of
 * 16-byte vectors of WORDs (WORD: an unsigned type of the element's
 * size); else, and for 16-byte elements, element by element. */
static inline __attribute__((always_inline)) void FN(tr8)(T *restrict dp, int64_t ds, const T *restrict sp,
                                                         int64_t a0)
{
#if defined(__has_builtin) && LANES > 1
#if __has_builtin(__builtin_shufflevector)
#define PB__VEC 1
    typedef WORD vec_t __attribute__((vector_size(16)));
    for (int u = 0; u < 8; u += LANES)
        for (int v = 0; v < 8; v += LANES) {
            vec_t r[LANES];
            for (int k = 0; k < LANES; k++)
                memcpy(&r[k], sp + (u + k) * a0 + v, 16);
#if LANES == 2
            vec_t c0 = __builtin_shufflevector(r[0], r[1], 0, 2), c1 = __builtin_shufflevector(r[0], r[1], 1, 3);
            memcpy(dp + v * ds + u, &c0, 16);
            memcpy(dp + (v + 1) * ds + u, &c1, 16);
#else
            vec_t t0 = __builtin_shufflevector(r[0], r[1], 0, 4, 1, 5);
            vec_t t1 = __builtin_shufflevector(r[0], r[1], 2, 6, 3, 7);
            vec_t t2 = __builtin_shufflevector(r[2], r[3], 0, 4, 1, 5);
            vec_t t3 = __builtin_shufflevector(r[2], r[3], 2, 6, 3, 7);
            vec_t c[4] = {__builtin_shufflevector(t0, t2, 0, 1, 4, 5), __builtin_shufflevector(t0, t2, 2, 3, 6, 7),
                          __builtin_shufflevector(t1, t3, 0, 1, 4, 5), __builtin_shufflevector(t1, t3, 2, 3, 6, 7)};
            for (int k = 0; k < 4; k++)
                memcpy(dp + (v + k) * ds + u, &c[k], 16);
#endif
        }
#endif
#endif
#ifndef PB__VEC
    for (int v = 0; v < 8; v++)
        for (int u = 0; u < 8; u++)
            dp[v * ds + u] = sp[u * a0 + v];
#endif
#undef PB__VEC
}

/* A transposing tile with unit strides (dst along index 0, src along
 * index 1), through buf.  Each src row is read whole into a column of
 * buf, 8 rows at a time in 8 × 8 blocks; then each dst row is written
 * whole from a row of buf.  Reading and writing rows whole keeps many
 * misses in flight, and buf, in L1, takes the transposing accesses that
 * at a large power-of-two stride would all fall into one cache set.
 * Meanwhile the rows of the next tile (nx, at nd and ns; nx NULL at the
 * last) are prefetched, so that its misses overlap this tile's work: its
 * rows lie far apart, where the hardware prefetchers do not look. */
static inline __attribute__((always_inline)) void FN(trb_k)(T *restrict dst, const T *restrict src,
                                                           const T *restrict src2, int64_t m0, int64_t m1,
                                                           const int64_t *st, T alpha, T beta, const int cj,
                                                           const int one, const int two, const int acc,
                                                           T *restrict buf, const walk_cur_t *nx, const T *nd,
                                                           const T *ns)
{
    (void)cj;
    const int64_t d1 = st[1], a0 = st[2], b0 = st[4], b1 = st[5];
    int64_t j0 = 0;
    for (; j0 + 8 <= m0; j0 += 8) {
        const T *restrict sp = src + j0 * a0;
        if (nx)
            for (int64_t u = j0; u < j0 + 8 && u < nx->m0; u++)
                FN(fetch)(ns + u * a0, nx->m1, 0);
        int64_t j1 = 0;
        for (; j1 + 8 <= m1; j1 += 8)
            FN(tr8)(buf + j1 * BS + j0, BS, sp + j1, a0);
        for (; j1 < m1; j1++)
            for (int u = 0; u < 8; u++)
                buf[j1 * BS + j0 + u] = sp[u * a0 + j1];
    }
    for (; j0 < m0; j0++) {
        const T *restrict sp = src + j0 * a0;
        if (nx && j0 < nx->m0)
            FN(fetch)(ns + j0 * a0, nx->m1, 0);
        for (int64_t j1 = 0; j1 < m1; j1++)
            buf[j1 * BS + j0] = sp[j1];
    }
    for (int64_t i1 = 0; i1 < m1; i1++) {
        T *dp = dst + i1 * d1;
        const T *bp = buf + i1 * BS;
        const T *s2 = two ? src2 + i1 * b1 : NULL;
        if (nx && i1 < nx->m1)
            FN(fetch)(nd + i1 * d1, nx->m0, 1);
        for (int64_t i0 = 0; i0 < m0; i0++)
            ELEM(dp + i0, bp + i0, s2 + i0 * b0);
    }
}

/* A variant without restrict for the in-place case (dst == src with the
 * same strides, so the walk never transposes). */
static void FN(tile_inplace)(T *dst, const T *src, int64_t m0, int64_t m1, const int64_t *st, T alpha, int cj)
{
    (void)cj;
    for (int64_t i1 = 0; i1 < m1; i1++)
        for (int64_t i0 = 0; i0 < m0; i0++)
            dst[i0 * st[0] + i1 * st[1]] = alpha * OPC(src[i0 * st[2] + i1 * st[3]]);
}

/* One tile.  Every combination of the flags is compiled into its own
 * loops, with no branch inside. */
static void FN(tile)(const walk_t *W, T *dst, const T *src, const T *src2, int64_t m0, int64_t m1, T alpha, T beta,
                     int cj, int one, int two, int acc, T *buf, const walk_cur_t *nx, const T *nd, const T *ns)
{
    const int64_t *st = W->st;
#define K(c, o, t, a)                                                                                                  \
    do {                                                                                                               \
        if (W->tr && W->unit)                                                                                          \
            FN(trb_k)(dst, src, src2, m0, m1, st, alpha, beta, c, o, t, a, buf, nx, nd, ns);                           \
        else if (W->tr)                                                                                                \
            FN(tr_k)(dst, src, src2, m0, m1, st, alpha, beta, c, o, t, a);                                             \
        else if (W->unit)                                                                                              \
            FN(row_k)(dst, src, src2, m0, m1, st, alpha, beta, c, o, t, a, 1, nx, nd, ns);                             \
        else                                                                                                           \
            FN(row_k)(dst, src, src2, m0, m1, st, alpha, beta, c, o, t, a, 0, NULL, NULL, NULL);                       \
    } while (0)
    switch ((cj << 3) | (one << 2) | (two << 1) | acc) {
    case 0: K(0, 0, 0, 0); break;
    case 1: K(0, 0, 0, 1); break;
    case 2: K(0, 0, 1, 0); break;
    case 4: K(0, 1, 0, 0); break;
    case 5: K(0, 1, 0, 1); break;
    case 6: K(0, 1, 1, 0); break;
#if CPLX
    case 8: K(1, 0, 0, 0); break;
    case 9: K(1, 0, 0, 1); break;
    case 10: K(1, 0, 1, 0); break;
    case 12: K(1, 1, 0, 0); break;
    case 13: K(1, 1, 0, 1); break;
    case 14: K(1, 1, 1, 0); break;
#endif
    default: break; /* two with acc does not occur */
    }
#undef K
}

/* Walk W's tiles in order, each tile told where the next one lies. */
static void FN(run)(const walk_t *W, T *dst, const T *src, const T *src2, T alpha, T beta, int cj, int one, int acc)
{
    const int two = src2 != NULL, inplace = (const void *)dst == (const void *)src;
    T buf[TB1 * BS] __attribute__((aligned(64)));
    walk_cur_t cur, nxt;
    walk_start(W, &cur);
    nxt = cur;
    bool more = walk_next(W, &nxt);
    for (;;) {
        T *dp = dst + cur.off[0];
        const T *sp = src + cur.off[1];
        const T *s2 = two ? src2 + cur.off[2] : NULL;
        if (inplace)
            FN(tile_inplace)(dp, sp, cur.m0, cur.m1, W->st, alpha, cj);
        else
            FN(tile)(W, dp, sp, s2, cur.m0, cur.m1, alpha, beta, cj, one, two, acc, buf,
                     more && W->pf ? &nxt : NULL, dst + nxt.off[0], src + nxt.off[1]);
        if (!more)
            return;
        cur = nxt;
        more = walk_next(W, &nxt);
    }
}

static ACC FN(dot)(const pb_loop_t *L, const T *a, const T *b, int cj)
{
    (void)cj;
    ACC sum = 0;
    uint64_t idx[PB_MAX_RANK] = {0};
    int64_t n0 = (int64_t)L->dim[0], a0 = L->s[0][0], b0 = L->s[1][0];
    for (;;) {
        int64_t oa = 0, ob = 0;
        for (int k = 1; k < L->rank; k++) {
            oa += (int64_t)idx[k] * L->s[0][k];
            ob += (int64_t)idx[k] * L->s[1][k];
        }
        ACC part = 0;
        for (int64_t i = 0; i < n0; i++) {
#if CPLX
            /* ⟨op(a), b⟩ = conj(op(a))·b: conj(conj(a)) is a itself */
            ACC x = (ACC)a[oa + i * a0];
            part += (cj ? x : conj(x)) * (ACC)b[ob + i * b0];
#else
            part += (ACC)a[oa + i * a0] * (ACC)b[ob + i * b0];
#endif
        }
        sum += part;
        int k = 1;
        for (; k < L->rank; k++) {
            if (++idx[k] < L->dim[k])
                break;
            idx[k] = 0;
        }
        if (k >= L->rank)
            return sum;
    }
}

/* The entry points strided.c's tables hold: scalars as pb_scalar_t, a
 * real pass never conjugates. */
static void FN(pass)(const walk_t *W, void *dst, const void *src, const void *src2, pb_scalar_t alpha,
                     pb_scalar_t beta, int cj, int one, int acc)
{
    FN(run)(W, dst, src, src2, TSCALAR(alpha), TSCALAR(beta), CPLX ? cj : 0, one, acc);
}

static pb_scalar_t FN(dot_scalar)(const pb_loop_t *L, const void *a, const void *b, int cj)
{
    ACC z = FN(dot)(L, a, b, CPLX ? cj : 0);
#if CPLX
    return (pb_scalar_t){creal(z), cimag(z)};
#else
    return (pb_scalar_t){z, 0};
#endif
}

#undef ELEM
#undef BS
#undef TB1
#undef OPC
