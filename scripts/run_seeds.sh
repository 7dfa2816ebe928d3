#!/usr/bin/env bash
# Run train_gpt.py once per seed and collect the logs into a record folder.
#
#   scripts/run_seeds.sh FOLDER SEED [SEED...]
#
# Each run gets the caller's environment plus SEED=<seed> and
# RUN_ID=<folder name>_seed<seed>; train_gpt.py writes logs/$RUN_ID.txt, which
# is copied to FOLDER/train_seed<seed>.log. train_gpt.py itself is copied into
# FOLDER once, before the first run, so the folder holds the code that ran.
#
# Environment:
#   NPROC_PER_NODE  processes (GPUs) per node, default 8
#   NNODES          nodes, default 1; above 1 --standalone is dropped and
#                   TORCHRUN_ARGS must carry the rendezvous options
#   TORCHRUN_ARGS   extra torchrun options, split on whitespace
#   TORCHRUN        launcher command, default "torchrun"
set -euo pipefail

usage() {
  echo "usage: $0 FOLDER SEED [SEED...]" >&2
  echo "  e.g. $0 records/track_10min_16mb/\$(date +%F)_MyRun 1337 42 2025" >&2
  exit 2
}

die() {
  echo "run_seeds: error: $*" >&2
  exit 1
}

[[ $# -ge 2 ]] || usage
folder=$1
shift
for seed in "$@"; do
  [[ $seed =~ ^[0-9]+$ ]] || die "seed '$seed' is not a non-negative integer"
done

# Resolve FOLDER against the caller's directory before moving to the repo root.
mkdir -p "$folder"
folder=$(cd "$folder" && pwd)
name=$(basename "$folder")
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root"
[[ -f train_gpt.py ]] || die "no train_gpt.py in $repo_root"

# Unquoted on purpose: TORCHRUN may be a command with arguments.
launcher=(${TORCHRUN:-torchrun})
nnodes=${NNODES:-1}
if [[ $nnodes == 1 ]]; then
  launcher+=(--standalone)
else
  launcher+=(--nnodes="$nnodes")
fi
launcher+=(--nproc_per_node="${NPROC_PER_NODE:-8}")
read -r -a extra_args <<< "${TORCHRUN_ARGS:-}"
launcher+=(${extra_args[@]+"${extra_args[@]}"} train_gpt.py)

if [[ -f $folder/train_gpt.py ]] && ! cmp -s train_gpt.py "$folder/train_gpt.py"; then
  echo "run_seeds: warning: replacing a different $folder/train_gpt.py;" \
    "logs already there from other code will fail check_record's Code size check" >&2
fi
cp train_gpt.py "$folder/train_gpt.py"

for seed in "$@"; do
  run_id="${name}_seed${seed}"
  log="logs/${run_id}.txt"
  # A log left by an earlier attempt must not pass for this run's output.
  if [[ -e $log ]]; then
    mv -f "$log" "$log.prev"
    echo "run_seeds: moved old $log to $log.prev" >&2
  fi
  echo "run_seeds: seed $seed (RUN_ID=$run_id): ${launcher[*]}" >&2
  status=0
  SEED="$seed" RUN_ID="$run_id" "${launcher[@]}" || status=$?
  [[ $status -eq 0 ]] || die "run for seed $seed failed with exit status $status (log, if any: $log)"
  [[ -f $log ]] || die "run for seed $seed finished but $repo_root/$log is missing"
  cp "$log" "$folder/train_seed${seed}.log"
  echo "run_seeds: wrote $folder/train_seed${seed}.log" >&2
done

echo "run_seeds: done; next: python scripts/make_record.py $folder && python scripts/check_record.py $folder --sota-bpb <current record bpb>" >&2
