#!/usr/bin/env bash
# The main job end to end on CPU with the offline sample data: build the sample (if missing), train the
# CPU sample configuration (scripts/run/sample_env.sh), write the int6+lzma artifact and run the final
# evaluations (round trip, sliding window, legal TTT). About 3 to 4 minutes on 2 CPU cores (0.73 s a step in bf16,
# 0.95 s in fp32 on a 2-core EPYC, 2026-11-29).
#
# Any setting can be overridden from the environment, e.g.  ITERATIONS=50 bash scripts/run/sample_run.sh
# A second run under the same RUN_ID is refused (runs/$RUN_ID/ holds a finished run): OVERWRITE_RUN=1 replaces it.
set -euo pipefail
cd "$(dirname "$0")/../.."

: "${PYTHON:=python3}"
source scripts/run/sample_env.sh
if [ ! -f "$TOKENIZER_PATH" ] || ! ls "$DATA_PATH"/fineweb_val_*.bin >/dev/null 2>&1; then
  "$PYTHON" data/build_sample_data.py
fi
export RUN_ID="${RUN_ID:-sample_cpu_seed${SEED:-1337}}"
echo "sample run: RUN_ID=$RUN_ID DATA_PATH=$DATA_PATH (log: logs/$RUN_ID.txt, artifact: runs/$RUN_ID/)"
exec "$PYTHON" train_gpt.py
