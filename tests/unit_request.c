/* unit.request: the request layer (daemon/request.c) on its own, without a
 * daemon: params as the loop thread gets them, checked against the
 * configuration.  A valid call of each method parses to what it says; each
 * documented refusal gives its PB_E* code, the argument at fault and a
 * message that names the problem.
 *
 * Requests are written in a small JSON-like notation (see pack_text) so
 * that each case reads as the client would send it: {"k": v}, [..],
 * "str", integers, reals, true/false/nil, and #N for N zero bytes of bin
 * (the data of a tensor). */
#include <ctype.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/request.h"

/* ---- the notation ------------------------------------------------------- */

static const char *skip_sep(const char *s)
{
    while (isspace((unsigned char)*s) || *s == ',' || *s == ':')
        s++;
    return s;
}

/* Items of a {..} or [..] at s (after the bracket), up to close: counts
 * top-level values (a map's keys and values both). */
static uint32_t count_items(const char *s, char close)
{
    uint32_t n = 0;
    int depth = 0;
    bool in_str = false, in_item = false;
    for (; *s; s++) {
        char ch = *s;
        if (in_str) {
            if (ch == '"')
                in_str = false;
            continue;
        }
        if (depth == 0 && ch == close)
            break;
        if (depth == 0 && !in_item && !isspace((unsigned char)ch) && ch != ',' && ch != ':') {
            n++;
            in_item = true;
        }
        if (depth == 0 && (ch == ',' || ch == ':'))
            in_item = false;
        if (ch == '"')
            in_str = true;
        else if (ch == '{' || ch == '[')
            depth++;
        else if (ch == '}' || ch == ']')
            depth--;
    }
    return n;
}

/* Pack one value of the notation; returns the text after it. */
static const char *pack_text(msgpack_packer *pk, const char *s)
{
    s = skip_sep(s);
    if (*s == '{' || *s == '[') {
        char close = *s == '{' ? '}' : ']';
        uint32_t n = count_items(s + 1, close);
        if (close == '}')
            msgpack_pack_map(pk, n / 2);
        else
            msgpack_pack_array(pk, n);
        s++;
        for (uint32_t i = 0; i < n; i++)
            s = pack_text(pk, s);
        s = skip_sep(s);
        assert_int_equal(*s, close);
        return s + 1;
    }
    if (*s == '"') {
        const char *e = strchr(s + 1, '"');
        assert_non_null(e);
        msgpack_pack_str_with_body(pk, s + 1, (size_t)(e - s - 1));
        return e + 1;
    }
    if (*s == '#') {
        char *e;
        unsigned long n = strtoul(s + 1, &e, 10);
        void *zero = calloc(1, n + 1);
        msgpack_pack_bin_with_body(pk, zero, n);
        free(zero);
        return e;
    }
    if (strncmp(s, "true", 4) == 0 || strncmp(s, "false", 5) == 0) {
        if (s[0] == 't')
            msgpack_pack_true(pk);
        else
            msgpack_pack_false(pk);
        return s + (s[0] == 't' ? 4 : 5);
    }
    if (strncmp(s, "nil", 3) == 0) {
        msgpack_pack_nil(pk);
        return s + 3;
    }
    size_t len = strspn(s, "0123456789+-.eE");
    assert_true(len > 0);
    if (strcspn(s, ".eE") < len) {
        msgpack_pack_double(pk, strtod(s, NULL));
    } else if (*s == '-') {
        msgpack_pack_int64(pk, strtoll(s, NULL, 10));
    } else {
        msgpack_pack_uint64(pk, strtoull(s, NULL, 10));
    }
    return s + len;
}

/* One decoded message: params point into msg, as in the daemon. */
typedef struct req {
    pb_storage_t *msg;
    msgpack_zone zone;
    msgpack_object params;
} req_t;

static void req_open(req_t *r, const char *text)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    assert_int_equal(*skip_sep(pack_text(&pk, text)), 0);
    r->msg = pb_storage_new(sb.size, false);
    assert_non_null(r->msg);
    memcpy(r->msg->ptr, sb.data, sb.size);
    msgpack_sbuffer_destroy(&sb);
    msgpack_zone_init(&r->zone, 4096);
    size_t off = 0;
    assert_int_equal(msgpack_unpack(r->msg->ptr, r->msg->size, &off, &r->zone, &r->params), MSGPACK_UNPACK_SUCCESS);
    assert_int_equal(r->params.type, MSGPACK_OBJECT_MAP);
}

