"""The data path (SPEC 2 and 8): every loader composition gives the record's batches bit for bit, the
shuffled loader keeps its contract, the prefetch thread fails loudly and stops cleanly, validation is the
same with or without prefetch, bad settings stop the run at start, and the logs carry the data-path lines.
GPU-only checks (copy stream, record_stream, pinned ring) are skipped without CUDA."""
from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt as tg
from conftest import REPO, TINY_ENV, clean_environ, read_log, run_training, short_val_data
from data.shards import read_shard

CPU = torch.device("cpu")
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Variables a test must not inherit from the shell: torchrun's layout and every data-path switch.
_RESET_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "TRAIN_LOADER", "TRAIN_PREFETCH",
               "TRAIN_PREFETCH_QUEUE", "TRAIN_COPY_STREAM", "VAL_PREFETCH", "VAL_COPY_STREAM",
               "VAL_BYTECOUNT_DEVICE", "VAL_PROGRESS_LOG_EVERY", "TRAINING_TIMING_BREAKDOWN",
               "TRAINING_TIMING_EVERY", "PROFILE", "PROFILE_STEPS", "GRAD_ACCUM_STEPS", "DEVICE")

SEQ = 16          # sequence length of the loader tests
LOCAL = 64        # tokens per rank and micro-step: TRAIN_BATCH_TOKENS=512 is 8 micro-batches of 64
ODD_SIZES = (523, 389, 701, 457)  # odd shard sizes: spans straddle shard ends and the stream wraps


def write_shard(path, tokens, count: int | None = None) -> None:
    """A shard in the challenge format; `count` overrides the header's token count (a truncated file)."""
    header = np.zeros(256, dtype="<i4")
    header[0], header[1] = 20240520, 1
    header[2] = len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def make_shards(directory: Path, sizes, kind: str = "train") -> list[np.ndarray]:
    """Shards whose tokens are distinct across the whole set (shard i holds a consecutive id range), so a
    window of tokens names the shard and offset it came from. Returns the token arrays."""
    directory.mkdir(parents=True, exist_ok=True)
    out, base = [], 0
    for i, n in enumerate(sizes):
        toks = np.arange(base, base + n, dtype=np.int64)
        write_shard(directory / f"fineweb_{kind}_{i:06d}.bin", toks)
        out.append(toks)
        base += n
    assert base < 2**16
    return out


def set_env(monkeypatch, base: dict | None = None, **over) -> None:
    """Clears the layout and data-path variables, then sets `base` updated with `over`."""
    for k in _RESET_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in {**(base or {}), **over}.items():
        monkeypatch.setenv(k, str(v))


def loader_env(data_dir: Path, **over) -> dict:
    # make_shards' ids run past 1024 (each id names its position); the loaders check ids < VOCAB_SIZE.
    env = {"DATA_PATH": str(data_dir), "TRAIN_SEQ_LEN": SEQ, "EVAL_SEQ_LEN": SEQ, "TRAIN_BATCH_TOKENS": 8 * LOCAL,
           "VAL_BATCH_SIZE": 64 * SEQ, "EVAL_STRIDE": SEQ, "SEED": 1337, "VOCAB_SIZE": 2**16}
    env.update(over)
    return env


def cpu_runtime(monkeypatch, **env) -> tg.Runtime:
    set_env(monkeypatch, env)
    return tg.Runtime(tg.Hyperparameters(), CPU, False, True, None)


def draw(loader, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches, all kept alive until compared (a loader reusing buffers would show up)."""
    return [loader.next_batch() for _ in range(steps)]


def assert_same_batches(got, want, what) -> None:
    assert len(got) == len(want), what
    for k, ((x, y), (ex, ey)) in enumerate(zip(got, want)):
        for a, b in ((x, ex), (y, ey)):
            assert a.dtype == torch.int64 and b.dtype == torch.int64, (what, k)
            assert a.shape == b.shape, (what, k, a.shape, b.shape)
            assert torch.equal(a.cpu(), b.cpu()), (what, k)


def call_with_timeout(fn, timeout: float = 60.0):
    """Runs fn in a watchdog thread; returns its result or raises its exception; fails on a hang."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed back to the test thread
            box["error"] = e

    t = threading.Thread(target=target, name="test-consumer", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"no result within {timeout}s: the loader hangs")
    if "error" in box:
        raise box["error"]
    return box["value"]


def prefetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("prefetch-") and t.is_alive()}


