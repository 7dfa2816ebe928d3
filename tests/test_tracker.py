"""TRACKER=wandb|tensorboard and scripts/run/compare_runs.py (issue 63): three tiny CPU runs (TINY_RUN: 2 layers of
width 32 on 1,024 val tokens, well under a second each once the worker's zygote runs), made once for the module,
serve both. Run `tb` logs to TensorBoard, `fail` is the same run whose tracker fails mid-run (TRACKER_PROJECT
differs: W&B's project, read by nothing else), `wb` logs to W&B offline with another seed. The trackers' own
readers give back the numbers the logs say; the failing tracker leaves the exact lines equal; compare_runs.py's
table shows only the settings that differ."""
from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import json
import re
import struct
import sys
import zlib
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

import launcher
import train_gpt as tg
from conftest import REPO, TINY_ENV, clean_environ, config_error, hide_modules, read_log, short_val_data

sys.path[:0] = [str(REPO / "scripts" / "run"), str(REPO / "scripts" / "record")]  # compare_runs; recordlib
import compare_runs  # noqa: E402
import recordlib as rl  # noqa: E402

HAS = {name: importlib.util.find_spec(name) is not None for name in ("wandb", "tensorboard")}


def needs(name):
    return pytest.mark.skipif(not HAS[name], reason=f"{name} is not installed (an optional extra: "
                                                    f"pip install {name}; .ci/run installs it)")


# W&B offline in the run's own process (its variables set there, so the runs share the worker's zygote), its files
# and config under the run's folder; then train_gpt's main(), as `python3 train_gpt.py` runs it.
RUN = """
import os, sys
os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=os.path.abspath("wandb_home"),
                  WANDB_CACHE_DIR=os.path.abspath("wandb_home"), WANDB_DATA_DIR=os.path.abspath("wandb_home"))
import train_gpt as tg
if sys.argv[1:] == ["fail"]:  # the tracker fails when the log reaches step 3: as a full disk would
    metrics = tg.Tracker.metrics
    def failing(self, line):
        if line.startswith("step:3/"):
            raise OSError("No space left on device (forced by tests/test_tracker.py)")
        return metrics(self, line)
    tg.Tracker.metrics = failing
if sys.argv[1:2] and sys.argv[1].startswith("block:"):  # a module whose import fails, as a broken install's would
    sys.modules[sys.argv[1].removeprefix("block:")] = None
if sys.argv[1:] == ["count"]:  # every host read of a tensor from each Trainer.step call to the next, and if it logged
    import json, threading, torch
    steps, main = [], threading.get_ident()
    def counting(name):
        read = getattr(torch.Tensor, name)
        def counted(self, *a, **k):
            # train_gpt.py's own reads in the main thread: not the loader threads' batches, nor torch.optim's AdamW
            # reading its CPU step counters (never a device sync)
            if steps and threading.get_ident() == main and sys._getframe(1).f_code.co_filename == tg.__file__:
                steps[-1][0] += 1
            return read(self, *a, **k)
        setattr(torch.Tensor, name, counted)
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        counting(name)
    step, fields = tg.Trainer.step, tg.TrainMeter.fields
    tg.Trainer.step = lambda self, *a, **k: steps.append([0, False]) or step(self, *a, **k)
    tg.TrainMeter.fields = lambda self, *a, **k: steps[-1].__setitem__(1, True) or fields(self, *a, **k)
sys.argv[1:] = []
try:
    tg.main()
finally:
    if "steps" in dir():
        open("host_reads.json", "w").write(json.dumps(steps))
"""
# TINY_ENV made smaller still (as tests/test_kernels.py's TINY_KERNEL_RUN): every line the tracker sends (train and
# val steps, the three scores with sliding window and TTT, evaluation times, bytes) at a fraction of TINY_ENV's cost.
TINY_RUN = {**TINY_ENV, "NUM_LAYERS": "2", "MODEL_DIM": "32", "NUM_HEADS": "2", "NUM_KV_HEADS": "1", "VE_LAYERS": "1",
            "XSA_LAST_N": "1", "TRAIN_SEQ_LEN": "64", "EVAL_SEQ_LEN": "64", "TRAIN_BATCH_TOKENS": "512",
            "GRAD_ACCUM_STEPS": "1", "VAL_BATCH_SIZE": "4096", "TTT_CHUNK_TOKENS": "512", "EVAL_STRIDE": "32",
            "DIAGNOSTIC_POST_EMA": "0"}