static void req_close(req_t *r)
{
    msgpack_zone_destroy(&r->zone);
    pb_storage_unref(r->msg);
}

/* Two buffers for {buffer, offset} and into, as a connection's table:
 * id 1 (4096 bytes, writable) and id 2 (256 bytes, read-only). */
static pb_storage_t *fake[2];

static pb_storage_t *fake_find(void *ctx, uint64_t id, bool write, const char *what, pb_err_t *err)
{
    (void)ctx;
    if (id == 1 || (id == 2 && !write))
        return fake[id - 1];
    pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: buffer %llu is not registered or read-only", what,
               (unsigned long long)id);
    return NULL;
}

static const pb_resolver_t resolver = {fake_find, NULL};

static pb_config_t config(void)
{
    pb_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.max_message_bytes = 1 << 20;
    cfg.device = (pb_device_t){PB_DEV_CPU, 0};
    return cfg;
}

/* A parsed call and what goes with it; cleared by call_close. */
typedef struct call {
    req_t r;
    pb_call_t c;
    pb_call_extra_t x;
    pb_err_t err;
    int rc;
} call_t;

static void call_parse(call_t *k, const pb_config_t *cfg, pb_call_kind_t kind, const char *text)
{
    memset(k, 0, sizeof *k);
    req_open(&k->r, text);
    k->rc = pb_request_call(cfg, &k->r.params, k->r.msg, &resolver, kind, &k->c, &k->x, &k->err);
}

static void call_close(call_t *k)
{
    pb_call_clear(&k->c);
    pb_into_clear(k->x.into, PB_MAX_IO);
    req_close(&k->r);
}

/* fused_dense's inputs, W 3×4 and x 4×2 of dtype DT, for the cases. */
#define T(dt, shape, bytes) "{\"dtype\": \"" dt "\", \"shape\": " shape ", \"data\": #" #bytes "}"
#define W64 T("f64", "[3, 4]", 96)
#define X64 T("f64", "[4, 2]", 64)
#define FD(extra) "{\"op\": \"fused_dense\", \"inputs\": {\"weight\": " W64 ", \"x\": " X64 "}" extra "}"

/* ---- valid calls -------------------------------------------------------- */

static void forward_parses(void **state)
{
    (void)state;
    pb_config_t cfg = config();
    call_t k;
    call_parse(&k, &cfg, PB_CALL_FORWARD, FD(", \"options\": {\"act\": \"gelu\"}, \"order\": \"F\", \"device\": \"cpu\""));
    assert_int_equal(k.rc, 0);
    assert_string_equal(k.c.op->name, "fused_dense");
    assert_int_equal(k.c.dtype, PB_F64);
    assert_int_equal(k.c.order, 'F');
    assert_false(k.c.taped);
    assert_int_equal(k.c.device.kind, PB_DEV_CPU);
    assert_int_equal(k.c.out_meta[0].rank, 2);
    assert_int_equal(k.c.out_meta[0].shape[0], 3);
    assert_int_equal(k.c.out_meta[0].shape[1], 2);
    assert_int_equal(k.x.reply_bytes, 3 * 2 * 8);
    /* The tensors are views of the message, not copies. */
    assert_ptr_equal(k.c.in[0].storage, k.r.msg);
    call_close(&k);

    /* f32, bias given, tensors in both orders. */
    call_parse(&k, &cfg, PB_CALL_FORWARD,
               "{\"op\": \"fused_dense\", \"inputs\": {\"weight\": " T("f32", "[3, 4]", 48)
               ", \"x\": {\"dtype\": \"f32\", \"shape\": [4], \"order\": \"F\", \"data\": #16}, \"bias\": "
               T("f32", "[3]", 12) "}}");
    assert_int_equal(k.rc, 0);
    assert_int_equal(k.c.dtype, PB_F32);
    assert_non_null(k.c.in[2].storage);
    assert_int_equal(k.x.reply_bytes, 3 * 4);
    call_close(&k);
}

