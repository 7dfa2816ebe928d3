# Settings of the CPU sample configuration, to be sourced: `source scripts/sample_env.sh`.
# The record's architecture (U-Net, banks, XSA, value embeddings, bigram hash, partial RoPE) at a size a
# laptop CPU trains in minutes, on the offline sample data (data/build_sample_data.py). Anything already
# set in the environment wins. EMA_DECAY is lowered because a 200-step run is far shorter than the
# record's 0.997 averaging horizon.
export DATA_PATH="${DATA_PATH:-./data/datasets/sample_sp1024}"
export TOKENIZER_PATH="${TOKENIZER_PATH:-./data/tokenizers/sample_1024_bpe.model}"
export DEVICE="${DEVICE:-cpu}"
export NUM_LAYERS="${NUM_LAYERS:-6}" MODEL_DIM="${MODEL_DIM:-128}" NUM_HEADS="${NUM_HEADS:-4}"
export NUM_KV_HEADS="${NUM_KV_HEADS:-2}" VE_LAYERS="${VE_LAYERS:-4,5}" XSA_LAST_N="${XSA_LAST_N:-2}"
export TRAIN_SEQ_LEN="${TRAIN_SEQ_LEN:-256}" EVAL_SEQ_LEN="${EVAL_SEQ_LEN:-256}"
export TRAIN_BATCH_TOKENS="${TRAIN_BATCH_TOKENS:-16384}" VAL_BATCH_SIZE="${VAL_BATCH_SIZE:-16384}"
export ITERATIONS="${ITERATIONS:-200}" WARMDOWN_ITERS="${WARMDOWN_ITERS:-80}" WARMUP_STEPS="${WARMUP_STEPS:-2}"
export MAX_WALLCLOCK_SECONDS="${MAX_WALLCLOCK_SECONDS:-0}" VAL_LOSS_EVERY="${VAL_LOSS_EVERY:-50}"
export TRAIN_LOG_EVERY="${TRAIN_LOG_EVERY:-25}" MUON_MOMENTUM_WARMUP_STEPS="${MUON_MOMENTUM_WARMUP_STEPS:-100}"
export EMA_DECAY="${EMA_DECAY:-0.98}"
export TTT_CHUNK_TOKENS="${TTT_CHUNK_TOKENS:-4096}" TTT_BATCH_SEQS="${TTT_BATCH_SEQS:-16}"
