"""What a checkpoint (CHECKPOINT_EVERY, issue 30) costs: bytes at each preset's shapes (checkpoint_payload_bytes,
1 and 8 ranks), and with --measure PRESET the seconds to write one on this machine: that preset's full-size
model after one real training step on random tokens (so every optimizer state exists), saved by the run's own
Checkpointer on the CPU (synchronous: the stall is the whole write, fsync included).

    python3 scripts/bench/bench_checkpoint.py                       # the bytes table
    python3 scripts/bench/bench_checkpoint.py --measure record_0323 --dir /tmp/ckpt_bench
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402


def settings(preset, world_size, **extra):
    env = {"PRESET": preset, "WORLD_SIZE": str(world_size), **extra}
    if world_size > 1:
        env.update(MASTER_ADDR="localhost", MASTER_PORT="1")
    return tg.Hyperparameters(env)


def bytes_table():
    lines = ["| preset | replicated | Muon momentum per rank (1 / 8 ranks) | checkpoint, 1 rank | checkpoint, 8 ranks |",
             "|---|---|---|---|---|"]
    for preset in tg.PRESETS:
        shared, one = tg.checkpoint_payload_bytes(settings(preset, 1))
        _, eight = tg.checkpoint_payload_bytes(settings(preset, 8))
        lines.append(f"| {preset} | {shared:,} | {one:,} / {eight:,} | {shared + one:,} | {shared + 8 * eight:,} |")
    return "\n".join(lines)


class RandomTokens:
    """A loader of random tokens (the write's cost does not depend on them)."""

    def __init__(self, h):
        self.h, self.g = h, torch.Generator().manual_seed(0)

    def next_batch(self):
        t = torch.randint(0, self.h.vocab_size, (1, self.h.train_seq_len + 1), generator=self.g)
        return t[:, :-1], t[:, 1:]

    def position(self):
        return {}


def measure(preset, folder, repeats):
    h = settings(preset, 1, TRAIN_SEQ_LEN="64", TRAIN_LOADER="stream", GRAD_ACCUM_STEPS="1", TRAIN_BATCH_TOKENS="64",
                 CHECKPOINT_EVERY="1", CHECKPOINT_DIR=str(folder), CHECKPOINT_KEEP="1")
    cpu = torch.device("cpu")
    rt = tg.Runtime(h, cpu, False, True, None, *tg.choose_precision(h, cpu))
    rt.log = lambda msg, console=True: None
    model = rt.prepare_model(tg.build_model(h))
    trainer, loader = tg.Trainer(rt, model), RandomTokens(h)
    averager = tg.WeightAverager(h, model)
    trainer.step(loader, 1.0, 0.95)
    ckpt = tg.Checkpointer(rt)
    times = []
    for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        ckpt.save(step, *tg.training_state(trainer, averager, loader, {"step": step}))
        times.append(time.perf_counter() - t0)
    files = sum(p.stat().st_size for p in (folder / tg.checkpoint_name(repeats)).glob("*.pt"))
    return files, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", choices=list(tg.PRESETS), help="write checkpoints of this preset's model")
    ap.add_argument("--dir", type=Path, default=Path("checkpoints/bench"), help="where (emptied first)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(bytes_table())
    if args.measure:
        shutil.rmtree(args.dir, ignore_errors=True)
        files, times = measure(args.measure, args.dir, args.repeats)
        print(f"\n{args.measure}: {files:,} bytes of .pt files per checkpoint; write (sync, CPU) seconds: "
              + " ".join(f"{t:.2f}" for t in times))
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
