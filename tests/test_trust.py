"""What a user meets first: exact seeds, the record's own command, the CPU precision choice, EVAL_ONLY, and
every bad input or fault ending in one clear line (never a traceback, a hang, or a run that looks finished)."""
from __future__ import annotations

import io
import json
import lzma
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train_gpt as tg
from conftest import (SCRIPT, TINY_ENV, clean_environ, config_error, packed_script, read_log, run_file, run_training,
                      short_val_data)

ANCHOR = Path(__file__).resolve().parents[2] / "shared" / "anchors" / "record_2026-03-23"
needs_anchor = pytest.mark.skipif(not ANCHOR.is_dir(), reason=f"{ANCHOR} (the record's files) is not here")


def record_command_env() -> dict[str, str]:
    """The env vars of the run command in the record's README, exactly as written there."""
    text = (ANCHOR / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?torchrun.*?)```", text, re.S).group(1)
    return dict(re.findall(r"\b([A-Z][A-Z0-9_]*)=(\S+)", block.split("torchrun")[0]))


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.strip()]


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    lines = error_lines(proc)
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert len(lines) == 1, lines
    for frag in fragments:
        assert frag in lines[0], (frag, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------------------------- seeds

# build_model against the record's initial state: tests/test_record_loop.py (the record's own code on this machine).


def test_other_configurations_still_build_and_differ_by_seed():
    env = {**TINY_ENV, "TIE_EMBEDDINGS": "0", "BIGRAM_VOCAB_SIZE": "0", "VE_ENABLED": "0"}
    a = tg.build_model(tg.Hyperparameters({**env, "SEED": "1"})).state_dict()
    b = tg.build_model(tg.Hyperparameters({**env, "SEED": "1"})).state_dict()
    c = tg.build_model(tg.Hyperparameters({**env, "SEED": "2"})).state_dict()
    assert "lm_head.weight" in a and "bigram.embed.weight" not in a and "ve_shared.embed.weight" not in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["qo_bank"], c["qo_bank"])


# ---------------------------------------------------------------------------------------------- the record's command

def averaged_steps(h):
    """100 steps of a toy model in the warmdown (LR scale 0.1), each moving the weights, averaged."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    avg = tg.WeightAverager(h, model)
    for step in range(1, 101):
        with torch.no_grad():
            model.weight.add_(1.0)
        avg.update(step, lr_scale=0.1)
    return model, avg


@needs_anchor
def test_record_command_collects_swa_but_keeps_the_ema():
    """The record's README command sets SWA_ENABLED=1; the record collects SWA snapshots and still ends with
    the EMA weights. With exactly that env our final weights are the EMA too."""
    env = record_command_env()
    assert env["SWA_ENABLED"] == "1" and env["EMA_DECAY"] == "0.997"
    h = tg.Hyperparameters(env)
    assert h.swa_enabled and not h.swa_apply and h.ema_enabled
    model, avg = averaged_steps(h)
    assert avg.swa_count == 2  # snapshots at steps 50 and 100
    ema = {k: v.clone() for k, v in avg.ema.items()}
    source = avg.apply_final()
    assert source.startswith("ema") and "not applied" in source
    assert torch.equal(model.weight, ema["weight"])
    # The opt-in applies the SWA average instead.
    model2, avg2 = averaged_steps(tg.Hyperparameters({**env, "SWA_APPLY": "1"}))
    swa = avg2.swa["weight"] / 2
    assert avg2.apply_final() == "swa(2)" and torch.equal(model2.weight, swa)


def test_record_style_run_logs_ema_final_weights(tmp_path, sample_data):
    proc = run_training({**TINY_ENV, **sample_data, "SWA_ENABLED": "1", "SWA_EVERY": "1", "WARMDOWN_ITERS": "8",
                         "TTT_ENABLED": "0", "EVAL_STRIDE": "0", "RUN_ID": "swa"}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in read_log(tmp_path, "swa").splitlines() if ln.startswith("final_weights:")]
    assert len(line) == 1 and line[0].startswith("final_weights:ema (swa snapshots collected: 1,"), line


# ---------------------------------------------------------------------------------------------- CPU precision

@pytest.mark.parametrize("native,setting,device,want", [
    (True, "auto", "cpu", torch.bfloat16), (False, "auto", "cpu", None), (False, "bf16", "cpu", torch.bfloat16),
    (True, "fp32", "cpu", None), (False, "auto", "cuda", torch.bfloat16),
])
def test_precision_follows_the_cpu_capability(monkeypatch, native, setting, device, want):
    monkeypatch.setattr(tg, "cpu_has_native_bf16", lambda: native)
    dtype, note = tg.choose_precision(tg.Hyperparameters({"AUTOCAST_DTYPE": setting}), torch.device(device))
    assert dtype == want
    assert ("fp32" in note) == (want is None)


def test_capability_check_is_onednn_bf16_support():
    assert tg.cpu_has_native_bf16() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_fp32_runs_keep_the_bf16_tables_out_of_the_arithmetic():
    """fp32 precision: embedding rows are cast to fp32, so logits (and every activation) are fp32 although
    the tables stay bf16; with bf16 autocast the record's path is untouched (bf16 rows)."""
    h = tg.Hyperparameters(TINY_ENV)
    ids = torch.randint(0, h.vocab_size, (2, 16))
    model = tg.build_model(h)
    rt = tg.Runtime(h, torch.device("cpu"), False, True, None, autocast_dtype=None)
    model = rt.prepare_model(model)
    assert model.tok_emb.weight.dtype == torch.bfloat16
    seen = []
    hook = model.blocks[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with rt.autocast():
        logits = model.forward_logits(ids)
    assert logits.dtype == torch.float32 and seen == [torch.float32]
    rt16 = tg.Runtime(h, torch.device("cpu"), False, True, None, autocast_dtype=torch.bfloat16)
    model = rt16.prepare_model(model)
    with rt16.autocast():
        model.forward_logits(ids)
    assert seen[-1] == torch.bfloat16
    hook.remove()


@pytest.mark.parametrize("autocast,ns", [(torch.bfloat16, torch.bfloat16), (None, torch.float32)])
def test_newton_schulz_follows_the_precision(autocast, ns):
    """bf16 runs keep the record's bf16 Newton-Schulz; fp32 runs (CPUs without native bf16) run it in fp32."""
    h = tg.Hyperparameters(TINY_ENV)
    rt = tg.Runtime(h, torch.device("cpu"), False, True, None, autocast_dtype=autocast)
    trainer = tg.Trainer(rt, rt.prepare_model(tg.build_model(h)))
    assert trainer.muon.ns_dtype == ns
    g = torch.randn(3, 16, 8)
    out = tg.zeropower_via_newtonschulz5(g, 5, dtype=ns)
    assert out.dtype == ns and out.shape == g.shape


@pytest.mark.real_command
def test_run_logs_precision_and_threads(tmp_path, sample_data):
    """A real `python3 train_gpt.py` without OMP_NUM_THREADS (no zygote may serve it: tests/launcher.py) chooses
    one thread per core and logs it; 257 val tokens (two sequences) and one sequence a micro-step keep its work short
    (issue 53: the lines asserted come before any work)."""
    data = short_val_data(sample_data, tmp_path, 2 * 128 + 1)
    env = {**TINY_ENV, **data, "ITERATIONS": "1", "TTT_ENABLED": "0", "EVAL_STRIDE": "0", "TRAIN_BATCH_TOKENS": "1024",
           "AUTOCAST_DTYPE": "fp32", "RUN_ID": "prec"}
    env.pop("OMP_NUM_THREADS", None)
    full = {k: v for k, v in clean_environ().items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, env={**full, **env}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(tmp_path, "prec")
    assert "\nprecision: fp32, no autocast (AUTOCAST_DTYPE=fp32)\n" in log
    cores = len(os.sched_getaffinity(0))
    assert f"\ncpu_threads: {cores} ({cores} cores / 1 local ranks)\n" in log


# ---------------------------------------------------------------------------------------------- bad settings

BAD_SETTINGS = [
    ({"LOGIT_SOFTCAP": "inf"}, "LOGIT_SOFTCAP='inf' must be a finite number"),
    ({"QK_GAIN_INIT": "nan"}, "QK_GAIN_INIT='nan' must be a finite number"),
    ({"QK_GAIN_INIT": "0"}, "QK_GAIN_INIT=0.0 must be > 0"),
    ({"MATRIX_LR": "1e400"}, "MATRIX_LR='1e400' must be a finite number"),
    ({"MAX_WALLCLOCK_SECONDS": "inf"}, "MAX_WALLCLOCK_SECONDS='inf' must be a finite number"),
    ({"SEED": str(2**32)}, "SEED=4294967296 must be in [0, 2^32)"),
    ({"SEED": "-1"}, "SEED=-1 must be in [0, 2^32)"),
    ({"ROPE_BASE": "1"}, "ROPE_BASE=1.0 must be > 1"),
    ({"EVAL_STRIDE": "0"}, "TTT_ENABLED=1 needs EVAL_STRIDE > 0"),
    ({"TTT_CHUNK_TOKENS": "64"}, "TTT_CHUNK_TOKENS=64 is shorter than EVAL_SEQ_LEN=128"),
    ({"SWA_APPLY": "1"}, "SWA_APPLY=1 needs SWA_ENABLED=1"),
    ({"SWA_APPLY": "1", "SWA_ENABLED": "1", "SWA_EVERY": "50"}, "no SWA snapshot would be taken"),
    ({"RUN_ID": "runs/a"}, "RUN_ID='runs/a' must be a plain file name"),
    ({"RUN_ID": ".."}, "RUN_ID='..' must be a plain file name"),
    ({"AUTOCAST_DTYPE": "fp16"}, "AUTOCAST_DTYPE='fp16' must be auto or bf16 or fp32"),
    ({"DIST_TIMEOUT_SECONDS": "0"}, "DIST_TIMEOUT_SECONDS=0.0 must be > 0"),
    ({"EVAL_ONLY": "/nonexistent/model.ptz"}, "EVAL_ONLY=/nonexistent/model.ptz: no such artifact file"),
    ({"ROPE_DIMS": "2", "TRAIN_SEQ_LEN": "2048", "EVAL_SEQ_LEN": "2048", "TRAIN_BATCH_TOKENS": "65536",
      "VAL_BATCH_SIZE": "65536", "TTT_CHUNK_TOKENS": "4096"}, "ROPE_DIMS=2"),
]


@pytest.mark.parametrize("over,fragment", BAD_SETTINGS, ids=[next(iter(o)) + "=" + next(iter(o.values()))
                                                              for o, _ in BAD_SETTINGS])
def test_bad_setting_is_refused_at_construction(over, fragment):
    assert fragment in config_error({**TINY_ENV, **over})


def test_swa_apply_accepted_when_a_snapshot_will_come():
    # 10 steps, warmdown over all 10: step index 9 has LR scale 0.1 < 0.2 and is step 10, a multiple of 10.
    h = tg.Hyperparameters({**TINY_ENV, "ITERATIONS": "10", "WARMDOWN_ITERS": "10", "SWA_APPLY": "1",
                            "SWA_ENABLED": "1", "SWA_EVERY": "10"})
    assert h.swa_apply and h.swa_snapshot_possible()
    # Under a wallclock cap the warmdown is timed: only "there is a warmdown" can be checked in advance.
    assert tg.Hyperparameters({**TINY_ENV, "MAX_WALLCLOCK_SECONDS": "60", "SWA_APPLY": "1", "SWA_ENABLED": "1",
                               "SWA_EVERY": "1000"}).swa_apply


BAD_RUNS = [
    pytest.param({"LOGIT_SOFTCAP": "inf"}, 2, "LOGIT_SOFTCAP", id="softcap-inf"),
    pytest.param({"EVAL_STRIDE": "0"}, 2, "EVAL_STRIDE", id="stride0-with-ttt"),
    pytest.param({"RUN_ID": "a/b"}, 2, "RUN_ID", id="run-id-slash"),
    pytest.param({"WORLD_SIZE": "2", "RANK": "0"}, 2, "torchrun", id="world-size-without-torchrun"),
    pytest.param({"SEED": "99999999999"}, 2, "SEED", id="seed-range"),
]


@pytest.mark.parametrize("over,code,fragment", BAD_RUNS)
def test_bad_setting_stops_the_script_fast_with_one_line(tmp_path, sample_data, over, code, fragment):
    """Refused before any work: nothing written (no log, no run folder), so before the data, the model or a process
    group; the 60 s limit only guards against a hang (a busy machine's speed decides nothing here)."""
    proc = run_training({**TINY_ENV, **sample_data, "RUN_ID": "bad", **over}, tmp_path, timeout=60)
    assert_one_line_error(proc, code, fragment)
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_that_is_not_sentencepiece(tmp_path, sample_data):
    bad = tmp_path / "tok.model"
    bad.write_text("not a model\n")
    proc = run_training({**TINY_ENV, **sample_data, "TOKENIZER_PATH": str(bad), "RUN_ID": "tok"}, tmp_path)
    assert_one_line_error(proc, 2, "TOKENIZER_PATH", "not a SentencePiece model")


def test_unwritable_log_directory(tmp_path, sample_data):
    (tmp_path / "logs").write_text("a file where the logs/ directory should be\n")
    proc = run_training({**TINY_ENV, **sample_data, "RUN_ID": "nolog"}, tmp_path)
    assert_one_line_error(proc, 2, "cannot write the log", "logs/nolog.txt")


@pytest.mark.real_command
def test_help_prints_the_settings_and_exits_0(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=tmp_path, env=clean_environ(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == ""
    settings = tg.Hyperparameters({}).settings
    assert len(settings) > 80
    for name, default in settings:
        preset = tg.PRESETS["record_0409"].get(name)
        tail = rf" +{re.escape(preset)}" if preset else ""
        assert re.search(rf"^  {name} +{re.escape(default)}{tail}$", proc.stdout, re.M), name
    assert re.search(r"^  SEED +1337$", proc.stdout, re.M) and re.search(r"^  TTT_LR +0.002 +0.005$", proc.stdout, re.M)
    assert re.search(r"^  NUM_LOOPS +0 +2$", proc.stdout, re.M)
    assert "data/build_sample_data.py" in proc.stdout and "cached_challenge_fineweb.py" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # no run started: no logs/


@pytest.mark.parametrize("preset", ["record_0427", "record_0430"])
@pytest.mark.real_command
def test_help_with_a_preset_shows_that_presets_column(tmp_path, preset):
    """`PRESET=record_0430 python3 train_gpt.py --help`: the last column is that preset's values."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=tmp_path,
                          env={**clean_environ(), "PRESET": preset}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == ""
    assert re.search(rf"^  variable +default \(PRESET=record_0323\) +PRESET={preset}$", proc.stdout, re.M)
    for name, default in tg.Hyperparameters({}).settings:
        value = tg.PRESETS[preset].get(name)
        tail = rf" +{re.escape(value)}" if value else ""
        assert re.search(rf"^  {name} +{re.escape(default)}{tail}$", proc.stdout, re.M), name
    assert re.search(r"^  TTT_MODE +sgd +lora$", proc.stdout, re.M)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.real_command
def test_help_with_an_unknown_preset_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=tmp_path,
                          env={**clean_environ(), "PRESET": "record_9999"}, capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, 2, "PRESET='record_9999'", "record_0430")


@pytest.mark.real_command
def test_help_into_a_closed_pipe_is_quiet(tmp_path):
    """`python3 train_gpt.py --help | head -3`: the reader goes away early; no BrokenPipeError traceback."""
    proc = subprocess.run(f"{sys.executable} {SCRIPT} --help | head -3", shell=True, cwd=tmp_path,
                          env={**clean_environ(), "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.startswith("usage:") and len(proc.stdout.splitlines()) == 3
    assert proc.stderr == ""


@pytest.mark.real_command
def test_unknown_argument_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--lr=3"], cwd=tmp_path, env=clean_environ(),
                          capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, 2, "'--lr=3'", "--help")


# ---------------------------------------------------------------------------------------------- faults during a run

def test_non_finite_loss_stops_the_run_without_artifact(tmp_path, sample_data):
    """The failed run leaves nothing under its name that looks finished, and another run's files untouched."""
    other = run_file(tmp_path, "other")
    other.parent.mkdir(parents=True)
    other.write_bytes(b"an earlier run's artifact")
    proc = run_training({**TINY_ENV, **sample_data, "TIED_EMBED_LR": "1e30", "SCALAR_LR": "1e30",
                         "MATRIX_LR": "1e30", "RUN_ID": "nan"}, tmp_path)
    line = assert_one_line_error(proc, 1, "training loss is not finite at step", "no artifact written")
    assert list((tmp_path / "runs" / "nan").iterdir()) == []  # no final_model.pt or .int6.ptz, no temporary file
    assert other.read_bytes() == b"an earlier run's artifact"
    log = read_log(tmp_path, "nan")
    assert log.rstrip("\n").endswith(line) and "\nfinal_int6_roundtrip" not in log


@pytest.mark.real_command
def test_unexpected_error_is_one_line_naming_the_stage(tmp_path, sample_data):
    """A disk that fills while the artifact is written (a file-size limit stands in for it): one line that
    names the stage, no partial artifact; DEBUG_TRACEBACK=1 shows the traceback."""
    limit = SCRIPT.stat().st_size + 200_000  # the log (it starts with the script) fits; the 1.4 MB raw model does not

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    # one training step and no post-EMA evaluation: the stage that fails is the artifact's (the suite's time)
    env = {**clean_environ(), **TINY_ENV, **sample_data, "TTT_ENABLED": "0", "EVAL_STRIDE": "0",
           "ITERATIONS": "1", "WARMDOWN_ITERS": "0", "DIAGNOSTIC_POST_EMA": "0", "OMP_NUM_THREADS": "1",
           "RUN_ID": "full"}
    for debug in ("0", "1"):
        proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, env={**env, "DEBUG_TRACEBACK": debug},
                              capture_output=True, text=True, timeout=600, preexec_fn=limit_file_size)
        assert proc.returncode == 1, proc.stderr[-3000:]
        if debug == "0":
            assert_one_line_error(proc, 1, "error: writing the artifact failed: OSError:", "DEBUG_TRACEBACK=1")
        else:
            assert "Traceback" in proc.stderr and "writing the artifact failed" in proc.stderr
        assert not list(tmp_path.rglob("final_model*")), list(tmp_path.rglob("*"))


@pytest.mark.real_command
def test_ctrl_c_exits_130_with_one_line(tmp_path, sample_data):
    env = {**clean_environ(), **TINY_ENV, **sample_data, "ITERATIONS": "100000", "TRAIN_LOG_EVERY": "1",
           "OMP_NUM_THREADS": "1", "RUN_ID": "int"}
    # A shell's background job inherits SIGINT ignored (and Python then keeps it so): give the child the default.
    proc = subprocess.Popen([sys.executable, str(SCRIPT)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    log = tmp_path / "logs" / "int.txt"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and "\nstep:2/" in log.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 130, err[-3000:]
    assert lines == ["interrupted (Ctrl-C) during training"], lines
    assert not run_file(tmp_path, "int").exists()


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid):
    """Whether process `pid` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.real_command
def test_stalled_peer_fails_the_run_within_the_timeout(tmp_path, sample_data):
    """Rank 1 is stopped (SIGSTOP) mid-training: rank 0's next collective gives up after
    DIST_TIMEOUT_SECONDS and the run exits non-zero instead of hanging."""
    env = {**clean_environ(), **TINY_ENV, **sample_data, "ITERATIONS": "100000", "OMP_NUM_THREADS": "1",
           "DIST_TIMEOUT_SECONDS": "8", "RUN_ID": "stall"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "logs" / "stall.txt"
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (log.exists() and "\nstep:2/" in log.read_text()):
            time.sleep(0.2)
        workers = _children(proc.pid)
        ranks = {}
        for pid in workers:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = [e for e in environ if e.startswith(b"RANK=")]
            if rank:
                ranks[int(rank[0][5:])] = pid
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGSTOP)
        t0 = time.time()
        while time.time() - t0 < 120 and _alive(ranks[0]):
            time.sleep(0.2)
        elapsed = time.time() - t0
        # torchrun's agent would give the stopped rank 30 s to answer SIGTERM: end it now
        os.kill(ranks[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    rank0 = [ln for ln in err.splitlines() if ln.startswith("error:") and ln.endswith("[rank 0]")]
    assert len(rank0) == 1 and "training failed" in rank0[0], err[-3000:]


# ---------------------------------------------------------------------------------------------- logs and artifacts

def test_rerun_with_the_same_run_id_starts_a_fresh_log(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "same.txt").write_text("an earlier run's log\nlegal_ttt_exact val_loss:1 val_bpb:1\n")
    h = tg.Hyperparameters({**TINY_ENV, "RUN_ID": "same"})
    path = tg.open_log(h)
    assert path.read_text() == ""


def test_eval_only_artifact_with_more_layers_names_the_mismatch(tmp_path):
    h4 = tg.Hyperparameters(TINY_ENV)
    path = tmp_path / "four.ptz"
    tg.save_artifact(str(path), tg.build_model(h4), late_qat=False)
    h3 = tg.Hyperparameters({**TINY_ENV, "NUM_LAYERS": "3", "VE_LAYERS": "1,2"})
    with pytest.raises(tg.ConfigError) as err:
        tg.load_artifact(str(path), h3)
    msg = str(err.value)
    assert "(other model settings: the artifact has 4 blocks, NUM_LAYERS=3 here): skip_weights shape (2, 64)" in msg
    assert "\n" not in msg


def test_artifact_records_late_qat_and_record_artifacts_default_to_on(tmp_path):
    h = tg.Hyperparameters(TINY_ENV)
    model = tg.build_model(h)
    for flag in (False, True):
        path = tmp_path / f"qat{int(flag)}.ptz"
        tg.save_artifact(str(path), model, late_qat=flag)
        assert tg.load_artifact(str(path), h).qat_on() is flag
    # The record's own format: only "w" and "m".
    obj = torch.load(io.BytesIO(lzma.decompress((tmp_path / "qat0.ptz").read_bytes())))
    del obj["late_qat"]
    buf = io.BytesIO()
    torch.save(obj, buf)
    (tmp_path / "record.ptz").write_bytes(lzma.compress(buf.getvalue(), preset=6))
    assert tg.load_artifact(str(tmp_path / "record.ptz"), h).qat_on() is True


def test_eval_batch_rows_never_pads_beyond_the_windows():
    h = tg.Hyperparameters({**TINY_ENV, "EVAL_BATCH_SEQS": "4096"})
    assert tg.eval_batch_rows(h, [37, 12]) == 37
    assert tg.eval_batch_rows(h, [0]) == 1
    assert tg.eval_batch_rows(tg.Hyperparameters({**TINY_ENV, "EVAL_BATCH_SEQS": "16"}), [37]) == 16


@needs_anchor
def test_script_fits_beside_the_records_largest_model(tmp_path_factory):
    """The script's bytes count in the submission, and record submissions ship it packed (scripts/pack/pack_code.py,
    run_seeds.sh with PACK_CODE=1), so the packed size is what must fit: the record's largest artifact (its
    submission.json total minus its code size) plus the packed file must stay under the cap with 2,000 bytes
    to spare for run-to-run variation of the compressed model (the record's own seeds differ by 12.6 KB). A
    run of the readable file logs its own, larger Code size, honestly."""
    record_code = int(re.search(r"^Code size: (\d+) bytes$", (ANCHOR / "train_seed1337.log").read_text(),
                                re.M).group(1))
    record_model_max = json.loads((ANCHOR / "submission.json").read_text())["bytes_total"] - record_code
    assert record_model_max == 15_900_548
    code = len(packed_script(tmp_path_factory)[1].encode("utf-8"))  # the session's pack (tests/test_pack_code.py's)
    assert code + record_model_max <= tg.SIZE_CAP_BYTES - 2_000, f"packed train_gpt.py is {code} bytes"
