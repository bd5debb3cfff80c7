/* Shared-memory buffers: per-connection tables, the mappings, and the
 * SIGBUS handler that keeps a shrunk file from killing the daemon. */
#define _GNU_SOURCE
#include "buffer.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../cuda/gpu.h"

/* ---- the registry ------------------------------------------------------- */

/* One live mapping, as the SIGBUS handler sees it.  Writers (register and
 * the last unref, any thread) hold reg_lock and bump seq to odd while they
 * change a slot; the handler takes no lock and skips a slot whose seq is
 * odd or moved while it read, as a seqlock reader does.  That skip never
 * loses the faulting mapping: its slot is written before any tensor can
 * view it and cleared only after the last view is gone. */
typedef struct reg_slot {
    atomic_uint seq;
    _Atomic(uintptr_t) base; /* 0: free */
    atomic_size_t len;       /* bytes mapped: the registered size in whole pages */
    atomic_int prot;
    atomic_bool broken;
} reg_slot_t;

#define CHUNK 1024
#define NCHUNKS (PB_SHM_MAX_MAPPINGS / CHUNK)

/* Allocated in order as needed, never freed: the handler may be reading. */
static _Atomic(reg_slot_t *) chunks[NCHUNKS];
static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static size_t reg_count, reg_bytes; /* under reg_lock */
static size_t reg_max;              /* under reg_lock; 0 until set from the kernel's limit */
/* Mappings per uid (under reg_lock): one uid holds at most half of reg_max,
 * so the others are not shut out of registering.  Entries with a count. */
static struct uid_maps {
    uid_t uid;
    size_t n;
} *uid_maps;
static size_t n_uid_maps, cap_uid_maps;

/* Half of vm.max_map_count, at most PB_SHM_MAX_MAPPINGS: past the kernel's
 * limit every mmap of the process fails (malloc's large blocks, thread
 * stacks, the reads of other connections), so the buffers of one client
 * must stop well before it.  Under reg_lock. */
static size_t max_mappings(void)
{
    if (reg_max == 0) {
        long v = 0;
        FILE *f = fopen("/proc/sys/vm/max_map_count", "re");
        if (f) {
            if (fscanf(f, "%ld", &v) != 1)
                v = 0;
            fclose(f);
        }
        reg_max = v > 2 ? (size_t)v / 2 : 32768;
        if (reg_max > PB_SHM_MAX_MAPPINGS)
            reg_max = PB_SHM_MAX_MAPPINGS;
    }
    return reg_max;
}

size_t pb_shm_max_mappings(void)
{
    pthread_mutex_lock(&reg_lock);
    size_t n = max_mappings();
    pthread_mutex_unlock(&reg_lock);
    return n;
}

/* One uid's share: half of the daemon's most, at least one. */
static size_t per_uid(size_t most)
{
    return most / 2 ? most / 2 : 1;
}

size_t pb_shm_max_mappings_per_uid(void)
{
    return per_uid(pb_shm_max_mappings());
}

void pb_shm_set_max_mappings(size_t n)
{
    pthread_mutex_lock(&reg_lock);
    reg_max = n > PB_SHM_MAX_MAPPINGS ? PB_SHM_MAX_MAPPINGS : n;
    pthread_mutex_unlock(&reg_lock);
}

static pthread_once_t bus_once = PTHREAD_ONCE_INIT;
static int bus_rc;
static struct sigaction bus_old;

/* The mapping record: free_ctx of its storage. */
typedef struct pb_shm {
    uint64_t id;
    int gpu;         /* -1: host memory; else the GPU whose memory it is (import_fd) */
    size_t len;      /* bytes mapped (whole pages; a GPU buffer's: its size) */
    bool writable;
    dev_t dev;       /* the file mapped: two registrations of one memfd */
    ino_t ino;       /* (on one connection or two) map the same bytes */
    uid_t uid;       /* its connection's, counted in uid_maps */
    reg_slot_t *slot;
} pb_shm_t;

