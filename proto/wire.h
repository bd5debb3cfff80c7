/* Framing of msgpack-RPC messages on a byte stream.
 *
 * msgpack-c's unpacker allocates whatever sizes a message declares before
 * it has read them, so a 5-byte map32 header can make it ask for 256 GiB.
 * pb_scan_* walks the msgpack structure itself, with no allocation, and
 * says where a message ends; only a complete message that passed the scan
 * is handed to msgpack_unpack_next.  The scan checks every declared count
 * and length against what is left of the size limit (each element takes at
 * least one byte), caps nesting at PB_WIRE_MAX_DEPTH and the number of
 * elements at PB_WIRE_MAX_ELEMENTS (which bounds the unpacker's zone at a
 * few dozen bytes per element), and refuses bytes that start no object.
 *
 * The scan is resumable: feeding it a longer prefix of the same message
 * continues where it stopped, so a large message arriving in many reads is
 * scanned once in total. */
#ifndef PB_WIRE_H
#define PB_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PB_WIRE_MAX_DEPTH 32
#define PB_WIRE_MAX_ELEMENTS (1u << 20)

typedef struct pb_scan {
    size_t off;      /* bytes of the current message accepted so far */
    size_t elements; /* elements seen so far */
    int depth;       /* containers open at off */
    uint32_t left[PB_WIRE_MAX_DEPTH]; /* elements still due in each */
    size_t need;     /* after a 0: the message is at least this long (a
                      * declared payload not all read yet), else 0 */
    size_t need_at;  /* where in the message that payload begins */
    const char *why; /* reason of the last PB_EPARSE */
    bool too_big;    /* that reason is the size limit */
} pb_scan_t;

void pb_scan_reset(pb_scan_t *s);

/* buf holds the first len bytes of a message (len grows between calls).
 * Returns 1 and sets *msg_len when a whole message lies in buf, 0 when
 * more bytes are needed (s->need says how many at least, when a declared
 * payload tells: a reader can size its buffer once), PB_EPARSE (with s->why) when the bytes can never
 * become a valid message within limit bytes. */
int pb_scan_feed(pb_scan_t *s, const uint8_t *buf, size_t len, size_t limit, size_t *msg_len);

#endif
