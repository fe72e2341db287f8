#!/usr/bin/env bash
# Install what `commitfs bench` and crates/cli/tests/bench_device.rs need
# (Debian packages; run as root). Each system or workload whose tool is missing
# is reported as missing by the bench, never fatal; the emulated device
# (--device emulated:PROFILE) and bench_device.rs need nbdkit, its headers,
# libnbd-bin (nbdfuse) and a C compiler.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq \
    e2fsprogs fuse3 util-linux kmod \
    xfsprogs fuse2fs \
    nbdkit nbdkit-plugin-dev libnbd-bin gcc \
    fsmark dbench postmark \
    fonts-dejavu-core >/dev/null
