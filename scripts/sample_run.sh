#!/usr/bin/env bash
# The main job end to end on CPU with the offline sample data: build the sample (if missing), train a
# scaled-down version of the record's model, write the int6+lzma artifact and run the final evaluations
# (round trip, sliding window, legal TTT). About 6 minutes on 2 CPU cores.
#
# Every setting below is only a default: anything already in the environment wins, e.g.
#   ITERATIONS=50 bash scripts/sample_run.sh
set -euo pipefail
cd "$(dirname "$0")/.."

: "${PYTHON:=python3}"
SAMPLE_DATA=./data/datasets/sample_sp1024
SAMPLE_TOKENIZER=./data/tokenizers/sample_1024_bpe.model
if [ ! -f "$SAMPLE_TOKENIZER" ] || ! ls "$SAMPLE_DATA"/fineweb_val_*.bin >/dev/null 2>&1; then
  "$PYTHON" data/build_sample_data.py
fi

export DATA_PATH="${DATA_PATH:-$SAMPLE_DATA}"
export TOKENIZER_PATH="${TOKENIZER_PATH:-$SAMPLE_TOKENIZER}"
export RUN_ID="${RUN_ID:-sample_cpu_seed${SEED:-1337}}"
export DEVICE="${DEVICE:-cpu}"
# The record's architecture (U-Net, banks, XSA, value embeddings, bigram hash, partial RoPE) at a size
# a laptop CPU trains in minutes.
export NUM_LAYERS="${NUM_LAYERS:-6}" MODEL_DIM="${MODEL_DIM:-128}" NUM_HEADS="${NUM_HEADS:-4}"
export NUM_KV_HEADS="${NUM_KV_HEADS:-2}" VE_LAYERS="${VE_LAYERS:-4,5}" XSA_LAST_N="${XSA_LAST_N:-2}"
export TRAIN_SEQ_LEN="${TRAIN_SEQ_LEN:-256}" EVAL_SEQ_LEN="${EVAL_SEQ_LEN:-256}"
export TRAIN_BATCH_TOKENS="${TRAIN_BATCH_TOKENS:-16384}" VAL_BATCH_SIZE="${VAL_BATCH_SIZE:-16384}"
export ITERATIONS="${ITERATIONS:-250}" WARMDOWN_ITERS="${WARMDOWN_ITERS:-100}" WARMUP_STEPS="${WARMUP_STEPS:-2}"
export MAX_WALLCLOCK_SECONDS="${MAX_WALLCLOCK_SECONDS:-0}" VAL_LOSS_EVERY="${VAL_LOSS_EVERY:-50}"
export TRAIN_LOG_EVERY="${TRAIN_LOG_EVERY:-25}" MUON_MOMENTUM_WARMUP_STEPS="${MUON_MOMENTUM_WARMUP_STEPS:-100}"
export TTT_CHUNK_TOKENS="${TTT_CHUNK_TOKENS:-4096}" TTT_BATCH_SEQS="${TTT_BATCH_SEQS:-16}"

echo "sample run: RUN_ID=$RUN_ID DATA_PATH=$DATA_PATH (log: logs/$RUN_ID.txt)"
exec "$PYTHON" train_gpt.py
