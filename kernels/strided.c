#include "strided.h"

#include "../cuda/exec.h"
#include "cmplx.h"
#include "par.h"
#include <stdlib.h>
#include <string.h>

/* The tile sides of a transposing pass: PB__TB0 elements along index 0
 * (dst's fastest) and PB__TB1_BYTES along index t (src's fastest), so a
 * tile is 16 KiB of any dtype (64 × 32 of f64) and its buffer
 * (strided_t.h) stays in L1 with room for the lines being read and
 * written.  A pass that does not transpose takes rows of about
 * ROW_BYTES per tile. */
#define PB__TB0 64
#define PB__TB1_BYTES 256
#define ROW_BYTES 8192

/* How a pass walks its loop.  The tile plane is index 0 (fastest in dst)
 * and a second index: t, the fastest in src, when the pass transposes;
 * else the index that walks memory closest in either operand.  Tiles
 * are at most b0 × b1 elements of that plane.  Every other index and the
 * tile counts along the two are the outer loops, innermost first. */
typedef struct walk {
    int n;                         /* outer loops */
    int64_t dim[PB_MAX_RANK];      /* their sizes */
    int64_t s[3][PB_MAX_RANK];     /* one step of each, per operand */
    int blk[PB_MAX_RANK];          /* 1: the tiles along index 0, 2: those along the second, 0: an index */
    int64_t n0, n1, b0, b1;        /* the plane and the tile sides */
    int64_t st[6];                 /* tile strides: dst 0, 1; src 0, 1; src2 0, 1 */
    bool tr;                       /* the tile transposes */
    bool unit;                     /* unit strides along the rows the tile reads and writes */
    bool pf;                       /* prefetch the next tile while at one */
} walk_t;

/* A position in the walk: the outer indices, the offsets they make and
 * the size of the tile there. */
typedef struct walk_cur {
    int64_t idx[PB_MAX_RANK];
    int64_t off[3];
    int64_t m0, m1;
} walk_cur_t;

static void walk_start(const walk_t *W, walk_cur_t *c)
{
    memset(c, 0, sizeof *c);
    c->m0 = W->b0;
    c->m1 = W->b1;
}

/* Step to the next tile; false after the last. */
static bool walk_next(const walk_t *W, walk_cur_t *c)
{
    for (int k = 0; k < W->n; k++) {
        bool wrap = ++c->idx[k] == W->dim[k];
        int64_t step = wrap ? -(W->dim[k] - 1) : 1;
        for (int o = 0; o < 3; o++)
            c->off[o] += step * W->s[o][k];
        if (wrap)
            c->idx[k] = 0;
        if (W->blk[k] == 1) {
            int64_t rest = W->n0 - c->idx[k] * W->b0;
            c->m0 = rest < W->b0 ? rest : W->b0;
        } else if (W->blk[k] == 2) {
            int64_t rest = W->n1 - c->idx[k] * W->b1;
            c->m1 = rest < W->b1 ? rest : W->b1;
        }
        if (!wrap)
            return true;
    }
    return false;
}

#define PB_T_BODY "strided_t.h"
#include "dtype_t.h"

typedef void pass_fn(const walk_t *W, void *dst, const void *src, const void *src2, pb_scalar_t alpha,
                     pb_scalar_t beta, int cj, int one, int acc);
typedef pb_scalar_t dot_fn(const pb_loop_t *L, const void *a, const void *b, int cj);
static pass_fn *const passes[PB_NDTYPES] = PB_T_FNS(pass);
static dot_fn *const dots[PB_NDTYPES] = PB_T_FNS(dot_scalar);

void pb_dense_strides(int rank, const uint64_t *shape, char order, int64_t *stride)
{
    /* Saturating: only a zero-size tensor (which has no element to step
     * to) may have dimensions whose product passes INT64_MAX, such as
     * [0, 2^40, 2^40]. */
    uint64_t s = 1;
    for (int k = 0; k < rank; k++) {
        int a = order == 'F' ? k : rank - 1 - k;
        stride[a] = (int64_t)s;
        if (__builtin_mul_overflow(s, shape[a] ? shape[a] : 1, &s) || s > INT64_MAX)
            s = INT64_MAX;
    }
}

