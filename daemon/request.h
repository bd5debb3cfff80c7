/* Request parsing: the params of forward, augmented_forward, check and the
 * cotangents of reverse, turned into a validated call, with the error the
 * contract asks for (code, argument, message) for anything wrong.
 *
 * Pure functions of the message and the configuration: no server state,
 * no allocation beyond the tensors they decode, so the loop thread and
 * the fuzz target (tests/fuzz) run exactly the same checks.
 *
 * Ownership: tensors decoded into c->in[] or cot[] hold references on msg
 * (or copies) and belong to the caller, also when an error is returned;
 * pb_call_clear / pb_tensor_clear drop them. */
#ifndef PB_REQUEST_H
#define PB_REQUEST_H

#include <msgpack.h>
#include <stdbool.h>
#include <stdint.h>

#include "../kernels/op.h"
#include "../proto/codec.h"
#include "config.h"

typedef enum pb_call_kind { PB_CALL_FORWARD, PB_CALL_AUGMENTED, PB_CALL_CHECK } pb_call_kind_t;

/* What a call's params say besides the call itself. */
typedef struct pb_call_extra {
    bool peer_scope;    /* augmented_forward: scope "peer" */
    uint64_t ttl_ms;    /* augmented_forward: ttl_s, or the default */
    uint64_t seed;      /* check */
    size_t reply_bytes; /* the outputs' bytes */
} pb_call_extra_t;

/* Every key of params must be one of allowed (NULL-terminated). */
int pb_request_check_keys(const msgpack_object *params, const char *const *allowed, pb_err_t *err);
/* params' "order": 'C' (absent) or 'F'. */
int pb_request_order(const msgpack_object *params, char *order, pb_err_t *err);
/* {op, inputs, options?, device?, order?, wrt, scope?, ttl_s?, seed?} as
 * kind allows, into c (zeroed by the caller): decoded, the op's validate
 * run, the outputs' size checked against cfg's max_message_bytes. */
int pb_request_call(const pb_config_t *cfg, const msgpack_object *params, pb_storage_t *msg, pb_call_kind_t kind,
                    pb_call_t *c, pb_call_extra_t *x, pb_err_t *err);
/* cots (NULL: none) against the outputs of tape t: cot[] by output index,
 * dtype and shape checked. */
int pb_request_cotangents(const pb_tapedata_t *t, const msgpack_object *cots, pb_storage_t *msg, pb_tensor_t *cot,
                          pb_err_t *err);

#endif
