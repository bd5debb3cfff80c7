#!/bin/sh
# Every test of pullbackd: the suites in a normal build, again in an
# ASan+UBSan build, the daemon's suites in a TSan build, the unit suite
# under valgrind, and libFuzzer over the decoder for PB_FUZZ_SECONDS
# (default 60; 0 skips it).  A stage that cannot
# run here says so on a line of its own, "SKIPPED: <stage>: <why>", and the
# skipped stages are listed again at the end: a missing tool never passes
# silently.  .ci/packages installs everything every stage needs.
set -eu
cd "$(dirname "$0")/.."
skipped=""
skip() {
    echo "SKIPPED: $1: $2"
    skipped="$skipped
SKIPPED: $1: $2"
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# meson test, and each test in it that skipped itself (exit 77: no GPU,
# no root, no systemd tools) named as a skipped stage.
suite() {
    stage=$1
    shift
    rc=0
    meson test "$@" 2>&1 | tee "$work/meson.log" || rc=$?
    # tee hides meson's status: read it from the summary instead.
    grep -q '^Fail: *0 *$' "$work/meson.log" && grep -q '^Timeout: *0 *$' "$work/meson.log" || rc=1
    for t in $(awk '$0 ~ / SKIP / { for (i = 1; i <= NF; i++) if ($i == "SKIP") print $(i - 1) }' "$work/meson.log"); do
        skip "$stage: $t" "the test skipped itself (exit 77); its log in meson-logs says why"
    done
    return $rc
}

# 1. The suites in the normal build.
[ -d build ] || meson setup build
ninja -C build
suite tests -C build --print-errorlogs

# 2. Again under AddressSanitizer and UndefinedBehaviorSanitizer.
[ -d build-asan ] || meson setup build-asan -Db_sanitize=address,undefined -Db_lundef=false --buildtype=debug
ninja -C build-asan
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
suite asan -C build-asan --print-errorlogs
unset ASAN_OPTIONS UBSAN_OPTIONS

# 3. The daemon under ThreadSanitizer, driven from outside by the suites
# that load it (many connections, workers and their idle helpers, reloads,
# drains), and the thread pool's own unit tests.  Unit tests that run
# OpenBLAS's threads stay out: TSan cannot see their uninstrumented
# synchronisation and reports it as races.  Tests that bound the daemon's
# resident memory do not enforce it here (TSan's shadow memory).
[ -d build-tsan ] || meson setup build-tsan -Db_sanitize=thread -Db_lundef=false
ninja -C build-tsan
export TSAN_OPTIONS="halt_on_error=1 handle_sigbus=0 second_deadlock_stack=1"
suite tsan -C build-tsan --suite e2e --suite load --suite python --print-errorlogs
suite tsan -C build-tsan unit.pool unit.offloop unit.conn_budget python.gpu cuda.fake --print-errorlogs
unset TSAN_OPTIONS

# 4. The unit suite once more under valgrind (memcheck).
if command -v valgrind >/dev/null; then
    suite valgrind -C build --suite unit --print-errorlogs \
        --wrap="valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite -q --suppressions=$(pwd)/tests/valgrind.supp"
else
    skip valgrind "valgrind is not installed (Debian: apt-get install valgrind)"
fi

# 5. libFuzzer over the decoder and request validation, for a bounded time:
# any crash, leak, timeout or out-of-memory fails the run.  Needs clang and
# its libFuzzer runtime (Debian 12: clang, libclang-rt-14-dev).
fuzz_seconds=${PB_FUZZ_SECONDS:-60}
if [ "$fuzz_seconds" = 0 ]; then
    skip fuzz "PB_FUZZ_SECONDS=0"
elif ! command -v clang >/dev/null; then
    skip fuzz "clang is not installed (Debian: apt-get install clang libclang-rt-14-dev)"
elif ! printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' \
        >"$work/probe.c" ||
     ! clang -fsanitize=fuzzer,address "$work/probe.c" -o "$work/probe" 2>"$work/probe.log"; then
    skip fuzz "clang cannot link -fsanitize=fuzzer (Debian: apt-get install libclang-rt-14-dev): $(head -n 1 "$work/probe.log")"
else
    [ -d build-fuzz ] || CC=clang meson setup build-fuzz -Dfuzz=true -Dtests=true \
        -Db_sanitize=address,undefined -Db_lundef=false
    ninja -C build-fuzz tests/fuzz/fuzz_decode
    root=$(pwd)
    rc=0
    mkdir "$work/corpus"
    (cd "$work" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
        "$root/build-fuzz/tests/fuzz/fuzz_decode" -max_total_time="$fuzz_seconds" \
        -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$work/corpus" "$root/tests/fuzz/corpus" \
        >"$work/fuzz.log" 2>&1) || rc=$?
    tail -n 25 "$work/fuzz.log"
    [ "$rc" -eq 0 ] || { echo "fuzz_decode failed ($rc)"; exit 1; }
fi

if [ -n "$skipped" ]; then
    echo "run_all: passed, with stages skipped:$skipped"
else
    echo "run_all: every stage ran and passed"
fi
