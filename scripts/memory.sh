#!/usr/bin/env bash
# Peak RSS of the commitfs daemon (issue #11, acceptance 2; docs/ARCHITECTURE.md
# "Memory"): a sequential write of WRITE_GIB GiB, then the creation of FILES empty
# files in directories of 1,000, each on a fresh image mounted with
# `-o cache_size=CACHE_MB`. Prints the daemon's VmHWM for each against the cap.
# Then times LOOKUPS stats of random files of those directories, most of whose
# indexes the cap has evicted (the kernel's dentries dropped first, so each is a
# LOOKUP the daemon answers), again with them cached, and the same stats on the
# kernel's ext4 (the image on a loop device, caches dropped).
# Needs root, FUSE and mkfs.ext4 (scripts/deps.sh); takes a few minutes.
#
#   scripts/memory.sh [CACHE_MB] [WRITE_GIB] [FILES] [LOOKUPS]
#   (defaults: 256 10 1000000 20000)
set -euo pipefail
CACHE_MB=${1:-256}
WRITE_GIB=${2:-10}
FILES=${3:-1000000}
LOOKUPS=${4:-20000}
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${COMMITFS_BIN:-$here/target/release/commitfs}
[ -x "$bin" ] || (cd "$here" && cargo build --release -q)
work=$(mktemp -d /var/tmp/commitfs-memory.XXXXXX)
mnt=$work/mnt
mkdir -p "$mnt"
cleanup() {
    "$bin" umount "$mnt" >/dev/null 2>&1 || true
    umount "$mnt" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

mount_fresh() { # size_gib inodes
    rm -f "$work/img"
    truncate -s "$1G" "$work/img"
    mkfs.ext4 -q -F -N "$2" -O fast_commit "$work/img"
    "$bin" mount -o "cache_size=$CACHE_MB" --pid-file "$work/pid" "$work/img" "$mnt"
    # The serving process is the monitor's child (the sandboxed daemon).
    pid=$(pgrep -P "$(cat "$work/pid")" | head -1)
    pid=${pid:-$(cat "$work/pid")}
}

hwm() { awk '/VmHWM/ {print int($2/1024)}' "/proc/$pid/status"; }

mount_fresh $((WRITE_GIB + 2)) 65536
t0=$(date +%s.%N)
dd if=/dev/zero of="$mnt/big" bs=1M count=$((WRITE_GIB * 1024)) status=none
t1=$(date +%s.%N)
w=$(hwm)
"$bin" umount "$mnt"
echo "sequential write of $WRITE_GIB GiB: peak RSS $w MiB (cap $CACHE_MB MiB), $(awk -v n="$WRITE_GIB" -v a="$t0" -v b="$t1" 'BEGIN {printf "%.0f", n * 1024 / (b - a)}') MiB/s"

mount_fresh 8 $((FILES + FILES / 5 + 1000))
t0=$(date +%s.%N)
python3 - "$mnt" "$FILES" <<'EOF'
import os, sys
root, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    if i % 1000 == 0:
        d = f"{root}/d{i // 1000}"
        os.mkdir(d)
    os.close(os.open(f"{d}/f{i}", os.O_CREAT | os.O_WRONLY, 0o644))
EOF
t1=$(date +%s.%N)
c=$(hwm)
"$bin" stats "$mnt" 2>/dev/null | grep '^metadata caches' || true
echo "creation of $FILES files: peak RSS $c MiB (cap $CACHE_MB MiB), $(awk -v n="$FILES" -v a="$t0" -v b="$t1" 'BEGIN {printf "%.0f", n / (b - a)}') files/s"

# Lookups: us per stat of a random file, its directory's index most likely
# evicted (the first pass), then cached (the second).
lookups() { # label
    sync
    echo 2 > /proc/sys/vm/drop_caches
    python3 - "$mnt" "$FILES" "$LOOKUPS" "$1" <<'EOF'
import os, random, sys, time
root, n, k, label = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = random.Random(1)
picks = [rng.randrange(n) for _ in range(k)]
for rnd in ("first", "again"):
    t = time.perf_counter()
    for i in picks:
        os.stat(f"{root}/d{i // 1000}/f{i}")
    us = (time.perf_counter() - t) * 1e6 / k
    print(f"{label}: {k} lookups of random files, {rnd}: {us:.1f} us each")
EOF
}
lookups "commitfs"
"$bin" stats "$mnt" 2>/dev/null | grep '^metadata caches' || true
c=$(hwm)
echo "after the lookups: peak RSS $c MiB (cap $CACHE_MB MiB)"
"$bin" umount "$mnt"
mount -o loop,ro "$work/img" "$mnt"
echo 3 > /proc/sys/vm/drop_caches
lookups "kernel ext4"
umount "$mnt"