/* The technique of Wayland's wl_shm: a client may shrink its file after
 * registering it, and touching the pages past the new end raises SIGBUS.
 * Put anonymous zero pages over the whole mapping that holds the address,
 * so that the access (and every later one) completes, and mark the mapping
 * broken: the request that touched it fails when it ends.  An address in no
 * registered mapping is not ours: the previous action comes back (the
 * default one, unless a sanitizer installed its own) and the signal is
 * raised again, for a fault by returning to the faulting access.  Only
 * atomics and async-signal-safe calls here (mmap is a plain system call). */
static void on_sigbus(int sig, siginfo_t *si, void *uctx)
{
    (void)uctx;
    int saved = errno;
    uintptr_t a = (uintptr_t)si->si_addr;
    for (int c = 0; si->si_code > 0 && c < NCHUNKS; c++) {
        reg_slot_t *ch = atomic_load(&chunks[c]);
        if (ch == NULL)
            break;
        for (int i = 0; i < CHUNK; i++) {
            reg_slot_t *sl = &ch[i];
            unsigned s1 = atomic_load(&sl->seq);
            if (s1 & 1)
                continue;
            uintptr_t b = atomic_load(&sl->base);
            size_t len = atomic_load(&sl->len);
            int prot = atomic_load(&sl->prot);
            if (atomic_load(&sl->seq) != s1 || b == 0 || a < b || a - b >= len)
                continue;
            /* Broken before the zero pages go in: a request on another
             * worker that reads them checks the flag after its reads, and
             * must see it (set after, a check in between passed zeros off
             * as the client's data). */
            atomic_store(&sl->broken, true);
            if (mmap((void *)b, len, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED)
                goto not_ours;
            errno = saved;
            return;
        }
    }
not_ours:
    sigaction(SIGBUS, &bus_old, NULL);
    if (si->si_code <= 0)
        raise(sig);
    errno = saved;
}

static void bus_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    bus_rc = sigaction(SIGBUS, &sa, &bus_old);
}

static void slot_write(reg_slot_t *sl, uintptr_t base, size_t len, int prot)
{
    atomic_fetch_add(&sl->seq, 1);
    atomic_store(&sl->base, base);
    atomic_store(&sl->len, len);
    atomic_store(&sl->prot, prot);
    atomic_store(&sl->broken, false);
    atomic_fetch_add(&sl->seq, 1);
}

static struct uid_maps *uid_entry(uid_t uid)
{
    for (size_t i = 0; i < n_uid_maps; i++)
        if (uid_maps[i].uid == uid)
            return &uid_maps[i];
    return NULL;
}

enum { ROOM, FULL, UID_FULL, NO_MEMORY };

/* Room for one more mapping of uid?  Under reg_lock. */
static int room_for(uid_t uid)
{
    size_t most = max_mappings();
    if (reg_count >= most)
        return FULL;
    const struct uid_maps *u = uid_entry(uid);
    return u && u->n >= per_uid(most) ? UID_FULL : ROOM;
}

/* A free slot holding uid's mapping, or NULL with *why (FULL, UID_FULL,
 * NO_MEMORY). */
