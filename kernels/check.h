/* Finite-difference check of an op's reverse rule, for the `check` method
 * and for rule debugging.
 *
 * For a random cotangent ȳ (seeded) and, per input in wrt, a random
 * direction v, it compares ⟨x̄, v⟩ from the op's reverse with the
 * derivative of L(t) = Re⟨ȳ, f(x + t·v)⟩ at t = 0 by a fourth-order
 * central difference.  The differences are taken in double precision
 * (f32 and c64 calls are promoted) so that an f32 rule is measured against
 * the exact derivative, not against f32 rounding.  The error is relative
 * to ‖x̄‖·‖v‖, which bounds ⟨x̄, v⟩, so a small directional derivative does
 * not inflate it. */
#ifndef PB_CHECK_H
#define PB_CHECK_H

#include <stdint.h>

#include "op.h"

/* c: validated, with c->wrt set (c->taped is set here).  On success
 * per_input[k] holds the error for wrt bit k (0 for bits not in wrt) and
 * *max_rel the largest. */
int pb_check_run(pb_call_t *c, uint64_t seed, double *max_rel, double per_input[PB_MAX_IO + 2], pb_err_t *err);

#endif
