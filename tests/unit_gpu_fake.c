/* cuda.fake: the GPU backend's host fake keeps its promises (cuda/fake.h),
 * and the GPU op code turns what it injects into the contract's errors.
 *
 * A check that must kill the process (a host read of device memory, a
 * precondition broken) runs in a child, and the test asserts the signal. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "cuda/fake.h"
#include "cuda/gpu.h"
#include "kernels/act.h"
#include "kernels/op.h"

extern const pb_op_t pb_op_fused_dense;

/* Start the fake as spec says, bound to device 0. */
static void fake(const char *spec)
{
    char why[200] = "";
    setenv("PULLBACKD_FAKE_CUDA", spec, 1);
    int n = pb_gpu_init(why, sizeof why);
    if (n < 1)
        fail_msg("PULLBACKD_FAKE_CUDA=%s: %s", spec, why);
    assert_int_equal(pb_gpu->thread_init(0), 0);
}

/* Run fn in a child; the signal that ended it (0: it exited). */
static int in_child(void (*fn)(void))
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* cmocka's handlers would turn the signal into a failed test. */
        const int sigs[] = {SIGABRT, SIGSEGV, SIGBUS, SIGILL, SIGFPE};
        for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++)
            signal(sigs[i], SIG_DFL);
        fn();
        _exit(0);
    }
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    return WIFSIGNALED(st) ? WTERMSIG(st) : 0;
}

static void *block;

static void read_device_memory(void)
{
    volatile char c = *(volatile char *)block;
    (void)c;
}

static void copy_past_the_end(void)
{
    char host[64] = {0};
    pb_gpu->h2d(block, host, 64); /* the block has 16 bytes */
}

static void host_memory_as_device(void)
{
    char host[16] = {0}, other[16] = {0};
    pb_gpu->h2d(host, other, 16);
}

static void device_memory_as_host(void)
{
    pb_gpu->d2h(block, block, 16);
}

static void free_twice(void)
{
    pb_gpu->free(0, block);
    pb_gpu->free(0, block);
}

static void gemm_short_leading_dimension(void)
{
    double one[2] = {1, 0};
    pb_gpu->gemm(1, 'N', 'N', 2, 1, 1, one, block, 1, block, 1, one, block, 2);
}

static void call_from_an_unbound_thread(void)
{
    pb_gpu->thread_fini();
    pb_gpu->zero(block, 16);
}

static void *other_device_block;

static void memory_of_another_device(void)
{
    pb_gpu->zero(other_device_block, 16);
}

static void device_memory_is_apart(void **state)
{
    (void)state;
    fake("devices=2");
    assert_int_equal(pb_gpu->alloc(0, 16, &block), 0);
    assert_int_equal(pb_gpu->alloc(1, 16, &other_device_block), 0);
    assert_int_equal(pb_gpu->used(0), 16);
    /* Within the rules: a round trip. */
    char in[16] = "0123456789abcde", out[16] = {0};
    assert_int_equal(pb_gpu->h2d(block, in, 16), 0);
    assert_int_equal(pb_gpu->d2h(out, block, 16), 0);
    assert_int_equal(pb_gpu->sync(), 0);
    assert_memory_equal(in, out, 16);

    assert_int_equal(in_child(read_device_memory), SIGSEGV);
    assert_int_equal(in_child(copy_past_the_end), SIGABRT);
    assert_int_equal(in_child(host_memory_as_device), SIGABRT);
    assert_int_equal(in_child(device_memory_as_host), SIGABRT);
    assert_int_equal(in_child(free_twice), SIGABRT);
    assert_int_equal(in_child(gemm_short_leading_dimension), SIGABRT);
    assert_int_equal(in_child(call_from_an_unbound_thread), SIGABRT);
    assert_int_equal(in_child(memory_of_another_device), SIGABRT);

    pb_gpu->free(0, block);
    pb_gpu->free(1, other_device_block);
    assert_int_equal(pb_gpu->used(0), 0);
    assert_int_equal(pb_gpu->used(1), 0);
}

static void bad_settings(void **state)
{
    (void)state;
    static const char *const bad[] = {"devices=0", "devices=17", "memory=12X", "color=1", "devices", "memory=",
                                      "sticky_after=-1"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char why[200] = "";
        setenv("PULLBACKD_FAKE_CUDA", bad[i], 1);
        assert_int_equal(pb_gpu_init(why, sizeof why), PB_EINVALID_ARGUMENT);
        assert_non_null(strstr(why, "PULLBACKD_FAKE_CUDA"));
    }
    fake("");
    assert_int_equal(pb_gpu_count(), 1);
    fake("devices=3,memory=2M");
    pb_gpu_info_t info;
    assert_int_equal(pb_gpu->info(2, &info), 0);
    assert_int_equal(info.total_bytes, 2u << 20);
    assert_int_equal(pb_gpu_count(), 3);
}