static int64_t mag(int64_t x) { return x < 0 ? -x : x; }

/* Drop size-1 indices, sort by the first operand's stride (then the
 * second's), merge indices that are contiguous in all nops operands.
 * Returns false when the space is empty (a zero dimension).  *t is the
 * index fastest in operand 1, when it differs from index 0. */
static bool normalise(const pb_loop_t *in, pb_loop_t *L, int nops, int *t)
{
    L->rank = 0;
    for (int k = 0; k < in->rank; k++) {
        if (in->dim[k] == 0)
            return false;
        if (in->dim[k] == 1)
            continue;
        int r = L->rank++;
        L->dim[r] = in->dim[k];
        for (int o = 0; o < 3; o++)
            L->s[o][r] = o < nops ? in->s[o][k] : 0;
    }
    /* insertion sort: at most 16 indices */
    for (int i = 1; i < L->rank; i++)
        for (int j = i; j > 0; j--) {
            int64_t a0 = mag(L->s[0][j - 1]), b0 = mag(L->s[0][j]);
            int64_t a1 = mag(L->s[1][j - 1]), b1 = mag(L->s[1][j]);
            if (a0 < b0 || (a0 == b0 && a1 <= b1))
                break;
            uint64_t td = L->dim[j];
            L->dim[j] = L->dim[j - 1];
            L->dim[j - 1] = td;
            for (int o = 0; o < 3; o++) {
                int64_t ts = L->s[o][j];
                L->s[o][j] = L->s[o][j - 1];
                L->s[o][j - 1] = ts;
            }
        }
    int r = 0;
    for (int k = 1; k < L->rank; k++) {
        bool merge = true;
        for (int o = 0; o < nops; o++)
            merge = merge && L->s[o][k] == L->s[o][r] * (int64_t)L->dim[r];
        if (merge) {
            L->dim[r] *= L->dim[k];
            continue;
        }
        r++;
        L->dim[r] = L->dim[k];
        for (int o = 0; o < 3; o++)
            L->s[o][r] = L->s[o][k];
    }
    if (L->rank > 0)
        L->rank = r + 1;
    else {
        L->rank = 1; /* a scalar: one element */
        L->dim[0] = 1;
        for (int o = 0; o < 3; o++)
            L->s[o][0] = 0;
    }
    *t = 0;
    for (int k = 1; k < L->rank; k++)
        if (L->s[1][k] != 0 && (*t == 0 || mag(L->s[1][k]) < mag(L->s[1][*t])))
            *t = k;
    /* Tile only when that index is faster in the source than index 0. */
    if (*t && L->s[1][0] != 0 && mag(L->s[1][*t]) >= mag(L->s[1][0]))
        *t = 0;
    return true;
}

/* How close an index walks memory: its smaller stride in dst and src. */
static int64_t nearness(int64_t sd, int64_t ss)
{
    sd = mag(sd);
    ss = mag(ss);
    return sd < ss ? sd : ss;
}

/* The walk of a normalised loop (t from normalise; nops operands).
 *
 * The outer loops go innermost first by nearness, as HPTT orders its
 * loops: consecutive tiles then continue the rows of one operand or the
 * other, rather than jumping in both. */
