"""Measures scripts/run/torchrun_resume.py's restart (issue 62): TRIES times, a tiny 2-rank CPU run on one node under
`torchrun_resume.py --standalone --nproc_per_node 2`, rank 1's worker SIGKILLed from outside as soon as the step-K
checkpoint is complete; for each try the seconds from the kill to the resumed run's end, its exit status and
whether its *_exact lines equal those of one uninterrupted run (plain torchrun, made first).

    python3 scripts/bench/bench_restart.py --data DATA_PATH --tokenizer TOKENIZER_PATH [--tries 10] [--dir /tmp/restart]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXACT = re.compile(r"^(final_int6_\w+|legal_ttt)_exact .*$", re.M)
TINY = {"MAX_WALLCLOCK_SECONDS": "0", "VAL_LOSS_EVERY": "0", "TRAIN_LOG_EVERY": "1", "TTT_ENABLED": "0",
        "EVAL_STRIDE": "0", "OMP_NUM_THREADS": "1", "GRAD_ACCUM_STEPS": "1", "DIAGNOSTIC_ROUNDTRIP": "1",
        "NUM_LAYERS": "2", "MODEL_DIM": "32", "NUM_HEADS": "2", "NUM_KV_HEADS": "1", "VE_LAYERS": "0,1",
        "XSA_LAST_N": "1", "BIGRAM_VOCAB_SIZE": "64", "TRAIN_SEQ_LEN": "64", "EVAL_SEQ_LEN": "64",
        "TRAIN_BATCH_TOKENS": "256", "VAL_BATCH_SIZE": "256", "ITERATIONS": "20", "WARMUP_STEPS": "1",
        "WARMDOWN_ITERS": "5", "DIST_TIMEOUT_SECONDS": "60"}


def exact_lines(folder: Path, run_id: str) -> list[str]:
    path = folder / "logs" / f"{run_id}.txt"
    return [m.group(0) for m in EXACT.finditer(path.read_text(encoding="utf-8"))] if path.exists() else []


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in os.listdir(f"/proc/{p}/task")
                    for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def rank_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--tries", type=int, default=10)
    ap.add_argument("--after", type=int, default=5, help="kill after this step's checkpoint (default 5)")
    ap.add_argument("--dir", default="/tmp/bench_restart")
    a = ap.parse_args()
    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    env = {**os.environ, **TINY, "DATA_PATH": a.data, "TOKENIZER_PATH": a.tokenizer}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(REPO / "train_gpt.py")]
    (base / "ref").mkdir()
    subprocess.run(torchrun, cwd=base / "ref", env={**env, "RUN_ID": "ref"}, check=True, capture_output=True)
    ref = exact_lines(base / "ref", "ref")
    print(f"reference: {ref}", flush=True)
    ok = 0
    for n in range(1, a.tries + 1):
        cwd = base / f"try{n}"
        cwd.mkdir()
        ck = cwd / "runs" / "cut" / "checkpoints" / f"step_{a.after:08d}"
        with open(cwd / "stderr.txt", "w") as err:
            resumer = REPO / "scripts" / "run" / "torchrun_resume.py"
            proc = subprocess.Popen([sys.executable, str(resumer), *torchrun[3:]],
                                    cwd=cwd, env={**env, "RUN_ID": "cut", "CHECKPOINT_EVERY": str(a.after)},
                                    stdout=subprocess.DEVNULL, stderr=err)
            killed_at = None
            while proc.poll() is None and killed_at is None:
                if ck.exists():
                    victim = next((p for p in descendants(proc.pid) if rank_of(p) == "1"), None)
                    if victim is not None:
                        os.kill(victim, signal.SIGKILL)
                        killed_at = time.monotonic()
                time.sleep(0.005)
            try:
                code = proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "timeout"
        took = time.monotonic() - killed_at if killed_at else float("nan")
        same = exact_lines(cwd, "cut") == ref and bool(ref)
        resumed = re.findall(r"^resumed_from:\S+ step:(\d+)", (cwd / "logs" / "cut.txt").read_text(), re.M)
        ok += same and code == 0 and killed_at is not None
        print(f"try {n}: killed:{killed_at is not None} exit:{code} kill_to_end_s:{took:.1f} resumed_at:{resumed} "
              f"exact_equal:{same}", flush=True)
    print(f"{ok} of {a.tries} resumed by themselves with the uninterrupted run's exact lines")
    return 0 if ok == a.tries else 1


if __name__ == "__main__":
    sys.exit(main())
