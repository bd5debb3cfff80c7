#include "tensor.h"

#include "../cuda/exec.h"

#include <complex.h>
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../proto/errors.h"
#include "strided.h"

static const struct {
    const char *name;
    size_t size;
} dtypes[PB_NDTYPES] = {
    [PB_F32] = {"f32", 4},
    [PB_F64] = {"f64", 8},
    [PB_C64] = {"c64", 8},
    [PB_C128] = {"c128", 16},
};

size_t pb_dtype_size(pb_dtype_t d) { return (unsigned)d < PB_NDTYPES ? dtypes[d].size : 0; }
bool pb_dtype_is_complex(pb_dtype_t d) { return d == PB_C64 || d == PB_C128; }
const char *pb_dtype_name(pb_dtype_t d) { return (unsigned)d < PB_NDTYPES ? dtypes[d].name : NULL; }
pb_dtype_t pb_dtype_real(pb_dtype_t d) { return d == PB_C64 ? PB_F32 : d == PB_C128 ? PB_F64 : d; }
pb_dtype_t pb_dtype_complex(pb_dtype_t d) { return d == PB_F32 ? PB_C64 : d == PB_F64 ? PB_C128 : d; }

int pb_dtype_parse(const char *s, size_t len, pb_dtype_t *out)
{
    for (int d = 0; d < PB_NDTYPES; d++) {
        if (strlen(dtypes[d].name) == len && memcmp(dtypes[d].name, s, len) == 0) {
            *out = (pb_dtype_t)d;
            return 0;
        }
    }
    return PB_EINVALID_ARGUMENT;
}

static void heap_free(pb_storage_t *s)
{
    pb_mem_free(s->ptr);
}

pb_storage_t *pb_storage_new(size_t size, bool zero)
{
    pb_storage_t *s = malloc(sizeof *s);
    if (s == NULL)
        return NULL;
    /* never 0 bytes, so a zero-size tensor still has a valid, unique
     * pointer */
    s->ptr = zero ? pb_mem_zalloc(size ? size : 1) : pb_mem_alloc(size ? size : 1);
    if (s->ptr == NULL) {
        free(s);
        return NULL;
    }
    atomic_init(&s->refs, 1);
    s->kind = PB_STORAGE_HEAP;
    s->device = (pb_device_t){PB_DEV_CPU, 0};
    s->size = size;
    s->free_fn = heap_free;
    s->free_ctx = NULL;
    return s;
}

struct view_ctx {
    void (*release)(void *);
    void *ctx;
};

static void view_release(pb_storage_t *s)
{
    struct view_ctx *vc = s->free_ctx;
    if (vc->release)
        vc->release(vc->ctx);
    free(vc);
}

pb_storage_t *pb_storage_wrap(pb_storage_kind_t kind, void *ptr, size_t size, void (*free_fn)(pb_storage_t *),
                              void *ctx)
{
    pb_storage_t *s = malloc(sizeof *s);
    if (s == NULL)
        return NULL;
    atomic_init(&s->refs, 1);
    s->kind = kind;
    s->device = (pb_device_t){PB_DEV_CPU, 0};
    s->ptr = ptr;
    s->size = size;
    s->free_fn = free_fn;
    s->free_ctx = ctx;
    return s;
}

pb_storage_t *pb_storage_view(void *ptr, size_t size, void (*release)(void *), void *ctx)
{
    struct view_ctx *vc = malloc(sizeof *vc);
    if (vc == NULL)
        return NULL;
    vc->release = release;
    vc->ctx = ctx;
    pb_storage_t *s = pb_storage_wrap(PB_STORAGE_VIEW, ptr, size, view_release, vc);
    if (s == NULL)
        free(vc);
    return s;
}

pb_storage_t *pb_storage_ref(pb_storage_t *s)
{
    if (s)
        atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
    return s;
}

void pb_storage_unref(pb_storage_t *s)
{
    if (s == NULL)
        return;
    if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) == 1) {
        s->free_fn(s);
        free(s);
    }
}

