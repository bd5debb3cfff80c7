#!/bin/sh
# Every test of pullbackd: the suites in a normal build, again in an
# ASan+UBSan build, and the unit suite under valgrind.
set -eu
cd "$(dirname "$0")/.."
[ -d build ] || meson setup build
ninja -C build
meson test -C build --print-errorlogs
[ -d build-asan ] || meson setup build-asan -Db_sanitize=address,undefined -Db_lundef=false --buildtype=debug
ninja -C build-asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    meson test -C build-asan --print-errorlogs
# The unit suite once more under valgrind (memcheck), where it is installed.
if command -v valgrind >/dev/null; then
    meson test -C build --suite unit --print-errorlogs \
        --wrap="valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite -q --suppressions=$(pwd)/tests/valgrind.supp"
fi
# libFuzzer over the decoder and request validation (clang), for a bounded
# time: any crash, leak, timeout or out-of-memory fails the run.
if command -v clang >/dev/null; then
    [ -d build-fuzz ] || CC=clang meson setup build-fuzz -Dfuzz=true -Dtests=true \
        -Db_sanitize=address,undefined -Db_lundef=false
    ninja -C build-fuzz tests/fuzz/fuzz_decode
    root=$(pwd)
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    rc=0
    (cd "$work" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
        "$root/build-fuzz/tests/fuzz/fuzz_decode" -max_total_time="${PB_FUZZ_SECONDS:-60}" \
        -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$work" "$root/tests/fuzz/corpus" \
        >"$work/fuzz.log" 2>&1) || rc=$?
    tail -n 25 "$work/fuzz.log"
    [ "$rc" -eq 0 ] || { echo "fuzz_decode failed ($rc)"; exit 1; }
fi
