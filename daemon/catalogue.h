/* The ops catalogue: the op table (kernels/op.h) as the `ops` method and
 * `hello` describe it on the wire.  The daemon-side companion of the op
 * table: a new op appears here without any edit. */
#ifndef PB_CATALOGUE_H
#define PB_CATALOGUE_H

#include "../kernels/op.h"
#include "../proto/codec.h"

/* {NAME: {inputs, outputs, options, dtypes, devices, wrt}} for every op. */
void pb_catalogue_ops(pb_out_t *o);
/* The names of the dtypes in mask, as an array. */
void pb_catalogue_dtypes(pb_out_t *o, unsigned mask);
/* The device kinds of mask (1u << pb_devkind_t) this daemon has, as an
 * array: "cpu", "cuda". */
void pb_catalogue_devices(pb_out_t *o, unsigned mask);
/* The devices present and serving: "cpu", "cuda:0", ... (hello; a GPU
 * that has failed is left out). */
void pb_catalogue_device_list(pb_out_t *o);

#endif
