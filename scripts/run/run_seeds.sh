#!/usr/bin/env bash
# Run train_gpt.py once per seed and collect the logs into a record folder.
#
#   scripts/run/run_seeds.sh FOLDER SEED [SEED...]
#
# Each run gets the caller's environment plus SEED=<seed> and
# RUN_ID=<folder name>_seed<seed>; train_gpt.py writes logs/$RUN_ID.txt, which
# is copied to FOLDER/train_seed<seed>.log, and its artifact
# runs/$RUN_ID/final_model.int6.ptz (in the repo root: one per seed; a record
# folder holds the logs and the code, not the artifacts). train_gpt.py itself is
# copied into FOLDER once, before the first run, so the folder holds the code that ran.
# A seed whose runs/$RUN_ID/ holds a finished run stops the script before any
# run, as train_gpt.py would refuse it (OVERWRITE_RUN=1 reruns it).
#
# With PACK_CODE=1, train_gpt.py is first specialised to the run this environment
# describes (PRESET and the settings set in it; scripts/pack/pack_code.py --for-env:
# only the code that run executes, docs/submitting.md), written readable to
# FOLDER/train_gpt_readable.py; FOLDER/train_gpt.py is its packed (self-extracting,
# minified, locals renamed, ZPAQ in a 7-bit literal) form, and the runs execute the
# packed file (from the repo root, so data paths resolve as usual): every log comes
# from the bytes submitted and its "Code size" is the packed file's size.
#
# Environment:
#   NPROC_PER_NODE  processes (GPUs) per node, default 8
#   NNODES          nodes, default 1; above 1 --standalone is dropped and
#                   TORCHRUN_ARGS must carry the rendezvous options
#   TORCHRUN_ARGS   extra torchrun options, split on whitespace
#   TORCHRUN        launcher command, default "torchrun"
#   PACK_CODE       1: run and ship the packed train_gpt.py (see above); default 0
#   PYTHON          interpreter for scripts/pack/pack_code.py, default "python3"
#   OVERWRITE_RUN   1: rerun seeds that finished before (train_gpt.py's setting)
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
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo_root"
[[ -f train_gpt.py ]] || die "no train_gpt.py in $repo_root"
pack=${PACK_CODE:-0}
[[ $pack == 0 || $pack == 1 ]] || die "PACK_CODE must be 0 or 1, got '$pack'"
# train_gpt.py refuses a RUN_ID that holds a finished run: find out now, not after the earlier seeds' runs.
if [[ ${OVERWRITE_RUN:-0} != 1 ]]; then
  for seed in "$@"; do
    done_artifact="runs/${name}_seed${seed}/final_model.int6.ptz"
    [[ ! -e $done_artifact ]] || die "seed $seed already finished ($repo_root/$done_artifact exists): leave it out," \
      "choose another FOLDER name, or set OVERWRITE_RUN=1 to rerun it"
  done
fi

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

if [[ $pack == 1 ]]; then
  # Pack beside the target first; check_record compares it with the readable copy.
  code=$(mktemp "$folder/.train_gpt.py.XXXXXX")
  readable=$(mktemp "$folder/.train_gpt_readable.py.XXXXXX")
  trap 'rm -f "$code" "$readable"' EXIT
  ${PYTHON:-python3} scripts/pack/pack_code.py train_gpt.py --for-env --readable -o "$readable" >&2 \
    || die "scripts/pack/pack_code.py could not specialise train_gpt.py to this run"
  ${PYTHON:-python3} scripts/pack/pack_code.py "$readable" -o "$code" >&2 \
    || die "scripts/pack/pack_code.py could not pack the specialised train_gpt.py"
  launcher+=(${extra_args[@]+"${extra_args[@]}"} "$folder/train_gpt.py")
else
  code=train_gpt.py
  launcher+=(${extra_args[@]+"${extra_args[@]}"} train_gpt.py)
fi

if [[ -f $folder/train_gpt.py ]] && ! cmp -s "$code" "$folder/train_gpt.py"; then
  echo "run_seeds: warning: replacing a different $folder/train_gpt.py;" \
    "logs already there from other code will fail check_record's Code size check" >&2
fi
if [[ $pack == 1 ]]; then
  mv -f "$code" "$folder/train_gpt.py"
  mv -f "$readable" "$folder/train_gpt_readable.py"
  echo "run_seeds: $folder/train_gpt.py is specialised to this run and packed; readable source in" \
    "train_gpt_readable.py" >&2
else
  cp train_gpt.py "$folder/train_gpt.py"
fi

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
  artifact="runs/${run_id}/final_model.int6.ptz"
  [[ -f $artifact ]] || die "run for seed $seed finished but $repo_root/$artifact is missing"
  cp "$log" "$folder/train_seed${seed}.log"
  echo "run_seeds: wrote $folder/train_seed${seed}.log; the artifact is $repo_root/$artifact" >&2
done

echo "run_seeds: done; next: python scripts/record/make_record.py $folder && python scripts/record/check_record.py $folder --sota-bpb <current record bpb>" >&2
