/* C client library of pullbackd.
 *
 * A small blocking client for the daemon's msgpack-RPC protocol (see
 * shared/PROTOCOL.md beside this repository): connect to the Unix socket, pack a request's params
 * with msgpack-c's own packer, send it, and read replies back as msgpack
 * objects.  Requests may be pipelined (several sends before any receive);
 * replies are paired with their request by msgid.
 *
 * Glossary
 *   request       [0, msgid, method, [params]], answered by one reply.
 *   notification  [2, method, [params]], never answered.
 *   reply         [1, msgid, error, result]; exactly one of error and
 *                 result is nil.
 *   msgid         uint32 the client picks per request; this library counts
 *                 up from 1 and never hands out 0 (the daemon answers
 *                 messages it cannot frame under msgid 0).
 *   params        the one map inside the request's params array.  The
 *                 caller packs it between pb_client_begin() and
 *                 pb_client_send().
 *   tensor        a map {dtype, shape, order?, data} (PROTOCOL section 2).
 *
 * Conventions: every function that can fail returns 0 or a negative errno
 * code (-ENOMEM, -EPIPE, ...); strerror(-rc) gives its text.  Out-parameters
 * are written only on success.  The library never prints, never aborts and
 * never raises SIGPIPE.  A client is not thread-safe: use one per thread,
 * or lock around it.
 *
 * Byte order: tensor data on the wire is little-endian.  pb_pack_tensor()
 * sends the caller's bytes as they are, which is right on little-endian
 * hosts (x86-64, aarch64); the pb_ctensor_copy_*() functions decode the
 * wire's byte order on any host. */
#ifndef PULLBACKD_H
#define PULLBACKD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <msgpack.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library is built with -fvisibility=hidden; only what carries this
 * attribute is exported when it is linked into a shared object. */
#if defined(__GNUC__) || defined(__clang__)
#define PB_CLIENT_API __attribute__((visibility("default")))
#else
#define PB_CLIENT_API
#endif

/* ---- Connection ------------------------------------------------------- */

/* An open connection.  Allocated by pb_client_connect() or
 * pb_client_from_fd(), freed by pb_client_close(), which also closes the
 * socket and frees every reply still queued inside. */
typedef struct pb_client pb_client_t;

/* The default socket path: the first set (non-empty) of $PULLBACKD_SOCKET,
 * $RUNTIME_DIRECTORY/pullbackd.sock (the first entry when systemd lists
 * several, separated by ':'), $XDG_RUNTIME_DIR/pullbackd.sock,
 * /tmp/pullbackd-$UID.sock.  Writes a NUL-terminated path into buf.
 * -ENAMETOOLONG when it does not fit in len bytes, -EINVAL for a NULL buf. */
PB_CLIENT_API int pb_client_socket_path(char *buf, size_t len);

/* Connect to path (NULL: the default chain above).  -ENAMETOOLONG for a path
 * longer than a sockaddr_un holds, else connect()'s errno (-ENOENT,
 * -ECONNREFUSED, -EACCES, ...), or -ENOMEM. */
PB_CLIENT_API int pb_client_connect(const char *path, pb_client_t **out);

/* Wrap a connected stream socket (a socketpair end, an inherited fd).  The
 * client takes the fd: it is closed by pb_client_close(), also when this
 * call fails. */
PB_CLIENT_API int pb_client_from_fd(int fd, pb_client_t **out);

/* Close the socket and free the client and its queued replies.  NULL is a
 * no-op. */
PB_CLIENT_API void pb_client_close(pb_client_t *c);

/* The socket, for poll().  Replies may already sit in the client's buffers
 * with nothing left to read on the fd: see pb_client_pending(). */
PB_CLIENT_API int pb_client_fd(const pb_client_t *c);

/* True when a reply can be returned by pb_client_recv() without waiting:
 * one is queued, or bytes already read hold a complete message.  False on
 * a connection a send has broken (see pb_client_send()). */
PB_CLIENT_API bool pb_client_pending(pb_client_t *c);

/* ---- Requests --------------------------------------------------------- */

/* Start a request to method: writes [0, msgid, method, [ into the client's
 * send buffer and returns the packer on which the caller packs exactly one
 * map, the params (e.g. msgpack_pack_map(pk, 0) for {}).  The packer belongs
 * to the client and is valid until the next send or begin.  Beginning again
 * before sending discards the unsent request.  NULL only when c or method is
 * NULL; an allocation failure while packing is reported by the send. */
