#!/usr/bin/env python3
"""Is the default run unchanged? One command: the train_gpt.py of a git commit and this checkout's, each run once on
the same tiny fp32 CPU configuration (the offline sample data, a short validation shard, every setting its default
but the model's and the run's sizes), and their loss lines and artifact bytes compared.

    python3 scripts/check_default_run.py [COMMIT] [--keep DIR] [--script PATH]

COMMIT (default HEAD) is read with `git show COMMIT:train_gpt.py` into a temporary folder; the sample data is built
there by this checkout's data/build_sample_data.py (both runs read the same files). Compared: every log line with a
loss in it (train_loss, val_loss, val_bpb; the time fields removed, which differ run to run), model_params, and the
bytes of final_model.int6.ptz (final_model.pt's size too, in its log line). Prints one line per difference and exits 1, or one line saying what was equal and
exits 0. --script PATH runs that file instead of this checkout's train_gpt.py; --keep DIR keeps both run folders.
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

REPO = Path(__file__).resolve().parents[1]

# The sizes of a run that takes seconds on 2 CPU cores; everything else is the default (the 2026-03-23 record's).
TINY_RUN = {
    "DEVICE": "cpu", "AUTOCAST_DTYPE": "fp32", "NUM_LAYERS": "4", "MODEL_DIM": "64", "NUM_HEADS": "4",
    "NUM_KV_HEADS": "2", "VE_LAYERS": "2,3", "XSA_LAST_N": "2", "TRAIN_SEQ_LEN": "128", "EVAL_SEQ_LEN": "128",
    "TRAIN_BATCH_TOKENS": "2048", "VAL_BATCH_SIZE": "4096", "ITERATIONS": "6", "WARMUP_STEPS": "1",
    "WARMDOWN_ITERS": "3", "MAX_WALLCLOCK_SECONDS": "0", "VAL_LOSS_EVERY": "3", "TRAIN_LOG_EVERY": "1",
    "TTT_CHUNK_TOKENS": "2048", "TTT_BATCH_SEQS": "8", "EVAL_BATCH_SEQS": "16", "SEED": "1337",
    "OMP_NUM_THREADS": "1",
}
VAL_TOKENS = 4097  # the short validation shard: 32 rows of 128 targets
LOSS = re.compile(r"train_loss|val_loss|val_bpb|model_params|Serialized model")
TIMES = re.compile(r"\s*\b\w*(time|_ms|avg)\w*:\S+")  # train_time:, step_avg:, eval_time:, data_wait_ms:


def sample_data(folder):
    """The 1024-token sample (build_sample_data.py) with its validation cut to VAL_TOKENS tokens."""
    subprocess.run([sys.executable, str(REPO / "data" / "build_sample_data.py"), "--out-dir", str(folder)], check=True,
                   capture_output=True)
    sys.path.insert(0, str(REPO))
    import numpy as np

    import train_gpt as tg
    data = folder / "datasets" / "sample_sp1024"
    val = data / "fineweb_val_000000.bin"
    tokens = tg.load_shard(val)[:VAL_TOKENS]
    header = np.zeros(tg.SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = (tg.SHARD_MAGIC, tg.SHARD_VERSION, tokens.size)
    for extra in data.glob("fineweb_val_*.bin"):
        extra.unlink()
    val.write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())
    return {"DATA_PATH": str(data), "TOKENIZER_PATH": str(folder / "tokenizers" / "sample_1024_bpe.model")}


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commit", nargs="?", default="HEAD")
    ap.add_argument("--script", type=Path, default=REPO / "train_gpt.py")
    ap.add_argument("--keep", type=Path, help="keep the two run folders here")
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="check_default_run_"))
    try:
        old = folder / "reference" / "train_gpt.py"
        old.parent.mkdir()
        show = subprocess.run(["git", "show", f"{args.commit}:train_gpt.py"], cwd=REPO, capture_output=True)
        if show.returncode != 0:
            sys.exit(f"check_default_run: no train_gpt.py at {args.commit!r}: {show.stderr.decode().strip()}")
        old.write_bytes(show.stdout)
        env = {**TINY_RUN, **sample_data(folder / "sample")}
        want, want_bytes = run(old, folder / "runs_reference", env)
        got, got_bytes = run(args.script.resolve(), folder / "runs_checked", env)
        diffs = [f"- {a}\n+ {b}" for a, b in zip(want, got) if a != b]
        if len(want) != len(got):
            diffs.append(f"{len(want)} loss lines at {args.commit}, {len(got)} now")
        if want_bytes != got_bytes:
            diffs.append(f"artifact: {len(want_bytes)} bytes at {args.commit}, {len(got_bytes)} now, "
                         f"{'different bytes' if len(want_bytes) == len(got_bytes) else 'different sizes'}")
        if args.keep:
            shutil.copytree(folder, args.keep, dirs_exist_ok=True)
        if diffs:
            print("\n".join(diffs))
            print(f"the default run CHANGED against {args.commit}")
            return 1
        print(f"the default run is unchanged against {args.commit}: {len(got)} loss lines equal, artifact "
              f"{len(got_bytes)} bytes equal byte for byte")
        return 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