static reg_slot_t *slot_take(uintptr_t base, size_t len, int prot, size_t size, uid_t uid, int *why)
{
    reg_slot_t *got = NULL;
    pthread_mutex_lock(&reg_lock);
    struct uid_maps *u = uid_entry(uid);
    *why = room_for(uid);
    if (*why == ROOM && u == NULL) {
        if (n_uid_maps == cap_uid_maps) {
            size_t ncap = cap_uid_maps ? 2 * cap_uid_maps : 8;
            struct uid_maps *nv = realloc(uid_maps, ncap * sizeof *nv);
            if (nv == NULL)
                *why = NO_MEMORY;
            else {
                uid_maps = nv;
                cap_uid_maps = ncap;
            }
        }
        if (*why == ROOM) {
            u = &uid_maps[n_uid_maps++];
            *u = (struct uid_maps){uid, 0};
        }
    }
    for (int c = 0; c < NCHUNKS && got == NULL && *why == ROOM; c++) {
        reg_slot_t *ch = atomic_load(&chunks[c]);
        if (ch == NULL) {
            ch = calloc(CHUNK, sizeof *ch);
            if (ch == NULL)
                break;
            atomic_store(&chunks[c], ch);
        }
        for (int i = 0; i < CHUNK && got == NULL; i++)
            if (atomic_load(&ch[i].base) == 0)
                got = &ch[i];
    }
    if (got) {
        slot_write(got, base, len, prot);
        reg_count++;
        reg_bytes += size;
        u->n++;
    } else {
        if (*why == ROOM)
            *why = NO_MEMORY; /* a chunk's calloc */
        if (u && u->n == 0)
            *u = uid_maps[--n_uid_maps];
    }
    pthread_mutex_unlock(&reg_lock);
    return got;
}

static void slot_release(reg_slot_t *sl, size_t size, uid_t uid)
{
    pthread_mutex_lock(&reg_lock);
    slot_write(sl, 0, 0, 0);
    reg_count--;
    reg_bytes -= size;
    struct uid_maps *u = uid_entry(uid);
    if (u && --u->n == 0)
        *u = uid_maps[--n_uid_maps];
    pthread_mutex_unlock(&reg_lock);
}

void pb_shm_totals(size_t *count, size_t *bytes)
{
    pthread_mutex_lock(&reg_lock);
    *count = reg_count;
    *bytes = reg_bytes;
    pthread_mutex_unlock(&reg_lock);
}

/* The last reference went.  The slot goes first: once the pages are
 * unmapped, a new mapping may take their address, and a stale slot would
 * claim its faults. */
static void shm_free(pb_storage_t *s)
{
    pb_shm_t *m = s->free_ctx;
    if (m->gpu >= 0)
        pb_gpu->unimport(m->gpu, s->ptr, m->len);
    else {
        slot_release(m->slot, s->size, m->uid);
        munmap(s->ptr, m->len);
    }
    free(m);
}

bool pb_shm_broken(const pb_storage_t *s)
{
    if (s == NULL || s->kind != PB_STORAGE_SHM)
        return false;
    const pb_shm_t *m = s->free_ctx;
    return m->slot && atomic_load(&m->slot->broken); /* a GPU buffer has no slot: no SIGBUS */
}

bool pb_shm_writable(const pb_storage_t *s)
{
    return s && s->kind == PB_STORAGE_SHM && ((const pb_shm_t *)s->free_ctx)->writable;
}

uint64_t pb_shm_id(const pb_storage_t *s)
{
    return s && s->kind == PB_STORAGE_SHM ? ((const pb_shm_t *)s->free_ctx)->id : 0;
}

bool pb_shm_same_file(const pb_storage_t *a, const pb_storage_t *b)
{
    if (a == b)
        return a != NULL;
    if (a == NULL || b == NULL || a->kind != PB_STORAGE_SHM || b->kind != PB_STORAGE_SHM)
        return false;
    const pb_shm_t *x = a->free_ctx, *y = b->free_ctx;
    return x->dev == y->dev && x->ino == y->ino;
}

uint64_t pb_shm_file_key(const pb_storage_t *s)
{
    if (s == NULL || s->kind != PB_STORAGE_SHM)
        return (uint64_t)(uintptr_t)s;
    const pb_shm_t *m = s->free_ctx;
    return (uint64_t)m->ino * 0x9E3779B97F4A7C15ull ^ (uint64_t)m->dev;
}

/* ---- tables ------------------------------------------------------------- */

void pb_buffers_init(pb_buffers_t *b)
{
    memset(b, 0, sizeof *b);
}

void pb_buffers_destroy(pb_buffers_t *b)
{
    for (size_t i = 0; i < b->n; i++)
        pb_storage_unref(b->v[i].storage);
    free(b->v);
    b->v = NULL;
    b->n = b->cap = 0;
    b->bytes = 0;
    /* last_id stays: ids are never reused on a connection. */
}

