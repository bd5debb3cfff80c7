/* The method handlers the method table (rpc.c) points at.  Each takes a
 * request whose head is filled, its params map and the message holding
 * it, and either answers the request (pb__req_finish / pb__req_fail) or
 * hands it on (to the pool, or to a busy tape's queue) to be answered
 * later.  calls.c: the math; admin.c: everything else. */
#ifndef PB_METHODS_H
#define PB_METHODS_H

#include <msgpack.h>

#include "request.h"

typedef void pb_method_fn(pb_req_t *r, const msgpack_object *params, pb_storage_t *msg);

/* calls.c */
pb_method_fn pb__m_forward, pb__m_augmented, pb__m_check, pb__m_reverse, pb__m_release;
/* admin.c */
pb_method_fn pb__m_hello, pb__m_ops, pb__m_stats, pb__m_metrics, pb__m_drain, pb__m_shutdown, pb__m_register,
    pb__m_unregister;

#endif
