/* Shared-memory buffers (contract section 6): a client's memfd or shm file,
 * mapped by the daemon so that tensors live in it without a copy, and
 * results can be written into it (into).
 *
 * Glossary
 *   buffer     a registered mapping as its connection knows it: an id
 *              (1, 2, ... per connection, never reused there) and the
 *              registered size.
 *   mapping    the mmap of the client's fd, MAP_SHARED over the registered
 *              size: read-write when the fd allows it, else read-only.
 *              One pb_storage_t of kind PB_STORAGE_SHM stands for it.
 *   table      a connection's buffers (pb_buffers_t): id -> mapping.
 *   registry   every live mapping of the process, in slots that the
 *              SIGBUS handler reads without locks.
 *   broken     the client shrank its file below the registered size and
 *              touching the mapping raised SIGBUS: the handler put
 *              anonymous zero pages over the whole mapping (so the access
 *              and every later one complete) and marked it broken.  A
 *              request that touched a broken buffer fails with
 *              invalid_argument, and the buffer is refused from then on.
 *
 * Ownership: a mapping is owned by the references on its storage.  The
 * table holds one; every tensor that views the mapping (inputs, cotangents
 * and into targets of requests in flight) holds one more, so unregistering
 * a buffer or closing its connection never pulls a mapping from under a
 * worker: the munmap happens at the last reference, on whatever thread
 * drops it.  The mapping record (free_ctx of the storage) is allocated by
 * pb_buffers_register and freed with the storage.  The fd is always closed
 * by pb_buffers_register: the mapping does not need it.  Registry slots
 * live in chunks that are never freed, so the signal handler never reads
 * freed memory.  The table itself belongs to its connection and runs on
 * the loop thread only. */
#ifndef PB_BUFFER_H
#define PB_BUFFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "../kernels/tensor.h"
#include "../proto/codec.h"
#include "../proto/errors.h"

/* Mappings the registry holds at most, over all connections: half of the
 * kernel's vm.max_map_count (read once), and never more than this; one
 * uid's at most half of that. */
#define PB_SHM_MAX_MAPPINGS 65536

typedef struct pb_buffer_ent {
    uint64_t id;
    pb_storage_t *storage; /* one reference, the table's */
} pb_buffer_ent_t;

typedef struct pb_buffers {
    pb_buffer_ent_t *v;    /* n entries, cap allocated */
    size_t n, cap;
    uint64_t last_id;
    size_t bytes;          /* registered sizes summed */
    uid_t uid;             /* its connection's: one uid maps at most half of
                            * the registry (0 after pb_buffers_init) */
} pb_buffers_t;

void pb_buffers_init(pb_buffers_t *b);
/* Drop the table's references (mappings still viewed by requests in
 * flight live until those end) and empty it; the table may be used again. */
void pb_buffers_destroy(pb_buffers_t *b);
/* Map size bytes of fd (always closed) and add them to the table.  Checks,
 * before anything is mapped: the table's count below max_count and its
 * bytes + size at most max_bytes (resource_exhausted naming
 * max_buffers_per_connection / max_buffer_bytes_per_connection), fd a
 * regular file (memfd, shm file) open for reading, size > 0 and at most
 * the file's size (invalid_argument).  0 and *id, or an error in err. */
/* A client's GPU memory (contract section 6, GPU buffers), exported as fd:
 * mapped on GPU gpu by its backend (import_fd), counted against the same
 * limits, its storage of kind PB_STORAGE_SHM with device cuda:gpu and a
 * device address (no host mapping, no SIGBUS guard: the memory lives as
 * long as the mapping, whatever the client does).  fd is closed here. */
int pb_buffers_register_gpu(pb_buffers_t *b, int fd, uint64_t size, int gpu, size_t max_count, size_t max_bytes,
                            uint64_t *id, pb_err_t *err);
int pb_buffers_register(pb_buffers_t *b, int fd, uint64_t size, size_t max_count, size_t max_bytes, uint64_t *id,
                        pb_err_t *err);
/* Drop buffer id from the table: 0, or invalid_argument for an id the
 * table does not hold. */
int pb_buffers_unregister(pb_buffers_t *b, uint64_t id, pb_err_t *err);
/* The resolver (codec.h) of a table: finds ids in b. */
pb_resolver_t pb_buffers_resolver(pb_buffers_t *b);

/* About a storage of kind PB_STORAGE_SHM (false / 0 for any other). */
bool pb_shm_broken(const pb_storage_t *s);
bool pb_shm_writable(const pb_storage_t *s);
uint64_t pb_shm_id(const pb_storage_t *s);
/* Whether two storages map the same file (a mapping starts at the file's
 * offset 0, so equal buffer offsets are equal bytes): one storage, or two
 * registrations of one memfd, on one connection or two.  Non-shm storages
 * are the same only when they are one. */
bool pb_shm_same_file(const pb_storage_t *a, const pb_storage_t *b);
/* A number equal for storages that map the same file (pb_shm_same_file);
 * any other storage's own address. */
uint64_t pb_shm_file_key(const pb_storage_t *s);

/* The most mappings the registry holds (see PB_SHM_MAX_MAPPINGS); the
 * setter is for tests (capped at PB_SHM_MAX_MAPPINGS; 0: the kernel's
 * limit again). */
size_t pb_shm_max_mappings(void);
/* One uid's most: half of pb_shm_max_mappings, at least one.  Both are in
 * hello.limits (max_mapped_buffers, max_mapped_buffers_per_uid) and named
 * by the refusals at them. */
size_t pb_shm_max_mappings_per_uid(void);
void pb_shm_set_max_mappings(size_t n);

/* Mappings alive in the process and their registered bytes (stats). */
void pb_shm_totals(size_t *count, size_t *bytes);

#endif