PB_CLIENT_API msgpack_packer *pb_client_begin(pb_client_t *c, const char *method);

/* Write the begun request (blocking until all of it is written; partial
 * writes and EINTR are handled, and replies that arrive meanwhile are read
 * and kept, so a long pipeline cannot deadlock against the daemon's
 * replies).  *msgid_out (may be NULL) gets its msgid.  The request is
 * discarded either way.  -EINVAL when nothing was begun or the params are
 * not exactly one map; -EMSGSIZE when a tensor's data or a str is 4 GiB or
 * longer (see pb_pack_tensor()); -ENOMEM; -EPIPE when the daemon closed
 * the connection (replies it sent before are still readable); -EPROTO
 * once a receive has lost the daemon's stream (see pb_client_recv()):
 * nothing could read the replies, so nothing is written.
 *
 * A failure before the first byte of the request is written leaves the
 * connection as it was.  One after it (the replies read meanwhile find no
 * memory, or are not msgpack, or the socket fails) would leave the daemon
 * reading whatever came next as the rest of the request: the send returns
 * -EIO instead and the connection is broken.  Nothing more is written, and
 * every later send and receive on it returns -EIO (replies already queued
 * included), so close it.  -EPIPE is the exception: the daemon is gone, and
 * what it sent before stays readable. */
PB_CLIENT_API int pb_client_send(pb_client_t *c, uint32_t *msgid_out);

/* As pb_client_send(), passing fd to the daemon as SCM_RIGHTS ancillary data
 * on the request's first bytes (register_buffer, PROTOCOL section 6).  The
 * caller keeps its fd.  -EBADF for a negative fd (the request is discarded
 * as by any failing send). */
PB_CLIENT_API int pb_client_send_with_fd(pb_client_t *c, int fd, uint32_t *msgid_out);

/* Start a notification [2, method, [ ; pack one map, then
 * pb_client_send_notify().  Notifications get no reply. */
PB_CLIENT_API msgpack_packer *pb_client_begin_notify(pb_client_t *c, const char *method);
PB_CLIENT_API int pb_client_send_notify(pb_client_t *c);

/* Write len raw bytes as they are (tests that send garbage or hand-made
 * messages).  Any begun request is left alone.  Fails as pb_client_send()
 * does, -EIO included. */
PB_CLIENT_API int pb_client_send_raw(pb_client_t *c, const void *buf, size_t len);

/* ---- Replies ---------------------------------------------------------- */

/* One reply.  Filled by pb_client_recv()/pb_client_call(), freed by
 * pb_reply_free().  `up` owns every byte that error, result and anything
 * reached from them point to (str and bin payloads included, so the data
 * of a tensor pb_obj_tensor() reads from it), and the strings
 * pb_reply_code()/pb_reply_message() return.  The struct may be moved by
 * assignment: the pointers stay valid, but free it only once.
 *
 * Reply memory: payloads lie in the client's receive buffers, which are
 * reference counted.  A reply holds its buffer until pb_reply_free(), and
 * its bytes stay as they were however many replies are received after it,
 * and after pb_client_close() (a reply may be freed on any thread).  A
 * reply of 1 MiB or more is received into a buffer of its own; the client
 * keeps up to two such buffers (512 MiB together) and receives a later big
 * reply into one only once every reply pointing into it has been freed, so
 * a loop that frees each big reply before the next call reuses memory that
 * is already mapped, while a reply kept across calls is simply not reused.
 * pb_client_close() frees the kept buffers that no reply holds. */
typedef struct pb_reply {
    uint32_t msgid;
    const msgpack_object *error;  /* NULL when the call succeeded */
    const msgpack_object *result; /* NULL when it failed */
    msgpack_unpacked up;
    const char *code_;            /* private: see pb_reply_code() */
    const char *message_;         /* private: see pb_reply_message() */
} pb_reply_t;

