/* The unit programs' "cuda" mode (meson's cuda suite): the same tests of
 * an op, run on cuda:0 of the GPU backend's host fake (cuda/fake.h).
 * A program includes this once, makes its calls on test_dev, and runs
 * its tests with fake_gpu_after as teardown. */
#ifndef PB_TEST_FAKE_GPU_H
#define PB_TEST_FAKE_GPU_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/gpu.h"
#include "kernels/tensor.h"

/* Where the op under test runs: the CPU, or cuda:0 of the fake. */
static pb_device_t test_dev = {PB_DEV_CPU, 0};

/* With the argument "cuda": start the fake, bind this thread to its
 * cuda:0 and make it test_dev.  1 in cuda mode, 0 otherwise; exits when
 * the fake does not start. */
static int fake_gpu_mode(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "cuda") != 0)
        return 0;
    char why[200] = "";
    setenv("PULLBACKD_FAKE_CUDA", "devices=1", 1);
    if (pb_gpu_init(why, sizeof why) != 1 || pb_gpu->thread_init(0)) {
        fprintf(stderr, "the fake GPU did not start: %s\n", why);
        exit(1);
    }
    test_dev = (pb_device_t){PB_DEV_CUDA, 0};
    return 1;
}

/* Teardown: on the GPU, every device byte went back. */
static int fake_gpu_after(void **state)
{
    (void)state;
    if (test_dev.kind == PB_DEV_CUDA && pb_gpu->used(0) != 0) {
        fprintf(stderr, "cuda:0 still holds %zu bytes\n", pb_gpu->used(0));
        return -1;
    }
    return 0;
}

#endif
