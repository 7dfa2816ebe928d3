#!/usr/bin/env bash
# CPU evidence for the 2026-04-09 record's toggles: the CPU sample configuration (scripts/run/sample_env.sh, offline
# sample data, NOT FineWeb) trained for the same wall-clock budget with each toggle alone, with the whole
# PRESET=record_0409 scaled down to 6 layers (vocab 1024 and the vocab-8192 sample), and with the default (both
# vocabularies: the 8192 sample's validation text is not the 1024 sample's, so compare bpb within a vocabulary),
# and PRESET=record_0427 / record_0430 scaled the same way on the CaseOps sample (build_sample_data.py --vocab-size
# 8192 --caseops: CaseOps sample data, NOT FineWeb, a third validation text) beside the default on that sample.
# Prints one markdown table; logs go to logs/frontier_<variant>.txt, artifacts to runs/frontier_<variant>/ (a rerun
# replaces them: OVERWRITE_RUN=1).
#
#   bash scripts/bench/compare_frontier.sh                  # every variant, 90 s of training each
#   SECONDS_PER_RUN=60 VARIANTS="default loops" bash scripts/bench/compare_frontier.sh
#   STEPS=60 bash scripts/bench/compare_frontier.sh         # equal steps instead (no time cap; sample_env's schedule)
#
# Runs one after another (never in parallel: equal time means equal CPU). TTT is off (sliding window only);
# the 6-layer analogues of the record's layer choices are LOOP_START=2 LOOP_END=3, PARALLEL_RESIDUAL_START=4.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${PYTHON:=python3}" "${SECONDS_PER_RUN:=90}" "${STEPS:=0}"
ALL="default loops parallel skip_gates no_extras qk525 muon_eq_r polar_express warmdown_frac min_lr embed_wd"
ALL="$ALL preset_1024 default_8192 preset_8192 default_caseops preset_0427 preset_0430"
: "${VARIANTS:=$ALL}"

variant_env() {  # the settings of one variant, as KEY=VALUE words
  local loops="NUM_LOOPS=2 LOOP_START=2 LOOP_END=3 ENABLE_LOOPING_AT=0.35"
  # the preset, scaled to the sample model: 6-layer analogues, a GPTQ reserve and calibration scaled to the budget
  local preset="PRESET=record_0409 LOOP_START=2 LOOP_END=3 PARALLEL_RESIDUAL_START=4 XSA_LAST_N=6 WARMDOWN_ITERS=0"
  preset="$preset GPTQ_CALIBRATION_BATCHES=4 GPTQ_RESERVE_SECONDS=$("$PYTHON" -c "print($SECONDS_PER_RUN * 12 / 600)")"
  local sp8192="DATA_PATH=./data/datasets/sample_sp8192 TOKENIZER_PATH=./data/tokenizers/sample_8192_bpe.model"
  local caseops="DATA_PATH=./data/datasets/sample_sp8192_caseops VOCAB_SIZE=8192"
  caseops="$caseops TOKENIZER_PATH=./data/tokenizers/sample_8192_bpe_caseops.model"
  # the 04-27 / 04-30 presets the same way: lanes from layer 4 (8 of 11), the record's calibration windows, their
  # GPTQ reserve scaled to the budget; #2014's context schedule 1024/2048/3072 as thirds of the sample's 256
  local newest="LOOP_START=2 LOOP_END=3 PARALLEL_RESIDUAL_START=4 XSA_LAST_N=6 WARMDOWN_ITERS=0 GPTQ_CALIBRATION_BATCHES=4"
  case "$1" in
    default) echo "" ;;
    loops) echo "$loops" ;;
    parallel) echo "PARALLEL_RESIDUAL_START=4" ;;
    skip_gates) echo "SKIP_GATES=1" ;;
    no_extras) echo "BIGRAM_VOCAB_SIZE=0 VE_ENABLED=0 SMEAR_GATE=0" ;;
    qk525) echo "QK_GAIN_INIT=5.25" ;;
    muon_eq_r) echo "MUON_ROW_NORMALIZE=1" ;;
    polar_express) echo "MUON_NS_COEFFS=polar_express" ;;
    warmdown_frac) echo "WARMDOWN_ITERS=0 WARMDOWN_FRAC=0.72" ;;
    min_lr) echo "WARMDOWN_ITERS=0 WARMDOWN_FRAC=0.72 MIN_LR=0.1" ;;
    embed_wd) echo "EMBED_WD=0.085" ;;
    preset_1024) echo "$preset VOCAB_SIZE=1024" ;;
    default_8192) echo "VOCAB_SIZE=8192 $sp8192" ;;
    preset_8192) echo "$preset $sp8192" ;;
    default_caseops) echo "$caseops" ;;
    preset_0427) echo "PRESET=record_0427 $newest GPTQ_RESERVE_SECONDS=$("$PYTHON" -c "print($SECONDS_PER_RUN * 0.5 / 600)") $caseops" ;;
    preset_0430) echo "PRESET=record_0430 $newest GPTQ_RESERVE_SECONDS=$("$PYTHON" -c "print($SECONDS_PER_RUN * 4 / 600)") EVAL_STRIDE=64 TRAIN_SEQ_LEN_SCHEDULE=85@0,171@0.1,256@0.7 $caseops" ;;
    *) echo "scripts/bench/compare_frontier.sh: unknown variant '$1' (choose from: $ALL)" >&2; return 1 ;;
  esac
}

