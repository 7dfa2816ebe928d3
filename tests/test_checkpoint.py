"""Checkpoints and an exact resume (issue 30): a run killed right after a checkpoint (SIGKILL, the
TEST_KILL_AT_CHECKPOINT test hook) and resumed with RESUME ends with the same final weights and *_exact lines,
bit for bit, as the run never stopped: the default model (stream loader, prefetch on), PRESET=record_0427 scaled
down (packed loader, the loop switch right after the checkpoint, EMA) and PRESET=record_0430 scaled down (the
resume inside a progressive-context phase's LR re-warmup), each on 1 and 2 gloo processes. A kill during a
checkpoint's write leaves the previous one, which RESUME=auto takes; refused resumes are one line, exit 2 and
change nothing on disk. Every comparison is between two runs made in this test, never a pinned number."""
from __future__ import annotations

import json
import re
import shutil
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import launcher
import train_gpt as tg
from conftest import SCRIPT, clean_environ, config_error, read_log, run_file, run_training, short_val_data
from test_documents import caseops_sample, write_tokens  # noqa: F401 (fixture: the vocab-8192 CaseOps sample)

EXACT = r"^(final_int6_\w+|legal_ttt)_exact (.*)$"
QUIET = {"MAX_WALLCLOCK_SECONDS": "0", "VAL_LOSS_EVERY": "0", "TRAIN_LOG_EVERY": "1", "TTT_ENABLED": "0",
         "EVAL_STRIDE": "0", "OMP_NUM_THREADS": "1", "GRAD_ACCUM_STEPS": "1",
         "DIAGNOSTIC_ROUNDTRIP": "1"}  # the one score (the LoRA presets skip it unless asked)
# The default model, tiny: its stream loader with prefetch on (the default), one warmup step, 4 steps.
DEFAULT = {**QUIET, "NUM_LAYERS": "2", "MODEL_DIM": "32", "NUM_HEADS": "2", "NUM_KV_HEADS": "1",
           "VE_LAYERS": "0,1", "XSA_LAST_N": "1", "BIGRAM_VOCAB_SIZE": "64", "TRAIN_SEQ_LEN": "64",
           "EVAL_SEQ_LEN": "64", "TRAIN_BATCH_TOKENS": "256", "VAL_BATCH_SIZE": "256", "ITERATIONS": "4",
           "WARMUP_STEPS": "1", "WARMDOWN_ITERS": "2"}
# The presets' models at 5 layers of width 32 (loops over layers 1-2, lanes from 3), packed rows of 256 tokens.
PRESET_SCALE = {**QUIET, "NUM_LAYERS": "5", "MODEL_DIM": "32", "NUM_HEADS": "2", "NUM_KV_HEADS": "1",
                "LOOP_START": "1", "LOOP_END": "2", "PARALLEL_RESIDUAL_START": "3", "XSA_LAST_N": "5",
                "VE_LAYERS": "3,4", "TRAIN_SEQ_LEN": "64", "EVAL_SEQ_LEN": "64", "TRAIN_BATCH_TOKENS": "256",
                "VAL_BATCH_SIZE": "256", "WARMUP_STEPS": "0", "GPTQ_CALIBRATION_BATCHES": "1",
                "GPTQ_CALIBRATION_SEQS": "0", "COMPRESSOR": "lzma"}
# name: (settings, CHECKPOINT_EVERY, the kill, log lines the resumed part must show). record_0427: the loop
# switches on at step 3 (ENABLE_LOOPING_AT=0.5 of 6 steps), right after the checkpoint of step 2. record_0430:
# context 32 -> 64 at step 3 with a 3-step LR re-warmup (steps 3, 4, 5), the resume at step 4 inside it, 128 at 5.
SCENARIOS = {
    "default": (DEFAULT, 1, None, ["resumed_from:runs/cut/checkpoints/step_00000003 step:3"]),
    "record_0427": ({**PRESET_SCALE, "PRESET": "record_0427", "ITERATIONS": "6", "ENABLE_LOOPING_AT": "0.5"}, 2,
                    "2:after", ["resumed_from:runs/cut/checkpoints/step_00000002 step:2", "layer_loop:enabled step:3",
                                "final_weights:ema"]),
    "record_0430": ({**PRESET_SCALE, "PRESET": "record_0430", "ITERATIONS": "8", "EVAL_SEQ_LEN": "128",
                     "TRAIN_SEQ_LEN": "128", "ROPE_TRAIN_SEQ_LEN": "128",
                     "TRAIN_SEQ_LEN_SCHEDULE": "32@0,64@0.3,128@0.6", "SEQ_LEN_REWARMUP_STEPS": "3"}, 4,
                    "4:after", ["resumed_from:runs/cut/checkpoints/step_00000004 step:4",
                                "seq_len:128 step:5 frac:0.6250", "final_weights:ema"]),
}