/* Block for the next reply: the oldest queued one, else the next from the
 * socket.  -EPIPE when the daemon closed the connection, -EPROTO for a
 * message that is not a msgpack-RPC response, -ENOMEM (nothing is lost: the
 * reply stays unread, and a later receive returns it once there is memory),
 * -EIO on a connection a send has broken (see pb_client_send()).
 *
 * Limits: before anything is unpacked, a message is framed by the scan the
 * daemon uses, which refuses one nested more than 32 containers deep (the
 * reply's own array and empty containers count) or holding more than about
 * 2^20 objects (a map's keys and values count one each), as it refuses
 * bytes that are not msgpack.  After such a message the stream cannot be
 * resynchronised: the connection is unusable, and every later receive and
 * send gives -EPROTO (replies queued before are still returned).  A
 * well-formed message that is no response only gives -EPROTO once. */
PB_CLIENT_API int pb_client_recv(pb_client_t *c, pb_reply_t *out);

/* As pb_client_recv(), waiting at most timeout_ms (< 0: forever);
 * -ETIMEDOUT when nothing complete arrived in time, never before timeout_ms
 * have passed (the wait is rounded up to whole milliseconds). */
PB_CLIENT_API int pb_client_recv_timeout(pb_client_t *c, pb_reply_t *out, int timeout_ms);

/* Send the begun request and wait for its reply.  Replies to other msgids
 * that arrive first are queued for later pb_client_recv()/pb_client_call().
 * 0 means a reply came, which may still carry an error: check out->error.
 * When the daemon closed the connection after an error under msgid 0 (a
 * parse_error, or resource_exhausted for a connection past a cap), that
 * error is the reply (out->msgid 0), here and in pb_client_wait(); a close
 * with nothing said is -EPIPE. */
PB_CLIENT_API int pb_client_call(pb_client_t *c, pb_reply_t *out);

/* Wait for the reply to msgid (sent earlier with pb_client_send()), queuing
 * the others.  Same returns as pb_client_recv(). */
PB_CLIENT_API int pb_client_wait(pb_client_t *c, uint32_t msgid, pb_reply_t *out);

/* Free what a reply holds and clear it.  Safe on a zeroed reply. */
PB_CLIENT_API void pb_reply_free(pb_reply_t *r);

/* The error's `code` ("invalid_argument", ...), NUL-terminated; "" for an
 * error without a str code; NULL when the reply is not an error. */
PB_CLIENT_API const char *pb_reply_code(const pb_reply_t *r);
/* The error's `message`; "" when it has none; NULL when not an error. */
PB_CLIENT_API const char *pb_reply_message(const pb_reply_t *r);

/* ---- Reading msgpack objects ------------------------------------------ */

/* The value under key in map (keys compared as str), NULL when map is not a
 * map or has no such key. */
PB_CLIENT_API const msgpack_object *pb_obj_get(const msgpack_object *map, const char *key);

/* Follow a dotted path of map keys ("outputs.y"); a segment of decimal
 * digits indexes an array ("devices.0.name").  NULL when any step is
 * missing.  The empty path is root itself. */
PB_CLIENT_API const msgpack_object *pb_obj_path(const msgpack_object *root, const char *dotted);

/* An integer object as int64 (-ERANGE above INT64_MAX) or uint64 (-ERANGE
 * for a negative one); -EINVAL for anything that is not a msgpack int. */
PB_CLIENT_API int pb_obj_int(const msgpack_object *o, int64_t *out);
PB_CLIENT_API int pb_obj_uint(const msgpack_object *o, uint64_t *out);
/* A float or integer object as double; -EINVAL otherwise. */
PB_CLIENT_API int pb_obj_double(const msgpack_object *o, double *out);
/* A bool object; -EINVAL otherwise. */
PB_CLIENT_API int pb_obj_bool(const msgpack_object *o, bool *out);

/* Compare a str object with s as strcmp() does on the bytes; 0 means equal.
 * NULL and non-str objects compare unequal to everything (-1). */
PB_CLIENT_API int pb_obj_strcmp(const msgpack_object *o, const char *s);

/* ---- Tensors ---------------------------------------------------------- */

#define PB_CTENSOR_MAX_RANK 16

/* A tensor as the client sends or receives it.  It owns nothing.
 *
 * For pb_pack_tensor(): dtype, rank, shape, order and data/nbytes are the
 * caller's; data is sent as it is (no check that nbytes matches the shape,
 * so tests can send wrong lengths).  A rank outside 0..16 is clamped into
 * it: a tensor of rank 17 has to be packed by hand.
 *
 * From pb_obj_tensor(): dtype points to a static string, and data points
 * into the reply's buffer, valid until pb_reply_free().  That data is NOT
 * aligned for its dtype (a msgpack bin may start at any byte), so do not
 * cast it to float * or double *: copy it out with pb_ctensor_copy_f64() /
 * _f32() or memcpy. */