# tb and wb: MFU against a CPU "peak" of 1 TFLOP/s, killed right after their step-2 checkpoint, then resumed.
RUNS = {
    "tb": {"TRACKER": "tensorboard" if HAS["tensorboard"] else "", "PEAK_TFLOPS": "1", "CHECKPOINT_EVERY": "2"},
    "fail": {"TRACKER": "tensorboard" if HAS["tensorboard"] else "", "TRACKER_PROJECT": "golf-b"},
    "wb": {"TRACKER": "wandb" if HAS["wandb"] else "", "SEED": "42", "PEAK_TFLOPS": "1", "CHECKPOINT_EVERY": "2"},
}
# TRACKER unset, the host reads counted (RUN's "count"): 14 steps, steps 11-14 not logged, a cheap evaluation.
PLAIN = {"ITERATIONS": "14", "TRAIN_LOG_EVERY": "100", "TTT_ENABLED": "0", "EVAL_STRIDE": "0"}


def launch(cwd: Path, env: dict[str, str], *args: str):
    return launcher.run(["-c", RUN, *args], {**clean_environ(), **env, "OMP_NUM_THREADS": "1"}, cwd, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sample_data) -> Path:
    cwd = tmp_path_factory.mktemp("tracker")
    (cwd / "val").mkdir()
    data = short_val_data(sample_data, cwd / "val", 1025)
    for run_id, extra in RUNS.items():
        env = {**TINY_RUN, **data, "RUN_ID": run_id, **extra}
        if "CHECKPOINT_EVERY" in extra:
            killed = launch(cwd, {**env, "TEST_KILL_AT_CHECKPOINT": "2:after"})
            assert killed.returncode == -9 and "error" not in killed.stderr, killed.stderr[-3000:]
            env["RESUME"] = "auto"
        proc = launch(cwd, env, *(["fail"] if run_id == "fail" else []))
        assert proc.returncode == 0, proc.stderr[-3000:]
        (cwd / f"{run_id}.stdout").write_text(proc.stdout)
    (cwd / "plain").mkdir()
    proc = launch(cwd / "plain", {**TINY_RUN, **data, "RUN_ID": "plain", **PLAIN}, "count")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd


TRAIN_LINE = re.compile(r"^step:(\d+)/\d+ train_loss:.*$", re.M)
NEW_NUMBERS = ("lr_", "muon_momentum", "grad_norm", "tok_s", "mfu")  # issue 72's, in each train line


def new_numbers(log_text: str) -> dict[tuple[str, int], float]:
    """(train/NAME, step) -> the number of each of issue 72's fields in the log's train lines."""
    return {(f"train/{k}", int(m[1])): float(v) for m in TRAIN_LINE.finditer(log_text)
            for k, v in re.findall(r" (\w+):([-+\d.e]+)(?= |$)", m[0]) if k.startswith(NEW_NUMBERS)}


def expected(log: rl.RunLog) -> dict[tuple[str, int], float]:
    """What the tracker must hold, from recordlib's reading of the log: (name, step) -> number."""
    out = {}
    for s in log.steps:
        out[(f"{s.kind}/{'train_loss' if s.kind == 'train' else 'val_loss'}", s.step)] = s.loss
        out[(f"{s.kind}/step_avg_ms", s.step)] = s.step_avg_ms
        if s.bpb is not None:
            out[("val/val_bpb", s.step)] = s.bpb
    last = log.final_step
    for name, e in log.exact.items():
        out[(f"eval/{rl.EVAL_PREFIXES[name]}_exact/val_bpb", last)] = e.val_bpb
    out[("eval/evaluation_time/total_s", last)] = log.eval_total_s
    out[("artifact/total_submission_size_int6_lzma_bytes", last)] = log.total_bytes
    return {**out, **new_numbers(log.path.read_text(encoding="utf-8"))}


# ---------------------------------------------------------------------------------------------- in process

