/* The ops catalogue (catalogue.h): what the `ops` method says of each op,
 * read from the op table (kernels/op.h), the one source that checking and
 * dispatch read too. */
#include "catalogue.h"

#include <stdbool.h>
#include <stdio.h>

#include "../cuda/gpu.h"

static void pack_strs(pb_out_t *o, const char *const *v, int n)
{
    msgpack_pack_array(&o->pk, (size_t)n);
    for (int i = 0; i < n; i++)
        pb_out_str(o, v[i]);
}

void pb_catalogue_dtypes(pb_out_t *o, unsigned mask)
{
    msgpack_pack_array(&o->pk, (size_t)__builtin_popcount(mask));
    for (int d = 0; d < PB_NDTYPES; d++)
        if (mask & PB_DTYPE_BIT(d))
            pb_out_str(o, pb_dtype_name((pb_dtype_t)d));
}

void pb_catalogue_devices(pb_out_t *o, unsigned mask)
{
    /* Only devices this daemon has; a GPU kind when it has a GPU. */
    int gpu = pb_gpu_count() > 0 && (mask & (1u << PB_DEV_CUDA));
    msgpack_pack_array(&o->pk, 1 + (size_t)gpu);
    pb_out_str(o, "cpu");
    if (gpu)
        pb_out_str(o, "cuda");
}

void pb_catalogue_device_list(pb_out_t *o)
{
    /* One reading of the flags: a worker may fail a GPU meanwhile. */
    int n = pb_gpu_count(), up = 0;
    bool failed[PB_GPU_MAX_DEVICES];
    for (int i = 0; i < n; i++)
        up += !(failed[i] = pb_gpu->failed(i));
    msgpack_pack_array(&o->pk, 1 + (size_t)up);
    pb_out_str(o, "cpu");
    for (int i = 0; i < n; i++) {
        if (failed[i])
            continue;
        char name[16];
        snprintf(name, sizeof name, "cuda:%d", i);
        pb_out_str(o, name);
    }
}

static const char *const opt_type_names[] = {"str", "bool", "int", "float", "scalar", "axes", "axes2", "str"};

void pb_catalogue_ops(pb_out_t *o)
{
    msgpack_pack_map(&o->pk, (size_t)pb_nops);
    for (int i = 0; i < pb_nops; i++) {
        const pb_op_t *op = pb_ops[i];
        pb_out_str(o, op->name);
        msgpack_pack_map(&o->pk, 6);
        pb_out_str(o, "inputs");
        msgpack_pack_map(&o->pk, (size_t)op->ninputs);
        for (int k = 0; k < op->ninputs; k++) {
            pb_out_str(o, op->inputs[k].name);
            msgpack_pack_map(&o->pk, 1);
            pb_out_str(o, "required");
            if (op->inputs[k].required)
                msgpack_pack_true(&o->pk);
            else
                msgpack_pack_false(&o->pk);
        }
        pb_out_str(o, "outputs");
        pack_strs(o, op->outputs, op->noutputs);
        pb_out_str(o, "options");
        msgpack_pack_map(&o->pk, (size_t)op->noptions);
        for (int k = 0; k < op->noptions; k++) {
            const pb_opt_spec_t *sp = &op->options[k];
            pb_out_str(o, sp->name);
            msgpack_pack_map(&o->pk, sp->values ? 3 : 2);
            pb_out_str(o, "type");
            pb_out_str(o, opt_type_names[sp->type]);
            pb_out_str(o, "default");
            if (sp->def_auto) {
                msgpack_pack_nil(&o->pk);
            } else switch (sp->type) {
            case PB_OPT_STR: pb_out_str(o, sp->values ? sp->values[sp->def_index] : ""); break;
            case PB_OPT_BOOL: if (sp->def_re != 0) msgpack_pack_true(&o->pk); else msgpack_pack_false(&o->pk); break;
            case PB_OPT_INT: msgpack_pack_int64(&o->pk, (int64_t)sp->def_re); break;
            case PB_OPT_FLOAT:
            case PB_OPT_SCALAR: msgpack_pack_double(&o->pk, sp->def_re); break;
            case PB_OPT_AXES:
            case PB_OPT_AXES2:
            case PB_OPT_TEXT: msgpack_pack_nil(&o->pk); break;
            }
            if (sp->values) {
                int n = 0;
                while (sp->values[n])
                    n++;
                pb_out_str(o, "values");
                pack_strs(o, sp->values, n);
            }
        }
        pb_out_str(o, "dtypes");
        pb_catalogue_dtypes(o, op->dtypes);
        pb_out_str(o, "devices");
        pb_catalogue_devices(o, op->devices);
        pb_out_str(o, "wrt");
        pack_strs(o, op->wrt_names, op->nwrt);
    }
}

