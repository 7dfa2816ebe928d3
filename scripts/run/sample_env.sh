# Settings of the CPU sample configuration, to be sourced: `source scripts/run/sample_env.sh`.
# The record's architecture (U-Net, banks, XSA, value embeddings, bigram hash, partial RoPE) at a size a
# laptop CPU trains in minutes, on the offline sample data (data/build_sample_data.py). Anything already
# set in the environment wins.
#
# The schedule follows ITERATIONS (default 200), so a shorter or longer run keeps the same shape. Unless
# set explicitly, these are derived from it (fractions rounded down, each at least 1):
#   WARMDOWN_ITERS              40% of the run            (80 at 200 steps)
#   MUON_MOMENTUM_WARMUP_STEPS  50%                       (100)
#   VAL_LOSS_EVERY              25%                       (50)
#   TRAIN_LOG_EVERY             12.5%                     (25)
#   EMA_DECAY                   1 - 4/ITERATIONS, kept within [0.9, 0.997]   (0.98)
# The EMA's averaging horizon 1/(1 - decay) is then a quarter of the run (50 steps at 200), where the
# record's 0.997 (a 333-step horizon) would leave a short run's EMA close to its initial weights.
#
# TRAIN_BATCH_TOKENS=8192, 32 sequences of 256 a step: the sample learns by its steps more than by its batch (measured
# 2026-11-29 on a 2-core EPYC, bf16, the last legal_ttt val_bpb: 200 steps of 8,192 tokens 1.709, 100 of 16,384 1.776,
# 150 of 8,192 1.785, 200 of 4,096 1.843; the old 200 of 16,384 scored 1.621 on another EPYC), and half the batch
# halves the quick start's training.
#
# GRAD_ACCUM_STEPS=1: the fewest micro-steps, the whole 8,192-token batch in one (a CPU's memory holds it many times
# over). The record's 8 micro-steps a step (8 over the ranks) were for an H100's memory; the sample's step takes the
# same tokens in one micro-batch, summed in another order, and the log's start says so (a `grad_accum:` line). The
# default run and the presets keep the record's split: their faith to the records' scripts is at 8 micro-steps.
export ITERATIONS="${ITERATIONS:-200}"
if [[ ! "$ITERATIONS" =~ ^[0-9]{1,9}$ ]] || (( 10#$ITERATIONS < 1 )); then
  echo "scripts/run/sample_env.sh: ITERATIONS=$ITERATIONS must be a whole number of steps from 1 to 999999999" >&2
  return 1 2>/dev/null || exit 1
fi
ITERATIONS=$(( 10#$ITERATIONS ))  # "050" -> 50 (bash would read a leading zero as octal)

_sample_n=$ITERATIONS
_sample_warmdown=$(( _sample_n * 2 / 5 ))
_sample_momentum=$(( _sample_n / 2 ))
_sample_val=$(( _sample_n / 4 ))
_sample_log=$(( _sample_n / 8 ))
# EMA decay in millionths, so it stays integer arithmetic: 1e6 - 4e6/n, clamped to [900000, 997000].
_sample_ema=$(( 1000000 - 4000000 / _sample_n ))
_sample_ema=$(( _sample_ema < 900000 ? 900000 : (_sample_ema > 997000 ? 997000 : _sample_ema) ))
_sample_ema=$(printf '0.%06d' "$_sample_ema")
while [[ "$_sample_ema" == *0 ]]; do _sample_ema=${_sample_ema%0}; done  # 0.980000 -> 0.98

export DATA_PATH="${DATA_PATH:-./data/datasets/sample_sp1024}"
export TOKENIZER_PATH="${TOKENIZER_PATH:-./data/tokenizers/sample_1024_bpe.model}"
export DEVICE="${DEVICE:-cpu}"
export NUM_LAYERS="${NUM_LAYERS:-6}" MODEL_DIM="${MODEL_DIM:-128}" NUM_HEADS="${NUM_HEADS:-4}"
export NUM_KV_HEADS="${NUM_KV_HEADS:-2}" VE_LAYERS="${VE_LAYERS:-4,5}" XSA_LAST_N="${XSA_LAST_N:-2}"
export TRAIN_SEQ_LEN="${TRAIN_SEQ_LEN:-256}" EVAL_SEQ_LEN="${EVAL_SEQ_LEN:-256}"
export TRAIN_BATCH_TOKENS="${TRAIN_BATCH_TOKENS:-8192}" VAL_BATCH_SIZE="${VAL_BATCH_SIZE:-16384}"
export GRAD_ACCUM_STEPS="${GRAD_ACCUM_STEPS:-1}"
export WARMUP_STEPS="${WARMUP_STEPS:-2}" MAX_WALLCLOCK_SECONDS="${MAX_WALLCLOCK_SECONDS:-0}"
export WARMDOWN_ITERS="${WARMDOWN_ITERS:-$(( _sample_warmdown < 1 ? 1 : _sample_warmdown ))}"
export MUON_MOMENTUM_WARMUP_STEPS="${MUON_MOMENTUM_WARMUP_STEPS:-$(( _sample_momentum < 1 ? 1 : _sample_momentum ))}"
export VAL_LOSS_EVERY="${VAL_LOSS_EVERY:-$(( _sample_val < 1 ? 1 : _sample_val ))}"
export TRAIN_LOG_EVERY="${TRAIN_LOG_EVERY:-$(( _sample_log < 1 ? 1 : _sample_log ))}"
export EMA_DECAY="${EMA_DECAY:-$_sample_ema}"
export TTT_CHUNK_TOKENS="${TTT_CHUNK_TOKENS:-4096}" TTT_BATCH_SEQS="${TTT_BATCH_SEQS:-16}"
unset _sample_n _sample_warmdown _sample_momentum _sample_val _sample_log _sample_ema
