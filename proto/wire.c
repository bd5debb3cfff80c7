#include "wire.h"

#include <string.h>

#include "errors.h"

void pb_scan_reset(pb_scan_t *s)
{
    memset(s, 0, sizeof *s);
}

static uint64_t be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

static int fail(pb_scan_t *s, const char *why)
{
    s->why = why;
    s->too_big = false;
    return PB_EPARSE;
}

static int fail_big(pb_scan_t *s, const char *why)
{
    fail(s, why);
    s->too_big = true;
    return PB_EPARSE;
}

/* One element has been consumed: count it in the containers it closes. */
static int element_done(pb_scan_t *s)
{
    while (s->depth > 0) {
        if (--s->left[s->depth - 1] > 0)
            return 0;
        s->depth--;
    }
    return 1;
}

int pb_scan_feed(pb_scan_t *s, const uint8_t *buf, size_t len, size_t limit, size_t *msg_len)
{
    for (;;) {
        size_t off = s->off;
        if (off >= len)
            return len > limit ? fail_big(s, "message larger than the size limit") : 0;
        if (off >= limit)
            return fail_big(s, "message larger than the size limit");
        uint8_t b = buf[off];
        size_t hdr = 1;      /* header bytes */
        uint64_t body = 0;   /* payload bytes after the header */
        uint64_t count = 0;  /* elements of a container */
        int container = 0;   /* 0 none, 1 array, 2 map */
        int nlen = 0;        /* width of a big-endian length field */

        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
            /* fixint, nil, bool */
        } else if ((b & 0xf0) == 0x80) {
            container = 2, count = b & 0x0f;
        } else if ((b & 0xf0) == 0x90) {
            container = 1, count = b & 0x0f;
        } else if ((b & 0xe0) == 0xa0) {
            body = b & 0x1f;
        } else {
            switch (b) {
            case 0xc4: case 0xd9: nlen = 1; break;          /* bin8, str8 */
            case 0xc5: case 0xda: nlen = 2; break;          /* bin16, str16 */
            case 0xc6: case 0xdb: nlen = 4; break;          /* bin32, str32 */
            case 0xc7: nlen = 1; break;                     /* ext8 */
            case 0xc8: nlen = 2; break;                     /* ext16 */
            case 0xc9: nlen = 4; break;                     /* ext32 */
            case 0xca: body = 4; break;                     /* float32 */
            case 0xcb: body = 8; break;                     /* float64 */
            case 0xcc: case 0xd0: body = 1; break;
            case 0xcd: case 0xd1: body = 2; break;
            case 0xce: case 0xd2: body = 4; break;
            case 0xcf: case 0xd3: body = 8; break;
            case 0xd4: body = 2; break;                     /* fixext1 */
            case 0xd5: body = 3; break;
            case 0xd6: body = 5; break;
            case 0xd7: body = 9; break;
            case 0xd8: body = 17; break;
            case 0xdc: container = 1, nlen = 2; break;
            case 0xdd: container = 1, nlen = 4; break;
            case 0xde: container = 2, nlen = 2; break;
            case 0xdf: container = 2, nlen = 4; break;
            default: return fail(s, "byte 0xc1 starts no msgpack object");
            }
            if (nlen) {
                if (off + 1 + (size_t)nlen > len)
                    return limit < off + 1 + (size_t)nlen ? fail_big(s, "message larger than the size limit") : 0;
                uint64_t v = be(buf + off + 1, nlen);
                hdr = 1 + (size_t)nlen;
                if (container)
                    count = v;
                else
                    body = v + (b >= 0xc7 && b <= 0xc9 ? 1 : 0); /* ext carries a type byte */
            }
        }

        size_t room = limit - off; /* bytes this element may still take */
        if (hdr > room || body > room - hdr)
            return fail_big(s, "a declared length is longer than the message can be");
        if (container) {
            uint64_t elems = container == 2 ? count * 2 : count;
            if (elems > room - hdr)
                return fail(s, "a container declares more elements than bytes remain");
            if (s->elements + elems > PB_WIRE_MAX_ELEMENTS)
                return fail(s, "message has too many elements");
            /* msgpack-c takes a stack slot for every container, empty
             * ones too: 32 containers inside 32 is one too many for it. */
            if (s->depth >= PB_WIRE_MAX_DEPTH)
                return fail(s, "nesting deeper than 32");
        }
        if (off + hdr + body > len) {
            s->need = off + hdr + (size_t)body;
            s->need_at = off + hdr;
            return 0;
        }

        s->off = off + hdr + (size_t)body;
        s->elements++;
        if (container && count > 0) {
            s->left[s->depth++] = (uint32_t)(container == 2 ? count * 2 : count);
            continue;
        }
        if (element_done(s)) {
            *msg_len = s->off;
            return 1;
        }
    }
}