def spec_stream_batches(shards: list[np.ndarray], world_size: int, rank: int, local: int, seq_len: int,
                        steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """SPEC 2's record order, written independently: one endless stream over the shards; micro-step k
    takes the next (local+1)*world_size tokens; rank r keeps the r-th span of local+1 tokens."""
    stream = np.concatenate(shards)
    span = local + 1
    width = span * world_size
    reps = (steps * width) // stream.size + 2
    tiled = np.tile(stream, reps)
    out = []
    for k in range(steps):
        mine = tiled[k * width + rank * span:k * width + (rank + 1) * span]
        out.append((mine[:-1].reshape(-1, seq_len), mine[1:].reshape(-1, seq_len)))
    return out


# ------------------------------------------------------------------------------- 1. every option, same batches

LAYOUTS = [(1, 0), (2, 0), (2, 1)]  # (world_size, rank)
OPTION_GRID = list(itertools.product((0, 1), (0, 1), (1, 3), (0, 1)))  # prefetch, copy stream, queue, breakdown


@pytest.mark.parametrize("loader_kind", ["stream", "shuffled"])
@pytest.mark.parametrize("world_size,rank", LAYOUTS)
def test_every_loader_option_gives_the_plain_batches(tmp_path, monkeypatch, loader_kind, world_size, rank):
    make_shards(tmp_path, ODD_SIZES)
    total = sum(ODD_SIZES)
    steps = 2 * total // ((LOCAL + 1) * world_size) + 3  # about two wraps of the stream (several re-cuts)
    base = loader_env(tmp_path, TRAIN_LOADER=loader_kind, WORLD_SIZE=world_size, RANK=rank)

    rt = cpu_runtime(monkeypatch, **base, TRAIN_PREFETCH=0, TRAIN_COPY_STREAM=0)
    assert rt.h.grad_accum_steps == 8 // world_size
    plain = tg.make_train_loader(rt)
    try:
        assert not isinstance(plain, tg.PrefetchingDistributedTokenLoader)
        want = draw(plain, steps)
    finally:
        plain.shutdown()
    assert want[0][0].shape == (LOCAL // SEQ, SEQ)

    for prefetch, copy_stream, queue_size, breakdown in OPTION_GRID:
        what = dict(loader=loader_kind, ws=world_size, rank=rank, prefetch=prefetch, copy=copy_stream,
                    queue=queue_size, breakdown=breakdown)
        rt = cpu_runtime(monkeypatch, **base, TRAIN_PREFETCH=prefetch, TRAIN_COPY_STREAM=copy_stream,
                         TRAIN_PREFETCH_QUEUE=queue_size, TRAINING_TIMING_BREAKDOWN=breakdown)
        # Runtime's effective switches: the breakdown turns overlap off; copy streams need CUDA.
        assert rt.train_prefetch == bool(prefetch and not breakdown), what
        assert rt.train_copy_stream is False, what
        loader = tg.make_train_loader(rt)
        try:
            assert isinstance(loader, tg.PrefetchingDistributedTokenLoader) == rt.train_prefetch, what
            got = call_with_timeout(lambda: draw(loader, steps))
        finally:
            loader.shutdown()
        assert_same_batches(got, want, what)


# ------------------------------------------------------------------------------- 2. stream order = SPEC 2

@pytest.mark.parametrize("world_size,rank", LAYOUTS)
@pytest.mark.parametrize("queue_size", [1, 2])
def test_prefetched_stream_matches_spec_slicing(tmp_path, monkeypatch, world_size, rank, queue_size):
    shards = make_shards(tmp_path, ODD_SIZES)
    steps = 3 * sum(ODD_SIZES) // ((LOCAL + 1) * world_size) + 2
    rt = cpu_runtime(monkeypatch, **loader_env(tmp_path, WORLD_SIZE=world_size, RANK=rank, TRAIN_PREFETCH=1,
                                               TRAIN_PREFETCH_QUEUE=queue_size))
    loader = tg.make_train_loader(rt)
    try:
        assert isinstance(loader, tg.PrefetchingDistributedTokenLoader) and loader._thread is not None
        got = call_with_timeout(lambda: draw(loader, steps))
    finally:
        loader.shutdown()
    want = [(torch.from_numpy(x), torch.from_numpy(y))
            for x, y in spec_stream_batches(shards, world_size, rank, LOCAL, SEQ, steps)]
    assert_same_batches(got, want, "spec")


# ------------------------------------------------------------------------------- 3. shuffled loader contract

SHUFFLE_SIZES = (SEQ + 1, SEQ + 5, 300, 411, 257)  # includes shards with room for only one window


def shuffled(files, rank, world_size, seed, batch_seqs=4):
    return tg.ShuffledSequenceLoader(files, rank, world_size, CPU, batch_seqs * SEQ, SEQ, seed)


def windows_of(loader, batches: int) -> np.ndarray:
    """The L+1 windows of `batches` batches, rebuilt from x and y (and checked to be x=w[:-1], y=w[1:])."""
    out = []
    for _ in range(batches):
        x, y = loader.next_batch()
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, SEQ)
        assert torch.equal(x[:, 1:], y[:, :-1])
        out.append(torch.cat([x, y[:, -1:]], dim=1).numpy())
    return np.concatenate(out)


def test_shuffled_windows_are_x_y_of_one_host_window(tmp_path):
    make_shards(tmp_path, SHUFFLE_SIZES)
    files = tg.list_shards(str(tmp_path / "fineweb_train_*.bin"))
    a, b = shuffled(files, 0, 2, 7), shuffled(files, 0, 2, 7)
    for _ in range(12):
        host = a.next_host()
        assert host.dtype == np.uint16 and host.shape == (4, SEQ + 1)
        x, y = b.next_batch()
        assert np.array_equal(x.numpy(), host[:, :-1]) and np.array_equal(y.numpy(), host[:, 1:])


def test_shuffled_is_deterministic_per_seed_and_rank(tmp_path, monkeypatch):
    make_shards(tmp_path, SHUFFLE_SIZES)
    files = tg.list_shards(str(tmp_path / "fineweb_train_*.bin"))
    same = [windows_of(shuffled(files, 0, 2, 1337), 20) for _ in range(2)]
    assert np.array_equal(same[0], same[1])
    assert not np.array_equal(same[0], windows_of(shuffled(files, 0, 2, 1338), 20))
    assert not np.array_equal(same[0], windows_of(shuffled(files, 1, 2, 1337), 20))
    # Through the settings too: SEED decides the order.
    by_seed = {}
    for seed in (1337, 1337, 99):
        rt = cpu_runtime(monkeypatch, **loader_env(tmp_path, TRAIN_LOADER="shuffled", TRAIN_PREFETCH=0, SEED=seed))
        loader = tg.make_train_loader(rt)
        by_seed.setdefault(seed, []).append(torch.stack([loader.next_batch()[0] for _ in range(10)]))
    assert torch.equal(by_seed[1337][0], by_seed[1337][1])
    assert not torch.equal(by_seed[1337][0], by_seed[99][0])


@pytest.mark.parametrize("rank", [0, 1])
def test_shuffled_rank_reads_its_own_shards_one_epoch_at_a_time(tmp_path, rank):
    world_size = 2
    shards = make_shards(tmp_path, SHUFFLE_SIZES)
    files = tg.list_shards(str(tmp_path / "fineweb_train_*.bin"))
    bases = np.array([int(s[0]) for s in shards])
    own = set(range(rank, len(shards), world_size))  # files[rank::world_size]
    wins = windows_of(shuffled(files, rank, world_size, 1234), 60)
    L = SEQ

    # Every window is a contiguous L+1 slice of one of this rank's shards.
    shard_of = np.searchsorted(bases, wins[:, 0], side="right") - 1
    starts = wins[:, 0] - bases[shard_of]
    for w, si, st in zip(wins, shard_of, starts):
        assert si in own, f"rank {rank} read shard {si}, owned by another rank"
        assert st + L + 1 <= SHUFFLE_SIZES[si]
        assert np.array_equal(w, shards[si][st:st + L + 1])

    # Epochs: within one, each shard's windows share a phase and every start of the cut is used exactly once.
    pos, epochs = 0, 0
    while True:
        phases = {}
        for si, st in zip(shard_of[pos:], starts[pos:]):
            phases.setdefault(int(si), int(st) % L)
            if len(phases) == len(own):
                break
        if len(phases) < len(own):
            break
        counts = {si: (SHUFFLE_SIZES[si] - 1 - ph) // L for si, ph in phases.items()}
        size = sum(counts.values())
        if pos + size > len(wins):
            break
        for si, ph in phases.items():
            n = SHUFFLE_SIZES[si]
            assert 0 <= ph <= min(L - 1, n - L - 1), (si, n, ph)
            used = sorted(int(st) for s, st in zip(shard_of[pos:pos + size], starts[pos:pos + size]) if s == si)
            assert used == [ph + j * L for j in range(counts[si])], (epochs, si)
        pos += size
        epochs += 1
    assert epochs >= 3, "the test draws too few windows to see several re-cuts"


def test_shuffled_needs_a_shard_per_rank(tmp_path, monkeypatch):
    make_shards(tmp_path, (400,))
    rt = cpu_runtime(monkeypatch, **loader_env(tmp_path, TRAIN_LOADER="shuffled", WORLD_SIZE=2, RANK=1))
    with pytest.raises(tg.ConfigError, match=r"TRAIN_LOADER=shuffled.*1 shards for WORLD_SIZE=2"):
        tg.make_train_loader(rt)


# ------------------------------------------------------------------------------- 4. worker failure

def test_truncated_shard_raises_in_the_caller_and_stops_the_thread(tmp_path, monkeypatch):
    sizes = (400, 333, 500)
    shards = make_shards(tmp_path, sizes)
    good_steps = (sizes[0] + sizes[1]) // (LOCAL + 1)  # micro-steps that end before the stream reaches it
    assert good_steps > 2 + 3  # the worker runs at most queue + 1 batches ahead: it has not opened shard 2
    want = spec_stream_batches(shards[:2], 1, 0, LOCAL, SEQ, good_steps)

    before = prefetch_threads()
    rt = cpu_runtime(monkeypatch, **loader_env(tmp_path, TRAIN_PREFETCH=1, TRAIN_PREFETCH_QUEUE=2))
    loader = tg.make_train_loader(rt)  # all shard headers are valid at start...
    bad = tmp_path / "fineweb_train_000002.bin"
    write_shard(bad, shards[2][:250], count=500)  # ...then shard 2 is cut short while the run goes on
    worker = loader._thread
    assert worker is not None and worker.is_alive()
    got = []

    def consume():
        while True:
            got.append(loader.next_batch())

    with pytest.raises(tg.ConfigError, match=r"fineweb_train_000002\.bin: size mismatch"):
        call_with_timeout(consume)
    assert_same_batches(got, [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in want], "before failure")
    assert loader._thread is None and not worker.is_alive()
    assert prefetch_threads() - before == set()
    with pytest.raises(RuntimeError):
        loader.next_batch()
    loader.shutdown()


def failing_producer(fail_at: int):
    """produce() whose batch k is filled with k, raising ValueError("boom") on call `fail_at`."""
    calls = []

    def produce():
        calls.append(1)
        if len(calls) == fail_at:
            raise ValueError("boom")
        return np.full(2 * SEQ + 1, len(calls), dtype=np.int32), None

    return produce


@pytest.mark.parametrize("threaded", [True, False])
def test_produce_exception_comes_out_after_the_good_batches(threaded):
    produce = failing_producer(fail_at=3)
    loader = tg.PrefetchingDistributedTokenLoader(produce, SEQ, CPU, queue_size=2, threaded=threaded,
                                                  copy_stream=False, name="test")
    worker = loader._thread
    try:
        for k in (1, 2):
            x, y = call_with_timeout(loader.next_batch)
            assert x.shape == (2, SEQ) and int(x[0, 0]) == k
        with pytest.raises(ValueError, match="^boom$"):
            call_with_timeout(loader.next_batch)
        if threaded:
            assert loader._thread is None and not worker.is_alive()
    finally:
        loader.shutdown()


def _truncation_data(tmp_path: Path, sample_data) -> tuple[Path, dict, np.ndarray]:
    data = tmp_path / "data"
    data.mkdir()
    src = Path(sample_data["DATA_PATH"])
    train0 = read_shard(src / "fineweb_train_000000.bin")
    per_step = 8 * (1024 // 8 + 1)  # TRAIN_BATCH_TOKENS=1024: 8 micro-steps of 128+1 tokens
    write_shard(data / "fineweb_train_000000.bin", train0[:6 * per_step + 50])  # room for 6 steps
    write_shard(data / "fineweb_train_000001.bin", train0[:4000])
    val = read_shard(src / "fineweb_val_000000.bin")
    write_shard(data / "fineweb_val_000000.bin", val[:8 * 128 + 1])
    env = {**TINY_ENV, "DATA_PATH": str(data), "TOKENIZER_PATH": sample_data["TOKENIZER_PATH"],
           "ITERATIONS": "1000", "WARMUP_STEPS": "1", "TRAIN_BATCH_TOKENS": "1024", "RUN_ID": "trunc",
           "EVAL_STRIDE": "0", "TTT_ENABLED": "0"}
    return data, env, train0


def _assert_one_line_shard_error(stderr: str, pattern: str = r"error: shard .*/fineweb_train_000001\.bin: "
                                                              r"size mismatch: .*") -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert re.fullmatch(pattern, last), last


def test_truncated_shard_at_start_stops_before_training(tmp_path, sample_data):
    data, env, train0 = _truncation_data(tmp_path, sample_data)
    write_shard(data / "fineweb_train_000001.bin", train0[:2000], count=4000)  # header promises more
    proc = run_training(env, tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train_loss" not in proc.stdout  # every shard header is checked before the first step
    _assert_one_line_shard_error(proc.stderr)


def _run_and_cut_after_step_1(cwd, env, cut):
    """Run train_gpt.py, call cut() once the step-1 train line is printed; returns (proc, stdout, stderr)."""
    full = {**clean_environ(), **env, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(REPO / "train_gpt.py")], cwd=cwd, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = []
        for line in proc.stdout:
            out.append(line)
            if line.startswith("step:1/1000 train_loss:"):
                cut()
                break
        rest, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, "".join(out) + rest, stderr


@pytest.mark.real_command
def test_truncated_shard_mid_training_exits_2_with_one_line(tmp_path, sample_data):
    """The shard goes bad while the run is going (valid at start): the prefetch thread hits it when the
    stream gets there, and the training loop exits with the thread's original error."""
    data, env, train0 = _truncation_data(tmp_path, sample_data)
    t0 = time.perf_counter()
    # once training runs, cut shard 1 short
    proc, stdout, stderr = _run_and_cut_after_step_1(
        tmp_path, env, lambda: write_shard(data / "fineweb_train_000001.bin", train0[:2000], count=4000))
    assert proc.returncode == 2, stderr[-3000:]
    assert time.perf_counter() - t0 < 240
    assert re.search(r"^step:2/1000 train_loss:", stdout, re.M), stdout[-2000:]  # it kept training until then
    _assert_one_line_shard_error(stderr)


def test_empty_train_shards_do_not_hang(tmp_path):
    for i in range(2):
        write_shard(tmp_path / f"fineweb_train_{i:06d}.bin", np.zeros(0, dtype=np.int64))
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import torch, train_gpt as tg\n"
            f"files = tg.list_shards({str(tmp_path / 'fineweb_train_*.bin')!r})\n"
            "try:\n"
            "    tg.DistributedTokenLoader(files, 0, 1, torch.device('cpu'), 64, 16).next_host()\n"
            "except tg.ConfigError as e:\n"
            "    print('config-error', e); sys.exit(0)\n"
            "sys.exit(1)\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10,
                              env={**clean_environ(), "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail("the stream loader spins forever on train shards without tokens")
    assert proc.returncode == 0 and "config-error" in proc.stdout, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------- 4b. shards changed or not shards

HEADER_BYTES = 256 * 4


def draw_until_error(loader, limit: int = 1000) -> tuple[list, Exception]:
    """Batches until the loader raises (under a watchdog); returns (the batches, the error)."""
    got = []

    def consume():
        for _ in range(limit):
            got.append(loader.next_batch())

    try:
        call_with_timeout(consume)
    except Exception as e:  # the error under test
        return got, e
    pytest.fail(f"no error within {limit} batches")


def assert_windows_of_positions(batches) -> None:
    """Shuffled batches over make_shards' first shard (id = position): each row is an intact window."""
    for x, y in batches:
        w = torch.cat([x, y[:, -1:]], dim=1).numpy()
        assert np.array_equal(w, w[:, :1] + np.arange(SEQ + 1))


@pytest.mark.parametrize("loader_kind", ["stream", "shuffled"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_shard_truncated_while_in_use_is_a_one_line_error(tmp_path, monkeypatch, loader_kind, prefetch):
    """Cutting short the shard being read killed a memory-mapped run with SIGBUS (exit 135, no message):
    the loader must raise a one-line ConfigError naming the file, through the prefetch thread too."""
    (shard,) = make_shards(tmp_path, (3000,))
    path = tmp_path / "fineweb_train_000000.bin"
    before = prefetch_threads()
    rt = cpu_runtime(monkeypatch, **loader_env(tmp_path, TRAIN_LOADER=loader_kind, TRAIN_PREFETCH=prefetch))
    loader = tg.make_train_loader(rt)
    keep = 1500
    try:
        assert isinstance(loader, tg.PrefetchingDistributedTokenLoader) == bool(prefetch)
        got = [call_with_timeout(loader.next_batch)]
        os.truncate(path, HEADER_BYTES + 2 * keep)
        more, err = draw_until_error(loader)
        got += more
    finally:
        loader.shutdown()
    assert type(err) is tg.ConfigError, repr(err)
    assert re.fullmatch(rf"shard {re.escape(str(path))}: truncated while in use \([^\n]*\)", str(err)), str(err)
    assert prefetch_threads() - before == set()
    if loader_kind == "stream":  # every batch before the cut comes out, in order; the one past it fails
        want = spec_stream_batches([shard], 1, 0, LOCAL, SEQ, keep // (LOCAL + 1))
        assert_same_batches(got, [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in want], "before the cut")
    else:
        assert_windows_of_positions(got)


@pytest.mark.real_command
def test_shard_truncated_in_use_mid_training_exits_2_with_one_line(tmp_path, sample_data):
    """End to end: shard 0 is cut short while the run reads it (valid at start)."""
    data, env, train0 = _truncation_data(tmp_path, sample_data)
    shard0 = data / "fineweb_train_000000.bin"
    per_step = 8 * (1024 // 8 + 1)
    # At step 1 the stream is within step 2 (prefetch runs a few micro-steps ahead); leave room for 3 steps of 6.
    proc, stdout, stderr = _run_and_cut_after_step_1(
        tmp_path, env, lambda: os.truncate(shard0, HEADER_BYTES + 2 * 3 * per_step))
    assert proc.returncode == 2, f"exit {proc.returncode} (135 or -7: SIGBUS): {stderr[-3000:]}"
    assert re.search(r"^step:3/1000 train_loss:", stdout, re.M), stdout[-2000:]
    _assert_one_line_shard_error(stderr, r"error: shard .*/fineweb_train_000000\.bin: truncated while in use \(.*\)")


@pytest.mark.parametrize("loader_kind", ["stream", "shuffled"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_train_token_past_vocab_is_a_one_line_error(tmp_path, monkeypatch, loader_kind, prefetch):
    """Train ids >= VOCAB_SIZE went unnoticed until an embedding lookup crashed; each span read is checked."""
    rng = np.random.default_rng(0)
    shards = [rng.integers(0, 1024, 500), rng.integers(0, 1024, 700)]
    shards[1][300] = 1500  # stream position 800
    for i, toks in enumerate(shards):
        write_shard(tmp_path / f"fineweb_train_{i:06d}.bin", toks)
    rt = cpu_runtime(monkeypatch, **loader_env(tmp_path, TRAIN_LOADER=loader_kind, TRAIN_PREFETCH=prefetch,
                                               VOCAB_SIZE=1024))
    loader = tg.make_train_loader(rt)
    try:
        got, err = draw_until_error(loader)
    finally:
        loader.shutdown()
    assert type(err) is tg.ConfigError, repr(err)
    assert str(err) == f"shard {tmp_path / 'fineweb_train_000001.bin'}: token id 1500 >= VOCAB_SIZE=1024"
    if loader_kind == "stream":
        want = spec_stream_batches(shards, 1, 0, LOCAL, SEQ, 800 // (LOCAL + 1))
        assert_same_batches(got, [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in want], "before the bad id")
    else:
        assert all(int(x.max()) < 1024 and int(y.max()) < 1024 for x, y in got)


def test_train_token_past_vocab_stops_the_run_with_one_line(tmp_path, sample_data):
    data, env, train0 = _truncation_data(tmp_path, sample_data)
    bad = train0[:6 * 8 * 129 + 50].copy()
    bad[200] = 1024  # in the second micro-batch of the first (warmup) step
    write_shard(data / "fineweb_train_000000.bin", bad)
    proc = run_training(env, tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _assert_one_line_shard_error(proc.stderr,
                                 r"error: shard .*/fineweb_train_000000\.bin: token id 1024 >= VOCAB_SIZE=1024")


def test_non_regular_shards_are_refused_without_hanging(tmp_path, monkeypatch):
    """open() of a FIFO blocks until a writer comes: a FIFO shard hung the run. Refused before opening."""
    make_shards(tmp_path, (400,))
    fifo = tmp_path / "fineweb_train_000001.bin"
    os.mkfifo(fifo)
    want = rf"^shard {re.escape(str(fifo))}: not a regular file$"
    with pytest.raises(tg.ConfigError, match=want):
        call_with_timeout(lambda: tg.read_shard_header(fifo), timeout=10)
    for kind in ("stream", "shuffled"):
        rt = cpu_runtime(monkeypatch, **loader_env(tmp_path, TRAIN_LOADER=kind, TRAIN_PREFETCH=1))
        with pytest.raises(tg.ConfigError, match=want):
            call_with_timeout(lambda: tg.make_train_loader(rt), timeout=10)
    val_fifo = tmp_path / "fineweb_val_000000.bin"
    os.mkfifo(val_fifo)
    with pytest.raises(tg.ConfigError, match=rf"^shard {re.escape(str(val_fifo))}: not a regular file$"):
        call_with_timeout(lambda: tg.load_validation_tokens(str(tmp_path / "fineweb_val_*.bin"), SEQ, 2**16),
                          timeout=10)
    (tmp_path / "dir").mkdir()
    with pytest.raises(tg.ConfigError, match=r"dir: not a regular file$"):
        tg.read_shard_header(tmp_path / "dir")
    # A symlink to a regular shard is a shard.
    os.symlink(tmp_path / "fineweb_train_000000.bin", tmp_path / "link.bin")
    assert tg.read_shard_header(tmp_path / "link.bin") == 400


# ------------------------------------------------------------------------------- 5. shutdown

def test_shutdown_joins_and_freezes_the_stream(tmp_path):
    make_shards(tmp_path, ODD_SIZES)
    files = tg.list_shards(str(tmp_path / "fineweb_train_*.bin"))
    base = tg.DistributedTokenLoader(files, 0, 1, CPU, LOCAL, SEQ)
    calls = [0]

    def produce():
        calls[0] += 1
        return base.next_host(), None

    queue_size = 2
    loader = tg.PrefetchingDistributedTokenLoader(produce, SEQ, CPU, queue_size=queue_size, threaded=True,
                                                  copy_stream=False, name="test")
    worker = loader._thread
    taken = 5
    for _ in range(taken):
        call_with_timeout(loader.next_batch)
    deadline = time.monotonic() + 10
    while calls[0] < taken + queue_size and time.monotonic() < deadline:
        time.sleep(0.01)  # let the worker fill the queue
    time.sleep(0.1)
    # Bounded run-ahead: the queue plus the one batch the worker holds while the queue is full.
    assert calls[0] <= taken + queue_size + 1, calls[0]
    loader.shutdown()
    assert loader._thread is None and not worker.is_alive()
    frozen = (calls[0], base.stream.file_idx, base.stream.pos)
    time.sleep(0.3)
    assert (calls[0], base.stream.file_idx, base.stream.pos) == frozen
    with pytest.raises(RuntimeError, match="shutdown"):
        loader.next_batch()
    loader.shutdown()  # twice is fine
    assert (calls[0], base.stream.file_idx, base.stream.pos) == frozen


def test_warmup_and_restore_restarts_the_prefetched_stream(tiny_env, monkeypatch):
    before = prefetch_threads()
    set_env(monkeypatch, tiny_env, WARMUP_STEPS=2, TRAIN_PREFETCH=1, TRAIN_BATCH_TOKENS=1024,
            NUM_LAYERS=2, VE_LAYERS="1", XSA_LAST_N=1)
    h = tg.Hyperparameters()
    rt = tg.Runtime(h, CPU, False, True, None)
    assert rt.train_prefetch
    trainer = tg.Trainer(rt, tg.build_model(h))
    loader = tg.warmup_and_restore(rt, trainer)
    try:
        assert isinstance(loader, tg.PrefetchingDistributedTokenLoader)
        # Only the new loader's thread is left: the warmup loader was shut down before the rewind.
        assert prefetch_threads() - before == {loader._thread}
        got = call_with_timeout(lambda: draw(loader, 10))
    finally:
        loader.shutdown()
    set_env(monkeypatch, tiny_env, TRAIN_PREFETCH=0, TRAIN_COPY_STREAM=0, TRAIN_BATCH_TOKENS=1024,
            NUM_LAYERS=2, VE_LAYERS="1", XSA_LAST_N=1)
    fresh = tg.make_train_loader(tg.Runtime(tg.Hyperparameters(), CPU, False, True, None))
    assert_same_batches(got, draw(fresh, 10), "after warmup")


# ------------------------------------------------------------------------------- 6. finite source

@pytest.mark.parametrize("threaded", [True, False])
def test_finite_source_ends_with_stop_iteration_and_carries_aux(threaded):
    items = [np.arange(k * 100, k * 100 + 3 * SEQ + 1, dtype=np.int32) for k in range(5)]
    it = iter(items)

    def produce():
        arr = next(it, None)
        return None if arr is None else (arr, f"aux{int(arr[0]) // 100}")

    loader = tg.PrefetchingDistributedTokenLoader(produce, SEQ, CPU, queue_size=2, threaded=threaded,
                                                  copy_stream=False, name="test")
    worker = loader._thread
    try:
        for k, arr in enumerate(items):
            if k % 2 == 0:  # inside inference mode, as evaluation calls it (in this thread: the mode is per thread)
                with torch.inference_mode():
                    x, y, aux = loader.next()
            else:  # outside, as training calls it
                x, y, aux = call_with_timeout(loader.next)
            # ordinary tensors either way, whichever thread made them: compiled graphs guard on inference tensors
            # (an unthreaded val loader's batches compiled a graph inside the evaluation timer, issue 35)
            assert not x.is_inference() and not y.is_inference()
            assert aux == f"aux{k}"
            assert x.dtype == torch.int64 and x.shape == (3, SEQ)
            assert np.array_equal(x.reshape(-1).numpy(), arr[:-1]) and np.array_equal(y.reshape(-1).numpy(), arr[1:])
        for _ in range(3):
            with pytest.raises(StopIteration):
                call_with_timeout(loader.next)
        if threaded:
            worker.join(timeout=10)
            assert not worker.is_alive()
    finally:
        loader.shutdown()
    with pytest.raises(StopIteration):  # the end stays the end, even after shutdown
        loader.next()


# ------------------------------------------------------------------------------- 7. validation

@pytest.fixture
def val_setup(tiny_env, monkeypatch):
    set_env(monkeypatch, tiny_env, NUM_LAYERS=2, VE_LAYERS="1", XSA_LAST_N=1)
    h = tg.Hyperparameters()
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    full = tg.load_validation_tokens(h.val_files, 128, h.vocab_size)
    val = full[:12 * 128 + 1].clone()  # 12 sequences: one batch of 8, then a ragged one of 4
    # Put a boundary token before some leading-space pieces, so that the byte count depends on the previous
    # token (the sample text never has that pair).
    boundary_id = int(luts.is_boundary.nonzero()[0])
    spaced = (luts.has_leading_space[val[1:].long()]).nonzero().flatten()
    val[spaced[::25]] = boundary_id
    assert bool((luts.is_boundary[val[:-1].long()] & luts.has_leading_space[val[1:].long()]).any())
    model = tg.build_model(h)
    return tiny_env, luts, val, model


def run_eval(monkeypatch, env, luts, val, model, log_path=None, **over):
    set_env(monkeypatch, env, NUM_LAYERS=2, VE_LAYERS="1", XSA_LAST_N=1, **over)
    rt = tg.Runtime(tg.Hyperparameters(), CPU, False, True, log_path)
    return rt, tg.eval_val(rt, model, val, luts)


def test_eval_val_is_the_same_with_and_without_prefetch(val_setup, monkeypatch, tmp_path):
    env, luts, val, model = val_setup
    results = {}
    for prefetch, bytecount in ((0, "cpu"), (1, "cpu"), (1, "cuda"), (0, "cuda")):
        # VAL_BYTECOUNT_DEVICE=cuda on a CPU runtime exercises the device-side count on the CPU device.
        rt, results[(prefetch, bytecount)] = run_eval(monkeypatch, env, luts, val, model, VAL_PREFETCH=prefetch,
                                                      VAL_BYTECOUNT_DEVICE=bytecount)
        assert rt.val_prefetch == bool(prefetch)
    first = results[(0, "cpu")]
    assert all(r == first for r in results.values()), results
    loss, bpb = first
    tokens = val.numel() - 1
    nbytes = float(luts.count(val[:-1], val[1:]).sum())
    assert math.isclose(bpb, loss / math.log(2.0) * tokens / nbytes, rel_tol=1e-12)


def test_val_progress_lines(val_setup, monkeypatch, tmp_path):
    env, luts, val, model = val_setup
    log = tmp_path / "val.txt"
    run_eval(monkeypatch, env, luts, val, model, log_path=log, VAL_PREFETCH=1, VAL_PROGRESS_LOG_EVERY=1)
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("val_progress:")]
    assert [re.match(r"val_progress: batch:(\d+)/2 elapsed:\d+ms$", ln).group(1) for ln in lines] == ["1", "2"]
    quiet = tmp_path / "quiet.txt"
    run_eval(monkeypatch, env, luts, val, model, log_path=quiet, VAL_PREFETCH=1)
    assert not quiet.exists() or "val_progress" not in quiet.read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_bytecount_is_refused_without_cuda(tiny_env, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # setup_runtime would create logs/ in the cwd
    set_env(monkeypatch, tiny_env, VAL_BYTECOUNT_DEVICE="cuda")
    with pytest.raises(tg.ConfigError, match="VAL_BYTECOUNT_DEVICE"):
        tg.setup_runtime(tg.Hyperparameters())


# ------------------------------------------------------------------------------- 8. bad settings

@pytest.mark.parametrize("name,value", [
    ("TRAIN_LOADER", "random"), ("TRAIN_PREFETCH_QUEUE", "0"), ("TRAIN_PREFETCH", "2"),
    ("TRAINING_TIMING_EVERY", "0"), ("PROFILE_STEPS", "5"), ("PROFILE_STEPS", "8:3"),
    ("VAL_BYTECOUNT_DEVICE", "gpu"), ("TRAIN_COPY_STREAM", "yes"), ("VAL_PROGRESS_LOG_EVERY", "-1"),
])
def test_bad_data_path_setting_names_the_variable(tiny_env, monkeypatch, name, value):
    set_env(monkeypatch, tiny_env, **{name: value})
    with pytest.raises(tg.ConfigError) as err:
        tg.Hyperparameters()
    assert str(err.value).startswith(f"{name}=")


def test_bad_setting_stops_the_script_with_one_line(tmp_path, sample_data):
    proc = run_training({**TINY_ENV, **sample_data, "TRAIN_LOADER": "random"}, tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "error: TRAIN_LOADER='random' must be stream or shuffled or packed"
    assert not (tmp_path / "logs").exists()


# ------------------------------------------------------------------------------- 9. logs of a tiny run

@pytest.fixture(scope="module")
def small_data(sample_data, tmp_path_factory) -> dict[str, str]:
    """The sample set with a 1024-token validation shard, so the end-of-run evaluations stay short."""
    return short_val_data(sample_data, tmp_path_factory.mktemp("small"), 8 * 128 + 1)


def tiny_run_env(small_data, run_id, **over) -> dict[str, str]:
    env = {**TINY_ENV, **small_data, "ITERATIONS": "4", "TRAIN_BATCH_TOKENS": "1024", "EVAL_STRIDE": "0",
           "TTT_ENABLED": "0", "RUN_ID": run_id}
    env.update({k: str(v) for k, v in over.items()})
    return env


def step_lines(out: str) -> list[str]:
    return re.findall(r"^step:\d+/4 train_loss:.*$", out, re.M)


def test_run_logs_data_wait_and_profile(tmp_path, small_data):
    proc = run_training(tiny_run_env(small_data, "dp", PROFILE=1, PROFILE_STEPS="2:4"), tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    lines = step_lines(out)
    assert len(lines) == 4
    assert all(re.search(r" data_wait_ms:\d+\.\d\d$", ln) for ln in lines), lines
    assert re.search(r"^data_wait: total_ms:\d+\.\d mean_ms_per_step:\d+\.\d+ max_step_ms:\d+\.\d+$", out, re.M)
    assert re.search(r"^data_path: loader:stream train_prefetch:1 queue:2 train_copy_stream:0 val_prefetch:1 ",
                     out, re.M), out
    assert "timing step:" not in out
    trace = tmp_path / "logs" / "dp_profile_rank0.json"
    assert trace.exists(), os.listdir(tmp_path / "logs")
    events = json.loads(trace.read_text())["traceEvents"]
    assert isinstance(events, list) and events
    assert "profile: steps 2..3 written to" in out
    assert "data_path: loader:stream" in read_log(tmp_path, "dp")


def test_run_logs_timing_breakdown(tmp_path, small_data):
    proc = run_training(tiny_run_env(small_data, "tb", TRAINING_TIMING_BREAKDOWN=1), tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert all(re.search(r" data_wait_ms:\d+\.\d\d$", ln) for ln in step_lines(out))
    fields = " ".join(rf"{k}_ms:\d+\.\d\d" for k in ("batch_cpu", "h2d", "forward", "backward", "clip",
                                                       "optimizer", "val"))
    timing = re.findall(rf"^timing step:(\d+) steps:1 {fields}$", out, re.M)
    assert timing == ["1", "2", "3", "4"], out
    line = re.search(r"^data_path: .*$", out, re.M).group(0)
    assert "train_prefetch:0" in line and "val_prefetch:0" in line and "train_copy_stream:0" in line
    assert "TRAINING_TIMING_BREAKDOWN=1 turns prefetch and copy streams off" in line
    assert re.search(r"^data_wait: total_ms:", out, re.M)


# ------------------------------------------------------------------------------- 10. CUDA only

def cuda_loaders(tmp_path, monkeypatch, **over):
    """(plain, copy-stream) train loaders over the same shards on the CUDA device."""
    make_shards(tmp_path, (5003, 4099, 6007))
    dev = torch.device("cuda", 0)
    set_env(monkeypatch, loader_env(tmp_path, TRAIN_PREFETCH=0, TRAIN_COPY_STREAM=0, **over))
    plain = tg.make_train_loader(tg.Runtime(tg.Hyperparameters(), dev, False, True, None))
    set_env(monkeypatch, loader_env(tmp_path, TRAIN_PREFETCH=1, TRAIN_COPY_STREAM=1, **over))
    rt = tg.Runtime(tg.Hyperparameters(), dev, False, True, None)
    assert rt.train_copy_stream and rt.train_prefetch
    fast = tg.make_train_loader(rt)
    assert fast.copy_stream is not None
    return plain, fast


@CUDA_ONLY
@pytest.mark.parametrize("loader_kind", ["stream", "shuffled"])
def test_copy_stream_batches_equal_plain_under_a_busy_compute_stream(tmp_path, monkeypatch, loader_kind):
    plain, fast = cuda_loaders(tmp_path, monkeypatch, TRAIN_LOADER=loader_kind)
    try:
        a = torch.randn(4096, 4096, device="cuda")
        kept = []
        for _ in range(40):
            for _ in range(4):
                a = (a @ a).tanh_()  # keeps the compute stream busy while the next copy is issued
            x, y = fast.next_batch()
            assert x.device.type == "cuda" and x.dtype == torch.int64 and y.dtype == torch.int64
            kept.append((x.clone(), y.clone()))  # reads on the compute stream, ordered after the copy
        torch.cuda.synchronize()
        assert_same_batches(kept, draw(plain, 40), "copy stream")
    finally:
        fast.shutdown()


@CUDA_ONLY
def test_record_stream_keeps_held_batches_intact(tmp_path, monkeypatch):
    plain, fast = cuda_loaders(tmp_path, monkeypatch)
    try:
        want = draw(plain, 60)
        held = []
        for _ in range(30):  # held batches survive allocations and later copies
            x, y = fast.next_batch()
            held.append((x, y))
            junk = [torch.full((x.numel() + 1,), -1, dtype=torch.int64, device="cuda") for _ in range(8)]
            big = torch.randn(2048, 2048, device="cuda")
            for _ in range(3):
                big = big @ big
            del junk, big
        torch.cuda.synchronize()
        assert_same_batches(held, want[:30], "held")
        # Dropped while the compute stream still has to read them: record_stream must keep the copy
        # stream from refilling that memory with a later batch before the queued read has run.
        a = torch.randn(4096, 4096, device="cuda")
        late = []
        for _ in range(30):
            for _ in range(3):
                a = (a @ a).tanh_()
            x, y = fast.next_batch()
            late.append((x.clone(), y.clone()))
            del x, y
        torch.cuda.synchronize()
        assert_same_batches(late, want[30:], "dropped")
    finally:
        fast.shutdown()


@CUDA_ONLY
def test_pinned_ring_is_reused(tmp_path, monkeypatch):
    _, fast = cuda_loaders(tmp_path, monkeypatch, TRAIN_PREFETCH_QUEUE=3)
    try:
        for _ in range(200):
            x, y = fast.next_batch()
            assert x.is_cuda and x.dtype == torch.int64 and y.is_cuda and y.dtype == torch.int64
        torch.cuda.synchronize()
        assert len(fast._ring) <= 3 + 3
        assert all(slot[0].is_pinned() for slot in fast._ring)
    finally:
        fast.shutdown()


@CUDA_ONLY
def test_cuda_bytecount_equals_cpu_bytecount(val_setup, monkeypatch):
    env, luts, val, model = val_setup
    model = model.cuda()
    results = []
    for bytecount in ("cpu", "cuda"):
        set_env(monkeypatch, env, NUM_LAYERS=2, VE_LAYERS="1", XSA_LAST_N=1, VAL_BYTECOUNT_DEVICE=bytecount)
        rt = tg.Runtime(tg.Hyperparameters(), torch.device("cuda", 0), False, True, None)
        assert rt.val_copy_stream
        results.append(tg.eval_val(rt, model, val, luts))
    tokens = val.numel() - 1
    implied_bytes = [tokens * loss / math.log(2.0) / bpb for loss, bpb in results]
    assert math.isclose(implied_bytes[0], implied_bytes[1], rel_tol=1e-9), results
    assert math.isclose(results[0][0], results[1][0], rel_tol=1e-6), results


@CUDA_ONLY
def test_copy_stream_failure_comes_after_the_good_batches():
    produce = failing_producer(fail_at=3)
    loader = tg.PrefetchingDistributedTokenLoader(produce, SEQ, torch.device("cuda", 0), queue_size=2,
                                                  threaded=True, copy_stream=True, name="test")
    try:
        for k in (1, 2):
            x, _ = call_with_timeout(loader.next_batch)
            assert int(x[0, 0]) == k
        with pytest.raises(ValueError, match="^boom$"):
            call_with_timeout(loader.next_batch)
    finally:
        loader.shutdown()


# ------------------------------------------------------------------------------- bench script

def test_bench_loader_quick_prints_the_table(tmp_path):
    # --quick with fewer and shorter simulated steps (a sleep on CPU): this checks the table's rows, not its timings
    # (the suite's time, issue 53: 16.7 s -> 2.1 s); --steps and --step-ms given beside --quick keep their values
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_loader.py"), "--quick", "--device",
                           "cpu", "--steps", "6", "--prod-steps", "4", "--step-ms", "20"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**clean_environ(), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    header = ("| loader | mode | tokens/s/rank | mean wait ms | p99 wait ms | max wait ms | "
              "max wait at shard crossing ms | wait/step % of step-ms | H2D bytes/step |")
    assert header in out, out
    for loader in ("stream", "shuffled", "packed"):
        for mode in ("plain", "prefetch"):
            assert re.search(rf"^\| {loader} \| {mode} \| [\d,]+ \|", out, re.M), out
        assert re.search(rf"^\| {loader} \| prefetch\+copy stream \| skipped", out, re.M), out
    assert "targets" in out.lower()
    assert "timed: 6 steps of 20 ms per configuration, production over 4 steps after 2 warm-up steps" in out