static const char *file_kind(mode_t m)
{
    return S_ISSOCK(m) ? "socket" : S_ISFIFO(m) ? "pipe" : S_ISDIR(m) ? "directory" : S_ISCHR(m) ? "character device"
           : S_ISBLK(m) ? "block device" : "special file";
}

static int full_err(pb_err_t *err, int why, uid_t uid)
{
    size_t most = pb_shm_max_mappings();
    if (why == NO_MEMORY)
        return pb_err_set(err, PB_ENOMEM, NULL, "out of memory for the buffer registry");
    if (why == UID_FULL)
        return pb_err_set(err, PB_ERESOURCE_EXHAUSTED, "max_mapped_buffers_per_uid",
                          "uid %u already maps %zu shared-memory buffers over its connections, its most (half of "
                          "the daemon's %zu)", (unsigned)uid, per_uid(most), most);
    return pb_err_set(err, PB_ERESOURCE_EXHAUSTED, "max_mapped_buffers",
                      "the daemon already maps %zu shared-memory buffers over all connections, its most (half of "
                      "vm.max_map_count, at most %d)", most, PB_SHM_MAX_MAPPINGS);
}

/* What a registration of either kind checks first, and room for one more
 * entry in the table: 0 or the error. */
static int register_room(pb_buffers_t *b, uint64_t size, size_t max_count, size_t max_bytes, pb_err_t *err)
{
    if (b->n >= max_count)
        return pb_err_set(err, PB_ERESOURCE_EXHAUSTED, "max_buffers_per_connection",
                          "this connection holds %zu buffers, at or past the max_buffers_per_connection limit (%zu)",
                          b->n, max_count);
    if (size == 0)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "size", "size must be a positive number of bytes");
    if (size > SIZE_MAX / 2)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "size", "size %llu is more than any file could hold",
                          (unsigned long long)size);
    if (b->bytes > max_bytes || size > max_bytes - b->bytes)
        return pb_err_set(err, PB_ERESOURCE_EXHAUSTED, "max_buffer_bytes_per_connection",
                          "this connection has %zu bytes of buffers registered; %llu more would pass the "
                          "max_buffer_bytes_per_connection limit of %zu",
                          b->bytes, (unsigned long long)size, max_bytes);
    if (b->n == b->cap) {
        size_t ncap = b->cap ? 2 * b->cap : 8;
        pb_buffer_ent_t *nv = realloc(b->v, ncap * sizeof *nv);
        if (nv == NULL)
            return pb_err_set(err, PB_ENOMEM, NULL, "out of memory for the buffer table");
        b->v = nv;
        b->cap = ncap;
    }
    return 0;
}

int pb_buffers_register_gpu(pb_buffers_t *b, int fd, uint64_t size, int gpu, size_t max_count, size_t max_bytes,
                            uint64_t *id, pb_err_t *err)
{
    int rc = register_room(b, size, max_count, max_bytes, err);
    pb_shm_t *m = NULL;
    void *p = NULL;
    char why[256] = "";
    if (rc == 0 && (m = calloc(1, sizeof *m)) == NULL)
        rc = pb_err_set(err, PB_ENOMEM, NULL, "out of memory for the buffer");
    if (rc == 0 && (rc = pb_gpu->import_fd(gpu, fd, (size_t)size, &p, why, sizeof why)))
        pb_err_set(err, rc, rc == PB_ERESOURCE_EXHAUSTED ? "device_memory" : NULL, "cuda:%d: %s", gpu, why);
    pb_storage_t *s = NULL;
    if (rc == 0) {
        /* The file's identity, for the accumulate locks and aliasing
         * checks (an export's fd is a file like any other). */
        struct stat st;
        if (fstat(fd, &st) == 0) {
            m->dev = st.st_dev;
            m->ino = st.st_ino;
        }
        m->gpu = gpu;
        m->writable = true;
        m->uid = b->uid;
        m->len = (size_t)size;
        m->id = b->last_id + 1;
        if ((s = pb_storage_wrap(PB_STORAGE_SHM, p, (size_t)size, shm_free, m)) == NULL) {
            pb_gpu->unimport(gpu, p, (size_t)size);
            rc = pb_err_set(err, PB_ENOMEM, NULL, "out of memory for the buffer");
        }
    }
    close(fd);
    if (rc) {
        free(m);
        return rc;
    }
    s->device = (pb_device_t){PB_DEV_CUDA, gpu};
    b->last_id = m->id;
    b->v[b->n++] = (pb_buffer_ent_t){m->id, s};
    b->bytes += (size_t)size;
    *id = m->id;
    return 0;
}

