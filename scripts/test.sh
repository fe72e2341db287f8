#!/usr/bin/env bash
# The README's test command. Installs what the tests need (scripts/deps.sh, as
# root), then runs every test binary of the workspace; a failing binary does not
# stop the others (--no-fail-fast), and the exit status says whether all passed.
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh -p commitfs-fs`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
exec cargo test --release --workspace --no-fail-fast "$@"