typedef struct pb_ctensor {
    const char *dtype;   /* "f32", "f64", "c64", "c128" */
    int rank;
    uint64_t shape[PB_CTENSOR_MAX_RANK];
    char order;          /* 'C' row-major or 'F' column-major; 0 when
                            packing: leave the key out (the daemon's default
                            is 'C') */
    const void *data;    /* little-endian values, complex as (re, im) */
    size_t nbytes;
    bool shm;            /* the values lie in a registered buffer instead of
                            data (PROTOCOL section 6) */
    uint64_t buffer;     /* with shm: the buffer id ... */
    uint64_t offset;     /* ... and the byte offset in it */
} pb_ctensor_t;

/* Bytes per element of a dtype name, 0 for an unknown one. */
PB_CLIENT_API size_t pb_ctensor_itemsize(const char *dtype);

/* Element count: the product of the shape (1 for rank 0), SIZE_MAX when it
 * overflows size_t or the rank is outside 0..16. */
PB_CLIENT_API size_t pb_ctensor_count(const pb_ctensor_t *t);

/* Pack t as a tensor map {dtype, shape, order?, data} (or {dtype, shape,
 * order?, buffer, offset} when t->shm).  Packing failures surface at send.
 * A msgpack bin holds less than 4 GiB: data of 2^32 bytes or more makes the
 * send of a client's request fail with -EMSGSIZE (nothing written); packed
 * with another packer, nil stands in its place.
 * Into a client's request (the packer pb_client_begin() returned), data of
 * 64 KiB and more is not copied: it is sent from t->data itself (sendmsg
 * with an iovec of its own), so it must stay valid and unchanged until
 * pb_client_send() returns. */
PB_CLIENT_API void pb_pack_tensor(msgpack_packer *pk, const pb_ctensor_t *t);

/* Read a tensor map.  -EINVAL when o is not a tensor as PROTOCOL section 2
 * says: not a map, unknown dtype, shape not an array of uints, rank > 16,
 * order other than "C"/"F", neither data nor buffer+offset, data neither a
 * bin nor a str (which the protocol takes as the same raw bytes), or a data
 * length other than product(shape) x itemsize.  Other keys are ignored. */
PB_CLIENT_API int pb_obj_tensor(const msgpack_object *o, pb_ctensor_t *out);

/* Copy t's values into out (n slots; a complex value takes two, re then im)
 * in t's memory order, converting f32 <-> f64 as a C cast does (c64 <->
 * c128 likewise).  -ENOBUFS when n is smaller than the number of slots
 * needed.  -EINVAL for a NULL or shm tensor, an unknown dtype, a rank
 * outside 0..16 or a shape whose element count overflows, nbytes smaller
 * than the shape needs, or, when there are values to copy, NULL data or a
 * NULL out. */
PB_CLIENT_API int pb_ctensor_copy_f64(const pb_ctensor_t *t, double *out, size_t n);
PB_CLIENT_API int pb_ctensor_copy_f32(const pb_ctensor_t *t, float *out, size_t n);

/* ---- Packing helpers --------------------------------------------------- */

/* A msgpack str holding s (NULL packs nil).  A string of 4 GiB or more is
 * refused as pb_pack_tensor() refuses such data.  A NULL pk (what
 * pb_client_begin() gives for a NULL client) packs nothing, here and in
 * pb_pack_kv_str(), pb_pack_tensor() and pb_pack_into(). */
PB_CLIENT_API void pb_pack_str(msgpack_packer *pk, const char *s);
/* One map entry: key and val as str. */
PB_CLIENT_API void pb_pack_kv_str(msgpack_packer *pk, const char *key, const char *val);

/* One target of a request's `into` (PROTOCOL section 6): the output (for
 * forward and augmented_forward) or gradient (for reverse) called name is
 * written into the registered buffer at byte offset, not returned. */
typedef struct pb_into {
    const char *name;
    uint64_t buffer;
    uint64_t offset;
} pb_into_t;

/* One params-map entry: the key "into" and its map {name: {buffer,
 * offset}} of n targets (count it in the params map's size). */
PB_CLIENT_API void pb_pack_into(msgpack_packer *pk, const pb_into_t *into, size_t n);

#ifdef __cplusplus
}
#endif

#endif