@pytest.fixture(scope="module")
def data(sample_data, caseops_sample, tmp_path_factory):  # noqa: F811
    """DATA_PATH/TOKENIZER_PATH per scenario: the samples' train shards and a val shard of a few sequences."""
    out = {"default": short_val_data(sample_data, tmp_path_factory.mktemp("ck_data"), 2 * 64 + 1)}
    src, short = caseops_sample / "datasets" / "sample_sp8192_caseops", tmp_path_factory.mktemp("ck_caseops")
    for f in sorted(src.glob("fineweb_train_*.bin")):
        (short / f.name).symlink_to(f)
    for name in ("fineweb_val_000000.bin", "fineweb_val_bytes_000000.bin"):
        write_tokens(short / name, tg.load_shard(src / name)[:2 * 128 + 1].astype(np.int64))
    caseops = {"DATA_PATH": str(short),
               "TOKENIZER_PATH": str(caseops_sample / "tokenizers" / "sample_8192_bpe_caseops.model")}
    return {"default": out["default"], "record_0427": caseops, "record_0430": caseops}


def launch(env, cwd, nproc):
    """train_gpt.py as one process (nproc 0), or as nproc gloo ranks started as torchrun would start them (RANK,
    WORLD_SIZE, MASTER_ADDR/PORT), without torchrun's agent process, which would end the other ranks when one dies:
    a CompletedProcess whose returncode is the first non-zero rank's and whose stderr is every rank's. Both forked
    from the worker's zygote (tests/launcher.py)."""
    if nproc == 0:
        return run_training(env, cwd)
    full = {**clean_environ(), **env, "OMP_NUM_THREADS": "1", "DIST_TIMEOUT_SECONDS": "120"}
    return launcher.run_ranks([SCRIPT], full, cwd, nproc, timeout=600, stop_peers=False)


def killed(proc):
    """Every process died of SIGKILL (the test hook), none of an error."""
    assert proc.returncode == -9 and "error:" not in proc.stderr, (proc.returncode, proc.stderr[-3000:])