def test_metrics_of_each_kind_of_line():
    t = object.__new__(tg.Tracker)
    t.step = 0
    assert t.metrics("step:3/9 train_loss:6.4258 train_time:974ms step_avg:324.77ms data_wait_ms:1.13") == {
        "train/train_loss": 6.4258, "train/train_time_ms": 974.0, "train/step_avg_ms": 324.77,
        "train/data_wait_ms": 1.13}
    assert t.step == 3
    assert t.metrics("legal_ttt_exact val_loss:6.89212363 val_bpb:3.80621768") == {
        "eval/legal_ttt_exact/val_loss": 6.89212363, "eval/legal_ttt_exact/val_bpb": 3.80621768}
    assert t.metrics("DIAGNOSTIC post_ema val_loss:nan val_bpb:3.8 eval_time:718ms")["eval/DIAGNOSTIC_post_ema/"
                                                                                    "eval_time_ms"] == 718.0
    assert t.metrics("evaluation_time: ttt_loop:7.3s total:10.2s") == {"eval/evaluation_time/ttt_loop_s": 7.3,
                                                                        "eval/evaluation_time/total_s": 10.2}
    assert t.metrics("Total submission size int6+lzma: 808898 bytes") == {
        "artifact/total_submission_size_int6_lzma_bytes": 808898}
    assert t.metrics("seed:1337") == {} and t.metrics("note: took 3: 4 bytes") == {} and t.step == 3


class MatmulFlops(TorchDispatchMode):
    """The model FLOPs of the matmuls run under it, from their own shapes: PyTorch's formulas (flop_registry: mm,
    bmm, ...), linear's, and the CPU kernel of SDPA: forward QK^T and AV (sdpa_flop_count, GQA too), backward the four
    gradient matmuls (dV, dP, dQ, dK: twice the forward), where sdpa_backward_flop_count adds a fifth, the kernel's
    recompute of QK^T (hardware FLOPs, not the model's: MFU counts none)."""
    flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out, op = func(*args, **(kwargs or {})), func._overloadpacket
        if op is torch.ops.aten.linear:
            self.flops += 2 * out.numel() * args[1].shape[-1]
        elif op is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            self.flops += sdpa_flop_count(*(a.shape for a in args[:3]))
        elif op is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
            self.flops += 2 * sdpa_flop_count(*(a.shape for a in args[1:4]))
        elif op in flop_registry:
            self.flops += flop_registry[op](*args, **(kwargs or {}), out_val=out)
        return out


# The presets' pieces at 4 layers of width 64: the depth loop over layers 1-2, two lanes from layer 3 (record_0427:
# SmearGate v2, the sparse attention gate, XSA; plain and looped), and the default model with a loop and a dense gate
# (bigram hash, SmearGate v1, VE; looped only). (The dispatch mode costs ~0.7 ms an op, and its first use imports
# Dynamo.)
FLOP_MODELS = {"record_0427": ({"PRESET": "record_0427"}, (False, True)),
               "default": ({"NUM_LOOPS": "1", "ATTN_GATE": "dense"}, (True,))}


