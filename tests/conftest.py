"""Shared fixtures: the offline sample data (built once per session), a tiny model configuration, and
helpers to run train_gpt.py as a user would (python or torchrun, in a scratch directory)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import launcher

# Inductor's compilations (the in-process Inductor tests, the interpreted kernels' process) in the process that asks for
# them, not in a pool of compile workers that each import torch first (issue 69: 3 to 4 s of CPU a process that compiles
# with Inductor, warm cache or cold; the same generated code). Read when torch._inductor is imported; a value the
# developer set is kept.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "train_gpt.py"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# A model small enough for 2 CPU cores: 4 layers, width 64, sequences of 128, 1,024 tokens a step (one sequence in each
# of the record's 8 micro-batches; issue 69: at 4,096 the default preset's tiny run took 5.9 s of CPU, now 4.8).
TINY_ENV = {
    "NUM_LAYERS": "4", "MODEL_DIM": "64", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "VE_LAYERS": "2,3",
    "XSA_LAST_N": "2", "TRAIN_SEQ_LEN": "128", "EVAL_SEQ_LEN": "128", "TRAIN_BATCH_TOKENS": "1024",
    "VAL_BATCH_SIZE": "8192", "ITERATIONS": "4", "WARMUP_STEPS": "1", "WARMDOWN_ITERS": "2",
    "MAX_WALLCLOCK_SECONDS": "0", "VAL_LOSS_EVERY": "0", "TRAIN_LOG_EVERY": "1", "TTT_CHUNK_TOKENS": "4096",
    "EVAL_BATCH_SEQS": "16", "TTT_BATCH_SEQS": "8", "SEED": "1337",
}

# Every variable train_gpt.py reads; cleared so the developer's shell cannot leak into a test.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def shared_folder(tmp_path_factory) -> Path:
    """A folder that every pytest-xdist worker of this test session sees (the session's base temporary folder; under
    xdist each worker's is a subfolder of it)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    folder.mkdir(exist_ok=True)
    return folder


def computed_once(folder: Path, build) -> Path:
    """`folder`, made by build(scratch) once for the whole session, whichever worker asks first: it builds under an
    exclusive lock and renames the scratch folder into place; a worker asking meanwhile waits for the lock and uses
    it (no data set or run made twice). A build that raises leaves nothing, and the next asker tries again."""
    import fcntl
    import shutil

    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not folder.exists():
            scratch = folder.parent / f"{folder.name}.building"
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir()
            build(scratch)
            scratch.rename(folder)
    return folder


def derived_cache_root() -> Path | None:
    """Where derived files outlive the session (derived_once): TEST_CACHE if set ("off" or "0": nowhere), else
    $XDG_CACHE_HOME/parameter-golf/tests (~/.cache/parameter-golf/tests)."""
    value = os.environ.get("TEST_CACHE", "").strip()
    if value.lower() in ("off", "0"):
        return None
    if value:
        return Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "parameter-golf" / "tests"


# The code packing and specialising tools (scripts/pack/*.py, which import one another): every derivation made by one
# of them is keyed by all of them.
PACK_TOOLS = tuple(sorted((REPO / "scripts" / "pack").glob("*.py")))
TEST_CACHE_ENTRIES = 48  # the most recently used entries kept (a specialisation's is about 0.7 MB)
# The installed packages whose versions are part of every derived_once key: what the specialiser (torch's classes),
# the packer (its compressors) and the data tools (sentencepiece, NumPy) may give other bytes with.
DERIVED_FROM_PACKAGES = ("torch", "numpy", "brotli", "zpaq", "sentencepiece", "triton")


def derived_once(tmp_path_factory, name: str, inputs: tuple, build) -> Path:
    """The session's folder `name` (computed_once) made by build(out), a pure function of `inputs` (file paths,
    whose bytes count, and strings: a run's settings): made in one session, copied in the next from the test cache
    (derived_cache_root), keyed by the sha256 of the inputs, Python's version and DERIVED_FROM_PACKAGES'. For what
    takes seconds to make and is no test's subject there: a specialisation, a pack (the runs that use them are the
    tests; the tools themselves run in tests of their own). Each cached file is checked against the sha256 it was
    stored with: a damaged entry is made again."""
    import hashlib
    import importlib.metadata
    import json
    import shutil

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    digest = hashlib.sha256(repr((name, sys.version, [version(d) for d in DERIVED_FROM_PACKAGES])).encode())
    for part in inputs:
        digest.update(part.read_bytes() if isinstance(part, Path) else str(part).encode())
    key = digest.hexdigest()[:24]
    root = derived_cache_root()

    def copy_in(out: Path) -> bool:
        entry = root / f"{name}_{key}"
        try:
            sums = json.loads((entry / "sha256.json").read_text())
            files = {rel: (entry / "files" / rel).read_bytes() for rel in sums}
        except (OSError, ValueError, TypeError):
            return False
        if any(hashlib.sha256(data).hexdigest() != sums[rel] for rel, data in files.items()):
            return False
        for rel, data in files.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_bytes(data)
        os.utime(entry)  # recently used
        return True

    def store(out: Path) -> None:
        entry = root / f"{name}_{key}"
        scratch = root / f".{name}_{key}.{os.getpid()}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.copytree(out, scratch / "files", symlinks=False)
            sums = {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
                    for p in sorted(out.rglob("*")) if p.is_file()}
            (scratch / "sha256.json").write_text(json.dumps(sums))
            shutil.rmtree(entry, ignore_errors=True)  # a damaged one
            scratch.rename(entry)
            entries = sorted((p for p in root.iterdir() if not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)
            for old in entries[:-TEST_CACHE_ENTRIES]:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass  # a cache that cannot be written only costs the next session the time
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def make(out: Path) -> None:
        if root is None or not copy_in(out):
            build(out)
            if root is not None:
                store(out)

    return computed_once(shared_folder(tmp_path_factory) / f"{name}_{key}", make)


def packed_script(tmp_path_factory) -> tuple[str, str]:
    """(minified, packed) train_gpt.py as scripts/pack/pack_code.py makes them (the pack checks itself), made once for
    the session (derived_once: kept for the next while the script and the packer are unchanged): the packing tests
    and the size check read the same pack."""
    sys.path.insert(0, str(REPO / "scripts" / "pack"))
    import pack_code

    def build(out: Path) -> None:
        minified = pack_code.minify(SCRIPT.read_text(encoding="utf-8"))
        (out / "minified.py").write_text(minified, encoding="utf-8")
        (out / "packed.py").write_text(pack_code.pack_minified(minified), encoding="utf-8")

    folder = derived_once(tmp_path_factory, "packed_train_gpt", (SCRIPT, *PACK_TOOLS), build)
    return (folder / "minified.py").read_text(encoding="utf-8"), (folder / "packed.py").read_text(encoding="utf-8")


def build_sample(out: Path, *args: str) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "data" / "build_sample_data.py"), "--out-dir", str(out), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


# The sample's val tokens the tests' runs read (SAMPLE_VAL_TOKENS - 1 targets): 2 batches of VAL_BATCH_SIZE=8192 for one
# process, 4 TTT chunks of TTT_CHUNK_TOKENS=4096 (TINY_ENV's). The sample has 32,769: half as many keep what the runs
# test at about half the cost of each evaluation over them (issue 69).
SAMPLE_VAL_TOKENS = 16 * 1024 + 1


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory) -> dict[str, str]:
    """The offline sample dataset (data/build_sample_data.py), built once for the session, with the first
    SAMPLE_VAL_TOKENS tokens of its val shard (short_val_data); returns DATA_PATH and TOKENIZER_PATH."""
    folder = shared_folder(tmp_path_factory)
    built = computed_once(folder / "sample", build_sample)
    full = {"DATA_PATH": str(built / "datasets" / "sample_sp1024"),
            "TOKENIZER_PATH": str(built / "tokenizers" / "sample_1024_bpe.model")}
    out = computed_once(folder / "sample_val", lambda out: short_val_data(full, out, SAMPLE_VAL_TOKENS))
    return {"DATA_PATH": str(out), "TOKENIZER_PATH": full["TOKENIZER_PATH"]}


