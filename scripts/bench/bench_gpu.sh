#!/usr/bin/env bash
# One-command benchmark on one CUDA GPU (docs/gpu.md, "GPU benchmark"): builds the offline sample data at the record's
# shapes, times every row in its own process under a time limit and prints one table (also written to
# $BENCH_DIR/table.md, default logs/bench_gpu/). Without CUDA, or with BENCH_TINY=1, the same pipeline runs at
# tiny shapes on CPU in under a minute (tests/test_bench_gpu.py).
#
#   bash scripts/bench/bench_gpu.sh
#   BENCH_ROWS="ours p1c1,record" BENCH_STEPS=50 bash scripts/bench/bench_gpu.sh   # a subset, more steps
#   BENCH_ROWS="race record_0501 loop off" BENCH_STEPS=12 BENCH_WARMUP=2 bash scripts/bench/bench_gpu.sh   # a preset
#     against its record's own script (scripts/bench/bench_record.py, scripts/record/record_shim; docs/gpu.md)
#
# Settings (all optional): BENCH_TINY, BENCH_STEPS, BENCH_WARMUP, BENCH_ROW_TIMEOUT (s per row), BENCH_BUDGET (s for
# the whole run: rows that would start later are reported as skipped), BENCH_VAL_TOKENS, BENCH_ROWS, BENCH_DIR,
# BENCH_ANCHORS (the records' files; default shared/anchors in the checkout, else ../shared/anchors).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${PYTHON:=python3}"
exec "$PYTHON" scripts/bench/bench_gpu.py "$@"
