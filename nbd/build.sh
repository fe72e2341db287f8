#!/usr/bin/env bash
# Build our nbdkit filter (the emulated device's latency model) against the
# system's nbdkit headers: nbd/build.sh [OUTPUT.so]
# Default output: target/nbd/nbdkit-commitfs-latency-filter.so.
# Needs: cc, nbdkit-plugin-dev (headers); nbdkit itself to run it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-target/nbd/nbdkit-commitfs-latency-filter.so}
if [ ! -f /usr/include/nbdkit-filter.h ]; then
    echo "nbd/build.sh: /usr/include/nbdkit-filter.h missing (apt-get install nbdkit-plugin-dev)" >&2
    exit 2
fi
mkdir -p "$(dirname "$OUT")"
cc -std=gnu11 -O2 -g -fPIC -shared -Wall -Wextra -Wno-unused-parameter -Werror \
    -o "$OUT.tmp" nbd/commitfs-latency-filter.c -lpthread
mv "$OUT.tmp" "$OUT"
echo "$OUT"