def finished(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


_RUNS: dict = {}


@pytest.fixture(scope="module")
def scenario(data, tmp_path_factory):
    """run(name, nproc) -> the never-stopped run and the stopped-and-resumed one (made once per module)."""

    def run(name, nproc):
        if (name, nproc) in _RUNS:
            return _RUNS[name, nproc]
        env, every, kill, _ = SCENARIOS[name]
        env = {**env, **data[name]}
        ref_dir, cut_dir = tmp_path_factory.mktemp(f"{name}_{nproc}_ref"), tmp_path_factory.mktemp(f"{name}_{nproc}")
        finished(launch({**env, "RUN_ID": "ref"}, ref_dir, nproc))
        ck = {**env, "RUN_ID": "cut", "CHECKPOINT_EVERY": str(every)}
        folder = cut_dir / "runs" / "cut" / "checkpoints"
        if kill is None and nproc == 0:  # killed while writing step 2's checkpoint, then right after step 3's
            killed(launch({**ck, "TEST_KILL_AT_CHECKPOINT": "2:during"}, cut_dir, nproc))
            assert [p.name for p in sorted(folder.iterdir())] == [".tmp_step_00000002", "step_00000001"]
            killed(launch({**ck, "RESUME": "auto", "TEST_KILL_AT_CHECKPOINT": "3:after"}, cut_dir, nproc))
            assert re.search(r"^resumed_from:runs/cut/checkpoints/step_00000001 step:1 ", read_log(cut_dir, "cut"),
                             re.M)
        else:
            killed(launch({**ck, "TEST_KILL_AT_CHECKPOINT": kill or "3:after"}, cut_dir, nproc))
        if kill is None:
            assert [p.name for p in sorted(folder.iterdir())] == ["step_00000002", "step_00000003"]  # KEEP=2
        finished(launch({**ck, "RESUME": "auto"}, cut_dir, nproc))
        _RUNS[name, nproc] = (ref_dir, cut_dir)
        return ref_dir, cut_dir

    return run


@pytest.mark.parametrize("nproc", [0, 2])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_stop_and_resume_equals_the_run_never_stopped(scenario, name, nproc):
    ref_dir, cut_dir = scenario(name, nproc)
    ref, cut = (torch.load(run_file(d, i, "final_model.pt")) for d, i in ((ref_dir, "ref"), (cut_dir, "cut")))
    assert sorted(ref) == sorted(cut)
    different = [k for k in ref if not (ref[k].dtype == cut[k].dtype and torch.equal(ref[k], cut[k]))]
    assert not different, different
    ref_log, cut_log = read_log(ref_dir, "ref"), read_log(cut_dir, "cut")
    exact = re.findall(EXACT, ref_log, re.M)
    assert exact and re.findall(EXACT, cut_log, re.M) == exact
    resumed_part = cut_log[cut_log.rindex("resumed_from:"):]
    for line in SCENARIOS[name][3]:
        assert line in resumed_part, line
    last = int(SCENARIOS[name][0]["ITERATIONS"])
    ref_steps = re.findall(r"^step:(\d+)/\d+ train_loss:(\S+)", ref_log, re.M)
    # the resumed run's train-loss lines equal the never-stopped run's for the same steps
    assert re.findall(r"^step:(\d+)/\d+ train_loss:(\S+)", resumed_part, re.M) == [
        s for s in ref_steps if int(s[0]) > int(re.match(r"\S+ step:(\d+)", resumed_part).group(1))]
    assert ref_steps[-1][0] == str(last)


def tree(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under folder: (size, mtime_ns, CRC-32): what "nothing changed on disk" compares."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, zlib.crc32(p.read_bytes()))
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_refusal(proc, *fragments):
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: RESUME"), proc.stderr[-3000:]
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def test_refused_resumes_are_one_line_exit_2_and_change_nothing(scenario, data, tmp_path):
    _, cut_dir = scenario("default", 0)
    work = tmp_path / "run"
    shutil.copytree(cut_dir, work, symlinks=True)
    env = {**SCENARIOS["default"][0], **data["default"], "RUN_ID": "cut", "CHECKPOINT_EVERY": "1"}
    before = tree(work)
    # the resumed run finished: its name is refused until OVERWRITE_RUN=1 (issue 47)
    proc = run_training({**env, "RESUME": "auto"}, work)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: RUN_ID=cut is a finished run (runs/cut/final_model.int6.ptz exists): choose a new RUN_ID, or set "
        "OVERWRITE_RUN=1 to replace its outputs"), proc.stderr[-3000:]
    assert tree(work) == before
    env["OVERWRITE_RUN"] = "1"
    # settings that change the math
    one_line_refusal(run_training({**env, "RESUME": "auto", "MODEL_DIM": "64", "SEED": "7"}, work),
                     "step_00000003 was written with settings that change the training", "MODEL_DIM=32 (now 64)",
                     "SEED=1337 (now 7)")
    assert tree(work) == before
    # a corrupted file: one byte flipped in the newest checkpoint
    newest = work / "runs" / "cut" / "checkpoints" / "step_00000003"
    blob = bytearray((newest / "shared0.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (newest / "shared0.pt").write_bytes(bytes(blob))
    before = tree(work)
    one_line_refusal(run_training({**env, "RESUME": "auto"}, work),
                     "checkpoint file runs/cut/checkpoints/step_00000003/shared0.pt is corrupted (its CRC-32 differs")
    assert tree(work) == before


def test_each_refusal_names_what_differs_or_the_file(scenario, data, tmp_path):
    """find_resume's refusals, in-process (the script turns each into one line and exit 2, as above)."""
    _, one = scenario("default", 0)
    _, two = scenario("default", 2)
    base = {**SCENARIOS["default"][0], **data["default"], "RUN_ID": "cut"}
    folder = tmp_path / "ck"
    shutil.copytree(one / "runs" / "cut" / "checkpoints", folder)
    before = tree(folder)

    def refusal(**over):
        with pytest.raises(tg.ConfigError) as err:
            tg.find_resume(tg.Hyperparameters({**base, "CHECKPOINT_DIR": str(folder), **over}))
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "WORLD_SIZE=2 (now 1)" in refusal(RESUME=str(two / "runs" / "cut" / "checkpoints"))
    assert "PRESET=record_0323 (now record_0409)" in refusal(RESUME="auto", PRESET="record_0409", NUM_LOOPS="0",
                                                             PARALLEL_RESIDUAL_START="-1", WARMDOWN_ITERS="0")
    assert "DATA_PATH=" in refusal(RESUME="auto", DATA_PATH=str(tmp_path))
    assert "already holds checkpoints" in refusal(CHECKPOINT_EVERY="1")  # a fresh run would mix with them
    assert "past the resumed step 2" in refusal(RESUME=str(folder / "step_00000002"), CHECKPOINT_EVERY="1")
    assert tree(folder) == before
    newest = folder / "step_00000003"
    manifest = (newest / "manifest.json").read_text(encoding="utf-8")
    saved = json.loads(manifest)
    assert saved["precision"] == list(tg.run_precision(tg.Hyperparameters(base)))
    # DEVICE and AUTOCAST_DTYPE left at auto resolve per machine: a checkpoint of a bf16 GPU run is refused here
    (newest / "manifest.json").write_text(json.dumps({**saved, "precision": ["cuda", "bfloat16"]}), encoding="utf-8")
    assert "device/precision=cuda/bfloat16 (now cpu/" in refusal(RESUME="auto")
    (newest / "manifest.json").write_text(manifest, encoding="utf-8")
    with open(newest / "rank0.pt", "r+b") as f:  # truncated
        f.truncate(100)
    assert f"checkpoint file {newest / 'rank0.pt'} is truncated" in refusal(RESUME="auto")
    (newest / "manifest.json").write_text("{", encoding="utf-8")  # damaged manifest
    assert f"checkpoint file {newest / 'manifest.json'} is unreadable or corrupted" in refusal(RESUME="auto")
    (newest / "manifest.json").unlink()  # incomplete: RESUME=auto takes the previous one
    h = tg.Hyperparameters({**base, "CHECKPOINT_DIR": str(folder), "RESUME": "auto"})
    assert tg.find_resume(h).path == folder / "step_00000002"
    assert "no manifest.json" in refusal(RESUME=str(newest))
    # settings that change no number may differ
    h = tg.Hyperparameters({**base, "CHECKPOINT_DIR": str(folder), "RESUME": "auto", "TRAIN_PREFETCH": "0",
                            "TRAIN_LOG_EVERY": "5", "RUN_ID": "other"})
    assert tg.find_resume(h).manifest["step"] == 2
    assert "TEST_KILL_AT_CHECKPOINT='3:later' must be" in config_error({"TEST_KILL_AT_CHECKPOINT": "3:later"})
    assert "CHECKPOINT_KEEP=0 must be > 0" in config_error({"CHECKPOINT_KEEP": "0"})


def test_record_tools_say_a_resumed_log_is_no_10_minute_record(scenario, capsys):
    """The real resumed log (three starts appended, steps past a checkpoint logged again) reads as one run;
    check_record on the 10-minute track and make_record say in one line that it resumed; the never-stopped
    log gets no such line."""
    import sys

    from conftest import REPO
    sys.path.insert(0, str(REPO / "scripts" / "record"))
    import check_record
    import make_record
    import recordlib as rl

    ref_dir, cut_dir = scenario("default", 0)
    ref = rl.parse_log_text(read_log(ref_dir, "ref"), ref_dir / "train_seed1337.log")
    cut = rl.parse_log_text(read_log(cut_dir, "cut"), cut_dir / "train_seed1337.log")
    assert cut.run_headers == 3 and [s for _, s in cut.resumes] == [1, 3]
    assert rl.integrity_problems(cut) == [] and rl.resumed_note(ref) is None
    note = rl.resumed_note(cut)
    assert note.startswith("resumed from a checkpoint (resumed_from:runs/cut/checkpoints/step_00000003 step:3)")
    assert "not a valid 10-minute-track record run" in note and "\n" not in note
    assert (cut.path, note) in check_record.check_log(cut, set(), "10min", None)
    assert all(note != msg for _, msg in check_record.check_log(cut, set(), "non-record", None))
    assert all("resumed" not in msg for _, msg in check_record.check_log(ref, set(), "10min", None))
    make_record.warn_incomplete([cut, ref])
    err = capsys.readouterr().err
    assert err.count("resumed from a checkpoint") == 1 and f"warning: {cut.path}: {note}" in err


@pytest.mark.parametrize("nproc", [0, 2])
def test_checkpoint_bytes_are_the_formulas(scenario, data, nproc):
    """checkpoint_payload_bytes (docs/running.md's sizes) equals the tensor bytes of a real checkpoint, replicated
    and each rank's Muon momentum; the files add only torch.save's framing and the RNG/loader state."""
    _, cut_dir = scenario("default", nproc)
    folder = cut_dir / "runs" / "cut" / "checkpoints" / "step_00000003"
    ws = max(nproc, 1)
    h = tg.Hyperparameters({**SCENARIOS["default"][0], **data["default"], "WORLD_SIZE": str(ws),
                            **({"MASTER_ADDR": "x", "MASTER_PORT": "1"} if ws > 1 else {})})
    shared_bytes, muon_bytes = tg.checkpoint_payload_bytes(h)
    shared = {}
    for r in range(ws):
        shared.update(torch.load(folder / f"shared{r}.pt", weights_only=True))
        own = torch.load(folder / f"rank{r}.pt", weights_only=True)
        assert sum(t.nbytes for st in own["muon"] for t in st.values()) == muon_bytes
    assert sum(t.nbytes for k, t in shared.items() if not k.endswith(".step")) == shared_bytes
    files = sum(p.stat().st_size for p in folder.glob("*.pt"))
    assert shared_bytes + ws * muon_bytes < files < shared_bytes + ws * muon_bytes + ws * 64 * 1024


class RandomTokens:
    """A loader of random tokens with a position, for in-process checkpoints."""

    def __init__(self, h):
        self.h, self.g, self.taken = h, torch.Generator().manual_seed(0), 0

    def next_batch(self):
        self.taken += 1
        t = torch.randint(0, self.h.vocab_size, (1, self.h.train_seq_len + 1), generator=self.g)
        return t[:, :-1], t[:, 1:]

    def position(self):
        return {"taken": self.taken}


def test_asynchronous_write_holds_a_copy_and_restores_every_state_as_it_was(tmp_path, data):
    """The CUDA path's asynchronous write, run on the CPU: the training state is copied before save() returns
    (weights changed while the thread writes do not reach the file); restore_training_state then gives a fresh
    model and optimizers that state bit for bit, dtypes included (Muon's bf16 momentum stays bf16)."""
    env = {**SCENARIOS["default"][0], **data["default"], "RUN_ID": "async", "CHECKPOINT_EVERY": "1",
           "CHECKPOINT_DIR": str(tmp_path / "ck")}
    cpu = torch.device("cpu")

    def fresh(**over):
        h = tg.Hyperparameters({**env, **over})
        rt = tg.Runtime(h, cpu, False, True, None, resume=tg.find_resume(h))
        trainer = tg.Trainer(rt, rt.prepare_model(tg.build_model(h)))
        return rt, trainer, tg.WeightAverager(h, trainer.model)

    rt, trainer, averager = fresh()
    lines = []
    rt.log = lambda msg, console=True: lines.append(msg)
    loader = RandomTokens(rt.h)
    for _ in range(2):
        trainer.step(loader, 1.0, 0.95)
        averager.update(1, 1.0)
    shared, own = tg.training_state(trainer, averager, loader, {"step": 2})
    expected = {k: v.clone() for k, v in shared.items()}
    momentum = [st["momentum_buffer"].clone() for st in own["muon"]]
    assert momentum and all(m.dtype == torch.bfloat16 for m in momentum)
    ckpt = tg.Checkpointer(rt)
    ckpt.asynchronous = True
    ckpt.save(2, shared, own)
    with torch.no_grad():  # training goes on while the thread writes
        for p in trainer.model.parameters():
            p.add_(1)
        for st in own["muon"]:
            st["momentum_buffer"].add_(1)
    for _ in range(6000):  # the training loop's way: each step's all-reduced flag, until the write is done
        ckpt.poll(ckpt.pending_flag().item())
        if ckpt.pending is None:
            break
        time.sleep(0.01)
    assert ckpt.pending is None
    assert re.fullmatch(r"checkpoint: step:2 stall_ms:\d+\.\d write:async", lines[0]), lines
    assert lines[1].startswith(f"checkpoint_saved:{tmp_path / 'ck' / 'step_00000002'} step:2 bytes:")

    rt2, trainer2, averager2 = fresh(RESUME="auto")
    assert rt2.resume.manifest["step"] == 2
    schedule = tg.restore_training_state(tg.load_checkpoint(rt2), trainer2, averager2)
    assert schedule == {"step": 2} and averager2.swa is None
    again, own2 = tg.training_state(trainer2, averager2, RandomTokens(rt2.h), schedule)
    assert sorted(again) == sorted(expected)
    for k, v in expected.items():
        assert again[k].dtype == v.dtype and torch.equal(again[k], v), k
    assert [st["momentum_buffer"] for st in own2["muon"]] != []
    for got, want in zip((st["momentum_buffer"] for st in own2["muon"]), momentum):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert own2["groups"] == own["groups"]