bool pb_shape_count(int rank, const uint64_t *shape, size_t itemsize, size_t *count, size_t *bytes)
{
    size_t n = 1;
    /* A zero-size dimension makes zero elements, whatever the others are
     * and wherever it stands (contract section 2). */
    for (int i = 0; i < rank; i++)
        if (shape[i] == 0)
            n = 0;
    for (int i = 0; i < rank && n; i++) {
        if (shape[i] > SIZE_MAX || __builtin_mul_overflow(n, (size_t)shape[i], &n))
            return false;
    }
    size_t b;
    if (__builtin_mul_overflow(n, itemsize, &b) || b > (SIZE_MAX >> 1))
        return false;
    if (count)
        *count = n;
    if (bytes)
        *bytes = b;
    return true;
}

size_t pb_tensor_count(const pb_tensor_t *t)
{
    size_t n = 1;
    for (int i = 0; i < t->rank; i++)
        n *= (size_t)t->shape[i];
    return n;
}

size_t pb_tensor_bytes(const pb_tensor_t *t) { return pb_tensor_count(t) * pb_dtype_size(t->dtype); }

int pb_tensor_alloc(pb_tensor_t *t, pb_dtype_t d, int rank, const uint64_t *shape, char order, bool zero)
{
    size_t bytes;
    if (rank < 0 || rank > PB_MAX_RANK || !pb_shape_count(rank, shape, pb_dtype_size(d), NULL, &bytes))
        return PB_EINVALID_ARGUMENT;
    if (pb_exec_gpu() >= 0)
        return pb__exec_tensor_alloc(t, d, rank, shape, order, zero);
    pb_storage_t *s = pb_storage_new(bytes, zero);
    if (s == NULL)
        return PB_ENOMEM;
    pb_tensor_over(t, s, d, rank, shape, order);
    return 0;
}

void pb_tensor_over(pb_tensor_t *t, pb_storage_t *s, pb_dtype_t d, int rank, const uint64_t *shape, char order)
{
    memset(t, 0, sizeof *t);
    t->dtype = d;
    t->rank = rank;
    t->order = order == 'F' ? 'F' : 'C';
    if (rank > 0) /* a scalar may come with no shape array at all */
        memcpy(t->shape, shape, (size_t)rank * sizeof *shape);
    t->storage = s;
    t->offset = 0;
}

void pb_tensor_ref(pb_tensor_t *dst, const pb_tensor_t *src)
{
    *dst = *src;
    pb_storage_ref(dst->storage);
}

void pb_tensor_clear(pb_tensor_t *t)
{
    pb_storage_unref(t->storage);
    memset(t, 0, sizeof *t);
}

bool pb_tensor_same_shape(const pb_tensor_t *a, const pb_tensor_t *b)
{
    return a->rank == b->rank && memcmp(a->shape, b->shape, (size_t)a->rank * sizeof a->shape[0]) == 0;
}

bool pb_tensor_aligned(const pb_tensor_t *t)
{
    size_t a = pb_dtype_size(t->dtype);
    if (a > 8)
        a = 8; /* complex double needs the alignment of a double */
    return ((uintptr_t)pb_tensor_data(t) % a) == 0;
}

int pb_tensor_make_owned(pb_tensor_t *t)
{
    if (pb_exec_gpu() >= 0)
        return pb__exec_make_owned(t);
    size_t bytes = pb_tensor_bytes(t);
    pb_storage_t *s = pb_storage_new(bytes, false);
    if (s == NULL)
        return PB_ENOMEM;
    if (bytes)
        memcpy(s->ptr, pb_tensor_data(t), bytes);
    pb_storage_unref(t->storage);
    t->storage = s;
    t->offset = 0;
    return 0;
}

/* Copy an n-d array between C and F order.  The F-order layout of shape s
 * is the C-order layout of reversed(s) with reversed indices, so this is a
 * transpose of reversed axes; matrices take the blocked path. */
