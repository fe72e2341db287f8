#!/usr/bin/env bash
# Install everything the tests, the demo and `commitfs bench` drive (Debian
# packages; needs root). Idempotent and quiet: packages already present are
# skipped without touching the network. Called by scripts/test.sh (the README's
# test command) and by .ci/run.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

# Oracles and tools the tests drive: FUSE (fusermount3), mkfs/e2fsck/debugfs,
# losetup/mount, the kernel modules; the emulated-device bench test needs
# nbdkit, its plugin headers, nbdfuse and a C compiler; the bench workloads;
# python3 holds a lock from a second process in crates/device/tests/exclusive.rs.
pkgs=(
    e2fsprogs fuse3 util-linux mount kmod pkg-config python3
    nbdkit nbdkit-plugin-dev libnbd-bin gcc
    xfsprogs fuse2fs fsmark dbench postmark fonts-dejavu-core
)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "deps: missing packages (${missing[*]}); run as root to install them" >&2
        exit 1
    fi
    echo "deps: installing ${missing[*]}" >&2
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Kernel pieces the tests use as oracles: loop devices, ext4, FUSE.
modprobe loop 2>/dev/null || true
modprobe fuse 2>/dev/null || true
[ -e /dev/fuse ] || { echo "deps: /dev/fuse missing (FUSE kernel module)" >&2; exit 1; }
