#include "op.h"

#include <string.h>

#include "act.h"

extern const pb_op_t pb_op_fused_dense, pb_op_tensorcontract, pb_op_tensoradd, pb_op_tensortrace;
extern const pb_op_t pb_fz_qr_ops[], pb_fz_eigh_ops[], pb_fz_eig_ops[], pb_fz_svd_ops[], pb_fz_polar_ops[];
extern const int pb_fz_qr_nops, pb_fz_eigh_nops, pb_fz_eig_nops, pb_fz_svd_nops, pb_fz_polar_nops;

/* The families, in the order `ops` lists them; each exports its rows and
 * their count, so a new op joins its family's array and nothing here. */
static const int one = 1;
static const struct {
    const pb_op_t *rows;
    const int *n;
} families[] = {
    {&pb_op_fused_dense, &one},  {&pb_op_tensorcontract, &one}, {&pb_op_tensoradd, &one},
    {&pb_op_tensortrace, &one},  {pb_fz_qr_ops, &pb_fz_qr_nops}, {pb_fz_eigh_ops, &pb_fz_eigh_nops},
    {pb_fz_eig_ops, &pb_fz_eig_nops}, {pb_fz_svd_ops, &pb_fz_svd_nops}, {pb_fz_polar_ops, &pb_fz_polar_nops},
};

/* The flat table, filled from the families before main runs (the counts
 * are link-time constants, not compile-time ones). */
const pb_op_t *pb_ops[PB_MAX_OPS];
int pb_nops;

__attribute__((constructor)) static void ops_concat(void)
{
    int n = 0;
    for (size_t f = 0; f < sizeof families / sizeof families[0]; f++)
        for (int i = 0; i < *families[f].n && n < PB_MAX_OPS; i++)
            pb_ops[n++] = &families[f].rows[i];
    pb_nops = n;
}

const char *const pb_act_names[PB_NACTS + 1] = {
#define PB_X(sym, name, src) name,
    PB_ACT_TABLE(PB_X)
#undef PB_X
    NULL,
};

const enum pb_act_src pb_act_src[PB_NACTS] = {
#define PB_X(sym, name, src) PB_ACT_FROM_##src,
    PB_ACT_TABLE(PB_X)
#undef PB_X
};

static bool eq(const char *a, const char *s, size_t len)
{
    return strlen(a) == len && memcmp(a, s, len) == 0;
}

const pb_op_t *pb_op_find(const char *name, size_t len)
{
    for (int i = 0; i < pb_nops; i++)
        if (eq(pb_ops[i]->name, name, len))
            return pb_ops[i];
    return NULL;
}

int pb_op_input_index(const pb_op_t *op, const char *name, size_t len)
{
    for (int i = 0; i < op->ninputs; i++)
        if (eq(op->inputs[i].name, name, len))
            return i;
    return -1;
}

int pb_op_output_index(const pb_op_t *op, const char *name, size_t len)
{
    for (int i = 0; i < op->noutputs; i++)
        if (eq(op->outputs[i], name, len))
            return i;
    return -1;
}

int pb_op_wrt_index(const pb_op_t *op, const char *name, size_t len)
{
    for (int i = 0; i < op->nwrt; i++)
        if (eq(op->wrt_names[i], name, len))
            return i;
    return -1;
}

int pb_op_option_index(const pb_op_t *op, const char *name, size_t len)
{
    for (int i = 0; i < op->noptions; i++)
        if (eq(op->options[i].name, name, len))
            return i;
    return -1;
}

void pb_call_defaults(pb_call_t *c)
{
    for (int i = 0; i < c->op->noptions; i++) {
        const pb_opt_spec_t *s = &c->op->options[i];
        pb_optval_t *v = &c->opt[i];
        if (v->given)
            continue;
        v->index = s->def_index;
        v->re = s->def_re;
        v->im = s->def_im;
        v->b = s->def_re != 0;
        v->i = (long long)s->def_re;
    }
}

void pb_call_clear(pb_call_t *c)
{
    for (int i = 0; i < PB_MAX_IO; i++) {
        pb_tensor_clear(&c->in[i]);
        pb_tensor_clear(&c->out[i]);
    }
}