def short_val_data(sample_data: dict[str, str], out: Path, val_tokens: int) -> dict[str, str]:
    """DATA_PATH in `out`: the sample train shards (linked) and one val shard of the first `val_tokens` tokens,
    so the end-of-run evaluations stay short."""
    import numpy as np

    import train_gpt as tg

    src = Path(sample_data["DATA_PATH"])
    for f in sorted(src.glob("fineweb_train_*.bin")):
        (out / f.name).symlink_to(f)
    val = np.concatenate([tg.load_shard(f) for f in sorted(src.glob("fineweb_val_*.bin"))])[:val_tokens]
    header = np.zeros(256, dtype="<i4")
    header[:3] = (tg.SHARD_MAGIC, tg.SHARD_VERSION, val.size)
    (out / "fineweb_val_000000.bin").write_bytes(header.tobytes() + val.astype("<u2").tobytes())
    return {"DATA_PATH": str(out), "TOKENIZER_PATH": sample_data["TOKENIZER_PATH"]}


def hide_modules(monkeypatch, *names: str) -> None:
    """importlib.util.find_spec answers None for `names` (as on a machine without those packages) for one test."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in names else find_spec(name, *a))


def config_error(environ: dict[str, str]) -> str:
    """The message of the ConfigError that Hyperparameters(environ) raises, checked to be one line."""
    import train_gpt as tg

    with pytest.raises(tg.ConfigError) as err:
        tg.Hyperparameters(environ)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def clean_environ() -> dict[str, str]:
    """os.environ without torchrun's variables (a test decides world size itself)."""
    return {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}


