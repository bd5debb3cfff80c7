/* The op table: every op pullbackd serves, described once.
 *
 * Glossary
 *   op                one entry of the table (fused_dense, ...): names of
 *                     inputs, outputs and options, the dtypes and devices it
 *                     takes, and its functions.  `ops`, argument checking,
 *                     dispatch and tape sizing all read the entry; the
 *                     daemon has no op-specific code.
 *   family            the ops one file defines and exports as an array of
 *                     rows (the QR family: qr_* and lq_*); op.c gathers the
 *                     families into the table.  A new op joins its
 *                     family's array, or comes as a new family.
 *   variant           which form of its family a row is (compact, full,
 *                     null, vals, trunc), read by the functions the
 *                     family's rows share.
 *   dtype body        a kernel written once for an element type T and
 *                     instantiated per dtype (dtype_t.h); an op function
 *                     picks its instance from an array indexed by dtype.
 *   call              one invocation: the op, device, dtype, input tensors,
 *                     parsed options, the wrt set and the output order.
 *   wrt               the set of inputs (and alpha/beta) whose gradients a
 *                     later reverse asks for; a bit mask over wrt_names.
 *   tape              what a reverse needs, saved by augmented forward: the
 *                     minimal set of tensors for the wrt set (pb_tapedata_t).
 *   cotangent         the adjoint ȳ of an output handed to reverse; a
 *                     missing one is zero.
 *   gradient          the adjoint of an input, returned by reverse.
 *
 * Ownership: a pb_call_t owns one reference on each tensor in in[] and
 * out[]; pb_call_clear drops them.  A pb_tapedata_t owns its saved[]
 * tensors; pb_tapedata_clear drops them.  Op functions run on a worker
 * thread (or inline for tiny calls) and touch only what they are given. */
#ifndef PB_OP_H
#define PB_OP_H

#include <stdbool.h>
#include <stddef.h>

#include "../proto/errors.h"
#include "tensor.h"

#define PB_MAX_IO 4
#define PB_MAX_OPTS 8
#define PB_MAX_SAVED 6
#define PB_MAX_WARNINGS 4

typedef enum pb_opt_type {
    PB_OPT_STR,     /* one of values[] when values is set */
    PB_OPT_BOOL,
    PB_OPT_INT,
    PB_OPT_FLOAT,
    PB_OPT_SCALAR,  /* real number or [re, im] */
    PB_OPT_AXES,    /* a list of 0-based axes: [2, 0, 1] */
    PB_OPT_AXES2,   /* two lists of axes: [[0, 2], [1]] */
    PB_OPT_TEXT,    /* free text up to PB_OPT_TEXT_MAX bytes (an einsum spec) */
} pb_opt_type_t;

#define PB_OPT_TEXT_MAX 63

typedef struct pb_opt_spec {
    const char *name;
    pb_opt_type_t type;
    const char *const *values; /* allowed strings, NULL-terminated; or NULL */
    int def_index;             /* default for enumerated strings */
    double def_re, def_im;     /* default for numbers (and bool) */
    bool def_auto;             /* the default depends on the inputs: `ops` shows nil */
    /* Axes and text options have no fixed default: absent means what the
     * op says (identity permutation, untraced axes...); `ops` shows nil. */
} pb_opt_spec_t;

typedef struct pb_optval {
    bool given;
    int index;     /* enumerated string */
    bool b;
    long long i;
    double re, im; /* numbers and scalars */
    bool cplx;     /* a scalar sent as [re, im]: its gradient stays complex */
    int nax[2];    /* axes options: the lengths of the one or two lists */
    signed char ax[2][PB_MAX_RANK]; /* their entries, checked to be < 16 */
    char text[PB_OPT_TEXT_MAX + 1]; /* text options, NUL-terminated */
} pb_optval_t;

/* A real or complex scalar (alpha, beta, their gradients). */
typedef struct pb_scalar {
    double re, im;
} pb_scalar_t;

typedef struct pb_io_spec {
    const char *name;
    bool required;
} pb_io_spec_t;

struct pb_op;

typedef struct pb_call {
    const struct pb_op *op;
    pb_device_t device;
    pb_dtype_t dtype;        /* the dtype of the inputs */
    pb_tensor_t in[PB_MAX_IO];  /* by input index; storage NULL if absent */
    pb_optval_t opt[PB_MAX_OPTS];
    unsigned wrt;            /* bits over op->wrt_names */
    bool taped;              /* augmented forward: fill the tape */
    char order;              /* 'C' or 'F' for outputs */
    /* Set by validate: */
    pb_tensor_t out_meta[PB_MAX_IO]; /* dtype and shape of each output */
    size_t tape_bytes;       /* exact bytes the tape will hold for wrt */
    double cost;             /* estimated floating-point operations */
    size_t work_bytes;       /* temporaries the forward or the reverse may hold at once, past
                                their inputs and outputs (a GPU reserves them; 0: few) */
    /* Set by forward: */
    pb_tensor_t out[PB_MAX_IO];
} pb_call_t;

