/* The caching allocator: see mem.h. */
#include "mem.h"

#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "tensor.h"

/* Under AddressSanitizer a cached block is poisoned, and so is the rest of
 * a block's class past what was asked: a use after free or past the end
 * is reported as it would be for malloc's memory. */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MEM_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define MEM_ASAN 1
#endif
#ifdef MEM_ASAN
#include <sanitizer/asan_interface.h>
#define MEM_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define MEM_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define MEM_POISON(p, n) ((void)(p), (void)(n))
#define MEM_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

/* Just before every block.  map_len is 0 for a malloc'd block (base is
 * what malloc returned) and the mapping's length for a large one (base is
 * the mapping; the header is its first bytes). */
typedef struct mem_hdr {
    void *base;
    size_t map_len;
    struct mem_hdr *next; /* on a cache list */
    uint32_t magic;
    bool fresh;           /* mapped for this allocation: still zero */
} mem_hdr_t;

#define MEM_MAGIC 0x70626d65u
/* A large block's data starts this far into its mapping (keeps PB_ALIGN). */
#define MEM_HEAD PB_ALIGN
_Static_assert(sizeof(mem_hdr_t) <= MEM_HEAD, "header fits before the block");
#define MEM_NCLASSES (64 * 4)
/* A request takes a cached block of its class or of up to this many
 * classes above (four classes: twice the size). */
#define MEM_REACH 4

static pthread_mutex_t mem_lock = PTHREAD_MUTEX_INITIALIZER;
static mem_hdr_t *mem_lists[MEM_NCLASSES]; /* cached blocks per class */
static size_t mem_cached, mem_mapped, mem_cap = PB_MEM_DEFAULT_CAP;
static unsigned long long mem_hits, mem_misses;

static mem_hdr_t *hdr_of(void *p)
{
    return (mem_hdr_t *)((char *)p - sizeof(mem_hdr_t));
}

/* The class of a mapping of at least len bytes (len ≥ PB_MEM_POOL_MIN), and
 * its length: len rounded up to a quarter of its power of two. */
static int mem_class(size_t len, size_t *class_len)
{
    int k = 63 - __builtin_clzll((unsigned long long)len);
    size_t q = (size_t)1 << (k - 2);
    size_t r = (len + q - 1) & ~(q - 1);
    int k2 = 63 - __builtin_clzll((unsigned long long)r);
    *class_len = r;
    return k2 * 4 + (int)((r >> (k2 - 2)) & 3);
}

static void *mem_large(size_t len)
{
    size_t clen;
    int cls = mem_class(len, &clen);
    mem_hdr_t *h = NULL;
    pthread_mutex_lock(&mem_lock);
    for (int c = cls; c < cls + MEM_REACH && c < MEM_NCLASSES && h == NULL; c++) {
        if ((h = mem_lists[c]) != NULL) {
            mem_lists[c] = h->next;
            mem_cached -= h->map_len;
            mem_hits++;
        }
    }
    if (h == NULL)
        mem_misses++;
    pthread_mutex_unlock(&mem_lock);
    if (h) {
        h->fresh = false;
        char *p = (char *)h->base + MEM_HEAD;
        MEM_UNPOISON(p, len - MEM_HEAD);
        MEM_POISON(p + (len - MEM_HEAD), h->map_len - len);
        return p;
    }
    void *base = mmap(NULL, clen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED)
        return NULL;
    pthread_mutex_lock(&mem_lock);
    mem_mapped += clen;
    pthread_mutex_unlock(&mem_lock);
    h = hdr_of((char *)base + MEM_HEAD);
    *h = (mem_hdr_t){.base = base, .map_len = clen, .magic = MEM_MAGIC, .fresh = true};
    MEM_POISON((char *)base + len, clen - len);
    return (char *)base + MEM_HEAD;
}

/* malloc, aligned by hand with the header before the aligned address:
 * glibc does not hand a freed aligned_alloc or posix_memalign block to a
 * later request, so every such block would page-fault fresh memory
 * (measured: ~6 MB of faults per round of a 4 MiB and two 1 MiB tensors,
 * none with malloc). */
static void *mem_small(size_t size)
{
    size_t total = size + PB_ALIGN + sizeof(mem_hdr_t);
    void *base = malloc(total);
    if (base == NULL)
        return NULL;
    uintptr_t a = ((uintptr_t)base + sizeof(mem_hdr_t) + PB_ALIGN - 1) & ~(uintptr_t)(PB_ALIGN - 1);
    mem_hdr_t *h = hdr_of((void *)a);
    *h = (mem_hdr_t){.base = base, .magic = MEM_MAGIC};
    return (void *)a;
}

/* size bytes (the caller's slack included), from the cache or malloc. */
static void *mem_get(size_t size)
{
    if (size > SIZE_MAX / 2)
        return NULL;
    if (size + MEM_HEAD >= PB_MEM_POOL_MIN)
        return mem_large(size + MEM_HEAD);
    return mem_small(size);
}

void *pb_mem_block(size_t size)
{
    return mem_get(size ? size : 1);
}

