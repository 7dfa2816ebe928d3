#!/usr/bin/env python3
"""Benchmark of the training data path (SPEC 2 and 8) at the record's shapes.

World size 8, TRAIN_BATCH_TOKENS=786432 (grad_accum 1 at world size 8: 98,304 tokens per rank and
micro-step), TRAIN_SEQ_LEN=2048. Shards in the challenge format are generated into a temporary directory
(default 4 shards of 10M tokens, ~20 MB each, standing in for the record's 100M-token shards) and removed
at the end. Loaders are built by train_gpt.make_train_loader from the settings, exactly as a run builds
them, for rank 0 of 8 (and, with --all-ranks, the production rate of every rank in turn).

For each loader (stream, shuffled, packed: the documents loader of SPEC-FRONTIER 3, on the same shards, whose
random ids put a BOS about every 1,024 tokens) x mode (plain, prefetch, prefetch+copy stream; the last needs CUDA):
  - production rate: tokens/s per rank of a tight next_batch loop (no consumer work), after a warm-up;
  - a simulated training step of --step-ms per batch (time.sleep on CPU; calibrated matmuls on CUDA):
    how long next_batch blocks per step (mean, p99, max) and the worst call that crossed into a new shard
    (stream) or re-cut the shards (shuffled);
  - bytes moved host->device per step: the compact int32 span (4*(n+1)) vs the record's int64 x and y (2*8*n).
Then, per loader, the cost of the host reads alone (next_host of the rank-0 base loader: pread of the shard
ranges) without and with the check of every span read against VOCAB_SIZE.

Run: python scripts/bench/bench_loader.py [--quick] [--device auto|cpu|cuda] [--all-ranks]
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import train_gpt as tg  # noqa: E402

WORLD_SIZE = 8
TRAIN_BATCH_TOKENS = 786_432
SEQ_LEN = 2048
LOCAL_TOKENS = TRAIN_BATCH_TOKENS // WORLD_SIZE  # grad_accum 1 at world size 8
BATCH_SEQS = LOCAL_TOKENS // SEQ_LEN
RECORD_TOKENS_PER_S = 1.2e6  # the record's training throughput per rank (tokens/s)

MODES = (("plain", 0, 0), ("prefetch", 1, 0), ("prefetch+copy stream", 1, 1))
HEADER = ("| loader | mode | tokens/s/rank | mean wait ms | p99 wait ms | max wait ms | "
          "max wait at shard crossing ms | wait/step % of step-ms | H2D bytes/step |")

# Everything train_gpt reads that could leak in from the shell and change what is measured.
_ENV_KEYS = ("DATA_PATH", "TRAIN_LOADER", "TRAIN_PREFETCH", "TRAIN_PREFETCH_QUEUE", "TRAIN_COPY_STREAM",
             "TRAINING_TIMING_BREAKDOWN", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GRAD_ACCUM_STEPS",
             "TRAIN_BATCH_TOKENS", "TRAIN_SEQ_LEN", "EVAL_SEQ_LEN", "SEED", "DEVICE", "BIGRAM_VOCAB_SIZE",
             "SMEAR_GATE")
KINDS = ("stream", "shuffled", "packed")


# ---------------------------------------------------------------------------------------- shards

def write_shard(path: Path, tokens: np.ndarray) -> None:
    header = np.zeros(tg.SHARD_HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = tg.SHARD_MAGIC, tg.SHARD_VERSION, tokens.size
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2", copy=False).tobytes())


def generate_shards(root: Path, num_shards: int, shard_tokens: int) -> tuple[Path, Path]:
    """The stream directory (the generated shards) and a shuffled directory in which every rank owns all of
    them: WORLD_SIZE * num_shards names, name j linking to shard (j // WORLD_SIZE) % num_shards, so that
    files[rank::WORLD_SIZE] are the num_shards real files for every rank."""
    stream_dir, shuffled_dir = root / "stream", root / "shuffled"
    stream_dir.mkdir()
    shuffled_dir.mkdir()
    rng = np.random.default_rng(0)
    real = []
    for i in range(num_shards):
        path = stream_dir / f"fineweb_train_{i:06d}.bin"
        write_shard(path, rng.integers(0, 1024, size=shard_tokens, dtype=np.uint16))
        real.append(path)
    for j in range(WORLD_SIZE * num_shards):
        os.symlink(real[(j // WORLD_SIZE) % num_shards], shuffled_dir / f"fineweb_train_{j:06d}.bin")
    return stream_dir, shuffled_dir


# ---------------------------------------------------------------------------------------- tracing

class Trace:
    """Per produced batch (in production order): did building it open a new shard (stream) or re-cut the
    shards (shuffled)? Batches come out of every loader in production order, so entry k is call k's."""

    def __init__(self) -> None:
        self.crossed: list[bool] = []
        self.bases: list = []


_TRACE: Trace | None = None


@contextlib.contextmanager
def traced():
    """Wraps the base loaders' next_host (and the shuffled re-cut) to record shard crossings; the batches
    themselves are untouched. Restores the classes afterwards."""
    stream_next, shuffled_next = tg.DistributedTokenLoader.next_host, tg.ShuffledSequenceLoader.next_host
    stream_init, shuffled_init = tg.DistributedTokenLoader.__init__, tg.ShuffledSequenceLoader.__init__
    recut = tg.ShuffledSequenceLoader._recut
    packed_next, packed_init = tg.DocumentPackingLoader.next_host, tg.DocumentPackingLoader.__init__

    def packed_next_traced(self):
        before = self.reader
        out = packed_next(self)
        _TRACE.crossed.append(self.reader is not before)
        return out

    def packed_init_registered(self, *args, **kwargs):
        packed_init(self, *args, **kwargs)
        _TRACE.bases.append(self)

    def stream_next_traced(self):
        before = self.stream.reader
        out = stream_next(self)
        _TRACE.crossed.append(self.stream.reader is not before)
        return out

    def shuffled_next_traced(self):
        before = self.__dict__.get("_bench_recuts", 0)
        out = shuffled_next(self)
        _TRACE.crossed.append(self.__dict__.get("_bench_recuts", 0) != before)
        return out

    def recut_counted(self):
        self.__dict__["_bench_recuts"] = self.__dict__.get("_bench_recuts", 0) + 1
        return recut(self)

    def stream_init_registered(self, *args, **kwargs):
        stream_init(self, *args, **kwargs)
        _TRACE.bases.append(self)

    def shuffled_init_registered(self, *args, **kwargs):
        shuffled_init(self, *args, **kwargs)
        _TRACE.bases.append(self)

    tg.DistributedTokenLoader.next_host = stream_next_traced
    tg.ShuffledSequenceLoader.next_host = shuffled_next_traced
    tg.ShuffledSequenceLoader._recut = recut_counted
    tg.DistributedTokenLoader.__init__ = stream_init_registered
    tg.ShuffledSequenceLoader.__init__ = shuffled_init_registered
    tg.DocumentPackingLoader.next_host, tg.DocumentPackingLoader.__init__ = packed_next_traced, packed_init_registered
    try:
        yield
    finally:
        tg.DocumentPackingLoader.next_host, tg.DocumentPackingLoader.__init__ = packed_next, packed_init
        tg.DistributedTokenLoader.next_host, tg.ShuffledSequenceLoader.next_host = stream_next, shuffled_next
        tg.ShuffledSequenceLoader._recut = recut
        tg.DistributedTokenLoader.__init__, tg.ShuffledSequenceLoader.__init__ = stream_init, shuffled_init


def build_loader(kind: str, data_dir: Path, device: torch.device, rank: int, prefetch: int, copy_stream: int,
                 queue_size: int):
    """train_gpt's own composition: settings -> Hyperparameters -> Runtime -> make_train_loader."""
    global _TRACE
    for k in _ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.update({
        "DATA_PATH": str(data_dir), "TRAIN_LOADER": kind, "WORLD_SIZE": str(WORLD_SIZE), "RANK": str(rank),
        "LOCAL_RANK": "0", "TRAIN_BATCH_TOKENS": str(TRAIN_BATCH_TOKENS), "TRAIN_SEQ_LEN": str(SEQ_LEN),
        "EVAL_SEQ_LEN": str(SEQ_LEN), "TRAIN_PREFETCH": str(prefetch), "TRAIN_COPY_STREAM": str(copy_stream),
        "TRAIN_PREFETCH_QUEUE": str(queue_size), "SEED": "1337",
    })
    if kind == "packed":  # token mixers across documents are refused with the packed loader
        os.environ.update({"BIGRAM_VOCAB_SIZE": "0", "SMEAR_GATE": "0"})
    h = tg.Hyperparameters()
    assert h.grad_accum_steps == 1 and h.train_batch_tokens // (h.world_size * h.grad_accum_steps) == LOCAL_TOKENS
    rt = tg.Runtime(h, device, False, True, None)
    assert rt.train_prefetch == bool(prefetch) and rt.train_copy_stream == bool(copy_stream)
    _TRACE = Trace()
    loader = tg.make_train_loader(rt)
    return loader, _TRACE


# ---------------------------------------------------------------------------------------- consumer

class Consumer:
    """Simulated training step of step_ms: a sleep on CPU; on CUDA, matmuls calibrated to last step_ms that
    also read the batch (so the compute stream depends on its copy), then a synchronize."""

    def __init__(self, device: torch.device, step_ms: float) -> None:
        self.device, self.step_ms = device, step_ms
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
            self.acc = torch.zeros((), device=device, dtype=torch.int64)
            for _ in range(3):
                self.a @ self.a
            torch.cuda.synchronize(device)
            n = 20
            t0 = time.perf_counter()
            for _ in range(n):
                self.a @ self.a
            torch.cuda.synchronize(device)
            per_ms = 1000.0 * (time.perf_counter() - t0) / n
            self.reps = max(1, round(step_ms / per_ms))
            self.describe = f"{self.reps} bf16 8192^3 matmuls (~{per_ms:.2f} ms each) + synchronize"
        else:
            self.describe = "time.sleep"

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.cuda:
            self.acc += x[0, :8].sum() + y[-1, -8:].sum()
            for _ in range(self.reps):
                self.a @ self.a
            torch.cuda.synchronize(self.device)
        else:
            int(x[0, 0]) + int(y[-1, -1])
            time.sleep(self.step_ms / 1000.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(kind: str, mode: str, prefetch: int, copy_stream: int, data_dir: Path, device: torch.device,
            args, consumer: Consumer) -> dict:
    loader, trace = build_loader(kind, data_dir, device, 0, prefetch, copy_stream, args.queue)
    try:
        base = trace.bases[0]
        taken = 0
        for _ in range(args.warmup):
            loader.next_batch()
            taken += 1
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.prod_steps):
            loader.next_batch()
        sync(device)
        rate = args.prod_steps * LOCAL_TOKENS / (time.perf_counter() - t0)
        taken += args.prod_steps
        if kind == "shuffled":
            # The analogue of a shard crossing is the re-cut at the end of an epoch; skip (untimed) to a few
            # batches before the first one so that the timed steps include it.
            epoch_windows = sum(len(s) for s in base.starts)  # nothing re-cut yet: still the first cut
            recut_call = epoch_windows // BATCH_SEQS
            skip = max(0, recut_call - args.steps // 2 - taken)
            for _ in range(skip):
                loader.next_batch()
            taken += skip
        waits, crossing_waits = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            x, y, *_ = loader.next_batch()
            wait = 1000.0 * (time.perf_counter() - t0)
            k = taken
            taken += 1
            crossed = trace.crossed[k] if k < len(trace.crossed) else False
            if copy_stream and k + 1 < len(trace.crossed):
                crossed = crossed or trace.crossed[k + 1]  # this call also took (and copied) batch k+1
            waits.append(wait)
            if crossed:
                crossing_waits.append(wait)
            consumer.step(x, y)
        rows = 1 if kind == "packed" else BATCH_SEQS
        assert x.dtype == torch.int64 and x.numel() == rows * (LOCAL_TOKENS // rows) == LOCAL_TOKENS
        assert x.shape[0] == rows and x.device.type == device.type
    finally:
        loader.shutdown()
    w = np.array(waits)
    host_words = BATCH_SEQS * (SEQ_LEN + 1) if kind == "shuffled" else LOCAL_TOKENS + 1
    return {"loader": kind, "mode": mode, "rate": rate, "mean": float(w.mean()), "p99": float(np.percentile(w, 99)),
            "max": float(w.max()), "cross_max": max(crossing_waits) if crossing_waits else None,
            "crossings": len(crossing_waits), "h2d": 4 * host_words}


def production_rate(kind: str, data_dir: Path, device: torch.device, rank: int, args) -> float:
    loader, _ = build_loader(kind, data_dir, device, rank, 0, 0, args.queue)
    try:
        for _ in range(args.warmup):
            loader.next_batch()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.prod_steps):
            loader.next_batch()
        sync(device)
        return args.prod_steps * LOCAL_TOKENS / (time.perf_counter() - t0)
    finally:
        loader.shutdown()


def host_read_us(kind: str, data_dir: Path, args) -> tuple[float, float]:
    """Microseconds per next_host of the rank-0 base loader (no prefetch, no device copy): the shard reads
    (pread) without and with the check of every span read against VOCAB_SIZE=1024. The two loaders take
    turns, five rounds, best round each, so that a busy machine shows less in the difference."""
    files = tg.list_shards(str(data_dir / "fineweb_train_*.bin"))
    cpu = torch.device("cpu")
    loaders = []
    for vocab_size in (None, 1024):
        if kind == "stream":
            loaders.append(tg.DistributedTokenLoader(files, 0, WORLD_SIZE, cpu, LOCAL_TOKENS, SEQ_LEN,
                                                     vocab_size=vocab_size))
        elif kind == "packed":
            loaders.append(tg.DocumentPackingLoader(files, 0, WORLD_SIZE, cpu, LOCAL_TOKENS, SEQ_LEN,
                                                    vocab_size=vocab_size))
        else:
            loaders.append(tg.ShuffledSequenceLoader(files, 0, WORLD_SIZE, cpu, LOCAL_TOKENS, SEQ_LEN, 1337,
                                                     vocab_size=vocab_size))
    best = [math.inf, math.inf]
    for _ in range(5):
        for i, base in enumerate(loaders):
            for _ in range(args.warmup):
                base.next_host()
            t0 = time.perf_counter()
            for _ in range(args.prod_steps):
                base.next_host()
            best[i] = min(best[i], (time.perf_counter() - t0) / args.prod_steps)
    return 1e6 * best[0], 1e6 * best[1]


# ---------------------------------------------------------------------------------------- report

def machine_lines(device: torch.device, consumer: Consumer) -> list[str]:
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    dev = f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu (no CUDA)"
    return [f"machine: cpu {model}; {os.cpu_count()} cores ({usable} usable); torch {torch.__version__}; "
            f"python {platform.python_version()}; device {dev}; torch threads {torch.get_num_threads()}",
            f"consumer: {consumer.describe}"]


def fmt_row(r: dict, step_ms: float) -> str:
    cross = "n/a (none in window)" if r["cross_max"] is None else f"{r['cross_max']:.3f} ({r['crossings']} calls)"
    return (f"| {r['loader']} | {r['mode']} | {r['rate']:,.0f} | {r['mean']:.3f} | {r['p99']:.3f} | {r['max']:.3f} | "
            f"{cross} | {100.0 * r['mean'] / step_ms:.2f}% | {r['h2d']:,} |")


def target_lines(rows: list[dict], step_ms: float) -> list[str]:
    mean_cap = 0.01 * step_ms
    rate_goal = 20 * RECORD_TOKENS_PER_S
    out = [f"targets: (a) mean wait < 1% of the {step_ms:g} ms step = {mean_cap:.2f} ms; (b) worst single wait "
           f"< 1 ms, shard crossings included; (c) production >= 20 x 1.2M = {rate_goal / 1e6:.0f}M tokens/s per rank"]
    for r in rows:
        worst = max(r["max"], r["cross_max"] or 0.0)
        a, b, c = r["mean"] < mean_cap, worst < 1.0, r["rate"] >= rate_goal
        out.append(f"  {r['loader']}/{r['mode']}: (a) {'PASS' if a else 'FAIL'} {r['mean']:.3f} ms; "
                   f"(b) {'PASS' if b else 'FAIL'} {worst:.3f} ms; (c) {'PASS' if c else 'FAIL'} "
                   f"{r['rate'] / 1e6:.1f}M tokens/s" + ("  -> all hold" if a and b and c else ""))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shard-tokens", type=int, default=10_000_000)
    ap.add_argument("--num-shards", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100, help="timed consumer steps per configuration")
    ap.add_argument("--prod-steps", type=int, default=60, help="steps of the production-rate loop")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=80.0, help="simulated compute per step")
    ap.add_argument("--queue", type=int, default=2, help="TRAIN_PREFETCH_QUEUE")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--all-ranks", action="store_true", help="also the plain production rate of ranks 0..7")
    ap.add_argument("--quick", action="store_true",
                    help="small shards and few steps (under 30 s); a flag given beside it keeps its own value")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads (0: 1 on CPU, where the int64 widening of a 98k-token batch "
                         "otherwise waits for OpenMP workers on a busy machine; torch's default on CUDA)")
    args = ap.parse_args()
    if args.quick:  # --quick's values become the defaults: the flags given explicitly still win
        ap.set_defaults(shard_tokens=2_000_000, steps=30, prod_steps=20, warmup=2)
        args = ap.parse_args()
    if args.shard_tokens < WORLD_SIZE * (LOCAL_TOKENS + 1):
        ap.error(f"--shard-tokens must be at least one micro-step ({WORLD_SIZE * (LOCAL_TOKENS + 1)} tokens)")
    want = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if want == "cuda" else torch.device("cpu")
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    elif device.type == "cpu":
        torch.set_num_threads(1)

    consumer = Consumer(device, args.step_ms)
    for line in machine_lines(device, consumer):
        print(line)
    per_step = WORLD_SIZE * (LOCAL_TOKENS + 1)
    print(f"shapes: world_size {WORLD_SIZE} (rank 0 measured), {LOCAL_TOKENS:,} tokens per rank per micro-step "
          f"(TRAIN_BATCH_TOKENS={TRAIN_BATCH_TOKENS}, grad_accum 1), seq {SEQ_LEN}, queue {args.queue}")
    print(f"shards: {args.num_shards} x {args.shard_tokens:,} tokens ({2 * args.shard_tokens / 1e6:.0f} MB each, "
          f"in the page cache); stream crosses a shard every {args.shard_tokens / per_step:.1f} steps; "
          f"shuffled: every rank owns the {args.num_shards} shards (links), re-cut every "
          f"~{args.num_shards * (args.shard_tokens // SEQ_LEN) / BATCH_SEQS:.0f} steps")
    print(f"timed: {args.steps} steps of {args.step_ms:g} ms per configuration, production over {args.prod_steps} "
          f"steps after {args.warmup} warm-up steps")
    sys.stdout.flush()

    root = Path(tempfile.mkdtemp(prefix="bench_loader_"))
    rows, skipped = [], []
    try:
        t0 = time.perf_counter()
        stream_dir, shuffled_dir = generate_shards(root, args.num_shards, args.shard_tokens)
        print(f"generated shards in {time.perf_counter() - t0:.1f}s under {root}")
        with traced():
            for kind, data_dir in zip(KINDS, (stream_dir, shuffled_dir, stream_dir)):
                for mode, prefetch, copy_stream in MODES:
                    if copy_stream and device.type != "cuda":
                        skipped.append((kind, mode))
                        continue
                    rows.append(measure(kind, mode, prefetch, copy_stream, data_dir, device, args, consumer))
                    print(f"  measured {kind}/{mode}", flush=True)
            all_ranks = []
            if args.all_ranks:
                for kind, data_dir in zip(KINDS, (stream_dir, shuffled_dir, stream_dir)):
                    for rank in range(WORLD_SIZE):
                        all_ranks.append((kind, rank, production_rate(kind, data_dir, device, rank, args)))
        host_reads = {kind: host_read_us(kind, data_dir, args)
                      for kind, data_dir in zip(KINDS, (stream_dir, shuffled_dir, stream_dir))}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print()
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    for kind in KINDS:
        for r in rows:
            if r["loader"] == kind:
                print(fmt_row(r, args.step_ms))
        for k, mode in skipped:
            if k == kind:
                print(f"| {kind} | {mode} | skipped (needs CUDA) | - | - | - | - | - | - |")
    record_bytes = 2 * 8 * LOCAL_TOKENS
    print()
    print(f"H2D per step: compact int32 = 4*(n+1) = {4 * (LOCAL_TOKENS + 1):,} bytes (stream; shuffled "
          f"4*B*(L+1) = {4 * BATCH_SEQS * (SEQ_LEN + 1):,}) vs the record's int64 x and y = 2*8*n = "
          f"{record_bytes:,} bytes ({record_bytes / (4 * (LOCAL_TOKENS + 1)):.1f}x more)"
          + ("; on CPU there is no copy, the widening to int64 happens in host memory" if device.type == "cpu" else ""))
    print()
    for kind in KINDS:
        off, on = host_reads[kind]
        print(f"host reads ({kind}, rank 0, next_host only): {off:.1f} us/batch without the VOCAB_SIZE check, "
              f"{on:.1f} us with it ({on - off:+.1f} us, {100.0 * (on - off) / (1000.0 * args.step_ms):+.3f}% "
              f"of the {args.step_ms:g} ms step)")
    if args.all_ranks:
        print()
        print("| loader | rank | plain tokens/s |")
        print("|---|---|---|")
        for kind, rank, rate in all_ranks:
            print(f"| {kind} | {rank} | {rate:,.0f} |")
    print()
    for line in target_lines(rows, args.step_ms):
        print(line)
    if skipped:
        print("prefetch+copy stream: skipped on CPU (copy streams need CUDA)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
