#!/usr/bin/env bash
# Run every cargo-fuzz target of fuzz/ briefly: scripts/fuzz.sh [SECONDS] [TARGET...]
#
# SECONDS per target (default 20). Needs a nightly toolchain and cargo-fuzz
# (`rustup toolchain install nightly`, `cargo install cargo-fuzz`); without them
# it says so and exits 2. The stable, CI-run counterpart is
# crates/format/tests/parse_any.rs (same properties, fuzz/src/props.rs).
#
# Seeds: the first run (or COMMITFS_FUZZ_RESEED=1) cuts real structures out of
# mkfs.ext4 images (1 KiB and 4 KiB blocks, with files, a deep extent tree, an htree
# directory with index nodes, xattrs, the journal) into fuzz/seeds/<target>/ by
# running parse_any's seed test with COMMITFS_FUZZ_SEED_DIR set. libFuzzer then
# grows fuzz/corpus/<target>/ from them. Crashes land in fuzz/artifacts/<target>/;
# the script exits 1 if any target found one.
#
# mount_ops mounts mutated images in memory and runs a fixed op mix
# (commitfs_fs::fuzzing); it needs no seeds (its templates are made with mkfs.ext4)
# and runs with a 64 MiB cap on single allocations. Without nightly, a long stable
# run of the same case: scripts/fuzz.sh stable [CASES] [FIRST_SEED]
# (crates/fs/tests/fuzz_mount.rs, deterministic seeds).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ "${1:-}" = stable ]; then
    COMMITFS_FUZZ_CASES=${2:-100000} COMMITFS_FUZZ_SEED=${3:-1} \
        exec cargo test --release -p commitfs-fs --test fuzz_mount -- --nocapture
fi
SECS=${1:-20}
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
    TARGETS=(superblock group_desc inode extent dir xattr jbd2 mount_ops)
fi

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "fuzz.sh: no nightly toolchain (rustup toolchain install nightly)" >&2
    exit 2
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: cargo-fuzz missing (cargo install cargo-fuzz)" >&2
    exit 2
fi

SEEDS=$ROOT/fuzz/seeds
if [ ! -d "$SEEDS" ] || [ "${COMMITFS_FUZZ_RESEED:-0}" = 1 ]; then
    echo "== generating seeds from mkfs.ext4 images into fuzz/seeds"
    rm -rf "$SEEDS"
    if ! COMMITFS_FUZZ_SEED_DIR=$SEEDS cargo test -q -p commitfs-format --test parse_any \
        real_structures_parse_and_round_trip >/dev/null 2>&1; then
        # The seed test writes the seeds before checking them: carry on if it did.
        echo "fuzz.sh: note: the seed test failed (run it to see why)" >&2
    fi
    if [ ! -d "$SEEDS" ]; then
        echo "fuzz.sh: seed generation failed" >&2
        exit 2
    fi
fi

cd "$ROOT/fuzz"
# -a: debug assertions and overflow checks on, so arithmetic overflows are found too.
echo "== building fuzz targets"
cargo +nightly fuzz build -a >/dev/null 2>&1 || cargo +nightly fuzz build -a || exit 2

failed=()
for t in "${TARGETS[@]}"; do
    mkdir -p "corpus/$t" "artifacts/$t"
    echo "== $t (${SECS}s)"
    log=$(mktemp)
    extra=()
    if [ "$t" = mount_ops ]; then
        mkdir -p "$SEEDS/$t"
        extra=(-malloc_limit_mb=64 -max_len=400)
    fi
    cargo +nightly fuzz run -a "$t" "corpus/$t" "$SEEDS/$t" -- \
        -max_total_time="$SECS" -max_len=70000 -timeout=10 -rss_limit_mb=4096 "${extra[@]}" \
        -print_final_stats=1 >"$log" 2>&1
    rc=$?
    grep -E "^Done|stat::number_of_executed_units|cov:" "$log" | tail -2
    if [ $rc -ne 0 ]; then
        echo "!! $t: crash (exit $rc); output tail:"
        grep -E "panicked|assert|left:|right:|Test unit written" "$log" | head -12
        failed+=("$t")
    fi
    rm -f "$log"
done

if [ ${#failed[@]} -ne 0 ]; then
    echo "fuzz.sh: crashes in: ${failed[*]} (inputs in fuzz/artifacts/)"
    exit 1
fi
echo "fuzz.sh: all ${#TARGETS[@]} targets ran ${SECS}s without a crash"
