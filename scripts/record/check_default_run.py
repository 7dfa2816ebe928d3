#!/usr/bin/env python3
"""Is the default run unchanged? One command: the train_gpt.py of a git commit and this checkout's, each run once on
the same tiny fp32 CPU configuration (the offline sample data, a short validation shard, every setting its default
but the model's and the run's sizes), and their loss lines and artifact bytes compared.

    python3 scripts/record/check_default_run.py [COMMIT] [--preset NAME|all] [--keep DIR] [--script PATH]

COMMIT (default HEAD) is read with `git show COMMIT:train_gpt.py` into a temporary folder; the sample data is built
there by this checkout's data/build_sample_data.py (both runs read the same files). Compared: every log line with a
loss in it (train_loss, val_loss, val_bpb; the time fields removed, which differ run to run, and fields only one side
logs: common_fields), model_params, and the
bytes of final_model.int6.ptz (final_model.pt's size too, in its log line). Prints one line per difference and exits 1, or one line saying what was equal and
exits 0. --script PATH runs that file instead of this checkout's train_gpt.py; --keep DIR keeps both run folders.
A COMMIT whose train_gpt.py is the checked file's, byte for byte, is refused in one line (nothing to compare).

--preset NAME runs that preset's tiny run instead (PRESET_RUNS: the sizes of tests/test_compile.py's PRESET_ENV, on
the sp1024 sample for record_0323 and a CaseOps vocab-8192 sample, its first 1,200 val tokens, for the others; the
default is the record_0323 run above); --preset all runs every preset's, each compared as above, one line each.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The sizes of a run that takes seconds on 2 CPU cores; everything else is the default (the 2026-03-23 record's).
TINY_RUN = {
    "DEVICE": "cpu", "AUTOCAST_DTYPE": "fp32", "NUM_LAYERS": "4", "MODEL_DIM": "64", "NUM_HEADS": "4",
    "NUM_KV_HEADS": "2", "VE_LAYERS": "2,3", "XSA_LAST_N": "2", "TRAIN_SEQ_LEN": "128", "EVAL_SEQ_LEN": "128",
    "TRAIN_BATCH_TOKENS": "2048", "VAL_BATCH_SIZE": "4096", "ITERATIONS": "6", "WARMUP_STEPS": "1",
    "WARMDOWN_ITERS": "3", "MAX_WALLCLOCK_SECONDS": "0", "VAL_LOSS_EVERY": "3", "TRAIN_LOG_EVERY": "1",
    "TTT_CHUNK_TOKENS": "2048", "TTT_BATCH_SEQS": "8", "EVAL_BATCH_SEQS": "16", "SEED": "1337",
    "OMP_NUM_THREADS": "1",
}
# Each preset's tiny run (tests/test_compile.py's PRESET_ENV, COMPILE=0): every layer kind (sequential, GPT-J
# parallel, two lanes), the layer loop, LoRA TTT, the tilt; record_0323's is TINY_RUN (the default run).
RUN_SCALE = {
    "DEVICE": "cpu", "AUTOCAST_DTYPE": "fp32", "OMP_NUM_THREADS": "1", "SEED": "1337",
    "NUM_LAYERS": "3", "MODEL_DIM": "64", "NUM_HEADS": "2", "NUM_KV_HEADS": "1", "LOOP_START": "1", "LOOP_END": "1",
    "PARALLEL_RESIDUAL_START": "2", "XSA_LAST_N": "3", "TRAIN_SEQ_LEN": "128", "EVAL_SEQ_LEN": "128",
    "TRAIN_BATCH_TOKENS": "512", "GRAD_ACCUM_STEPS": "1", "VAL_BATCH_SIZE": "4096", "ITERATIONS": "3",
    "WARMUP_STEPS": "1", "MAX_WALLCLOCK_SECONDS": "0", "TRAIN_LOG_EVERY": "1", "GPTQ_CALIBRATION_BATCHES": "1",
    "GPTQ_CALIBRATION_SEQS": "2", "EVAL_BATCH_SEQS": "16", "TTT_CHUNK_SIZE": "16", "TTT_BATCH_SIZE": "4",
    "TTT_LORA_RANK": "4", "PHASED_TTT_PREFIX_DOCS": "4", "PHASED_TTT_NUM_PHASES": "2", "TTT_CHUNK_TOKENS": "512",
    "DIAGNOSTIC_POST_EMA": "1", "DIAGNOSTIC_ROUNDTRIP": "1", "COMPILE": "0",
}
PRESET_RUNS = {
    "record_0323": TINY_RUN,
    "record_0409": {**RUN_SCALE, "ENABLE_LOOPING_AT": "0.5", "VOCAB_SIZE": "8192", "ITERATIONS": "2",
                    "WARMDOWN_ITERS": "0", "CHECKPOINT_EVERY": "0", "VAL_LOSS_EVERY": "0",
                    "EVAL_BUDGET_SECONDS": "0.0"},
    "record_0427": RUN_SCALE,
    "record_0430": {**RUN_SCALE, "TRAIN_SEQ_LEN_SCHEDULE": "64@0,128@0.5", "SEQ_LEN_REWARMUP_STEPS": "2",
                    "ROPE_TRAIN_SEQ_LEN": "128", "TTT_CHUNK_SIZE_BY_DOC_LEN": "64:4,256:8"},
    "record_0501": {**RUN_SCALE, "NGRAM_TILT_ORDER": "2", "PHASED_TTT_NUM_PHASES": "1", "VAL_PREFETCH": "0"},
}
VAL_TOKENS = 4097  # the short validation shard: 32 rows of 128 targets
CASEOPS_VAL_TOKENS = 1200  # the CaseOps sample's validation cut (with its byte sidecar)
LOSS = re.compile(r"train_loss|val_loss|val_bpb|model_params|Serialized model")
# train_time:, step_avg:, eval_time:, data_wait_ms:, tok_s:, mfu:
TIMES = re.compile(r"\s*\b(\w*(time|_ms|avg)\w*|tok_s|mfu):\S+")


def sample_data(folder, caseops=False):
    """The 1024-token sample (build_sample_data.py) with its validation cut to VAL_TOKENS tokens; caseops: the
    CaseOps vocab-8192 sample (2 train shards), its validation and byte sidecar cut to CASEOPS_VAL_TOKENS."""
    extra = ["--vocab-size", "8192", "--caseops", "--train-shards", "2"] if caseops else []
    subprocess.run([sys.executable, str(REPO / "data" / "build_sample_data.py"), "--out-dir", str(folder), *extra],
                   check=True, capture_output=True)
    sys.path.insert(0, str(REPO))
    import numpy as np

    import train_gpt as tg
    data = folder / "datasets" / ("sample_sp8192_caseops" if caseops else "sample_sp1024")
    cut = [data / "fineweb_val_000000.bin"] + [data / "fineweb_val_bytes_000000.bin"] * caseops
    cuts = [(path, tg.load_shard(path)[:CASEOPS_VAL_TOKENS if caseops else VAL_TOKENS]) for path in cut]
    for extra_file in data.glob("fineweb_val_*.bin"):
        extra_file.unlink()
    for path, tokens in cuts:
        header = np.zeros(tg.SHARD_HEADER_INTS, dtype="<i4")
        header[:3] = (tg.SHARD_MAGIC, tg.SHARD_VERSION, tokens.size)
        path.write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())
    model = "sample_8192_bpe_caseops.model" if caseops else "sample_1024_bpe.model"
    return {"DATA_PATH": str(data), "TOKENIZER_PATH": str(folder / "tokenizers" / model)}


def run(script, cwd, env):
    """The run's loss lines (times removed) and its artifact's bytes."""
    cwd.mkdir(parents=True)
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    full = {**{k: v for k, v in os.environ.items() if k not in drop}, **env, "RUN_ID": "check"}
    proc = subprocess.run([sys.executable, str(script)], cwd=cwd, env=full, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"check_default_run: {script} failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    log = (cwd / "logs" / "check.txt").read_text(encoding="utf-8").splitlines()
    start = max(i for i, line in enumerate(log) if line == "=" * 100)  # the run's lines follow the code and versions
    lines = [TIMES.sub("", line) for line in log[start:] if LOSS.search(line)]
    return lines, (cwd / "runs" / "check" / "final_model.int6.ptz").read_bytes()


def common_fields(a, b):
    """Two lines without the NAME:value fields only one of them has (a field one commit's log added, e.g. issue
    72's lr_*:, muon_momentum:, grad_norm: in the train lines): what both logged is compared."""
    names = [{f.split(":")[0] for f in line.split() if ":" in f} for line in (a, b)]
    keep = names[0] & names[1]
    return tuple(" ".join(f for f in line.split() if ":" not in f or f.split(":")[0] in keep) for line in (a, b))


def compare(commit, name, want, got, want_bytes, got_bytes):
    """(lines to print, changed): one line per difference, then one saying what was compared."""
    diffs = [f"- {a}\n+ {b}" for a, b in map(common_fields, want, got) if a != b]
    if len(want) != len(got):
        diffs.append(f"{len(want)} loss lines at {commit}, {len(got)} now")
    if want_bytes != got_bytes:
        diffs.append(f"artifact: {len(want_bytes)} bytes at {commit}, {len(got_bytes)} now, "
                     f"{'different bytes' if len(want_bytes) == len(got_bytes) else 'different sizes'}")
    if diffs:
        return diffs + [f"the {name} run CHANGED against {commit}"], True
    return [f"the {name} run is unchanged against {commit}: {len(got)} loss lines equal, artifact "
            f"{len(got_bytes)} bytes equal byte for byte"], False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commit", nargs="?", default="HEAD")
    ap.add_argument("--script", type=Path, default=REPO / "train_gpt.py")
    ap.add_argument("--preset", choices=[*PRESET_RUNS, "all"], help="a preset's tiny run, or every preset's")
    ap.add_argument("--keep", type=Path, help="keep the run folders here")
    args = ap.parse_args(argv)
    show = subprocess.run(["git", "show", f"{args.commit}:train_gpt.py"], cwd=REPO, capture_output=True)
    if show.returncode != 0:
        sys.exit(f"check_default_run: no train_gpt.py at {args.commit!r}: {show.stderr.decode().strip()}")
    if show.stdout == args.script.read_bytes():
        sys.exit(f"check_default_run: {args.script} is train_gpt.py at {args.commit} byte for byte: nothing to "
                 f"compare (name the commit the change started from)")
    presets = list(PRESET_RUNS) if args.preset == "all" else [args.preset or "record_0323"]
    folder = Path(tempfile.mkdtemp(prefix="check_default_run_"))
    try:
        old = folder / "reference" / "train_gpt.py"
        old.parent.mkdir()
        old.write_bytes(show.stdout)
        data = {}
        changed = False
        for preset in presets:
            caseops = preset != "record_0323"
            if caseops not in data:
                data[caseops] = sample_data(folder / ("caseops" if caseops else "sample"), caseops)
            env = {**PRESET_RUNS[preset], **data[caseops], **({"PRESET": preset} if args.preset else {})}
            want, want_bytes = run(old, folder / preset / "runs_reference", env)
            got, got_bytes = run(args.script.resolve(), folder / preset / "runs_checked", env)
            name = f"PRESET={preset}" if args.preset else "default"
            lines, diff = compare(args.commit, name, want, got, want_bytes, got_bytes)
            print("\n".join(lines), flush=True)
            changed = changed or diff
        if args.keep:
            shutil.copytree(folder, args.keep, dirs_exist_ok=True)
        return int(changed)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
