/* pullbackd-demo: the LuxLib seed case through the C client.
 *
 * y = gelu.(W·x .+ b) for fixed 2×2 W, x and a length-2 b in f32, first with
 * `forward`, then with `augmented_forward` (wrt weight, x, bias) followed by
 * `reverse` with the cotangent ȳ, printing the three gradients.  Exit 0 on
 * success; 1 with the daemon's error code and message (or the transport
 * error) on failure. */
#define _GNU_SOURCE
#include "pullbackd.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const float W[4] = { 0.3f, -0.8f, 0.5f, 0.1f };
static const float X[4] = { 1.0f, -0.4f, 0.7f, 2.0f };
static const float B[2] = { 0.05f, -0.2f };
static const float YBAR[4] = { 1.0f, 0.5f, -0.3f, 2.0f };

static pb_ctensor_t f32_tensor(const float *v, int rank, uint64_t d0, uint64_t d1)
{
    pb_ctensor_t t = { 0 };
    t.dtype = "f32";
    t.rank = rank;
    t.shape[0] = d0;
    t.shape[1] = d1;
    t.order = 'C';
    t.data = v;
    t.nbytes = (size_t)(rank == 1 ? d0 : d0 * d1) * sizeof(float);
    return t;
}

static void pack_inputs(msgpack_packer *pk)
{
    pb_ctensor_t w = f32_tensor(W, 2, 2, 2);
    pb_ctensor_t x = f32_tensor(X, 2, 2, 2);
    pb_ctensor_t b = f32_tensor(B, 1, 2, 0);

    pb_pack_str(pk, "inputs");
    msgpack_pack_map(pk, 3);
    pb_pack_str(pk, "weight");
    pb_pack_tensor(pk, &w);
    pb_pack_str(pk, "x");
    pb_pack_tensor(pk, &x);
    pb_pack_str(pk, "bias");
    pb_pack_tensor(pk, &b);
}

static void pack_options(msgpack_packer *pk)
{
    pb_pack_str(pk, "options");
    msgpack_pack_map(pk, 1);
    pb_pack_kv_str(pk, "act", "gelu");
}

/* Send the begun request and wait for its reply; on any failure say why on
 * stderr and return -1 (r is then empty). */
static int call(pb_client_t *c, const char *method, pb_reply_t *r)
{
    int rc = pb_client_call(c, r);
    if (rc < 0) {
        fprintf(stderr, "pullbackd-demo: %s: %s\n", method, strerror(-rc));
        return -1;
    }
    if (r->error != NULL) {
        fprintf(stderr, "pullbackd-demo: %s: %s: %s\n", method, pb_reply_code(r),
                pb_reply_message(r));
        pb_reply_free(r);
        return -1;
    }
    return 0;
}

/* Print name = [..] or [[..], [..]] for a rank-1 or rank-2 real tensor,
 * six significant digits, rows as the math reads whatever the memory order. */
static int print_tensor(const char *name, const msgpack_object *o)
{
    pb_ctensor_t t;
    double v[64];

    if (pb_obj_tensor(o, &t) < 0 || t.rank < 1 || t.rank > 2 ||
        pb_ctensor_copy_f64(&t, v, sizeof v / sizeof v[0]) < 0 ||
        (strcmp(t.dtype, "f32") != 0 && strcmp(t.dtype, "f64") != 0)) {
        fprintf(stderr, "pullbackd-demo: %s: not a small real tensor of rank 1 or 2\n", name);
        return -1;
    }
    size_t rows = t.rank == 2 ? (size_t)t.shape[0] : 1;
    size_t cols = t.rank == 2 ? (size_t)t.shape[1] : (size_t)t.shape[0];

    printf("%s = ", name);
    if (t.rank == 2)
        printf("[");
    for (size_t i = 0; i < rows; i++) {
        printf("%s[", i > 0 ? ", " : "");
        for (size_t j = 0; j < cols; j++) {
            size_t k = t.order == 'F' ? j * rows + i : i * cols + j;
            printf("%s%.6g", j > 0 ? ", " : "", v[k]);
        }
        printf("]");
    }
    if (t.rank == 2)
        printf("]");
    printf("\n");
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: pullbackd-demo [--socket PATH]\n"
               "Runs fused_dense (act gelu) forward and reverse on a fixed 2x2 case.\n");
}