@pytest.mark.parametrize("name", list(FLOP_MODELS))
def test_train_flops_per_token_is_the_models_matmuls(name):
    settings, orders = FLOP_MODELS[name]
    h = tg.Hyperparameters({"NUM_LAYERS": "4", "MODEL_DIM": "64", "NUM_HEADS": "4", "NUM_KV_HEADS": "2",
                            "LOOP_START": "1", "LOOP_END": "2", "PARALLEL_RESIDUAL_START": "3", "XSA_LAST_N": "4",
                            "VE_LAYERS": "2,3", "VOCAB_SIZE": "256", "BIGRAM_DIM": "16", "VE_DIM": "8", **settings})
    model = tg.build_model(h).float()
    model.set_compute_dtype(torch.float32)
    ids = torch.randint(0, h.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    for looping in orders:
        model.looping = looping
        with MatmulFlops() as count:
            tg.training_loss(h, model, ids, ids).backward()
        assert count.flops == pytest.approx(tg.train_flops_per_token(h, 48, looping) * ids.numel(), rel=1e-12)
    assert tg.train_flops_per_token(h, 48, True) > tg.train_flops_per_token(h, 48, False)  # the loop's 2 layer runs


@pytest.mark.parametrize("system", ["1", "0"])
def test_wandb_init_gets_the_run_id_resume_and_system_metrics(monkeypatch, tmp_path, system):
    """What wandb.init is asked (a stand-in records it): the id of RUN_ID (a RUN_ID W&B would refuse gets a safe one
    with its CRC-32), resume="allow" only for RESUME's resumed run, system metrics unless TRACKER_SYSTEM=0."""
    if not HAS["wandb"]:
        pytest.skip("wandb is not installed")
    hs = [tg.Hyperparameters({"RUN_ID": run_id, "TRACKER": "wandb", "TRACKER_SYSTEM": system})
          for run_id in ("a.b-c_1", "my run (2)")]
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", type(sys)("wandb"))
    sys.modules["wandb"].init = lambda **kw: calls.append(kw) or type("Run", (), {"step": 0})()
    sys.modules["wandb"].Settings = dict
    monkeypatch.chdir(tmp_path)
    for h, resume in zip(hs, (None, tg.ResumePoint(tmp_path, {"step": 5}))):
        tg.Tracker(h, resume)
    assert [(c["id"], c["name"], c["resume"], c["settings"]["x_disable_stats"]) for c in calls] == [
        ("a.b-c_1", "a.b-c_1", None, system == "0"),
        (f"my-run-2-{zlib.crc32(b'my run (2)'):08x}", "my run (2)", "allow", system == "0")]


def test_bad_tracker_settings_stop_at_start(monkeypatch, sample_data):
    env = {**TINY_ENV, **sample_data}
    assert "TRACKER='mlflow' must be wandb or tensorboard" in config_error({**env, "TRACKER": "mlflow"})
    assert config_error({**env, "PEAK_TFLOPS": "-1"}).startswith("PEAK_TFLOPS=-1 must be a device's peak TFLOP/s")
    hide_modules(monkeypatch, "wandb")
    assert config_error({**env, "TRACKER": "wandb"}).startswith("TRACKER=wandb needs the wandb package")
    assert tg.Hyperparameters(env).tracker == ""  # default off


@needs("wandb")
def test_a_tracker_that_cannot_start_stops_the_run_in_one_line(tmp_path, sample_data):
    env = {**TINY_ENV, **sample_data, "RUN_ID": "badproject", "TRACKER": "wandb", "TRACKER_PROJECT": "a/b"}
    proc = launch(tmp_path, env)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: TRACKER=wandb cannot start: UsageError: Invalid project name 'a/b'")
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    assert not (tmp_path / "logs").exists()  # before any work: not even the log
    assert not (tmp_path / "runs").joinpath("badproject").exists()  # nor the run folder it made (W&B's files in it)


@pytest.mark.parametrize("kind,module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb.sdk")])
def test_a_tracker_whose_import_fails_says_its_pip_line_and_leaves_no_run_folder(tmp_path, sample_data, kind, module):
    if not HAS[kind]:
        pytest.skip(f"{kind} is not installed")
    proc = launch(tmp_path, {**TINY_ENV, **sample_data, "RUN_ID": "r", "TRACKER": kind}, f"block:{module}")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert re.fullmatch(rf"error: TRACKER={kind} cannot start: ModuleNotFoundError: [^\n]*'{re.escape(module)}[^\n]* "
                        rf"\(pip install {kind}, or pip install --force-reinstall {kind} if it is installed\)\n",
                        proc.stderr.replace("import of ", "'"))  # (the halted import's words)
    assert list(tmp_path.iterdir()) == []  # no runs/r, no logs/


@needs("tensorboard")
def test_an_unwritable_tensorboard_folder_is_one_line_every_time(tmp_path, sample_data):
    """A folder that exists but takes no file, even from root (as an unwritable one for a user): refused before
    SummaryWriter starts its writer thread, which printed its own traceback in one start out of two."""
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "tensorboard").symlink_to("/proc/self/fdinfo")
    for _ in range(2):
        proc = launch(tmp_path, {**TINY_ENV, **sample_data, "RUN_ID": "r", "TRACKER": "tensorboard"})
        assert (proc.returncode, proc.stdout) == (2, "")
        assert re.fullmatch(r"error: TRACKER=tensorboard cannot start: (FileNotFoundError|PermissionError): "
                            r"\[Errno \d+\] [^\n]*runs/r/tensorboard/\.write_test\.\d+'\n", proc.stderr), proc.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["r", "runs", "tensorboard"]  # as it was: no log