static void augmented_parses(void **state)
{
    (void)state;
    pb_config_t cfg = config();
    call_t k;
    call_parse(&k, &cfg, PB_CALL_AUGMENTED, FD(", \"wrt\": [\"x\", \"weight\"], \"scope\": \"peer\", \"ttl_s\": 2.5"));
    assert_int_equal(k.rc, 0);
    assert_true(k.c.taped);
    assert_int_equal(k.c.wrt, 3u);
    assert_true(k.x.peer_scope);
    assert_int_equal(k.x.ttl_ms, 2500);
    call_close(&k);
    /* The defaults: connection scope, ten minutes; a tiny ttl is 1 ms. */
    call_parse(&k, &cfg, PB_CALL_AUGMENTED, FD(", \"wrt\": []"));
    assert_int_equal(k.rc, 0);
    assert_int_equal(k.c.wrt, 0u);
    assert_false(k.x.peer_scope);
    assert_int_equal(k.x.ttl_ms, 600000);
    call_close(&k);
    call_parse(&k, &cfg, PB_CALL_AUGMENTED, FD(", \"wrt\": [\"x\"], \"scope\": \"connection\", \"ttl_s\": 0.0001"));
    assert_int_equal(k.rc, 0);
    assert_int_equal(k.x.ttl_ms, 1);
    call_close(&k);
}

static void check_parses(void **state)
{
    (void)state;
    pb_config_t cfg = config();
    call_t k;
    call_parse(&k, &cfg, PB_CALL_CHECK, FD(", \"wrt\": [\"weight\"], \"seed\": 7"));
    assert_int_equal(k.rc, 0);
    assert_int_equal(k.x.seed, 7);
    assert_int_equal(k.c.wrt, 1u);
    call_close(&k);
}

/* Inputs in the shared-memory buffers and outputs sent into one. */
static void buffers_and_into(void **state)
{
    (void)state;
    pb_config_t cfg = config();
    call_t k;
    call_parse(&k, &cfg, PB_CALL_FORWARD,
               "{\"op\": \"fused_dense\", \"inputs\": {\"weight\": {\"dtype\": \"f64\", \"shape\": [3, 4], "
               "\"buffer\": 2, \"offset\": 64}, \"x\": " X64 "}, \"into\": {\"y\": {\"buffer\": 1, \"offset\": 8}}}");
    assert_int_equal(k.rc, 0);
    assert_ptr_equal(k.c.in[0].storage, fake[1]);
    assert_int_equal(k.c.in[0].offset, 64);
    assert_ptr_equal(k.x.into[0].storage, fake[0]);
    assert_int_equal(k.x.into[0].offset, 8);
    assert_int_equal(k.x.into[0].room, 48);
    assert_int_equal(k.x.reply_bytes, 0); /* y goes into the buffer */
    call_close(&k);
}

