/* Growing an array by doubling: the one place the daemon's tables (tape
 * peers, uid buffering figures) get more room. */
#ifndef PB_GROW_H
#define PB_GROW_H

#include <stdbool.h>
#include <stdlib.h>

/* Make room for one more element in *arr (n used of *cap, elem bytes
 * each): true, or false with *arr untouched when memory is short. */
static inline bool pb__grow(void **arr, size_t n, size_t *cap, size_t elem)
{
    if (n < *cap)
        return true;
    size_t ncap = *cap ? 2 * *cap : 8;
    void *p = realloc(*arr, ncap * elem);
    if (p == NULL)
        return false;
    *arr = p;
    *cap = ncap;
    return true;
}

#endif
