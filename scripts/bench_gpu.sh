#!/usr/bin/env bash
# Moved to scripts/bench/bench_gpu.sh (scripts/README.md, "Moved"): this old path forwards to it.
echo "note: scripts/bench_gpu.sh moved to scripts/bench/bench_gpu.sh; running it from there" >&2
exec bash "$(dirname "$0")/bench/bench_gpu.sh" "$@"