static void walk_plan(const pb_loop_t *L, int t, int nops, size_t item, walk_t *W)
{
    memset(W, 0, sizeof *W);
    W->tr = t != 0;
    if (!W->tr)
        for (int k = 1; k < L->rank; k++)
            if (t == 0 || nearness(L->s[0][k], L->s[1][k]) < nearness(L->s[0][t], L->s[1][t]))
                t = k;
    W->n0 = (int64_t)L->dim[0];
    W->n1 = t ? (int64_t)L->dim[t] : 1;
    for (int o = 0; o < 3; o++) {
        W->st[2 * o] = L->s[o][0];
        W->st[2 * o + 1] = t ? L->s[o][t] : 0;
    }
    if (W->tr) {
        W->b0 = PB__TB0;
        W->b1 = PB__TB1_BYTES / (int64_t)item;
        W->unit = W->st[0] == 1 && W->st[3] == 1;
    } else {
        W->b0 = W->n0;
        W->b1 = ROW_BYTES / (W->n0 * (int64_t)item);
        W->unit = W->st[0] == 1 && W->st[2] == 1 && (nops < 3 || W->st[4] == 1);
    }
    /* Rows longer than a tile are streamed well by the hardware. */
    W->pf = W->tr || W->n0 * (int64_t)item <= ROW_BYTES;
    W->b0 = W->b0 < W->n0 ? W->b0 : W->n0;
    W->b1 = W->b1 < 1 ? 1 : W->b1 < W->n1 ? W->b1 : W->n1;
    int n = 0;
    for (int k = 0; k < L->rank; k++) {
        int64_t b = k == 0 ? W->b0 : k == t ? W->b1 : 1, nn = (int64_t)L->dim[k];
        if (k == 0 || k == t) {
            if (nn <= b)
                continue;
            nn = (nn + b - 1) / b;
        }
        int j = n++; /* insertion by nearness, stable */
        int64_t key = nearness(b * L->s[0][k], b * L->s[1][k]);
        for (; j > 0 && key < nearness(W->s[0][j - 1], W->s[1][j - 1]); j--) {
            W->dim[j] = W->dim[j - 1];
            W->blk[j] = W->blk[j - 1];
            for (int o = 0; o < 3; o++)
                W->s[o][j] = W->s[o][j - 1];
        }
        W->dim[j] = nn;
        W->blk[j] = k == 0 ? 1 : k == t ? 2 : 0;
        for (int o = 0; o < 3; o++)
            W->s[o][j] = b * L->s[o][k];
    }
    W->n = n;
}

/* A pass that moves at least this many bytes (read and written) is split
 * across idle workers along its outermost loop: about a millisecond of
 * copying, well above the cost of waking a helper; pieces move at least
 * a quarter of it. */
#define PAR_BYTES ((int64_t)8 << 20)

typedef struct split {
    walk_t W;
    pb_dtype_t d;
    size_t item;
    char *dst;
    const char *src, *src2;
    pb_scalar_t alpha, beta;
    bool conj;
    int one, acc;
} split_t;

/* Outer indices [lo, hi) of the outermost loop: the same walk, started
 * there; a tile count along the plane keeps its last tile's size. */
static void split_piece(void *ctx, long lo, long hi)
{
    const split_t *c = ctx;
    walk_t w = c->W;
    size_t it = c->item;
    if (w.n == 0) { /* one row (a contiguous copy): elements [lo, hi) of it */
        w.n0 = w.b0 = hi - lo;
        passes[c->d](&w, c->dst + lo * w.st[0] * (int64_t)it, c->src + lo * w.st[2] * (int64_t)it,
                     c->src2 ? c->src2 + lo * w.st[4] * (int64_t)it : NULL, c->alpha, c->beta, c->conj, c->one,
                     c->acc);
        return;
    }
    int k = w.n - 1;
    w.dim[k] = hi - lo;
    if (w.blk[k] == 1) {
        int64_t rest = w.n0 - lo * w.b0, most = (hi - lo) * w.b0;
        w.n0 = rest < most ? rest : most;
        w.b0 = w.b0 < w.n0 ? w.b0 : w.n0;
    } else if (w.blk[k] == 2) {
        int64_t rest = w.n1 - lo * w.b1, most = (hi - lo) * w.b1;
        w.n1 = rest < most ? rest : most;
        w.b1 = w.b1 < w.n1 ? w.b1 : w.n1;
    }
    passes[c->d](&w, c->dst + lo * w.s[0][k] * (int64_t)it, c->src + lo * w.s[1][k] * (int64_t)it,
                 c->src2 ? c->src2 + lo * w.s[2][k] * (int64_t)it : NULL, c->alpha, c->beta, c->conj, c->one,
                 c->acc);
}

