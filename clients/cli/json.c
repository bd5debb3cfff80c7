/* JSON output of msgpack objects (json.h). */
#include "json.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The length of the valid UTF-8 sequence at s (at most n bytes), 0 when
 * the bytes there are not one: a stray continuation byte, a truncated or
 * overlong sequence, a surrogate, or a code point above U+10FFFF. */
static size_t json_utf8_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    size_t len;
    unsigned cp;

    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf)
        len = 2, cp = c & 0x1f;
    else if (c >= 0xe0 && c <= 0xef)
        len = 3, cp = c & 0x0f;
    else if (c >= 0xf0 && c <= 0xf4)
        len = 4, cp = c & 0x07;
    else
        return 0;
    if (len > n)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10ffff ||
        (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return len;
}

void pb__json_string(FILE *f, const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;

    fputc('"', f);
    for (size_t i = 0; i < n;) {
        unsigned c = p[i];
        if (c == '"' || c == '\\') {
            fputc('\\', f);
            fputc((int)c, f);
            i++;
        } else if (c == '\n') {
            fputs("\\n", f);
            i++;
        } else if (c == '\t') {
            fputs("\\t", f);
            i++;
        } else if (c < 0x20 || c == 0x7f) {
            fprintf(f, "\\u%04x", c);
            i++;
        } else {
            size_t len = json_utf8_len(p + i, n - i);
            if (len == 0) {
                fputs("\\ufffd", f);
                i++;
            } else {
                fwrite(p + i, 1, len, f);
                i += len;
            }
        }
    }
    fputc('"', f);
}

void pb__json_double(FILE *f, double v)
{
    char buf[40];

    if (!isfinite(v)) {
        fputs("null", f);
        return;
    }
    /* The shortest of %.15g .. %.17g that reads back exactly: 65.2 rather
     * than 65.200000000000003. */
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            break;
    }
    fputs(buf, f);
}

static void json_base64(FILE *f, const unsigned char *p, size_t n)
{
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

    fputc('"', f);
    for (size_t i = 0; i < n; i += 3) {
        unsigned v = (unsigned)p[i] << 16;
        if (i + 1 < n)
            v |= (unsigned)p[i + 1] << 8;
        if (i + 2 < n)
            v |= p[i + 2];
        fputc(tab[(v >> 18) & 63], f);
        fputc(tab[(v >> 12) & 63], f);
        fputc(i + 1 < n ? tab[(v >> 6) & 63] : '=', f);
        fputc(i + 2 < n ? tab[v & 63] : '=', f);
    }
    fputc('"', f);
}

static void json_key_object(FILE *f, const msgpack_object *k)
{
    switch (k->type) {
    case MSGPACK_OBJECT_STR:
        pb__json_string(f, k->via.str.ptr, k->via.str.size);
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        fprintf(f, "\"%" PRIu64 "\"", k->via.u64);
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        fprintf(f, "\"%" PRId64 "\"", k->via.i64);
        break;
    case MSGPACK_OBJECT_BOOLEAN:
        fputs(k->via.boolean ? "\"true\"" : "\"false\"", f);
        break;
    default:
        /* Containers, floats, bin or nil as keys: the daemon sends none. */
        fputs("\"?\"", f);
        break;
    }
}

void pb__json_object(FILE *f, const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
        fputs("null", f);
        break;
    case MSGPACK_OBJECT_BOOLEAN:
        fputs(o->via.boolean ? "true" : "false", f);
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        fprintf(f, "%" PRIu64, o->via.u64);
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        fprintf(f, "%" PRId64, o->via.i64);
        break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        pb__json_double(f, o->via.f64);
        break;
    case MSGPACK_OBJECT_STR:
        pb__json_string(f, o->via.str.ptr, o->via.str.size);
        break;
    case MSGPACK_OBJECT_BIN:
        json_base64(f, (const unsigned char *)o->via.bin.ptr, o->via.bin.size);
        break;
    case MSGPACK_OBJECT_ARRAY:
        fputc('[', f);
        for (uint32_t i = 0; i < o->via.array.size; i++) {
            if (i > 0)
                fputs(", ", f);
            pb__json_object(f, &o->via.array.ptr[i]);
        }
        fputc(']', f);
        break;
    case MSGPACK_OBJECT_MAP:
        fputc('{', f);
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            if (i > 0)
                fputs(", ", f);
            json_key_object(f, &o->via.map.ptr[i].key);
            fputs(": ", f);
            pb__json_object(f, &o->via.map.ptr[i].val);
        }
        fputc('}', f);
        break;
    default:
        fputs("null", f);
        break;
    }
}

void pb__json_open(pb_json_obj_t *j, FILE *f)
{
    j->f = f;
    j->first = true;
    fputc('{', f);
}

void pb__json_key(pb_json_obj_t *j, const char *key)
{
    if (!j->first)
        fputs(", ", j->f);
    j->first = false;
    pb__json_string(j->f, key, strlen(key));
    fputs(": ", j->f);
}

void pb__json_close(pb_json_obj_t *j)
{
    fputc('}', j->f);
}

static bool json_skipped(const msgpack_object *k, const char *const *skip)
{
    if (skip == NULL || k->type != MSGPACK_OBJECT_STR)
        return false;
    for (size_t i = 0; skip[i] != NULL; i++)
        if (strlen(skip[i]) == k->via.str.size && memcmp(skip[i], k->via.str.ptr, k->via.str.size) == 0)
            return true;
    return false;
}

void pb__json_members(pb_json_obj_t *j, const msgpack_object *m, const char *const *skip)
{
    if (m == NULL || m->type != MSGPACK_OBJECT_MAP)
        return;
    for (uint32_t i = 0; i < m->via.map.size; i++) {
        const msgpack_object *k = &m->via.map.ptr[i].key;
        if (json_skipped(k, skip))
            continue;
        if (!j->first)
            fputs(", ", j->f);
        j->first = false;
        json_key_object(j->f, k);
        fputs(": ", j->f);
        pb__json_object(j->f, &m->via.map.ptr[i].val);
    }
}