int pb_buffers_register(pb_buffers_t *b, int fd, uint64_t size, size_t max_count, size_t max_bytes, uint64_t *id,
                        pb_err_t *err)
{
    int rc = 0;
    void *p = MAP_FAILED;
    size_t len = 0;
    pb_shm_t *m = NULL;
    reg_slot_t *slot = NULL;
    pb_storage_t *s;
    struct stat st;
    int fl;
    if ((rc = register_room(b, size, max_count, max_bytes, err)))
        goto out;
    /* Only a memfd or a shm file: F_GET_SEALS succeeds on exactly the
     * files of tmpfs (memfd_create, shm_open) and hugetlbfs, and does no
     * I/O.  fstat and mmap run on the event loop, and on those files they
     * never wait for a disk or a network, as they could for a file on NFS
     * or FUSE (not even fstat is called on such a file here). */
    if (fcntl(fd, F_GET_SEALS) < 0) {
        int type;
        socklen_t tl = sizeof type;
        bool sock = getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) == 0, pipe = fcntl(fd, F_GETPIPE_SZ) >= 0;
        rc = pb_err_set(err, PB_EINVALID_ARGUMENT, NULL, "the file descriptor is %s, not a memfd or shared-memory "
                        "file (tmpfs or hugetlbfs)", sock ? "a socket" : pipe ? "a pipe" : "another kind of file");
        goto out;
    }
    if (fstat(fd, &st) != 0) {
        rc = pb_err_set(err, PB_EINVALID_ARGUMENT, NULL, "cannot fstat the file descriptor: %s", strerror(errno));
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = pb_err_set(err, PB_EINVALID_ARGUMENT, NULL,
                        "the file descriptor is a %s, not a memfd or shared-memory file", file_kind(st.st_mode));
        goto out;
    }
    if (st.st_size < 0 || (uint64_t)st.st_size < size) {
        rc = pb_err_set(err, PB_EINVALID_ARGUMENT, "size", "size %llu is more than the file's %lld bytes",
                        (unsigned long long)size, (long long)st.st_size);
        goto out;
    }
    fl = fcntl(fd, F_GETFL);
    if (fl < 0 || (fl & O_ACCMODE) == O_WRONLY) {
        rc = pb_err_set(err, PB_EINVALID_ARGUMENT, NULL, "the file descriptor is not open for reading");
        goto out;
    }
    {
        /* Full already: not even one more mapping (slot_take checks again). */
        pthread_mutex_lock(&reg_lock);
        int why = room_for(b->uid);
        pthread_mutex_unlock(&reg_lock);
        if (why != ROOM) {
            rc = full_err(err, why, b->uid);
            goto out;
        }
    }
    pthread_once(&bus_once, bus_install);
    if (bus_rc != 0) {
        rc = pb_err_set(err, PB_EINTERNAL, NULL, "cannot install the SIGBUS handler that shared memory needs");
        goto out;
    }
    m = calloc(1, sizeof *m);
    if (m == NULL) {
        rc = pb_err_set(err, PB_ENOMEM, NULL, "out of memory for the buffer");
        goto out;
    }
    /* Read-write when the fd allows it; a read-only fd, or a memfd sealed
     * against writes (EPERM), is mapped read-only and refused as into. */
    m->writable = (fl & O_ACCMODE) == O_RDWR;
    m->gpu = -1;
    m->dev = st.st_dev;
    m->ino = st.st_ino;
    if (m->writable)
        p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED && (!m->writable || errno == EPERM || errno == EACCES)) {
        m->writable = false;
        p = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, 0);
    }
    if (p == MAP_FAILED) {
        int e = errno;
        rc = e == ENOMEM ? pb_err_set(err, PB_ERESOURCE_EXHAUSTED, NULL, "cannot map %llu bytes: %s",
                                      (unsigned long long)size, strerror(e))
                         : pb_err_set(err, PB_EINVALID_ARGUMENT, NULL, "cannot map the file: %s", strerror(e));
        goto out;
    }
    long page = sysconf(_SC_PAGESIZE);
    size_t pg = page > 0 ? (size_t)page : 4096;
    len = ((size_t)size + pg - 1) / pg * pg;
    int why;
    slot = slot_take((uintptr_t)p, len, m->writable ? PROT_READ | PROT_WRITE : PROT_READ, (size_t)size, b->uid, &why);
    if (slot == NULL) {
        rc = full_err(err, why, b->uid);
        goto out;
    }
    m->uid = b->uid;
    m->len = len;
    m->slot = slot;
    m->id = b->last_id + 1;
    s = pb_storage_wrap(PB_STORAGE_SHM, p, (size_t)size, shm_free, m);
    if (s == NULL) {
        rc = pb_err_set(err, PB_ENOMEM, NULL, "out of memory for the buffer");
        goto out;
    }
    b->last_id = m->id;
    b->v[b->n++] = (pb_buffer_ent_t){m->id, s};
    b->bytes += (size_t)size;
    *id = m->id;
    m = NULL;
    p = MAP_FAILED;
    slot = NULL;
