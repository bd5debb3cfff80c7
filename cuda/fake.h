/* The host fake of the GPU backend (gpu.h): the GPU op code, tape
 * accounting and errors run through it in CI, on machines without a GPU.
 *
 * It is chosen by the environment variable PULLBACKD_FAKE_CUDA, a comma-
 * separated list of settings (any may be left out):
 *   devices=N       devices present (default 1, at most PB_GPU_MAX_DEVICES)
 *   memory=BYTES    each device's memory, with a K, M or G suffix (1024-based;
 *                   default 1G): an allocation past it is PB_ENOMEM
 *   sticky_after=K  the (K+1)-th stream call (copy, GEMM, kernel) on any
 *                   device fails that device with a sticky error, as an
 *                   illegal address would (default: never)
 *   unbindable=D    device D's thread_init fails (its workers cannot bind)
 *   solver_info=K   every solver call (syevd, gesvd) reports info K, as one that
 *                   did not converge (default: the solver's own)
 *   solver_oom=1    every solver call fails for want of device memory for
 *                   its workspace (PB_ENOMEM: the device stays usable)
 * An empty value is "devices=1".  The daemon reads it once at start.
 *
 * What it checks, each by aborting the process with a "fake CUDA:" line
 * on stderr (a test that trips one fails):
 *   - device memory is a mapping the host cannot touch: each allocation is
 *     shared pages mapped twice, PROT_NONE at the address handed out and
 *     read-write at a shadow the fake alone uses; a host dereference of a
 *     device pointer faults;
 *   - every device pointer a call is given lies, with the extent the call
 *     will touch, inside one live allocation of the calling worker's
 *     device, and every host pointer lies outside all of them;
 *   - stream calls come from a thread bound by thread_init;
 *   - BLAS's and cuSOLVER's preconditions: int sizes, leading dimensions
 *     at least the rows, square matrices where a kernel wants one, info
 *     in host memory (the backend copies it back);
 *   - free is given what alloc gave, once.
 * The math is the CPU's: OpenBLAS for GEMMs, LAPACK for the solver,
 * kernels/fused_dense.c's passes and the factorizations' host kernels
 * (kernels/factor_common_t.h) for the kernels. */
#ifndef PB_GPU_FAKE_H
#define PB_GPU_FAKE_H

#include <stddef.h>

#include "gpu.h"

/* Parse spec (PULLBACKD_FAKE_CUDA's value) and reset the fake: the
 * backend, or NULL with why in msg. */
const pb_gpu_backend_t *pb__gpu_fake(const char *spec, char *msg, size_t len);

#endif