@pytest.fixture
def tiny_env(monkeypatch, sample_data) -> dict[str, str]:
    """Sets the tiny configuration in os.environ (for in-process Hyperparameters()) and returns it."""
    for k in _TORCHRUN_VARS:
        monkeypatch.delenv(k, raising=False)
    env = {**TINY_ENV, **sample_data}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def run_training(env: dict[str, str], cwd: Path, nproc: int = 0, timeout: int = 600,
                 real: bool = False, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    """Runs train_gpt.py (or `script`, a wrapper that runs it: WORK_CLOCK_RUN) in `cwd` with `env` added, as
    `python3 train_gpt.py` (nproc=0) or `torchrun --standalone --nproc_per_node=nproc train_gpt.py` would: forked
    from the worker's zygote (tests/launcher.py: the same program without paying the imports again), or with `real`
    through those very commands. As torchrun's, a failed nproc run's exit status is 1."""
    full = {**clean_environ(), **env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
    if real:
        cmd = [sys.executable, str(script)]
        if nproc > 0:
            cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)
    if nproc > 0:
        proc = launcher.run_ranks([script], full, cwd, nproc, timeout=timeout)
        proc.returncode = 1 if proc.returncode else 0
        return proc
    return launcher.run([script], full, cwd, timeout=timeout)


# train_gpt.py on a clock the test controls (issue 69): time.perf_counter() (the only clock the script reads) returns
# the work the run has done, not the time it took: the matmul FLOPs of the main thread's ops so far (forward and
# backward, counted by a dispatch mode with PyTorch's own FLOP formulas, torch.utils.flop_counter's, and linear's) at GFLOPS
# GFLOP/s, plus 1 ms for each earlier reading in the same thread. The same run reads the same times, and decides the
# same, on a fast, slow or busy machine, and its costs keep their proportions (a TTT training step costs what its
# matmuls cost). Write it with .format(repo=..., gflops=...) and run it with run_training(script=...).
WORK_CLOCK_RUN = """
import sys, threading, time
sys.path.insert(0, {repo!r})
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
import train_gpt as tg

class WorkClock(TorchDispatchMode):
    def __init__(self, flops_per_s):
        super().__init__()
        self.flops, self.flops_per_s, self.readings = 0, flops_per_s, {{}}
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {{}}))
        if func._overloadpacket is torch.ops.aten.linear:  # not decomposed under inference mode; not in the registry
            self.flops += 2 * out.numel() * args[1].shape[-1]
        elif func._overloadpacket in flop_registry:
            self.flops += flop_registry[func._overloadpacket](*args, **(kwargs or {{}}), out_val=out)
        return out
    def perf_counter(self):
        me = threading.get_ident()
        self.readings[me] = self.readings.get(me, 0) + 1
        return self.readings[me] * 1e-3 + self.flops / self.flops_per_s

clock = WorkClock({gflops!r} * 1e9)
tg.time = type("Time", (), {{"perf_counter": staticmethod(clock.perf_counter)}})
with clock:
    tg.main()
"""


def shared_run(tmp_path_factory, name: str, env: dict[str, str], nproc: int = 0) -> Path:
    """The folder of a successful run_training(env + RUN_ID=name, nproc) made once for the session (computed_once):
    tests that compare against the same run share it and must not write into its folder (its log is
    logs/NAME.txt). Keyed by the whole environment, the process count and train_gpt.py's bytes."""
    import hashlib

    env = {**env, "RUN_ID": name}
    key = hashlib.sha256(repr((sorted(env.items()), nproc)).encode() + SCRIPT.read_bytes()).hexdigest()[:16]

    def build(cwd: Path) -> None:
        proc = run_training(env, cwd, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]

    return computed_once(shared_folder(tmp_path_factory) / f"run_{name}_{key}", build)


def read_log(cwd: Path, run_id: str) -> str:
    return (cwd / "logs" / f"{run_id}.txt").read_text(encoding="utf-8")


def run_file(cwd: Path, run_id: str, name: str = "final_model.int6.ptz") -> Path:
    """A file of the run RUN_ID in `cwd`, in its folder runs/RUN_ID: its artifact unless `name` says another."""
    return cwd / "runs" / run_id / name


def perturbed(model, seed=5, scale=0.05):
    """The model with every parameter moved off its initial value by scale x N(0, 1) noise (from `seed`), in place:
    the output projections and the MLP's down projection start at zero, so without this a change to the attention's
    q, k, v or the MLP's input shows no effect at initialisation, and a piece's zero- or one-initialised weights show
    none either (docs/frontier.md "Adding a technique": the test to copy). Returns the model."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen).to(p.dtype))
    return model


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's in-process work (restored after), for modules that ask for it with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`: on a loaded 2-core machine OpenMP threads that
    spin-wait for a descheduled partner make CPU runs tens of times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The suite's longest files (measured with --durations on a 2-core EPYC, 2026-11-29), longest first but for the first
# four, whose shared runs pair up (each worker builds what the other then reads): collected first, so that `-n 2
# --dist loadfile` starts them at once on both workers and the many short files fill in after, instead of one long
# file running alone at the end (test_trust.py's 55 s left one worker idle for 10 s).
LONGEST_FIRST = ("test_specialise.py", "test_compile_presets.py", "test_compile_ranks.py", "test_specialise_tools.py",
                 "test_preflight.py", "test_trust.py", "test_artifact_eval.py", "test_bench_gpu.py", "test_nodes.py",
                 "test_launcher.py", "test_compile.py", "test_pack_code.py", "test_kernels.py", "test_replay.py",
                 "test_gptq.py", "test_data_path.py", "test_train_core.py", "test_artifact_0427.py", "test_ttt_lora.py",
                 "test_frontier.py", "test_checkpoint.py", "test_record_loop.py", "test_worked_examples.py",
                 "test_documents.py", "test_model_0427.py")


def worker_threads() -> int:
    """This pytest process's share of the CPU cores: the cores divided among pytest-xdist's workers (1 on CI's 2 cores
    with -n 2), so that in-process tests of two workers do not leave OpenMP threads spin-waiting for cores the
    other worker holds."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def pytest_configure(config):
    """pytest-xdist reorders --dist loadfile's files by their number of tests unless told not to: keep LONGEST_FIRST's
    order (the option exists only where pytest-xdist is installed). Each worker computes on its share of the cores
    (worker_threads)."""
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False
    config.addinivalue_line("markers", "real_command: runs train_gpt.py (or Python) through the real commands, "
                                       "python3 or torchrun, where the others fork from tests/launcher.py's zygote")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(worker_threads())


def pytest_collection_modifyitems(session, config, items):
    """Order the tests by LONGEST_FIRST's files (the others after them, in their usual order; within a file, as
    written)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
