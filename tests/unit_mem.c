/* unit.mem: the caching allocator (kernels/mem.c): large blocks come back
 * from the cache (the same memory, already paged in), a request takes a
 * block of its class or up to twice it, the cap bounds what is kept, trim
 * and a lowered cap empty the cache, zeroed blocks are zero when reused,
 * blocks are aligned with their slack readable, and threads share it. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include <cmocka.h>

#include "kernels/mem.h"
#include "kernels/tensor.h"

#define MiB ((size_t)1 << 20)

static pb_mem_stats_t stats(void)
{
    pb_mem_stats_t s;
    pb_mem_stats(&s);
    return s;
}

static int setup(void **state)
{
    (void)state;
    pb_mem_set_cap(PB_MEM_DEFAULT_CAP);
    pb_alloc_trim();
    return 0;
}

static long minflt(void)
{
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return r.ru_minflt;
}

static void large_blocks_are_reused(void **state)
{
    (void)state;
    pb_mem_stats_t s0 = stats();
    char *a = pb_mem_alloc(32 * MiB);
    assert_non_null(a);
    assert_int_equal((uintptr_t)a % PB_ALIGN, 0);
    memset(a, 7, 32 * MiB);
    a[32 * MiB + PB_TAIL_SLACK(32 * MiB) - 1] = 1; /* the slack is ours to read (and write) */
    pb_mem_free(a);
    pb_mem_stats_t s1 = stats();
    assert_int_equal(s1.misses, s0.misses + 1);
    assert_true(s1.cached_bytes >= 32 * MiB);
    /* A slightly different size of the same class: the same memory, no
     * page faults to speak of (a fresh 32 MiB costs 8,192). */
    long f0 = minflt();
    char *b = pb_mem_alloc(32 * MiB - 4096);
    assert_ptr_equal(a, b);
    memset(b, 1, 32 * MiB - 4096);
    assert_true(minflt() - f0 < 64);
    pb_mem_stats_t s2 = stats();
    assert_int_equal(s2.hits, s1.hits + 1);
    assert_int_equal(s2.cached_bytes, s0.cached_bytes);
    pb_mem_free(b);
}

static void a_class_takes_up_to_twice_its_size(void **state)
{
    (void)state;
    char *big = pb_mem_block(8 * MiB);
    pb_mem_free(big);
    /* 5 MiB: 8 MiB is less than twice its class (5 MiB) away: reused. */
    char *p = pb_mem_block(5 * MiB);
    assert_ptr_equal(p, big);
    pb_mem_free(p);
    /* 3 MiB: 8 MiB is more than twice: a new block, the big one stays. */
    char *q = pb_mem_block(3 * MiB);
    assert_ptr_not_equal(q, big);
    size_t cached = stats().cached_bytes;
    assert_true(cached >= 8 * MiB);
    pb_mem_free(q);
    assert_true(stats().cached_bytes > cached);
}

static void zalloc_zeroes_a_reused_block(void **state)
{
    (void)state;
    char *a = pb_mem_alloc(4 * MiB);
    memset(a, 0xab, 4 * MiB);
    pb_mem_free(a);
    char *z = pb_mem_zalloc(4 * MiB);
    assert_ptr_equal(a, z);
    for (size_t i = 0; i < 4 * MiB; i += 4093)
        assert_int_equal(z[i], 0);
    assert_int_equal(z[4 * MiB - 1], 0);
    pb_mem_free(z);
    /* Through a storage too, as the kernels ask for it. */
    pb_storage_t *s = pb_storage_new(4 * MiB, true);
    assert_non_null(s);
    assert_int_equal(((char *)s->ptr)[12345], 0);
    pb_storage_unref(s);
}

static void the_cap_bounds_the_cache(void **state)
{
    (void)state;
    pb_mem_set_cap(10 * MiB);
    void *a = pb_mem_block(6 * MiB), *b = pb_mem_block(6 * MiB);
    size_t mapped = stats().mapped_bytes;
    pb_mem_free(a);
    assert_true(stats().cached_bytes >= 6 * MiB);
    pb_mem_free(b); /* past the cap: unmapped */
    assert_true(stats().cached_bytes <= 10 * MiB);
    assert_true(stats().mapped_bytes < mapped);
    /* A lower cap empties what lies above it. */
    pb_mem_set_cap(1 * MiB);
    assert_int_equal(stats().cached_bytes, 0);
    assert_int_equal(stats().mapped_bytes, 0);
    /* set_cap_only leaves what is cached until fit_cap (the daemon's
     * reload runs that off its loop); frees meanwhile obey the new cap. */
    void *d = pb_mem_block(4 * MiB), *e = pb_mem_block(4 * MiB);
    pb_mem_set_cap(10 * MiB);
    pb_mem_free(d);
    size_t held = stats().cached_bytes;
    assert_true(held >= 4 * MiB);
    pb_mem_set_cap_only(1 * MiB);
    assert_int_equal(stats().cached_bytes, held);
    pb_mem_free(e); /* past the new cap: unmapped */
    assert_int_equal(stats().cached_bytes, held);
    pb_mem_fit_cap();
    assert_int_equal(stats().cached_bytes, 0);
    assert_int_equal(stats().mapped_bytes, 0);
    /* Cap 0: nothing is kept. */
    pb_mem_set_cap(0);
    void *c = pb_mem_block(1 * MiB);
    pb_mem_free(c);
    assert_int_equal(stats().cached_bytes, 0);
    pb_mem_set_cap(PB_MEM_DEFAULT_CAP);
}