typedef struct pb_tapedata {
    const struct pb_op *op;
    pb_device_t device;
    pb_dtype_t dtype;
    unsigned wrt;
    double cost;                     /* the forward's estimated flops */
    size_t work_bytes;               /* the call's work_bytes */
    pb_tensor_t in_meta[PB_MAX_IO];  /* dtype/shape of inputs; no storage */
    pb_tensor_t out_meta[PB_MAX_IO]; /* dtype/shape of outputs; no storage */
    pb_optval_t opt[PB_MAX_OPTS];
    pb_tensor_t saved[PB_MAX_SAVED]; /* op-defined slots, owned */
    double scalars[4];               /* op-defined numbers (factorizations: max|A_ij|) */
} pb_tapedata_t;

typedef struct pb_warnings {
    int n;
    char text[PB_MAX_WARNINGS][200];
} pb_warnings_t;

typedef struct pb_op {
    const char *name;
    /* Which form of its family the op is, for functions that several rows
     * share (the factorizations: fz_variant_t in factor_common.h); 0 for
     * an op with a family of one. */
    int variant;
    const pb_io_spec_t *inputs;   /* ninputs entries */
    int ninputs;
    const char *const *outputs;   /* noutputs names */
    int noutputs;
    const pb_opt_spec_t *options; /* noptions entries */
    int noptions;
    const char *const *wrt_names; /* inputs first, then alpha/beta */
    int nwrt;
    unsigned dtypes;              /* PB_DTYPE_BIT mask */
    unsigned devices;             /* 1u << pb_devkind_t */
    /* Shapes, dtypes and option values; fills out_meta, tape_bytes, cost.
     * Runs on the loop thread: no allocation beyond the call, no math. */
    int (*validate)(pb_call_t *c, pb_err_t *err);
    /* Per device kind; NULL where the op has no implementation.  forward
     * fills c->out; with c->taped it also fills tape->saved. */
    int (*forward[2])(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err);
    /* cot[] by output index (storage NULL: zero), grad[] by wrt index,
     * filled for the bits of tape->wrt, in the given order. */
    int (*reverse[2])(const pb_tapedata_t *tape, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                      pb_warnings_t *warn, pb_err_t *err);
    /* For the finite-difference check (check.c), all optional: the step
     * relative to max|x| (0: 1e-3); a projection of a direction for input
     * k onto what the op accepts (eigh: the Hermitian part); a projection
     * of random cotangents onto their gauge-invariant part, given the
     * call's outputs c->out (0 or PB_ENOMEM). */
    double fd_step;
    void (*fd_direction)(const pb_call_t *c, int k, pb_tensor_t *dir);
    int (*fd_cotangents)(const pb_call_t *c, pb_tensor_t *cot);
} pb_op_t;

/* The table: every family's rows in the order `ops` lists them (op.c
 * gathers them before main runs; read-only after), and lookup by name
 * (NULL if unknown). */
#define PB_MAX_OPS 64
extern const pb_op_t *pb_ops[PB_MAX_OPS];
extern int pb_nops;
const pb_op_t *pb_op_find(const char *name, size_t len);
int pb_op_input_index(const pb_op_t *op, const char *name, size_t len);
int pb_op_output_index(const pb_op_t *op, const char *name, size_t len);
int pb_op_wrt_index(const pb_op_t *op, const char *name, size_t len);
int pb_op_option_index(const pb_op_t *op, const char *name, size_t len);

/* Set defaults for every option not given. */
void pb_call_defaults(pb_call_t *c);
void pb_call_clear(pb_call_t *c);
/* Move c's identity (op, device, dtype, wrt, metas, options) into t. */
void pb_tapedata_init(pb_tapedata_t *t, const pb_call_t *c);
void pb_tapedata_clear(pb_tapedata_t *t);
size_t pb_tapedata_bytes(const pb_tapedata_t *t);
/* dst: a tensor the tape may keep: a reference when src already owns
 * exactly its bytes on the heap or in device memory, or when it lies in a received message
 * (daemon memory that nothing writes once parsed, refcounted) and is at
 * least half of it: the tape then co-owns the message and holds at most
 * twice the bytes it accounts for, and a big input is not copied.  Else a
 * copy: never a pointer into a client's memory (shared memory) or a small
 * part of a big message.  0 or PB_ENOMEM (dst left empty). */
int pb_tape_keep(pb_tensor_t *dst, const pb_tensor_t *src);

/* Run a whole call on its device: forward (and the tape when c->taped). */
int pb_op_run_forward(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err);
int pb_op_run_reverse(const pb_tapedata_t *tape, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                      pb_warnings_t *warn, pb_err_t *err);

#endif
