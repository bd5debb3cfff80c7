/* Reply encoders: the result map of each method, packed from the request
 * that computed it (request.h) after pb_out_result_header.  A handler
 * sets r->encode to one of these; rpc.c calls it when the request
 * succeeded.  They only read the request and the server's counters. */
#ifndef PB_REPLY_H
#define PB_REPLY_H

#include "request.h"

void pb__enc_forward(pb_req_t *r, pb_out_t *o);
void pb__enc_augmented(pb_req_t *r, pb_out_t *o);
void pb__enc_check(pb_req_t *r, pb_out_t *o);
void pb__enc_reverse(pb_req_t *r, pb_out_t *o);
void pb__enc_release(pb_req_t *r, pb_out_t *o);
void pb__enc_register(pb_req_t *r, pb_out_t *o);
void pb__enc_unregister(pb_req_t *r, pb_out_t *o);
void pb__enc_hello(pb_req_t *r, pb_out_t *o);
void pb__enc_ops(pb_req_t *r, pb_out_t *o);
void pb__enc_stats(pb_req_t *r, pb_out_t *o);
void pb__enc_metrics(pb_req_t *r, pb_out_t *o);
void pb__enc_admin(pb_req_t *r, pb_out_t *o);

#endif
