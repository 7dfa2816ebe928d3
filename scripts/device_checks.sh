#!/usr/bin/env bash
# Issue 35's GPU checks in one device call (docs/gpu.md, "Measured on a GPU"): every step under its own time limit,
# the whole inside a 10-minute command, each step's output also written to $OUT (default logs/device_checks/).
#   bash scripts/device_checks.sh                 # on a machine with one CUDA GPU
#   P=record_0430 bash scripts/device_checks.sh   # another preset for the preflight step
# Steps: versions; the CUDA-only tests; PREFLIGHT=1 of one preset compiled at full model shapes on the offline
# CaseOps sample (its report: compile lines, step times, evaluation projection, artifact, peak memory, and how long
# it took); the Triton kernels checked against fp64 and timed; #2135's n-gram hints (ours on CPU and CUDA, the
# record's C); the benchmark's default row against the 2026-03-23 record, in what time is left.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:=logs/device_checks}" "${BUDGET:=585}" "${P:=record_0501}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
stamp versions
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -V
  python3 -c "import inspect, torch, triton, train_gpt as t; v = t.import_torch_varlen(); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'torch_varlen usable:', v is not None, 'gqa:', v and t.varlen_gqa_mode(inspect.signature(v)))"
} 2>&1 | tee "$OUT/env.txt"
stamp cuda_tests
# the varlen test (issue 41): expand and native GQA against the masked path, eager and inductor-compiled
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/test_varlen.py::test_torch_varlen_on_cuda_equals_the_masked_path \
  tests/test_data_path.py::test_copy_stream_batches_equal_plain_under_a_busy_compute_stream \
  tests/test_data_path.py::test_record_stream_keeps_held_batches_intact tests/test_data_path.py::test_pinned_ring_is_reused \
  tests/test_data_path.py::test_cuda_bytecount_equals_cpu_bytecount \
  tests/test_data_path.py::test_copy_stream_failure_comes_after_the_good_batches \
  tests/test_ngram_tilt.py::test_cuda_equals_cpu 2>&1 | tail -25 | tee "$OUT/tests.txt"
stamp "preflight $P"
# PREFLIGHT=1 (issue 36) of the preset at full model shapes on the offline CaseOps sample: every stage once (compile,
# timed steps per training state with their data_wait, GPTQ, the per-group artifact, each evaluation on a slice, LoRA
# TTT, the tilt's hints on the whole stream), its report and how long the rehearsal takes on one GPU. WARMUP_STEPS=2:
# the real 20 warm-up steps of 8 micro-batches took 190.9 s here on one H200 (docs/gpu.md).
S=$(mktemp -d)
python3 data/build_sample_data.py --out-dir "$S" --vocab-size 8192 --caseops --train-shards 2 >/dev/null
timeout 280 env PREFLIGHT=1 PRESET="$P" DATA_PATH="$S/datasets/sample_sp8192_caseops" \
  TOKENIZER_PATH="$S/tokenizers/sample_8192_bpe_caseops.model" WARMUP_STEPS=2 \
  RUN_ID="device_checks_$P" python3 train_gpt.py > "$OUT/preflight_$P.txt" 2>&1
echo "exit $? after $(( $(date +%s) - T0 )) s" >> "$OUT/preflight_$P.txt"
cp preflight.json "$OUT/preflight_$P.json" 2>/dev/null
grep -E "^(compile|warmup_time|eval_warmup|peak memory|error|preflight|step:)|Traceback|^exit" "$OUT/preflight_$P.txt"
stamp kernels
timeout 60 python3 scripts/bench_kernels.py --no-step --reps 10 2>&1 | tail -20 | tee "$OUT/kernels.txt"
stamp ngram
timeout 90 python3 scripts/bench_ngram.py --skip-whole 2>&1 | tail -15 | tee "$OUT/ngram.txt"
stamp bench
L=$(left)
BENCH_ROWS="ours p1c1,record 2026" BENCH_STEPS=12 BENCH_WARMUP=3 BENCH_ROW_TIMEOUT=$(( L / 2 )) BENCH_BUDGET=$L \
  timeout "$L" bash scripts/bench_gpu.sh 2>&1 | tail -30 | tee "$OUT/bench.txt"
cp logs/bench_gpu/table.md "$OUT/" 2>/dev/null
stamp done