/* A fused_dense call on cuda:0 of 8×8 f64 with gelu and every gradient. */
static void setup(pb_call_t *c)
{
    memset(c, 0, sizeof *c);
    c->op = &pb_op_fused_dense;
    c->device = (pb_device_t){PB_DEV_CUDA, 0};
    c->dtype = PB_F64;
    c->order = 'C';
    c->taped = true;
    c->wrt = 7;
    c->opt[0].given = true;
    c->opt[0].index = PB_ACT_GELU;
    uint64_t ws[2] = {8, 8}, bs[1] = {8};
    assert_int_equal(pb_tensor_alloc(&c->in[0], PB_F64, 2, ws, 'C', true), 0);
    assert_int_equal(pb_tensor_alloc(&c->in[1], PB_F64, 2, ws, 'F', true), 0);
    assert_int_equal(pb_tensor_alloc(&c->in[2], PB_F64, 1, bs, 'C', true), 0);
    pb_err_t err;
    assert_int_equal(pb_op_fused_dense.validate(c, &err), 0);
}

static void out_of_device_memory(void **state)
{
    (void)state;
    fake("memory=1K"); /* W and x are 512 bytes each */
    pb_call_t c;
    pb_tapedata_t tape;
    pb_err_t err = {0};
    setup(&c);
    assert_int_equal(pb_op_run_forward(&c, &tape, &err), PB_ERESOURCE_EXHAUSTED);
    assert_string_equal(err.arg, "device_memory");
    assert_non_null(strstr(err.message, "cuda:0 is out of memory"));
    assert_null(c.out[0].storage);
    assert_int_equal(pb_gpu->used(0), 0);
    assert_false(pb_gpu->failed(0));
    pb_call_clear(&c);

    fake("memory=4K"); /* enough */
    setup(&c);
    assert_int_equal(pb_op_run_forward(&c, &tape, &err), 0);
    assert_int_equal(pb_gpu->used(0), pb_tapedata_bytes(&tape));
    pb_tapedata_clear(&tape);
    pb_call_clear(&c);
    assert_int_equal(pb_gpu->used(0), 0);
}

static void sticky_error(void **state)
{
    (void)state;
    pb_call_t c;
    pb_tapedata_t tape, late;
    pb_err_t err = {0};
    /* One forward is 6 stream calls (three copies in, the GEMM, the
     * kernel, the copy out): the device fails in the second forward. */
    fake("sticky_after=8");
    setup(&c);
    assert_int_equal(pb_op_run_forward(&c, &tape, &err), 0);
    pb_call_clear(&c);
    setup(&c);
    assert_int_equal(pb_op_run_forward(&c, &late, &err), PB_EDEVICE_UNAVAILABLE);
    assert_string_equal(err.arg, "device");
    assert_non_null(strstr(err.message, "cuda:0 has failed"));
    assert_true(pb_gpu->failed(0));
    pb_call_clear(&c);
    /* It stays failed: allocations, new calls and the first tape's reverse. */
    void *p;
    assert_int_equal(pb_gpu->alloc(0, 8, &p), PB_EDEVICE_UNAVAILABLE);
    setup(&c);
    assert_int_equal(pb_op_run_forward(&c, NULL, &err), PB_EDEVICE_UNAVAILABLE);
    pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
    uint64_t ys[2] = {8, 8};
    assert_int_equal(pb_tensor_alloc(&cot[0], PB_F64, 2, ys, 'C', true), 0);
    pb_warnings_t warn = {0};
    assert_int_equal(pb_op_run_reverse(&tape, cot, grad, 'C', &warn, &err), PB_EDEVICE_UNAVAILABLE);
    for (int i = 0; i < PB_MAX_IO + 2; i++)
        assert_null(grad[i].storage);
    /* The CPU keeps serving. */
    pb_call_clear(&c);
    setup(&c);
    c.device = (pb_device_t){PB_DEV_CPU, 0};
    assert_int_equal(pb_op_run_forward(&c, NULL, &err), 0);
    pb_call_clear(&c);
    /* A failed device's tapes still free. */
    pb_tensor_clear(&cot[0]);
    pb_tapedata_clear(&tape);
    assert_int_equal(pb_gpu->used(0), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(device_memory_is_apart),
        cmocka_unit_test(bad_settings),
        cmocka_unit_test(out_of_device_memory),
        cmocka_unit_test(sticky_error),
    };
    return cmocka_run_group_tests_name("cuda.fake", tests, NULL, NULL);
}
