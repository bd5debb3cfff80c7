/* The daemon's memory for tensors, work arrays and message buffers.
 *
 * Glossary
 *   block    what pb_mem_alloc and pb_mem_block return: PB_ALIGN-aligned
 *            bytes, freed with pb_mem_free only.  A header just before
 *            the block says where it came from.
 *   class    large blocks (PB_MEM_POOL_MIN and up, header included) are
 *            mapped in size classes, four per power of two (a block wastes
 *            at most a quarter of its class), so that a freed block fits
 *            the next request of about the same size.
 *   cache    freed large blocks kept mapped, per class, for reuse: a block
 *            taken from the cache is already paged in (a first touch of a
 *            fresh page costs microseconds, 8,192 of them per 32 MiB),
 *            which is the point.  A request may take a cached block of up
 *            to twice its class.  The cache holds at most its cap in
 *            bytes; a free past the cap unmaps the block.  pb_mem_trim
 *            empties it (the daemon calls it after idle-trim seconds
 *            without a request), as PyTorch's caching allocator empties
 *            its cache on request.
 *
 * Small blocks come from malloc: glibc's arenas already reuse them.
 *
 * Ownership: the caller owns a block until pb_mem_free; the cache owns
 * the blocks on its lists.  Thread-safe: one mutex guards the cache, taken
 * once per large allocation or free. */
#ifndef PB_MEM_H
#define PB_MEM_H

#include <stdbool.h>
#include <stddef.h>

/* Blocks this large and up come from the cache. */
#define PB_MEM_POOL_MIN ((size_t)256 << 10)

/* Both allocators leave PB_TAIL_SLACK(size) readable bytes after a block:
 * OpenBLAS 0.3.21's zgemv_n kernel, inside the row-reflector routines
 * (gelq2, ungl2, gebd2: gelqf, unglq/orglq, gesdd), reads past the end of
 * its matrix by up to about one column.  Measured with the matrix's end
 * against a PROT_NONE page: 1465 of 1600 LQ shapes up to 40×40 crashed
 * with no slack, 497 with 256 bytes, none with one column; GEMM never
 * read past its operands.  A block at the end of mapped memory (the top of
 * a malloc arena, the end of a mapping) would take the daemon down with
 * SIGSEGV.  The slack is the block's own size up to 1 MiB (a column of
 * 65536 c128 rows), plus 64 bytes. */
#define PB_TAIL_SLACK(size) (((size) < ((size_t)1 << 20) ? (size) : ((size_t)1 << 20)) + 64)

/* size bytes plus PB_TAIL_SLACK(size) readable after them, PB_ALIGN
 * aligned, uninitialised: tensors and the work arrays BLAS and LAPACK see.
 * NULL when out of memory or on overflow. */
void *pb_mem_alloc(size_t size);
/* The same, the first size bytes zeroed (a freshly mapped block is zero
 * already and is not written). */
void *pb_mem_zalloc(size_t size);
/* n·size zeroed bytes with the slack (the factorizations' work arrays);
 * NULL on overflow or out of memory. */
void *pb_mem_calloc(size_t n, size_t size);
/* size bytes without the slack: message buffers, which no BLAS reads. */
void *pb_mem_block(size_t size);
/* Back to the cache (large blocks) or to malloc; NULL is ignored. */
void pb_mem_free(void *p);
/* On the calling thread from now on, a large block that a free or release
 * would unmap is handed to defer(block, arg) instead, which returns true
 * when it has taken the block (another thread then pb_mem_release's it)
 * and false to have it unmapped here.  NULL: unmap here again.  The
 * daemon's loop thread sets one: unmapping costs about 85 ms a GiB. */
void pb_mem_defer_unmaps(bool (*defer)(void *block, void *arg), void *arg);
/* Back to the system at once, not to the cache: memory that a flood or a
 * closed connection held, which should not stay resident. */
void pb_mem_release(void *p);
/* The bytes a large block maps (0 for a small one): what its unmapping
 * gives back.  Readable while the block waits to be released. */
size_t pb_mem_mapped_size(const void *p);

/* Tune glibc (called once at startup, before any thread is made): it
 * keeps blocks up to 1 GiB in its heap instead of mapping each. */
void pb_alloc_init(void);
/* The cache's byte cap (PB_MEM_DEFAULT_CAP until set).  set_cap applies
 * it at once: a cache holding more is emptied.  set_cap_only changes it
 * for the frees to come, and fit_cap later empties a cache holding more
 * than the cap then (unmapping costs about 85 ms a GiB: the daemon does
 * that off its loop). */
#define PB_MEM_DEFAULT_CAP ((size_t)1 << 30)
void pb_mem_set_cap(size_t cap);
void pb_mem_set_cap_only(size_t cap);
void pb_mem_fit_cap(void);
/* Unmap every cached block and give glibc's free pages back. */
void pb_alloc_trim(void);
/* glibc's free pages only (after a connection that held much left). */
void pb_alloc_trim_heap(void);

typedef struct pb_mem_stats {
    size_t cached_bytes;   /* on the cache's lists now */
    size_t mapped_bytes;   /* large blocks in use or cached */
    size_t cap;
    unsigned long long hits, misses; /* large allocations served from the cache or mapped */
} pb_mem_stats_t;
void pb_mem_stats(pb_mem_stats_t *out);

#endif