static void copy_reorder(char *dst, const char *src, int rank, const uint64_t *shape, size_t isz, char dst_order)
{
    if (rank == 2) {
        /* src C (r x c) -> dst F equals a plain transpose; likewise F -> C. */
        size_t rows = dst_order == 'F' ? shape[0] : shape[1];
        size_t cols = dst_order == 'F' ? shape[1] : shape[0];
        /* src is rows x cols row-major, dst is cols x rows row-major. */
        const size_t B = 32;
        for (size_t i0 = 0; i0 < rows; i0 += B)
            for (size_t j0 = 0; j0 < cols; j0 += B)
                for (size_t i = i0; i < rows && i < i0 + B; i++)
                    for (size_t j = j0; j < cols && j < j0 + B; j++)
                        memcpy(dst + (j * rows + i) * isz, src + (i * cols + j) * isz, isz);
        return;
    }
    size_t n = 1;
    for (int k = 0; k < rank; k++)
        n *= shape[k];
    uint64_t idx[PB_MAX_RANK] = {0};
    size_t cstride[PB_MAX_RANK], fstride[PB_MAX_RANK];
    size_t s = 1;
    for (int k = rank - 1; k >= 0; k--) {
        cstride[k] = s;
        s *= shape[k];
    }
    s = 1;
    for (int k = 0; k < rank; k++) {
        fstride[k] = s;
        s *= shape[k];
    }
    const size_t *sst = dst_order == 'F' ? cstride : fstride;
    const size_t *dst_st = dst_order == 'F' ? fstride : cstride;
    for (size_t e = 0; e < n; e++) {
        size_t so = 0, d = 0;
        for (int k = 0; k < rank; k++) {
            so += idx[k] * sst[k];
            d += idx[k] * dst_st[k];
        }
        memcpy(dst + d * isz, src + so * isz, isz);
        for (int k = rank - 1; k >= 0; k--) {
            if (++idx[k] < shape[k])
                break;
            idx[k] = 0;
        }
    }
}

int pb_tensor_to_order(pb_tensor_t *dst, const pb_tensor_t *src, char order)
{
    pb_tensor_t t;
    int rc = pb_tensor_alloc(&t, src->dtype, src->rank, src->shape, order, false);
    if (rc)
        return rc;
    size_t isz = pb_dtype_size(src->dtype);
    int nontrivial = 0;
    for (int k = 0; k < src->rank; k++)
        nontrivial += src->shape[k] > 1;
    if (pb_exec_gpu() >= 0) {
        /* device memory (cuda/exec.h): one strided pass, each operand's
         * strides those of its order (a flat copy when they agree) */
        bool flat = src->order == t.order || nontrivial <= 1;
        pb_loop_t L = {.rank = flat ? 1 : src->rank, .dim = {pb_tensor_count(src)}, .s = {{1}, {1}}};
        int64_t c = 1, f = 1;
        for (int k = 0; k < src->rank && !flat; k++) {
            int r = src->rank - 1 - k;
            L.dim[k] = src->shape[k];
            L.s[order == 'F' ? 0 : 1][k] = f;
            L.s[order == 'F' ? 1 : 0][r] = c;
            f *= (int64_t)src->shape[k];
            c *= (int64_t)src->shape[r];
        }
        pb_strided(src->dtype, &L, pb_tensor_data(&t), pb_tensor_data(src), false, (pb_scalar_t){1, 0}, NULL,
                   (pb_scalar_t){0, 0}, false);
    } else if (src->order == t.order || nontrivial <= 1)
        memcpy(pb_tensor_data(&t), pb_tensor_data(src), pb_tensor_bytes(src));
    else
        copy_reorder(pb_tensor_data(&t), pb_tensor_data(src), src->rank, src->shape, isz, t.order);
    *dst = t;
    return 0;
}

const char *pb_shape_str(const pb_tensor_t *t, char *buf, size_t len)
{
    size_t o = 0;
    o += (size_t)snprintf(buf + o, len - o, "(");
    for (int k = 0; k < t->rank && o < len; k++)
        o += (size_t)snprintf(buf + o, len - o, "%s%llu", k ? ", " : "", (unsigned long long)t->shape[k]);
    if (o < len)
        snprintf(buf + o, len - o, t->rank == 1 ? ",)" : ")");
    return buf;
}
