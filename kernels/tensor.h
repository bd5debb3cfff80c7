/* Tensors and their storage.
 *
 * Glossary
 *   storage  a refcounted block of bytes: heap memory owned by the daemon,
 *            a view into a received message, shared memory (section 6) or
 *            device memory (CUDA).  Every byte a tensor reads lives in one.
 *   tensor   dtype, shape, memory order (C or F) and a byte offset into a
 *            storage.  Tensors are small values; copying one takes a new
 *            reference on its storage (pb_tensor_ref), dropping one releases
 *            it (pb_tensor_clear).
 *   device   where a storage's bytes are: PB_DEV_CPU or PB_DEV_CUDA + index.
 *
 * Ownership: a storage frees its bytes when its last reference goes
 * (free_fn with free_ctx).  A tensor owns one reference.  A tape holds
 * tensors, hence references, so it keeps alive what it needs (a big
 * input by a reference to its received message: op.h's pb_tape_keep) and
 * never points into memory a client owns. */
#ifndef PB_TENSOR_H
#define PB_TENSOR_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mem.h"

#define PB_MAX_RANK 16
#define PB_ALIGN 64

typedef enum pb_dtype {
    PB_F32 = 0,
    PB_F64 = 1,
    PB_C64 = 2,
    PB_C128 = 3,
    PB_NDTYPES = 4,
} pb_dtype_t;

#define PB_DTYPE_BIT(d) (1u << (d))
#define PB_DTYPES_REAL (PB_DTYPE_BIT(PB_F32) | PB_DTYPE_BIT(PB_F64))
#define PB_DTYPES_ALL (PB_DTYPES_REAL | PB_DTYPE_BIT(PB_C64) | PB_DTYPE_BIT(PB_C128))

typedef enum pb_devkind { PB_DEV_CPU = 0, PB_DEV_CUDA = 1 } pb_devkind_t;

typedef struct pb_device {
    pb_devkind_t kind;
    int index; /* GPU ordinal for PB_DEV_CUDA, 0 for the CPU */
} pb_device_t;

typedef enum pb_storage_kind {
    PB_STORAGE_HEAP,    /* pb_mem_alloc, freed with pb_mem_free (mem.h) */
    PB_STORAGE_VIEW,    /* a received message (daemon memory nothing writes once
                           parsed), kept alive by free_ctx's release */
    PB_STORAGE_SHM,     /* mmap'ed shared-memory buffer (section 6); made by
                           pb_storage_wrap, free_ctx is the daemon's mapping
                           record (daemon/buffer.h) */
    PB_STORAGE_DEVICE,  /* device memory; free_fn returns it to the device */
} pb_storage_kind_t;

typedef struct pb_storage {
    atomic_int refs;
    pb_storage_kind_t kind;
    pb_device_t device;
    void *ptr;
    size_t size;
    void (*free_fn)(struct pb_storage *);
    void *free_ctx;
} pb_storage_t;

typedef struct pb_tensor {
    pb_dtype_t dtype;
    int rank;
    char order;          /* 'C' row-major or 'F' column-major */
    uint64_t shape[PB_MAX_RANK];
    pb_storage_t *storage; /* one reference owned; NULL for an empty slot */
    size_t offset;       /* byte offset of element 0 in storage */
} pb_tensor_t;

size_t pb_dtype_size(pb_dtype_t d);
bool pb_dtype_is_complex(pb_dtype_t d);
/* "f32" ... ; NULL for an invalid value. */
const char *pb_dtype_name(pb_dtype_t d);
/* 0 and *out on success, PB_EINVALID_ARGUMENT for an unknown name. */
int pb_dtype_parse(const char *s, size_t len, pb_dtype_t *out);
/* The real dtype of matching precision (c64 -> f32) and the reverse. */
pb_dtype_t pb_dtype_real(pb_dtype_t d);
pb_dtype_t pb_dtype_complex(pb_dtype_t d);

/* A heap storage of size bytes, PB_ALIGN-aligned, uninitialised (zeroed
 * when zero is true).  NULL when out of memory. */
pb_storage_t *pb_storage_new(size_t size, bool zero);
/* A storage that borrows ptr; release(ctx) runs when the last reference
 * goes. */
pb_storage_t *pb_storage_view(void *ptr, size_t size, void (*release)(void *), void *ctx);
/* A storage of the given kind over bytes its owner manages: free_fn(s)
 * runs when the last reference goes (then s itself is freed), and
 * s->free_ctx is ctx, so the owner finds its own record from any tensor
 * that views the bytes (shared memory: daemon/buffer.c).  NULL when out of
 * memory. */
pb_storage_t *pb_storage_wrap(pb_storage_kind_t kind, void *ptr, size_t size, void (*free_fn)(pb_storage_t *),
                              void *ctx);
pb_storage_t *pb_storage_ref(pb_storage_t *s);
void pb_storage_unref(pb_storage_t *s);

/* Element count, or 0 with *overflow set when the product overflows. */
bool pb_shape_count(int rank, const uint64_t *shape, size_t itemsize, size_t *count, size_t *bytes);
size_t pb_tensor_count(const pb_tensor_t *t);
size_t pb_tensor_bytes(const pb_tensor_t *t);
static inline void *pb_tensor_data(const pb_tensor_t *t)
{
    return t->storage ? (char *)t->storage->ptr + t->offset : NULL;
}
/* A new heap tensor of the given dtype and shape (C order unless order is
 * 'F').  0 or PB_ENOMEM. */
int pb_tensor_alloc(pb_tensor_t *t, pb_dtype_t d, int rank, const uint64_t *shape, char order, bool zero);
/* t: a tensor of dtype d, that shape and order ('F', else C) from the
 * start of s, taking over the caller's reference on s. */
void pb_tensor_over(pb_tensor_t *t, pb_storage_t *s, pb_dtype_t d, int rank, const uint64_t *shape, char order);
/* dst becomes another reference to src's bytes. */
void pb_tensor_ref(pb_tensor_t *dst, const pb_tensor_t *src);
/* Drop the reference and empty the slot; safe on an empty slot. */
void pb_tensor_clear(pb_tensor_t *t);
/* Same dtype and shape. */
bool pb_tensor_same_shape(const pb_tensor_t *a, const pb_tensor_t *b);
/* True when the data pointer is aligned for the dtype (inputs decoded
 * from a message may not be). */
bool pb_tensor_aligned(const pb_tensor_t *t);
/* Give t its own aligned heap copy of its bytes (same order).  0 or
 * PB_ENOMEM; on failure t is unchanged. */
int pb_tensor_make_owned(pb_tensor_t *t);
/* Copy into a new heap tensor in the requested order. */
int pb_tensor_to_order(pb_tensor_t *dst, const pb_tensor_t *src, char order);
/* "(2, 3)" into buf. */
const char *pb_shape_str(const pb_tensor_t *t, char *buf, size_t len);

#endif
