/* JSON output of msgpack objects, for pullbackctl --json.
 *
 * The daemon's replies are msgpack; scripts want JSON.  The mapping:
 * nil -> null, bool -> true/false, integers as decimal, floats in the
 * shortest form that reads back to the same double (NaN and infinities,
 * which JSON cannot hold, become null), str -> string (control characters
 * escaped, bytes that are not UTF-8 replaced by U+FFFD so the output is
 * always valid JSON), bin -> base64 string, ext -> null, arrays and maps as
 * themselves (a map key that is not a str is written as its JSON text in a
 * string, e.g. 7 -> "7").
 *
 * Everything writes to a FILE * and never fails on its own: check
 * ferror() once at the end. */
#ifndef PB_CLI_JSON_H
#define PB_CLI_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <msgpack.h>

/* Write o as JSON. */
void pb__json_object(FILE *f, const msgpack_object *o);
/* Write the n bytes at s as a JSON string (quotes included). */
void pb__json_string(FILE *f, const char *s, size_t n);
/* A number: a double in its shortest round-trip form, null when not finite. */
void pb__json_double(FILE *f, double v);

/* Writing one object member by member, with the commas in the right places:
 * pb__json_open(), then any number of key + value pairs, then
 * pb__json_close().  A value is written right after its key by any of the
 * writers above (or by pb__json_open() for a nested object). */
typedef struct pb_json_obj {
    FILE *f;
    bool first;
} pb_json_obj_t;

void pb__json_open(pb_json_obj_t *j, FILE *f);
/* Write the separator and "key": ; the caller writes the value next. */
void pb__json_key(pb_json_obj_t *j, const char *key);
void pb__json_close(pb_json_obj_t *j);

/* Every member of the msgpack map m, as members of the open object j (for
 * adding the daemon's result to fields the caller writes itself).  Keys
 * listed in skip (NULL-terminated, may be NULL) are left out.  Nothing is
 * written when m is not a map. */
void pb__json_members(pb_json_obj_t *j, const msgpack_object *m, const char *const *skip);

#endif