static void meta_of(pb_tensor_t *m, const pb_tensor_t *t)
{
    *m = *t;
    m->storage = NULL;
    m->offset = 0;
}

void pb_tapedata_init(pb_tapedata_t *t, const pb_call_t *c)
{
    memset(t, 0, sizeof *t);
    t->op = c->op;
    t->device = c->device;
    t->dtype = c->dtype;
    t->wrt = c->wrt;
    t->cost = c->cost;
    t->work_bytes = c->work_bytes;
    for (int i = 0; i < PB_MAX_IO; i++) {
        meta_of(&t->in_meta[i], &c->in[i]);
        meta_of(&t->out_meta[i], &c->out_meta[i]);
    }
    memcpy(t->opt, c->opt, sizeof t->opt);
}

void pb_tapedata_clear(pb_tapedata_t *t)
{
    for (int i = 0; i < PB_MAX_SAVED; i++)
        pb_tensor_clear(&t->saved[i]);
}

int pb_tape_keep(pb_tensor_t *dst, const pb_tensor_t *src)
{
    pb_tensor_ref(dst, src);
    const pb_storage_t *s = src->storage;
    size_t bytes = pb_tensor_bytes(src);
    if ((s->kind == PB_STORAGE_HEAP || s->kind == PB_STORAGE_DEVICE) && src->offset == 0 && s->size == bytes)
        return 0;
    if (s->kind == PB_STORAGE_VIEW && bytes >= s->size / 2)
        return 0;
    int rc = pb_tensor_make_owned(dst);
    if (rc)
        pb_tensor_clear(dst);
    return rc;
}

size_t pb_tapedata_bytes(const pb_tapedata_t *t)
{
    size_t n = 0;
    for (int i = 0; i < PB_MAX_SAVED; i++)
        if (t->saved[i].storage)
            n += pb_tensor_bytes(&t->saved[i]);
    return n;
}

/* A vector or scalar is the same bytes in either order: it says the one
 * the request asked for (contract section 2: C unless order "F"), whatever
 * the op built it as (the factorizations' S and D come from LAPACK). */
static void tag_vectors(pb_tensor_t *t, int n, char order)
{
    for (int i = 0; i < n; i++)
        if (t[i].storage && t[i].rank <= 1)
            t[i].order = order;
}

int pb_op_run_forward(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    /* Bin payloads inside a message lie at any byte offset; BLAS and the
     * kernels want naturally aligned elements. */
    for (int i = 0; i < c->op->ninputs; i++)
        if (c->in[i].storage && !pb_tensor_aligned(&c->in[i]) && pb_tensor_make_owned(&c->in[i]))
            return pb_err_set(err, PB_ENOMEM, NULL, "out of memory aligning input %s", c->op->inputs[i].name);
    if (tape)
        pb_tapedata_init(tape, c);
    int rc = c->op->forward[c->device.kind](c, tape, err);
    if (rc && tape)
        pb_tapedata_clear(tape);
    if (rc == 0)
        tag_vectors(c->out, c->op->noutputs, c->order);
    return rc;
}

int pb_op_run_reverse(const pb_tapedata_t *tape, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                      pb_warnings_t *warn, pb_err_t *err)
{
    pb_tensor_t aligned[PB_MAX_IO] = {{0}};
    for (int i = 0; i < tape->op->noutputs; i++) {
        if (cot[i].storage == NULL)
            continue;
        pb_tensor_ref(&aligned[i], &cot[i]);
        if (!pb_tensor_aligned(&aligned[i]) && pb_tensor_make_owned(&aligned[i])) {
            for (int k = 0; k < PB_MAX_IO; k++)
                pb_tensor_clear(&aligned[k]);
            return pb_err_set(err, PB_ENOMEM, NULL, "out of memory aligning cotangents");
        }
    }
    int rc = tape->op->reverse[tape->device.kind](tape, aligned, grad, order, warn, err);
    for (int k = 0; k < PB_MAX_IO; k++)
        pb_tensor_clear(&aligned[k]);
    if (rc == 0)
        tag_vectors(grad, PB_MAX_IO + 2, order);
    return rc;
}
