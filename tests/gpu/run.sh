#!/bin/sh
# The GPU checks, as one script for a machine with a GPU (the device tool),
# all logs under $OUT; a few minutes.  Prepare on the CPU machine first:
#   tests/gpu/prepare.sh       (builds and packs gpu-carry.tar.xz)
# then on the GPU machine, from the repository root, with that file carried:
#   tests/gpu/run.sh
# Steps, each with a PASS/FAIL/SKIP line here and its log in $OUT:
#   1. nvidia-smi;
#   2. cuda.real: the real backend call by call (tests/gpu/real_backend.c);
#   3. the GPU op code through the host fake, as CI runs it (a check that
#      the carried build works here at all);
#   4. a daemon on the real GPU: the parity sweep of every GPU op against
#      the CPU (tests/gpu/parity.py), GPU memory exported by another
#      process and used in place (tests/gpu/export_client.c), and
#      finite-difference checks through `check` on cuda;
#   5. compute-sanitizer (memcheck, then racecheck) over cuda.real (its
#      cuSOLVER eigensolver and factorization kernels too);
#   6. benchmarks: bench_gpu in process, bench_gpu_socket through the
#      daemon with 8 processes.
# On a machine without a GPU every step but 3 says SKIP and the script
# exits 0: try it there first, so the lent minutes go to the GPU.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$root/gpu-out}
mkdir -p "$OUT"
carry=${PB_GPU_CARRY:-$root/gpu-carry.tar.xz}
work=$(mktemp -d)
trap 'kill "$daemon" 2>/dev/null; rm -rf "$work"' EXIT
daemon=""
if ! tar -xJf "$carry" -C "$work"; then
    echo "FAIL: cannot unpack $carry (run tests/gpu/prepare.sh on the CPU machine and carry it)"
    exit 1
fi
export LD_LIBRARY_PATH="$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PULLBACKD_CUDA_MODULE="$work/cuda/libpullbackd-cuda.so"
export ASAN_OPTIONS=protect_shadow_gap=0
PY=${PYTHON:-python3}
failed=0

# step NAME CMD...: run CMD with its output in $OUT/NAME.log; 77 is SKIP.
step() {
    name=$1
    shift
    start=$(date +%s)
    "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    secs=$(($(date +%s) - start))
    case $rc in
    0) echo "PASS $name (${secs}s)" ;;
    77) echo "SKIP $name: $(tail -n 1 "$OUT/$name.log")" ;;
    *) echo "FAIL $name (exit $rc, ${secs}s): $OUT/$name.log"; tail -n 5 "$OUT/$name.log"; failed=1 ;;
    esac
    return $rc
}

if command -v nvidia-smi >/dev/null; then
    step nvidia-smi nvidia-smi
else
    echo "SKIP nvidia-smi: not found"
fi
gpu=1
step real_backend "$work/tests/gpu_real_backend"
[ $? -eq 77 ] && gpu=0
step fake_fused_dense "$work/tests/unit_fused_dense" cuda
step fake_tensorops "$work/tests/unit_tensorops" cuda
step fake_factor "$work/tests/unit_factor" cuda
step fake_checks "$work/tests/unit_gpu_fake"

if [ $gpu = 1 ]; then
    sock="$work/pullbackd.sock"
    "$work/daemon/pullbackd" --socket "$sock" --log-level info >"$OUT/daemon.log" 2>&1 &
    daemon=$!
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    step parity "$PY" "$root/tests/gpu/parity.py" "$sock"
    step export_client "$work/tests/gpu_export_client" "$sock"
    step fd_checks "$PY" - "$sock" "$root" <<'PYEOF'
import sys
import numpy as np
sys.path.insert(0, sys.argv[2] + "/clients/python")
import pullbackd
rng = np.random.default_rng(5)
bad = 0
with pullbackd.Client(sys.argv[1], timeout=120) as c:
    for dtype, tol in ((np.float64, 1e-6), (np.float32, 1e-2), (np.complex128, 1e-6), (np.complex64, 1e-2)):
        cplx = np.issubdtype(dtype, np.complexfloating)
        A = rng.standard_normal((3, 4, 5)).astype(dtype)
        B = rng.standard_normal((5, 4)).astype(dtype)
        cases = [("tensorcontract", {"A": A, "B": B}, {"spec": "abc,cd->abd"}, ["A", "B", "alpha"]),
                 ("tensoradd", {"A": A}, {"pA": [2, 0, 1]}, ["A", "alpha"]),
                 ("tensortrace", {"A": A[:, :, :3]}, {"p": [1], "q": [[0], [2]]}, ["A", "alpha"])]
        H = rng.standard_normal((6, 6)).astype(dtype) + (1j * rng.standard_normal((6, 6)) if cplx else 0)
        H = ((H + H.conj().T) / 2).astype(dtype)
        cases += [(op, {"A": H}, {"maxrank": 3} if op == "eigh_trunc" else {}, ["A"])
                  for op in ("eigh_full", "eigh_vals", "eigh_trunc")]
        T = rng.standard_normal((7, 4)).astype(dtype) + (1j * rng.standard_normal((7, 4)) if cplx else 0)
        T = T.astype(dtype)
        cases += [(op, {"A": X}, {"maxrank": 2} if op == "svd_trunc" else {}, ["A"])
                  for op in ("svd_compact", "svd_vals", "svd_trunc") for X in (T, T.T.copy())]
        cases += [("left_polar", {"A": T}, {}, ["A"]), ("right_polar", {"A": T.T.copy()}, {}, ["A"])]
        if not cplx:
            cases.append(("fused_dense", {"weight": B.T.copy(), "x": A[0].T.copy(), "bias": B[:4, 0].copy()},
                          {"act": "gelu"}, ["weight", "x", "bias"]))
        for op, inputs, options, wrt in cases:
            r = c.check(op, inputs, wrt=wrt, options=options, device="cuda")
            ok = r["max_rel_err"] <= tol
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} {op} {dtype.__name__}: max_rel_err {r['max_rel_err']:.3g} (<= {tol})")
sys.exit(1 if bad else 0)
PYEOF
    step bench_gpu_socket "$PY" "$root/tests/bench/bench_gpu_socket.py" "$sock" 8
    kill "$daemon" 2>/dev/null
    wait "$daemon" 2>/dev/null
    daemon=""
    if command -v compute-sanitizer >/dev/null; then
        step memcheck compute-sanitizer --tool memcheck --leak-check full --error-exitcode 1 "$work/tests/gpu_real_backend"
        step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 "$work/tests/gpu_real_backend"
    else
        echo "SKIP sanitizer: compute-sanitizer not found"
    fi
    step bench_gpu "$work/tests/bench/bench_gpu"
    cat "$OUT/bench_gpu.log" "$OUT/bench_gpu_socket.log" 2>/dev/null
else
    echo "SKIP the daemon on a GPU, sanitizer and benchmarks: no CUDA device here"
fi
[ $failed = 0 ] && echo "run.sh: every step that ran passed" || echo "run.sh: some steps FAILED"
exit $failed