# ---------------------------------------------------------------------------------------------- the three runs

@needs("tensorboard")
def test_tensorboard_gives_back_the_log(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs / "runs" / "tb" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    # killed after step 2's checkpoint and resumed: each step once (the resumed part sent steps 1-2 from the log)
    assert [e.step for e in acc.Scalars("train/train_loss")] == [1, 2, 3, 4]
    got = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    want = expected(rl.parse_log(runs / "logs" / "tb.txt"))
    assert len(want) >= 15
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-7), key  # TensorBoard keeps float32
    settings = acc.Tensors("settings/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "    TRACKER=tensorboard [env]" in settings and "    PRESET=record_0323 [default]" in settings
    exact = {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
             for tag in acc.Tags()["tensors"] if tag.endswith("_exact/text_summary")}
    lines = list(re.finditer(r"^(\w+_exact) val_loss:.*$", read_log(runs, "tb"), re.M))
    assert len(lines) == 3 and exact == {  # every digit of the log's scores, beside the float32 scalars
        f"eval/{m.group(1)}/text_summary": [(4, m.group(0))] for m in lines}


def test_the_train_lines_new_numbers(runs):
    """Issue 72's numbers in the train lines (PEAK_TFLOPS=1): every group's LR is its base LR x the step's one
    schedule scale, Muon's momentum its warmup's, MFU = train_flops_per_token x tok/s over the peak (to the
    printed digits), and a gradient norm at each step."""
    h = tg.Hyperparameters({**TINY_RUN, "PEAK_TFLOPS": "1"})
    base = {g: lr for g, (_, lr, _) in tg.group_settings(h).items()}
    lines = TRAIN_LINE.findall(read_log(runs, "tb"))
    numbers = new_numbers(read_log(runs, "tb"))
    assert [int(s) for s in lines] == [1, 2, 3, 4]
    flops = tg.train_flops_per_token(h, 64, False)
    for step in (1, 2, 3, 4):
        got = {k.removeprefix("train/"): v for (k, s), v in numbers.items() if s == step}
        scale = got["lr_matrix"] / base["matrix"]
        assert scale in (1.0, 0.5) and {g: got[f"lr_{g}"] for g in ("embed", "scalar")} == {
            g: float(f"{base[g] * scale:.4g}") for g in ("embed", "scalar")}
        assert got["muon_momentum"] == float(f"{tg.muon_momentum_at(h, step - 1):.4g}") and got["grad_norm"] > 0
        assert got["mfu"] == pytest.approx(flops * got["tok_s"] / 1e12, rel=2e-3)
    assert "mfu" not in "".join(TRAIN_LINE.findall(read_log(runs / "plain", "plain")))  # CPU: no peak, no MFU


def test_the_steps_host_reads_are_unchanged_without_a_tracker(runs):
    """TRACKER unset: after each training step one host read (the flags' all-reduce: loss finite, elapsed time),
    and a logged step one more (its loss with the clip's gradient norm, read together): as before issue 72, whose
    numbers add none."""
    steps = json.loads((runs / "plain" / "host_reads.json").read_text())[-14:]
    assert [logged for _, logged in steps] == [True] * 10 + [False] * 4
    assert [reads for reads, _ in steps[:-1]] == [2] * 10 + [1] * 3  # (after the last: the evaluation's)


def wandb_records(path: Path):
    """The records of a W&B run file (run-ID.wandb): a 7-byte header (":W&B", magic, version), then blocks of 32 KiB
    holding chunks, each with a 7-byte header (CRC-32C, length, type: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, parts = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


@needs("wandb")
def test_wandb_offline_gives_back_the_log_in_one_run_across_a_resume(runs):
    """The run killed after its step-2 checkpoint and resumed: W&B offline wrote a folder for each process (one if
    both started in the same second), all under the one run id (wandb sync makes them one run). The killed
    process's W&B kept its records in memory (a SIGKILL loses them), so the resumed one sent steps 1-2 again from the
    log, then 3-4: its history has every step once."""
    files = sorted((runs / "runs" / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] in (["run-wb.wandb"], ["run-wb.wandb"] * 2), files
    got, config, steps, artifacts = {}, {}, {}, 0
    for f in files:
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                got.update({(k, r.history.step.num): v for k, v in items.items() if not k.startswith("_")})
                steps.setdefault(f, []).extend([r.history.step.num] if "train/train_loss" in items else [])
            elif kind == "run":
                assert (r.run.run_id, r.run.display_name, r.run.project) == ("wb", "wb", "parameter-golf")
                config = {item.key: json.loads(item.value_json) for item in r.run.config.update}
            elif kind == "artifact":  # at the end: the artifact and the log, as they are on disk
                assert (f, r.artifact.name, r.artifact.type) == (files[-1], "wb-submission", "model")
                assert {e.path: e.digest for e in r.artifact.manifest.contents} == {
                    p.name: base64.b64encode(hashlib.md5(p.read_bytes()).digest()).decode()
                    for p in (runs / "runs" / "wb" / "final_model.int6.ptz", runs / "logs" / "wb.txt")}
                artifacts += 1
    assert steps.pop(files[-1]) == [1, 2, 3, 4] and artifacts == 1  # the resumed process's
    assert all(set(s) <= {1, 2} for s in steps.values())  # the killed process's, if it wrote any
    want = expected(rl.parse_log(runs / "logs" / "wb.txt"))
    assert {k for k in want if k[0].startswith("train/lr_")} == {
        (f"train/lr_{g}", s) for g in ("embed", "scalar", "matrix") for s in (1, 2, 3, 4)}
    assert {k: got[k] for k in want} == want  # W&B keeps the log's numbers exactly, issue 72's too
    assert config["SEED"] == {"value": 42, "source": "env"} and config["TRACKER_PROJECT"]["source"] == "default"


@needs("tensorboard")
def test_a_tracker_failing_mid_run_leaves_the_exact_lines(runs):
    warning = ("warning: TRACKER=tensorboard failed (OSError: No space left on device (forced by "
               "tests/test_tracker.py)); the run goes on without it")
    out = (runs / "fail.stdout").read_text()
    assert out.count("warning: TRACKER") == 1 and warning in out.splitlines()
    assert out.splitlines().index(warning) == out.splitlines().index(next(
        line for line in out.splitlines() if line.startswith("step:3/"))) + 1

    def exact(text):
        keep = ("step:", "Serialized model", "Code size", "Total submission")
        return [line.split(" train_time:")[0] for line in text.splitlines()
                if line.startswith(keep) or re.match(r"\w+_exact ", line)]  # (not the log's copy of the source)

    assert exact(read_log(runs, "fail")) == exact(read_log(runs, "tb"))
    assert len(exact(read_log(runs, "tb"))) == 12
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs / "runs" / "fail" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/train_loss")] == [1, 2]  # nothing sent after the failure


def test_compare_runs_table(runs, tmp_path, capsys, monkeypatch):
    """The three runs' table and plot, with two that did not finish: `cut`, a log cut mid-line (its run still going,
    or stopped), and `stopped`, interrupted after its sliding-window score, made the lowest of all (1.0): a partial
    score is marked, sorted after every final one, and never drawn as a final score."""
    cut, stopped = tmp_path / "cut.txt", tmp_path / "stopped.txt"
    text = read_log(runs, "wb")
    cut.write_text(text[:text.index("step:3/4 train_loss:") + 16])
    text = read_log(runs, "tb")
    sliding = re.search(r"^final_int6_sliding_window_exact val_loss:\S+ val_bpb:(\S+)\n", text, re.M)
    stopped.write_text(text[:sliding.start(1)] + "1.00000000\ninterrupted (Ctrl-C) during evaluation\n")
    argv = [str(runs / "runs" / name) for name in ("tb", "wb", "fail")] + [str(stopped), str(cut), "--sort", "val_bpb"]
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # plot_logs closes its figure: keep it to count the curves
    assert compare_runs.main(argv + ["--csv", str(tmp_path / "t.csv"), "--markdown", str(tmp_path / "t.md"),
                                     "--plot", str(tmp_path / "c.png")]) == 0
    printed = capsys.readouterr().out.splitlines()
    with open(tmp_path / "t.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    trackers = ["TRACKER"] if HAS["wandb"] or HAS["tensorboard"] else []  # tensorboard, wandb (or "" without)
    assert list(rows[0]) == ["run", "preset", "CHECKPOINT_EVERY", "PEAK_TFLOPS", "SEED", *trackers, "TRACKER_PROJECT",
                             "steps", "step_ms", "val_bpb", "pre_ttt_bpb", "post_ttt_bpb", "eval_s", "bytes", "status"]
    logs = {name: rl.parse_log(runs / "logs" / f"{name}.txt") for name in ("tb", "wb", "fail")}
    order = sorted(logs, key=lambda n: (logs[n].exact["legal_ttt"].val_bpb, list(logs).index(n)))
    assert [r["run"] for r in rows] == [*order, "stopped", "cut"]  # the partial 1.0 after every final score
    for r in rows[:3]:
        log = logs[r["run"]]
        assert (r["status"], r["steps"], r["preset"]) == ("finished", "4/4", "record_0323")
        assert float(r["val_bpb"]) == float(r["post_ttt_bpb"]) == log.exact["legal_ttt"].val_bpb
        assert float(r["pre_ttt_bpb"]) == log.exact["sliding"].val_bpb
        assert (int(r["bytes"]), float(r["eval_s"])) == (log.total_bytes, log.eval_total_s)
        assert r["SEED"] == ("42" if r["run"] == "wb" else "1337")
        assert r["TRACKER_PROJECT"] == ("golf-b" if r["run"] == "fail" else "parameter-golf")
    assert (rows[3]["status"], rows[3]["val_bpb"], rows[3]["pre_ttt_bpb"], rows[3]["post_ttt_bpb"]) == (
        "failed: interrupted (Ctrl-C) during evaluation", "1*", "1*", "")
    assert rows[4]["status"] == "unfinished (cut mid-line)" and rows[4]["post_ttt_bpb"] == rows[4]["val_bpb"] == ""
    assert printed[0].split() == list(rows[0]) and printed[-3].startswith("cut ") and len(printed) == 8
    bpb = list(rows[0]).index("val_bpb")  # the TRACKER column is there only where a tracker is installed
    assert printed[-2] == compare_runs.FOOTNOTE and printed[4].split()[bpb:bpb + 2] == ["1*", "1*"]
    md = (tmp_path / "t.md").read_text().splitlines()
    assert md[0] == "| " + " | ".join(rows[0]) + " |" and len(md) == 9 and md[-1] == "\\" + compare_runs.FOOTNOTE
    assert "| 1\\* | 1\\* |" in md[5]
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = figures[0].axes
    curves = [[(ln.get_label(), ln.get_linestyle(), ln.get_marker()) for ln in ax.get_lines()] for ax in axes]
    names = ["tb", "wb", "fail", "stopped (failed)", "cut (cut mid-line)"]
    markers = [ln[2] for ln in curves[0]]
    assert len(set(markers)) == 5  # one marker a run: identical runs stay visible
    styles = ["-", "-", "-", ":", "-."]  # finished, failed, cut
    assert curves[0] == curves[1] == list(zip(names, styles, markers))
    for ax, lines in zip(axes[2:], curves[2:]):  # val bpb: no val line in the cut log; a star a finished run
        assert [ln for ln in lines if ln[2] != "*"] == list(zip(names, styles, markers))[:4]
        stars = [(ln.get_ydata()[0], ln.get_color()) for ln in ax.get_lines() if ln.get_marker() == "*"]
        colors = [ln.get_color() for ln in ax.get_lines() if ln.get_marker() != "*"]  # each star its run's colour
        assert stars == [(logs[n].exact["legal_ttt"].val_bpb, colors[i]) for i, n in enumerate(("tb", "wb", "fail"))]
        assert [t.get_text() for t in ax.texts] == [f"{logs[n].exact['legal_ttt'].val_bpb:.5f}"
                                                    for n in ("tb", "wb", "fail")]
