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
        --wrap='valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite -q'
fi