void *pb_mem_alloc(size_t size)
{
    if (size > SIZE_MAX / 2)
        return NULL;
    return mem_get(size + PB_TAIL_SLACK(size));
}

void *pb_mem_zalloc(size_t size)
{
    void *p = pb_mem_alloc(size);
    if (p && !hdr_of(p)->fresh)
        memset(p, 0, size);
    return p;
}

void *pb_mem_calloc(size_t n, size_t size)
{
    if (size != 0 && n > SIZE_MAX / 2 / size)
        return NULL;
    return pb_mem_zalloc(n * size);
}

static void mem_unmap(mem_hdr_t *h)
{
    size_t len = h->map_len;
    MEM_UNPOISON(h->base, len); /* the next mapping here starts clean */
    munmap(h->base, len);
    pthread_mutex_lock(&mem_lock);
    mem_mapped -= len;
    pthread_mutex_unlock(&mem_lock);
}

/* This thread's hand-off for blocks to unmap (pb_mem_defer_unmaps). */
static __thread bool (*mem_defer)(void *block, void *arg);
static __thread void *mem_defer_arg;

void pb_mem_defer_unmaps(bool (*defer)(void *block, void *arg), void *arg)
{
    mem_defer = defer;
    mem_defer_arg = arg;
}

static void mem_put(void *p, bool keep)
{
    if (p == NULL)
        return;
    mem_hdr_t *h = hdr_of(p);
    if (h->magic != MEM_MAGIC)
        abort(); /* not a block of ours, or its header was overwritten */
    if (h->map_len == 0) {
        h->magic = 0;
        free(h->base);
        return;
    }
    if (keep) {
        size_t clen;
        int cls = mem_class(h->map_len, &clen);
        pthread_mutex_lock(&mem_lock);
        if (mem_cached + h->map_len <= mem_cap) {
            MEM_POISON(p, h->map_len - MEM_HEAD);
            h->next = mem_lists[cls];
            mem_lists[cls] = h;
            mem_cached += h->map_len;
            pthread_mutex_unlock(&mem_lock);
            return;
        }
        pthread_mutex_unlock(&mem_lock);
    }
    /* Poisoned while it waits: the header stays readable for the release,
     * and mem_unmap unpoisons the whole mapping. */
    MEM_POISON(p, h->map_len - MEM_HEAD);
    if (mem_defer && mem_defer(p, mem_defer_arg))
        return; /* another thread will pb_mem_release it */
    mem_unmap(h);
}

size_t pb_mem_mapped_size(const void *p)
{
    return p ? hdr_of((void *)p)->map_len : 0;
}

void pb_mem_free(void *p)
{
    mem_put(p, true);
}

void pb_mem_release(void *p)
{
    mem_put(p, false);
}

void pb_alloc_init(void)
{
    /* glibc maps every block above 32 MiB (the dynamic threshold's cap)
     * with mmap and unmaps it on free; blocks under PB_MEM_POOL_MIN that
     * glibc would map (below its dynamic threshold's start) stay in the
     * heap, and the heap is trimmed only above 1 GiB free. */
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

/* Take every cached block off the lists (under mem_lock); the caller
 * unmaps them with mem_unmap_all. */
static mem_hdr_t *mem_take_all(void)
{
    mem_hdr_t *all = NULL;
    for (int c = 0; c < MEM_NCLASSES; c++) {
        while (mem_lists[c]) {
            mem_hdr_t *h = mem_lists[c];
            mem_lists[c] = h->next;
            h->next = all;
            all = h;
        }
    }
    mem_cached = 0;
    return all;
}

static void mem_unmap_all(mem_hdr_t *all)
{
    while (all) {
        mem_hdr_t *next = all->next;
        mem_unmap(all);
        all = next;
    }
}

void pb_mem_set_cap_only(size_t cap)
{
    pthread_mutex_lock(&mem_lock);
    mem_cap = cap;
    pthread_mutex_unlock(&mem_lock);
}

void pb_mem_fit_cap(void)
{
    pthread_mutex_lock(&mem_lock);
    mem_hdr_t *all = mem_cached > mem_cap ? mem_take_all() : NULL;
    pthread_mutex_unlock(&mem_lock);
    mem_unmap_all(all);
}

void pb_mem_set_cap(size_t cap)
{
    pb_mem_set_cap_only(cap);
    pb_mem_fit_cap();
}

void pb_alloc_trim(void)
{
    pthread_mutex_lock(&mem_lock);
    mem_hdr_t *all = mem_take_all();
    pthread_mutex_unlock(&mem_lock);
    mem_unmap_all(all);
    pb_alloc_trim_heap();
}

void pb_alloc_trim_heap(void)
{
    /* glibc keeps freed blocks of its arenas resident: hand their free
     * pages back (all arenas, holes included). */
    malloc_trim(0);
}

void pb_mem_stats(pb_mem_stats_t *out)
{
    pthread_mutex_lock(&mem_lock);
    *out = (pb_mem_stats_t){mem_cached, mem_mapped, mem_cap, mem_hits, mem_misses};
    pthread_mutex_unlock(&mem_lock);
}
