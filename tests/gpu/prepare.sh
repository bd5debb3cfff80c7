#!/bin/sh
# Build, on this CPU machine, what tests/gpu/run.sh runs on a GPU machine,
# and pack it with the Debian libraries it loads into gpu-carry.tar.xz at
# the repository root (git-ignored): the GPU machine has the CUDA image but
# none of our Debian libraries (../shared/CUDA.md).  Carry that one file
# (the device tool's carry), then run tests/gpu/run.sh there.
#
# The build is build-gpu (release, -Dcuda=enabled, gpu_arch as configured:
# 90 by default, H100 and H200).  glibc's and the C++ runtime's libraries
# stay behind: the image's are newer (its CUDA libraries need them) and
# run what Debian 12 built.
set -eu
cd "$(dirname "$0")/../.."
[ -d build-gpu ] || meson setup build-gpu --buildtype=release -Dcuda=enabled
targets="daemon/pullbackd cuda/libpullbackd-cuda.so tests/gpu_real_backend tests/unit_fused_dense \
tests/unit_tensorops tests/unit_factor tests/unit_gpu_fake tests/bench/bench_gpu tests/gpu_export_client"
# shellcheck disable=SC2086
ninja -C build-gpu $targets
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib"
for t in $targets; do
    mkdir -p "$stage/$(dirname "$t")"
    cp "build-gpu/$t" "$stage/$t"
    # The libraries it loads from Debian, not glibc's and not CUDA's.
    ldd "build-gpu/$t" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' |
        grep -v -E '/(libc|libm|libmvec|libpthread|libdl|librt|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so|/usr/local/cuda' |
        while read -r lib; do cp -L -n "$lib" "$stage/lib/"; done
done
tar -cJf gpu-carry.tar.xz -C "$stage" .
echo "gpu-carry.tar.xz: $(du -h gpu-carry.tar.xz | cut -f1); carry it and run tests/gpu/run.sh on the GPU machine"