/* reverse's cotangents against a tape of the forward they follow. */
static void cotangents(void **state)
{
    (void)state;
    pb_config_t cfg = config();
    call_t k;
    call_parse(&k, &cfg, PB_CALL_AUGMENTED, FD(", \"wrt\": [\"x\"]"));
    assert_int_equal(k.rc, 0);
    pb_tapedata_t tape;
    assert_int_equal(pb_op_run_forward(&k.c, &tape, &k.err), 0);
    call_close(&k);

    static const struct {
        const char *text;
        int code;
        const char *arg, *msg;
    } cases[] = {
        {"{\"cotangents\": {\"y\": " T("f64", "[3, 2]", 48) "}}", 0, "", ""},
        {"{}", 0, "", ""}, /* no cotangents: all zero */
        {"{\"cotangents\": [1]}", PB_EINVALID_ARGUMENT, "cotangents", "cotangents must be a map"},
        {"{\"cotangents\": {\"z\": " T("f64", "[3, 2]", 48) "}}", PB_EINVALID_ARGUMENT, "cotangents",
         "fused_dense has no output 'z'"},
        {"{\"cotangents\": {\"y\": " T("f32", "[3, 2]", 24) "}}", PB_EDTYPE_MISMATCH, "cotangents.y",
         "cotangent y is f32 but output y is f64"},
        {"{\"cotangents\": {\"y\": " T("f64", "[2, 3]", 48) "}}", PB_ESHAPE_MISMATCH, "cotangents.y",
         "has shape (2, 3) but output y has shape (3, 2)"},
        {"{\"cotangents\": {\"y\": " T("f64", "[3, 2]", 40) "}}", PB_EINVALID_ARGUMENT, "cotangents.y",
         "data holds 40 bytes but shape and dtype need 48"},
        {"{\"cotangents\": {\"y\": " T("f64", "[3, 2]", 48) ", \"y\": " T("f64", "[3, 2]", 48) "}}",
         PB_EINVALID_ARGUMENT, "cotangents.y", "cotangent y given twice"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        req_t r;
        req_open(&r, cases[i].text);
        pb_tensor_t cot[PB_MAX_IO] = {{0}};
        pb_err_t err = {0};
        int rc = pb_request_cotangents(&tape, pb__obj_get(&r.params, "cotangents"), r.msg, &resolver, cot, &err);
        if (rc != cases[i].code || strcmp(err.arg, cases[i].arg) != 0 || strstr(err.message, cases[i].msg) == NULL)
            fail_msg("case %zu: %s\n  got %d (%s) '%s'", i, cases[i].text, rc, err.arg, err.message);
        for (int j = 0; j < PB_MAX_IO; j++)
            pb_tensor_clear(&cot[j]);
        req_close(&r);
    }
    pb_tapedata_clear(&tape);
}

/* ---- refusals ----------------------------------------------------------- */

typedef struct refusal {
    pb_call_kind_t kind;
    const char *text;
    int code;
    const char *arg; /* err.arg exactly */
    const char *msg; /* a part of err.message */
} refusal_t;

#define F PB_CALL_FORWARD
#define A PB_CALL_AUGMENTED
#define C PB_CALL_CHECK
#define INV PB_EINVALID_ARGUMENT
#define TX(tensor) "{\"op\": \"fused_dense\", \"inputs\": {\"weight\": " tensor ", \"x\": " X64 "}}"

static const refusal_t refusals[] = {
    /* params */
    {F, FD(", \"bogus\": 1"), INV, "params", "unknown key 'bogus' in params"},
    {C, FD(", \"wrt\": [], \"into\": {}"), INV, "params", "unknown key 'into'"},
    {F, FD(", \"wrt\": []"), INV, "params", "unknown key 'wrt'"},
    {F, FD(", \"scope\": \"peer\""), INV, "params", "unknown key 'scope'"},
    /* op */
    {F, "{\"inputs\": {}}", INV, "op", "op must be the name of an op"},
    {F, "{\"op\": 5, \"inputs\": {}}", INV, "op", "op must be the name of an op"},
    {F, "{\"op\": \"nope\", \"inputs\": {}}", PB_EUNKNOWN_OP, "op", "unknown op 'nope'"},
    /* inputs */
    {F, "{\"op\": \"fused_dense\"}", INV, "inputs", "inputs must be a map"},
    {F, "{\"op\": \"fused_dense\", \"inputs\": [1]}", INV, "inputs", "inputs must be a map"},
    {F, "{\"op\": \"fused_dense\", \"inputs\": {\"z\": " X64 "}}", INV, "inputs", "fused_dense has no input 'z'"},
    {F, "{\"op\": \"fused_dense\", \"inputs\": {\"weight\": " W64 "}}", INV, "inputs.x", "missing required input x"},
    {F, "{\"op\": \"fused_dense\", \"inputs\": {\"weight\": " W64 ", \"weight\": " W64 ", \"x\": " X64 "}}", INV,
     "inputs.weight", "input weight given twice"},
    /* tensors */
    {F, TX("[1, 2]"), INV, "inputs.weight", "inputs.weight must be a tensor map"},
    {F, TX("{\"shape\": [3, 4], \"data\": #96}"), INV, "inputs.weight", "dtype must be one of"},
    {F, TX("{\"dtype\": 8, \"shape\": [3, 4], \"data\": #96}"), INV, "inputs.weight", "dtype must be one of"},
    {F, TX(T("f16", "[3, 4]", 48)), INV, "inputs.weight", "unknown dtype 'f16'"},
    {F, TX("{\"dtype\": \"f64\", \"shape\": 12, \"data\": #96}"), INV, "inputs.weight", "shape must be an array"},
    {F, TX(T("f64", "[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]", 8)), INV, "inputs.weight", "rank 17 is above the maximum"},
    {F, TX(T("f64", "[3, -4]", 96)), INV, "inputs.weight", "shape[1] must be a non-negative integer"},
    {F, TX(T("f64", "[3, 4.5]", 96)), INV, "inputs.weight", "shape[1] must be a non-negative integer"},
    {F, TX(T("f64", "[4294967296, 4294967296]", 8)), INV, "inputs.weight", "the product of the shape overflows"},
    {F, TX(T("c128", "[1152921504606846976]", 8)), INV, "inputs.weight", "the product of the shape overflows"},
    {F, TX(T("f64", "[3, 4]", 95)), INV, "inputs.weight", "data holds 95 bytes but shape and dtype need 96"},
    {F, TX(T("f64", "[3, 4]", 97)), INV, "inputs.weight", "data holds 97 bytes but shape and dtype need 96"},
    {F, TX("{\"dtype\": \"f64\", \"shape\": [3, 4]}"), INV, "inputs.weight", "data must be bin"},
    {F, TX("{\"dtype\": \"f64\", \"shape\": [3, 4], \"data\": [1]}"), INV, "inputs.weight", "data must be bin"},
    {F, TX("{\"dtype\": \"f64\", \"shape\": [3, 4], \"order\": \"X\", \"data\": #96}"), INV, "inputs.weight",
     "order must be \"C\" or \"F\""},
    {F, TX("{\"dtype\": \"f64\", \"shape\": [3, 4], \"data\": #96, \"strides\": [1]}"), INV, "inputs.weight",
     "unknown tensor key 'strides'"},
    /* tensors in buffers */
    {F, TX("{\"dtype\": \"f64\", \"shape\": [3, 4], \"data\": #96, \"buffer\": 1, \"offset\": 0}"), INV,
     "inputs.weight", "either data or buffer and offset"},
    {F, TX("{\"dtype\": \"f64\", \"shape\": [3, 4], \"buffer\": 1}"), INV, "inputs.weight", "buffer needs offset"},
    {F, TX("{\"dtype\": \"f64\", \"shape\": [3, 4], \"buffer\": 3, \"offset\": 0}"), INV, "inputs.weight",
     "buffer 3 is not registered"},
    {F, TX("{\"dtype\": \"f64\", \"shape\": [3, 4], \"buffer\": 2, \"offset\": 168}"), INV, "inputs.weight",
     "96 bytes at offset 168 run past the end of buffer 2"},
    {F, TX("{\"dtype\": \"f64\", \"shape\": [3, 4], \"buffer\": 1, \"offset\": 4}"), INV, "inputs.weight",
     "offset 4 is not aligned"},
    /* dtypes and shapes across inputs (the op's validate) */
    {F, "{\"op\": \"fused_dense\", \"inputs\": {\"weight\": " W64 ", \"x\": " T("f32", "[4, 2]", 32) "}}",
     PB_EDTYPE_MISMATCH, "inputs.x", "input x is f32 but weight is f64"},
    {F, "{\"op\": \"fused_dense\", \"inputs\": {\"weight\": " W64 ", \"x\": " T("f64", "[5, 2]", 80) "}}",
     PB_ESHAPE_MISMATCH, "inputs.x", "x has 5 rows but weight (3, 4) has 4 columns"},
    /* options */
    {F, FD(", \"options\": [1]"), INV, "options", "options must be a map"},
    {F, FD(", \"options\": {\"foo\": 1}"), INV, "options", "fused_dense has no option 'foo'"},
    {F, FD(", \"options\": {\"act\": \"nope\"}"), INV, "options.act", "act must be one of: "},
    {F, FD(", \"options\": {\"act\": 3}"), INV, "options.act", "act must be one of: "},
    {F, FD(", \"options\": {\"act\": \"relu\", \"act\": \"gelu\"}"), INV, "options.act", "option act given twice"},
    /* device and order */
    {F, FD(", \"device\": \"tpu\""), INV, "device", "device must be \"cpu\", \"cuda\" or \"cuda:N\""},
    {F, FD(", \"device\": 0"), INV, "device", "device must be"},
    {F, FD(", \"device\": \"cuda:1\""), PB_EDEVICE_UNAVAILABLE, "device", "device cuda:1 is not available"},
    {F, FD(", \"order\": \"X\""), INV, "order", "order must be \"C\" or \"F\""},
    /* wrt */
    {A, FD(""), INV, "wrt", "missing wrt"},
    {C, FD(""), INV, "wrt", "missing wrt"},
    {A, FD(", \"wrt\": \"x\""), INV, "wrt", "wrt must be an array of input names"},
    {A, FD(", \"wrt\": [\"y\"]"), INV, "wrt", "wrt[0] 'y' is not a differentiable input of fused_dense (those are: weight, x, bias)"},
    {A, FD(", \"wrt\": [\"x\", 1]"), INV, "wrt", "wrt[1] '?' is not a differentiable input"},
    {A, FD(", \"wrt\": [\"x\", \"x\"]"), INV, "wrt", "wrt names x twice"},
    {A, FD(", \"wrt\": [\"bias\"]"), INV, "wrt", "wrt names bias, which was not given in inputs"},
    /* accumulate is reverse's */
    {F, FD(", \"accumulate\": true"), INV, "accumulate", "accumulate is reverse's"},
    {A, FD(", \"wrt\": [], \"accumulate\": true"), INV, "accumulate", "outputs of augmented_forward"},
    {F, FD(", \"accumulate\": 1"), INV, "accumulate", "accumulate must be true or false"},
    /* scope, ttl_s, seed */
    {A, FD(", \"wrt\": [], \"scope\": \"world\""), INV, "scope", "scope must be \"connection\" or \"peer\""},
    {A, FD(", \"wrt\": [], \"ttl_s\": 0"), INV, "ttl_s", "ttl_s must be a number of seconds > 0"},
    {A, FD(", \"wrt\": [], \"ttl_s\": -1"), INV, "ttl_s", "ttl_s must be a number of seconds > 0"},
    {A, FD(", \"wrt\": [], \"ttl_s\": \"1\""), INV, "ttl_s", "ttl_s must be a number"},
    {A, FD(", \"wrt\": [], \"ttl_s\": 31536001"), INV, "ttl_s", "at most 31536000"},
    {C, FD(", \"wrt\": [], \"seed\": -1"), INV, "seed", "seed must be a non-negative integer"},
    {C, FD(", \"wrt\": [], \"seed\": 1.5"), INV, "seed", "seed must be a non-negative integer"},
    /* into */
    {F, FD(", \"into\": [1]"), INV, "into", "into must be a map from output names"},
    {F, FD(", \"into\": {\"z\": {\"buffer\": 1, \"offset\": 0}}"), INV, "into", "into names 'z', which is no output"},
    {F, FD(", \"into\": {\"y\": 1}"), INV, "into.y", "into.y must be {buffer, offset}"},
    {F, FD(", \"into\": {\"y\": {\"buffer\": 1, \"offset\": 0, \"size\": 4}}"), INV, "into.y", "nothing else"},
    {F, FD(", \"into\": {\"y\": {\"buffer\": 2, \"offset\": 0}}"), INV, "into.y", "read-only"},
    {F, FD(", \"into\": {\"y\": {\"buffer\": 1, \"offset\": 4056}}"), INV, "into.y", "48 bytes at offset 4056 run past"},
    {F, FD(", \"into\": {\"y\": {\"buffer\": 1, \"offset\": 12}}"), INV, "into.y", "offset 12 is not aligned"},
    {F, FD(", \"into\": {\"y\": {\"buffer\": 1, \"offset\": -8}}"), INV, "into.y", "offset must be a non-negative"},
    {F, FD(", \"into\": {\"y\": {\"buffer\": 1, \"offset\": 0}, \"y\": {\"buffer\": 1, \"offset\": 64}}"), INV,
     "into.y", "into.y given twice"},
};

static void refused(void **state)
{
    (void)state;
    pb_config_t cfg = config();
    int wrong = 0; /* every case runs: one report lists all that differ */
    for (size_t i = 0; i < sizeof refusals / sizeof refusals[0]; i++) {
        const refusal_t *t = &refusals[i];
        call_t k;
        call_parse(&k, &cfg, t->kind, t->text);
        if (k.rc != t->code || strcmp(k.err.arg, t->arg) != 0 || strstr(k.err.message, t->msg) == NULL ||
            k.err.code != t->code) {
            print_error("case %zu: %s\n  want %d (%s) '%s'\n  got  %d (%s) '%s'\n", i, t->text, t->code, t->arg,
                        t->msg, k.rc, k.err.arg, k.err.message);
            wrong++;
        }
        call_close(&k);
    }
    assert_int_equal(wrong, 0);
}

/* The limits that come from the configuration. */
static void config_limits(void **state)
{
    (void)state;
    pb_config_t cfg = config();
    call_t k;
    /* y is 48 bytes: more than max_message_bytes 47 is refused ... */
    cfg.max_message_bytes = 47;
    call_parse(&k, &cfg, PB_CALL_FORWARD, FD(""));
    assert_int_equal(k.rc, PB_ERESOURCE_EXHAUSTED);
    assert_string_equal(k.err.arg, "max_message_bytes");
    assert_non_null(strstr(k.err.message, "the outputs would take 48 bytes, more than max_message_bytes 47"));
    call_close(&k);
    /* ... 48 fits, and outputs sent into a buffer do not count. */
    cfg.max_message_bytes = 48;
    call_parse(&k, &cfg, PB_CALL_FORWARD, FD(""));
    assert_int_equal(k.rc, 0);
    call_close(&k);
    cfg.max_message_bytes = 0;
    call_parse(&k, &cfg, PB_CALL_FORWARD, FD(", \"into\": {\"y\": {\"buffer\": 1, \"offset\": 0}}"));
    assert_int_equal(k.rc, 0);
    call_close(&k);
    /* The configured device is the default: a daemon told to use a GPU it
     * has not got refuses calls that name no device, and serves those
     * that ask for the CPU. */
    cfg = config();
    cfg.device = (pb_device_t){PB_DEV_CUDA, 0};
    call_parse(&k, &cfg, PB_CALL_FORWARD, FD(""));
    assert_int_equal(k.rc, PB_EDEVICE_UNAVAILABLE);
    assert_string_equal(k.err.arg, "device");
    call_close(&k);
    call_parse(&k, &cfg, PB_CALL_FORWARD, FD(", \"device\": \"cpu\""));
    assert_int_equal(k.rc, 0);
    call_close(&k);
}

static void keys_and_order(void **state)
{
    (void)state;
    static const char *const allowed[] = {"tape", "keep", NULL};
    req_t r;
    pb_err_t err;
    req_open(&r, "{\"tape\": 1, \"keep\": true}");
    assert_int_equal(pb_request_check_keys(&r.params, allowed, &err), 0);
    char order = 0;
    assert_int_equal(pb_request_order(&r.params, &order, &err), 0);
    assert_int_equal(order, 'C');
    req_close(&r);
    req_open(&r, "{\"tape\": 1, \"order\": \"F\"}");
    assert_int_equal(pb_request_check_keys(&r.params, allowed, &err), PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err.message, "unknown key 'order' in params (expected: tape, keep)"));
    assert_int_equal(pb_request_order(&r.params, &order, &err), 0);
    assert_int_equal(order, 'F');
    req_close(&r);
    req_open(&r, "{\"order\": \"c\"}");
    assert_int_equal(pb_request_order(&r.params, &order, &err), PB_EINVALID_ARGUMENT);
    req_close(&r);
    req_open(&r, "{\"accumulate\": true}");
    bool acc = false;
    assert_int_equal(pb_request_accumulate(&r.params, &acc, &err), 0);
    assert_true(acc);
    req_close(&r);
}

static int setup(void **state)
{
    (void)state;
    fake[0] = pb_storage_new(4096, true);
    fake[1] = pb_storage_new(256, true);
    return fake[0] && fake[1] ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    pb_storage_unref(fake[0]);
    pb_storage_unref(fake[1]);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(forward_parses),   cmocka_unit_test(augmented_parses), cmocka_unit_test(check_parses),
        cmocka_unit_test(buffers_and_into), cmocka_unit_test(cotangents),       cmocka_unit_test(refused),
        cmocka_unit_test(config_limits),    cmocka_unit_test(keys_and_order),
    };
    return cmocka_run_group_tests_name("unit.request", tests, setup, teardown);
}
