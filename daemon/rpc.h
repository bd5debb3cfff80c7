/* Methods: decoding a framed message, validating its params, dispatching
 * the math to the pool and answering.
 *
 * Glossary
 *   request   pb_req_t: one message being served, from decoding to reply.
 *   waiter    a request touching a busy tape, queued on that tape so that
 *             requests on one tape run in the order they were sent.
 *   inline    a request so small (PB_INLINE_COST flops) that it runs on
 *             the loop thread: handing it to a worker would cost more than
 *             the arithmetic.
 *
 * Ownership: a request owns its call (tensors), its tape data until the
 * table takes it, its gradients, and one reference on its connection; it
 * frees them all when its reply has been queued. */
#ifndef PB_RPC_H
#define PB_RPC_H

#include "server.h"

#define PB_INLINE_COST 32768.0

/* Serve one framed message held in msg.  late: it arrived after SIGTERM's
 * drain budget and is answered shutting_down. */
void pb_rpc_message(pb_conn_t *c, pb_storage_t *msg, bool late);
/* c is closing: free its connection-scoped tapes, detach the others. */
void pb_rpc_conn_closed(pb_conn_t *c);
/* Drop the tapes whose ttl has passed (not busy ones). */
void pb_rpc_sweep(pb_server_t *s);

#endif