void pb_strided(pb_dtype_t d, const pb_loop_t *in, void *dst, const void *src, bool conj, pb_scalar_t alpha,
                const void *src2, pb_scalar_t beta, bool accumulate)
{
    if (pb_exec_gpu() >= 0)
        pb__exec_strided(d, in, dst, src, conj, alpha, src2, beta, accumulate);
    else
        pb__strided_host(d, in, dst, src, conj, alpha, src2, beta, accumulate);
}

void pb__strided_host(pb_dtype_t d, const pb_loop_t *in, void *dst, const void *src, bool conj, pb_scalar_t alpha,
                      const void *src2, pb_scalar_t beta, bool accumulate)
{
    pb_loop_t L;
    int t;
    static const double complex zero = 0; /* one zero element of any dtype */
    if (accumulate)
        src2 = NULL;
    pb_loop_t tmp;
    if (alpha.re == 0 && alpha.im == 0 && !accumulate) {
        /* As in BLAS, alpha = 0 means src is not read (NaNs in it do not
         * propagate): dst = beta·src2, or zeros. */
        tmp = *in;
        for (int k = 0; k < tmp.rank; k++)
            tmp.s[1][k] = src2 ? tmp.s[2][k] : 0;
        in = &tmp;
        src = src2 ? src2 : &zero;
        alpha = src2 ? beta : (pb_scalar_t){1, 0};
        src2 = NULL;
        conj = false;
    }
    if (!normalise(in, &L, src2 ? 3 : 2, &t))
        return;
    int one = alpha.re == 1 && alpha.im == 0, acc = accumulate;
    if ((unsigned)d >= PB_NDTYPES)
        return;
    size_t item = pb_dtype_size(d);
    split_t sp = {.d = d, .item = item, .dst = dst, .src = src, .src2 = src2, .alpha = alpha, .beta = beta,
                  .conj = conj, .one = one, .acc = acc};
    walk_plan(&L, t, src2 ? 3 : 2, item, &sp.W);
    /* Split the outermost loop, or the one row there is, and only along
     * an index that moves dst: pieces then write apart (an accumulation
     * may sum into dst along an index of stride 0). */
    int64_t elems = 1;
    for (int k = 0; k < L.rank; k++)
        elems *= (int64_t)L.dim[k];
    int64_t bytes = elems * (int64_t)item * (src2 ? 3 : 2);
    int64_t outer = sp.W.n ? sp.W.dim[sp.W.n - 1] : sp.W.tr ? 1 : sp.W.n0;
    int64_t dstep = sp.W.n ? sp.W.s[0][sp.W.n - 1] : sp.W.st[0];
    if (bytes >= PAR_BYTES && outer >= 2 && dstep != 0) {
        long grain = (long)(PAR_BYTES / 4 / (bytes / outer)) + 1;
        pb_par_for((long)outer, grain, split_piece, &sp);
        return;
    }
    passes[d](&sp.W, dst, src, src2, alpha, beta, conj, one, acc);
}

pb_scalar_t pb_strided_dot(pb_dtype_t d, const pb_loop_t *in, const void *a, bool conj, const void *b)
{
    if (pb_exec_gpu() >= 0)
        return pb__exec_dot(d, in, a, conj, b);
    return pb__strided_dot_host(d, in, a, conj, b);
}

pb_scalar_t pb__strided_dot_host(pb_dtype_t d, const pb_loop_t *in, const void *a, bool conj, const void *b)
{
    pb_loop_t L;
    int t;
    pb_scalar_t r = {0, 0};
    if (!normalise(in, &L, 2, &t))
        return r;
    if ((unsigned)d < PB_NDTYPES)
        r = dots[d](&L, a, b, conj);
    return r;
}

void pb_tensor_zero(pb_tensor_t *t)
{
    size_t n = pb_tensor_bytes(t);
    if (n && pb_exec_gpu() >= 0)
        pb__exec_zero(pb_tensor_data(t), n);
    else if (n)
        memset(pb_tensor_data(t), 0, n);
}