for v in $VARIANTS; do variant_env "$v" >/dev/null || exit 2; done
[ -f data/tokenizers/sample_1024_bpe.model ] || "$PYTHON" data/build_sample_data.py >/dev/null
if [[ " $VARIANTS " == *_8192* ]] && [ ! -f data/tokenizers/sample_8192_bpe.model ]; then
  "$PYTHON" data/build_sample_data.py --vocab-size 8192 >/dev/null
fi
if [[ " $VARIANTS " == *caseops* || " $VARIANTS " == *preset_04* ]] && [ ! -f data/tokenizers/sample_8192_bpe_caseops.model ]; then
  "$PYTHON" data/build_sample_data.py --vocab-size 8192 --caseops >/dev/null
fi

rows=()
for v in $VARIANTS; do
  settings=$(variant_env "$v")
  echo "== $v: ${settings:-(defaults)}" >&2
  (
    if (( STEPS > 0 )); then
      export ITERATIONS="$STEPS" && source scripts/run/sample_env.sh  # its schedule for STEPS steps, no time cap
    else
      export ITERATIONS=100000 && source scripts/run/sample_env.sh
      # the schedule of a 200-step sample run, timed against the budget instead of a step count
      export WARMDOWN_ITERS=80 MUON_MOMENTUM_WARMUP_STEPS=100 EMA_DECAY=0.98 MAX_WALLCLOCK_SECONDS="$SECONDS_PER_RUN"
    fi
    export VAL_LOSS_EVERY=0 TRAIN_LOG_EVERY=50 TTT_ENABLED=0 RUN_ID="frontier_$v" OVERWRITE_RUN=1
    for kv in $settings; do export "${kv?}"; done
    "$PYTHON" train_gpt.py >/dev/null
  ) || { echo "scripts/bench/compare_frontier.sh: variant $v failed (log: logs/frontier_$v.txt)" >&2; exit 1; }
  rows+=("$v|$settings")
done

"$PYTHON" - "${rows[@]}" <<'PY'
import re, sys
print("| variant | settings | steps | step_avg ms | post-EMA val_bpb | int6 round trip | sliding (stride 64) | artifact bytes |")
print("|---|---|---|---|---|---|---|---|")
for row in sys.argv[1:]:
    name, settings = row.split("|", 1)
    log = open(f"logs/frontier_{name}.txt", encoding="utf-8").read()
    log = log[log.index("\nRunning Python"):]
    last = re.findall(r"^step:(\d+)/\d+ val_loss:\S+ val_bpb:\S+ train_time:(\d+)ms step_avg:(\S+)ms", log, re.M)[-1]
    post = re.search(r"^DIAGNOSTIC post_ema val_loss:\S+ val_bpb:(\S+)", log, re.M).group(1)
    rt = re.search(r"^final_int6_roundtrip_exact val_loss:\S+ val_bpb:(\S+)", log, re.M).group(1)
    sw = re.search(r"^final_int6_sliding_window_exact val_loss:\S+ val_bpb:(\S+)", log, re.M).group(1)
    size = re.search(r"^Serialized model int6\+\w+: (\d+) bytes", log, re.M).group(1)
    shown = " ".join(s for s in settings.split() if not s.startswith(("DATA_PATH", "TOKENIZER_PATH")))
    shown += " (CaseOps sample)" if "caseops" in settings else ""
    print(f"| {name} | {shown or '-'} | {last[0]} | {last[2]} | {float(post):.4f} | {float(rt):.4f} | "
          f"{float(sw):.4f} | {int(size):,} |")
PY
