#!/usr/bin/env bash
# Kept for old instructions: everything is installed by scripts/deps.sh.
exec bash "$(dirname "$0")/deps.sh"