int main(int argc, char **argv)
{
    const char *path = NULL;
    pb_client_t *c = NULL;
    pb_reply_t r;
    msgpack_packer *pk;
    int status = 1;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--socket") == 0 && i + 1 < argc) {
            path = argv[++i];
        } else if (strncmp(argv[i], "--socket=", 9) == 0) {
            path = argv[i] + 9;
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            return 0;
        } else {
            usage(stderr);
            return 2;
        }
    }

    char def[108];
    if (path == NULL && pb_client_socket_path(def, sizeof def) == 0)
        path = def;
    int rc = pb_client_connect(path, &c);
    if (rc < 0) {
        fprintf(stderr, "pullbackd-demo: connect %s: %s\n", path ? path : "(default)",
                strerror(-rc));
        return 1;
    }

    /* forward: y only, no tape. */
    pk = pb_client_begin(c, "forward");
    msgpack_pack_map(pk, 3);
    pb_pack_kv_str(pk, "op", "fused_dense");
    pack_inputs(pk);
    pack_options(pk);
    if (call(c, "forward", &r) < 0)
        goto out;
    rc = print_tensor("y", pb_obj_path(r.result, "outputs.y"));
    pb_reply_free(&r);
    if (rc < 0)
        goto out;

    /* augmented_forward: y and a tape for the three gradients. */
    pk = pb_client_begin(c, "augmented_forward");
    msgpack_pack_map(pk, 4);
    pb_pack_kv_str(pk, "op", "fused_dense");
    pack_inputs(pk);
    pack_options(pk);
    pb_pack_str(pk, "wrt");
    msgpack_pack_array(pk, 3);
    pb_pack_str(pk, "weight");
    pb_pack_str(pk, "x");
    pb_pack_str(pk, "bias");
    if (call(c, "augmented_forward", &r) < 0)
        goto out;
    const msgpack_object *tape = pb_obj_get(r.result, "tape");
    uint64_t tape_id, tape_bytes = 0;
    if (pb_obj_uint(tape, &tape_id) < 0) {
        fprintf(stderr, "pullbackd-demo: augmented_forward: no uint tape handle in the result\n");
        pb_reply_free(&r);
        goto out;
    }
    pb_obj_uint(pb_obj_get(r.result, "tape_bytes"), &tape_bytes);
    printf("tape %llu (%llu bytes)\n", (unsigned long long)tape_id,
           (unsigned long long)tape_bytes);
    pb_reply_free(&r);

    /* reverse: cotangent ȳ for y; consumes the tape. */
    pb_ctensor_t ybar = f32_tensor(YBAR, 2, 2, 2);
    pk = pb_client_begin(c, "reverse");
    msgpack_pack_map(pk, 2);
    pb_pack_str(pk, "tape");
    msgpack_pack_uint64(pk, tape_id);
    pb_pack_str(pk, "cotangents");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "y");
    pb_pack_tensor(pk, &ybar);
    if (call(c, "reverse", &r) < 0)
        goto out;
    const msgpack_object *g = pb_obj_get(r.result, "gradients");
    rc = print_tensor("weight_bar", pb_obj_get(g, "weight"));
    if (rc == 0)
        rc = print_tensor("x_bar", pb_obj_get(g, "x"));
    if (rc == 0)
        rc = print_tensor("bias_bar", pb_obj_get(g, "bias"));
    const msgpack_object *warn = pb_obj_get(r.result, "warnings");
    if (warn != NULL && warn->type == MSGPACK_OBJECT_ARRAY) {
        for (uint32_t i = 0; i < warn->via.array.size; i++) {
            const msgpack_object *w = &warn->via.array.ptr[i];
            if (w->type == MSGPACK_OBJECT_STR)
                printf("warning: %.*s\n", (int)w->via.str.size, w->via.str.ptr);
        }
    }
    pb_reply_free(&r);
    if (rc == 0)
        status = 0;
out:
    pb_client_close(c);
    return status;
}