static void trim_and_release_unmap(void **state)
{
    (void)state;
    void *a = pb_mem_block(2 * MiB), *b = pb_mem_block(2 * MiB);
    pb_mem_free(a);
    pb_mem_release(b); /* never cached */
    pb_mem_stats_t s = stats();
    assert_true(s.cached_bytes >= 2 * MiB && s.cached_bytes < 4 * MiB);
    pb_alloc_trim();
    s = stats();
    assert_int_equal(s.cached_bytes, 0);
    assert_int_equal(s.mapped_bytes, 0);
}

static void small_blocks_and_edges(void **state)
{
    (void)state;
    pb_mem_stats_t s0 = stats();
    for (size_t n = 0; n < 300000; n = n * 3 + 1) {
        char *p = pb_mem_alloc(n);
        assert_non_null(p);
        assert_int_equal((uintptr_t)p % PB_ALIGN, 0);
        memset(p, 1, n + PB_TAIL_SLACK(n));
        pb_mem_free(p);
        char *z = pb_mem_zalloc(n);
        for (size_t i = 0; i < n; i++)
            assert_int_equal(z[i], 0);
        pb_mem_release(z);
    }
    void *z0 = pb_mem_block(0);
    assert_non_null(z0);
    pb_mem_free(z0);
    pb_mem_free(NULL);
    pb_mem_release(NULL);
    assert_null(pb_mem_alloc(SIZE_MAX - 10));
    assert_null(pb_mem_block(SIZE_MAX / 2 + 1));
    char *c = pb_mem_calloc(1000, 8);
    assert_int_equal(c[7999], 0);
    pb_mem_free(c);
    assert_null(pb_mem_calloc(SIZE_MAX / 4, 8));
    pb_mem_stats_t s1 = stats();
    assert_int_equal(s1.mapped_bytes, s1.cached_bytes); /* nothing left in use */
    (void)s0;
}

/* Four threads allocate, fill, check and free blocks of many classes at
 * once: no block is handed out twice. */
static void *churn(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    for (int i = 0; i < 400; i++) {
        seed = seed * 1103515245u + 12345u;
        size_t n = PB_MEM_POOL_MIN + (seed >> 8) % (3 * MiB);
        unsigned char *p = pb_mem_alloc(n);
        if (p == NULL)
            return (void *)1;
        unsigned char tag = (unsigned char)(seed >> 24);
        memset(p, tag, n);
        for (size_t k = 0; k < n; k += 997)
            if (p[k] != tag)
                return (void *)1;
        if (p[n - 1] != tag)
            return (void *)1;
        pb_mem_free(p);
    }
    return NULL;
}

static void threads_share_the_cache(void **state)
{
    (void)state;
    pthread_t t[4];
    for (uintptr_t i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&t[i], NULL, churn, (void *)(i + 1)), 0);
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(t[i], &r);
        assert_null(r);
    }
    pb_mem_stats_t s = stats();
    assert_int_equal(s.mapped_bytes, s.cached_bytes); /* everything was freed */
    assert_true(s.hits > 0);
    pb_alloc_trim();
}

/* pb_mem_defer_unmaps: what this thread would unmap goes to the hook. */
static void *deferred[4];
static int ndeferred;

static bool take(void *block, void *arg)
{
    (void)arg;
    if (ndeferred == 4)
        return false; /* refused: unmapped by the freeing thread */
    deferred[ndeferred++] = block;
    return true;
}

static void *release_thread(void *p)
{
    pb_mem_release(p);
    return NULL;
}

static void unmaps_are_deferred(void **state)
{
    (void)state;
    ndeferred = 0;
    pb_mem_set_cap(2 * MiB);
    void *a = pb_mem_block(4 * MiB), *b = pb_mem_block(1 * MiB), *c = pb_mem_block(1 * MiB);
    size_t mapped = stats().mapped_bytes;
    pb_mem_defer_unmaps(take, NULL);
    pb_mem_free(b);           /* under the cap: cached, no hand-off */
    pb_mem_free(a);           /* past the cap: handed off, still mapped */
    pb_mem_release(c);        /* a release too */
    assert_int_equal(ndeferred, 2);
    assert_ptr_equal(deferred[0], a);
    assert_ptr_equal(deferred[1], c);
    assert_int_equal(stats().mapped_bytes, mapped);
    /* Another thread releases them (no hook there): unmapped. */
    for (int i = 0; i < ndeferred; i++) {
        pthread_t t;
        assert_int_equal(pthread_create(&t, NULL, release_thread, deferred[i]), 0);
        pthread_join(t, NULL);
    }
    assert_true(stats().mapped_bytes < mapped - 4 * MiB);
    /* A refusing hook: unmapped here. */
    ndeferred = 4;
    void *d = pb_mem_block(4 * MiB);
    size_t before = stats().mapped_bytes;
    pb_mem_release(d);
    assert_true(stats().mapped_bytes < before);
    pb_mem_defer_unmaps(NULL, NULL);
    pb_mem_set_cap(PB_MEM_DEFAULT_CAP);
}

int main(void)
{
    pb_alloc_init();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(large_blocks_are_reused, setup),
        cmocka_unit_test_setup(a_class_takes_up_to_twice_its_size, setup),
        cmocka_unit_test_setup(zalloc_zeroes_a_reused_block, setup),
        cmocka_unit_test_setup(the_cap_bounds_the_cache, setup),
        cmocka_unit_test_setup(trim_and_release_unmap, setup),
        cmocka_unit_test_setup(small_blocks_and_edges, setup),
        cmocka_unit_test_setup(threads_share_the_cache, setup),
        cmocka_unit_test_setup(unmaps_are_deferred, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
