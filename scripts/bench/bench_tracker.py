#!/usr/bin/env python3
"""Time TRACKER's cost per logged line (issue 63): train_gpt.Tracker started as a run starts it, in a scratch
folder (W&B offline), then N train lines like the log's sent through it; prints microseconds per line for each
installed tracker. A run logs one train line every TRAIN_LOG_EVERY steps (500 by default), so the cost a step is
this over TRAIN_LOG_EVERY.

Example:
    python3 scripts/bench/bench_tracker.py --lines 2000
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402


class Quiet:
    """What Tracker.send needs of a Runtime: its log (a failure's warning)."""

    def log(self, msg):
        print(msg)


def per_line_us(kind: str, lines: int) -> float:
    h = tg.Hyperparameters({"TRACKER": kind, "RUN_ID": f"bench_{kind}"})
    tracker = tg.Tracker(h)
    texts = [f"step:{s}/{lines} train_loss:{6 - s / lines:.4f} train_time:{s * 90}ms step_avg:90.{s % 100:02d}ms "
             f"data_wait_ms:0.{s % 100:02d}" for s in range(1, lines + 1)]
    rt = Quiet()
    t0 = time.perf_counter()
    for text in texts:
        tracker.send(rt, text)
    elapsed = time.perf_counter() - t0
    tracker.close(0)
    return 1e6 * elapsed / lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=2000)
    args = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        for kind in ("tensorboard", "wandb"):
            if importlib.util.find_spec(kind) is None:
                print(f"{kind}: not installed")
                continue
            print(f"{kind}: {per_line_us(kind, args.lines):.1f} us per logged line ({args.lines} train lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
