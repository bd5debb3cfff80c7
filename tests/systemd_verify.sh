#!/bin/sh
# e2e.systemd_verify: the systemd units as meson installs them pass
# `systemd-analyze verify` with nothing to say, and the sysusers.d entry
# they rely on parses.  Skips (77) where systemd's tools are missing.
#
# Usage: systemd_verify.sh SERVICE SOCKET SYSUSERS PULLBACKD BINDIR
#   SERVICE   the generated pullbackd.service (ExecStart under BINDIR)
#   PULLBACKD the binary of this build
#
# verify checks that ExecStart's binary exists, and the installed path
# (BINDIR/pullbackd) need not exist on a build machine.  So the unit
# verified is a copy with only that path swapped for this build's binary;
# every other line is the unit that gets installed.  verify exits 0 even
# for unknown keys and values it cannot parse (it only warns), so any
# output at all fails the test.
set -eu
if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "systemd-analyze not found (package systemd): skipped"
    exit 77
fi
service=$1 socket=$2 sysusers=$3 bin=$4 bindir=$5
# meson passes the binary relative to the build directory.
case "$bin" in /*) ;; *) bin="$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")" ;; esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! grep -qx "ExecStart=$bindir/pullbackd" "$service"; then
    echo "FAIL: $service does not run $bindir/pullbackd:"
    grep '^ExecStart' "$service" || true
    exit 1
fi
sed "s|^ExecStart=$bindir/pullbackd\$|ExecStart=$bin|" "$service" >"$work/pullbackd.service"
cp "$socket" "$work/pullbackd.socket"

# What the issue asks of the units, in case an edit drops it.
fail=0
for want in 'Type=notify' 'WatchdogSec=' 'ExecReload=' 'ProtectSystem=strict' 'ProtectHome=yes' \
    'PrivateTmp=yes' 'NoNewPrivileges=yes' 'RuntimeDirectory=pullbackd' 'DevicePolicy=closed' \
    'DeviceAllow=char-nvidiactl' 'DeviceAllow=char-nvidia-frontend' 'DeviceAllow=char-nvidia-uvm' \
    'DeviceAllow=char-nvidia-caps' 'DeviceAllow=char-nvidia ' 'LimitNOFILE=' 'RestrictAddressFamilies=AF_UNIX' \
    'PrivateNetwork=yes' 'CapabilityBoundingSet=$' 'RestrictNamespaces=yes' 'RestrictSUIDSGID=yes' \
    'ProtectClock=yes' 'ProtectKernelLogs=yes' 'ProtectHostname=yes' 'SystemCallFilter=@system-service' \
    'UMask=0077'; do
    grep -q "^$want" "$work/pullbackd.service" || { echo "FAIL: pullbackd.service lacks $want"; fail=1; }
done
if grep -q '^PrivateDevices=' "$work/pullbackd.service"; then
    echo "FAIL: PrivateDevices= would hide the GPUs"
    fail=1
fi
for want in 'ListenStream=/run/pullbackd/pullbackd.sock' 'SocketMode=0660' 'SocketGroup=pullback'; do
    grep -qx "$want" "$work/pullbackd.socket" || { echo "FAIL: pullbackd.socket lacks $want"; fail=1; }
done

out=$(systemd-analyze verify --man=no "$work/pullbackd.socket" "$work/pullbackd.service" 2>&1) || {
    echo "FAIL: systemd-analyze verify exited $?"
    fail=1
}
if [ -n "$out" ]; then
    echo "FAIL: systemd-analyze verify has something to say:"
    echo "$out"
    fail=1
fi

if command -v systemd-sysusers >/dev/null 2>&1; then
    mkdir -p "$work/root/etc"
    if ! systemd-sysusers --root="$work/root" --dry-run "$sysusers" >"$work/sysusers.log" 2>&1; then
        echo "FAIL: systemd-sysusers rejects $sysusers:"
        cat "$work/sysusers.log"
        fail=1
    fi
fi
[ "$fail" -eq 0 ] && echo "units verified: pullbackd.service, pullbackd.socket, sysusers entry"
exit "$fail"
