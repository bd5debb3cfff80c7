/* The strided passes for one element type; included by strided.c with
 * T (element), ACC (accumulator: double or double complex), SFX (name
 * suffix) and CPLX (1 for complex types) defined. */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)
#if CPLX
#define OPC(x) (cj ? CAT(conj, SFXC)(x) : (x))
#else
#define OPC(x) (x)
#endif

/* One tile: n0 × n1 elements, index 0 innermost.  The flags are
 * constants at every call site below, so each combination is compiled
 * into its own loop with no branch inside. */
static inline __attribute__((always_inline)) void FN(tile_k)(T *restrict dst, const T *restrict src,
                                                            const T *restrict src2, int64_t n0, int64_t n1,
                                                            const int64_t *st, T alpha, T beta, const int cj,
                                                            const int one, const int two, const int acc)
{
    (void)cj;
    const int64_t d0 = st[0], d1 = st[1], a0 = st[2], a1 = st[3], b0 = st[4], b1 = st[5];
    for (int64_t i1 = 0; i1 < n1; i1++) {
        T *dp = dst + i1 * d1;
        const T *sp = src + i1 * a1;
        const T *s2 = two ? src2 + i1 * b1 : NULL;
        for (int64_t i0 = 0; i0 < n0; i0++) {
            T v = OPC(sp[i0 * a0]);
            if (!one)
                v = alpha * v;
            if (two)
                v += beta * s2[i0 * b0];
            if (acc)
                dp[i0 * d0] += v;
            else
                dp[i0 * d0] = v;
        }
    }
}

/* A variant without restrict for the in-place case (dst == src). */
static inline __attribute__((always_inline)) void FN(tile_inplace)(T *dst, const T *src, int64_t n0, int64_t n1,
                                                                  const int64_t *st, T alpha, const int cj)
{
    (void)cj;
    for (int64_t i1 = 0; i1 < n1; i1++)
        for (int64_t i0 = 0; i0 < n0; i0++)
            dst[i0 * st[0] + i1 * st[1]] = alpha * OPC(src[i0 * st[2] + i1 * st[3]]);
}