out:
    close(fd);
    if (slot)
        slot_release(slot, (size_t)size, b->uid);
    if (p != MAP_FAILED)
        munmap(p, len ? len : (size_t)size);
    free(m);
    return rc;
}

static size_t find_index(const pb_buffers_t *b, uint64_t id)
{
    for (size_t i = 0; i < b->n; i++)
        if (b->v[i].id == id)
            return i;
    return b->n;
}

int pb_buffers_unregister(pb_buffers_t *b, uint64_t id, pb_err_t *err)
{
    size_t i = find_index(b, id);
    if (i == b->n)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "buffer",
                          "buffer %llu is not registered on this connection", (unsigned long long)id);
    pb_storage_t *s = b->v[i].storage;
    b->bytes -= s->size;
    memmove(&b->v[i], &b->v[i + 1], (b->n - i - 1) * sizeof b->v[0]);
    b->n--;
    pb_storage_unref(s);
    return 0;
}

static pb_storage_t *resolve(void *ctx, uint64_t id, bool write, const char *what, pb_err_t *err)
{
    pb_buffers_t *b = ctx;
    size_t i = find_index(b, id);
    if (i == b->n) {
        pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                   "%s: buffer %llu is not registered on this connection (never registered, unregistered, or "
                   "another connection's)",
                   what, (unsigned long long)id);
        return NULL;
    }
    pb_storage_t *s = b->v[i].storage;
    if (pb_shm_broken(s)) {
        pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                   "%s: buffer %llu shrank below its registered size; its contents are lost: unregister it",
                   what, (unsigned long long)id);
        return NULL;
    }
    if (write && !pb_shm_writable(s)) {
        pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                   "%s: buffer %llu is mapped read-only (its file descriptor was not open for writing, or the "
                   "file is sealed against writes): results cannot be written into it",
                   what, (unsigned long long)id);
        return NULL;
    }
    return s;
}

pb_resolver_t pb_buffers_resolver(pb_buffers_t *b)
{
    return (pb_resolver_t){resolve, b};
}