static void FN(tile)(T *dst, const T *src, const T *src2, int64_t n0, int64_t n1, const int64_t *st, T alpha,
                     T beta, int cj, int one, int two, int acc, int inplace)
{
    if (inplace) {
        if (cj)
            FN(tile_inplace)(dst, src, n0, n1, st, alpha, 1);
        else
            FN(tile_inplace)(dst, src, n0, n1, st, alpha, 0);
        return;
    }
#define K(c, o, t, a) FN(tile_k)(dst, src, src2, n0, n1, st, alpha, beta, c, o, t, a)
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

/* A transposing tile: src is contiguous along index 1, dst along index 0.
 * Reading src straight into dst would walk one of them across m lines a
 * large (often power-of-two) stride apart, which share a cache set and
 * evict each other.  So the tile goes through buf, a block in L1: each src
 * row is read once, whole, into a column of buf, then each dst row is
 * written once, whole, from a row of buf.  buf holds PB__TB × PB__TB. */
#ifndef PB__TB
#define PB__TB 32
#endif
static void FN(tile_t)(T *dst, const T *src, const T *src2, int64_t m0, int64_t m1, const int64_t *st, T alpha,
                       T beta, int cj, int one, int two, int acc, int inplace, T *restrict buf)
{
    if (inplace) {
        FN(tile)(dst, src, src2, m0, m1, st, alpha, beta, cj, one, two, acc, inplace);
        return;
    }
    const int64_t a0 = st[2], a1 = st[3], d1 = st[1];
    if (a1 == 1 && st[0] == 1 && one && !two && !acc && !cj) {
        /* A plain dense transpose: 8 × 8 blocks straight from src to dst,
         * 8 lines of each in L1, constant trip counts the compiler
         * unrolls. */
        int64_t i0 = 0, i1 = 0;
        for (i1 = 0; i1 + 8 <= m1; i1 += 8)
            for (i0 = 0; i0 + 8 <= m0; i0 += 8) {
                const T *restrict sp = src + i0 * a0 + i1;
                T *restrict dp = dst + i1 * d1 + i0;
                for (int v = 0; v < 8; v++)
                    for (int u = 0; u < 8; u++)
                        dp[v * d1 + u] = sp[u * a0 + v];
            }
        for (int64_t j1 = 0; j1 < m1; j1++) /* the ragged edges */
            for (int64_t j0 = (j1 < i1 ? i0 : 0); j0 < m0; j0++)
                dst[j1 * d1 + j0] = src[j0 * a0 + j1];
        return;
    }
    if (a1 == 1) /* the usual dense case: unit stride known to the compiler */
        for (int64_t i0 = 0; i0 < m0; i0++) {
            const T *restrict sp = src + i0 * a0;
            for (int64_t i1 = 0; i1 < m1; i1++)
                buf[i1 * PB__TB + i0] = sp[i1];
        }
    else
        for (int64_t i0 = 0; i0 < m0; i0++) {
            const T *restrict sp = src + i0 * a0;
            for (int64_t i1 = 0; i1 < m1; i1++)
                buf[i1 * PB__TB + i0] = sp[i1 * a1];
        }
    const int64_t sb[6] = {st[0], st[1], 1, PB__TB, st[4], st[5]};
    FN(tile)(dst, buf, src2, m0, m1, sb, alpha, beta, cj, one, two, acc, 0);
}

/* L normalised (see strided.c): index 0 is the fastest in dst, index t
 * (0 when no tiling) the fastest in src.  Walk the other indices with an
 * odometer and the (0, t) plane in PB__TB × PB__TB tiles. */
static void FN(run)(const pb_loop_t *L, int t, T *dst, const T *src, const T *src2, T alpha, T beta, int cj,
                    int one, int acc)
{
    const int two = src2 != NULL, inplace = (const void *)dst == (const void *)src;
    T buf[PB__TB * PB__TB] __attribute__((aligned(64)));
    const int64_t blk = PB__TB;
    int64_t n0 = (int64_t)L->dim[0], n1 = t ? (int64_t)L->dim[t] : 1;
    int64_t st[6] = {L->s[0][0], t ? L->s[0][t] : 0, L->s[1][0], t ? L->s[1][t] : 0, L->s[2][0],
                     t ? L->s[2][t] : 0};
    uint64_t idx[PB_MAX_RANK] = {0};
    for (;;) {
        int64_t od = 0, os = 0, o2 = 0;
        for (int k = 1; k < L->rank; k++) {
            if (k == t)
                continue;
            od += (int64_t)idx[k] * L->s[0][k];
            os += (int64_t)idx[k] * L->s[1][k];
            o2 += (int64_t)idx[k] * L->s[2][k];
        }
        if (t == 0) {
            FN(tile)(dst + od, src + os, two ? src2 + o2 : NULL, n0, 1, st, alpha, beta, cj, one, two, acc,
                     inplace);
        } else {
            for (int64_t j1 = 0; j1 < n1; j1 += blk)
                for (int64_t j0 = 0; j0 < n0; j0 += blk) {
                    int64_t m0 = n0 - j0 < blk ? n0 - j0 : blk, m1 = n1 - j1 < blk ? n1 - j1 : blk;
                    FN(tile_t)(dst + od + j0 * st[0] + j1 * st[1], src + os + j0 * st[2] + j1 * st[3],
                               two ? src2 + o2 + j0 * st[4] + j1 * st[5] : NULL, m0, m1, st, alpha, beta, cj, one,
                               two, acc, inplace, buf);
                }
        }
        int k = 1;
        for (; k < L->rank; k++) {
            if (k == t)
                continue;
            if (++idx[k] < L->dim[k])
                break;
            idx[k] = 0;
        }
        if (k >= L->rank)
            return;
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

#undef OPC
#undef FN
#undef CAT
#undef CAT_
