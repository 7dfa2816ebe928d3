"""PREFLIGHT=1 (issue 36): the whole run rehearsed through the run's own code, its report (log lines and
preflight.json) and its verdict. Every preset's rehearsal at the tiny scale of tests/test_compile.py is ready and
leaves nothing that looks like a finished run; the rehearsal's artifact is byte for byte the one a real run with
the rehearsal's settings writes, and its step time is that run's; a broken shard, a missing byte sidecar, a TTT
learning rate that only fails at evaluation, an artifact over the cap and a bad setting each give NOT READY
naming the problem, with exit status 1."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import train_gpt as tg
from conftest import REPO, SCRIPT, TINY_ENV, WORK_CLOCK_RUN, read_log, run_file, run_training
from test_compile import PRESET_ENV, eager_run, preset_data  # noqa: F401 (fixture: each preset's tiny data)
from test_documents import caseops_sample  # noqa: F401 (fixture)
from test_presets import caseops_run_data  # noqa: F401 (fixture)

EXACT_LINE = re.compile(r"^\S+_exact ", re.M)


def preflight(env, cwd, script=None, timeout=300, nproc=0):
    """PREFLIGHT=1 in `cwd` (nproc > 0: under torchrun): (process, preflight.json as a dict or None, the log or "")."""
    cwd.mkdir(exist_ok=True)
    env = {"PREFLIGHT_STEPS": "1", **env, "PREFLIGHT": "1", "RUN_ID": env.get("RUN_ID", "pf")}  # the suite's time
    proc = run_training(env, cwd, nproc=nproc, timeout=timeout, script=script or SCRIPT)
    report = run_file(cwd, env["RUN_ID"], "preflight.json")
    log = cwd / "logs" / f"{env['RUN_ID']}.preflight.txt"
    return (proc, json.loads(report.read_text()) if report.exists() else None,
            log.read_text(encoding="utf-8") if log.exists() else "")


def assert_nothing_complete_looking(cwd):
    """No artifact or raw model of any run, no score line of a finished run, no log named as a run's."""
    left = sorted(str(p.relative_to(cwd)) for p in cwd.glob("**/*_model*"))
    assert left == [], left
    assert not (cwd / "logs" / "pf.txt").exists()


# record_0427 has no pair of its own (issue 69: 12 s of the suite): its code is record_0430's without record_0430's own
# paths, and no rehearsal stage, state or artifact byte depends on how else their values differ (the LoRA targets,
# QK_GAIN_INIT, GPTQ_RESERVE_SECONDS, TTT_LOCAL_LR_MULT; the tiny runs' TTT phases are equal): record_0430's pair
# stands for it.
REHEARSED = [p for p in PRESET_ENV if p != "record_0427"]


@pytest.mark.parametrize("preset", REHEARSED)
def test_each_presets_rehearsal_is_ready_and_agrees_with_a_real_run_of_its_settings(preset, preset_data, tmp_path,  # noqa: F811
                                                                                    tmp_path_factory):
    """The rehearsal is ready, reports every stage, state, evaluation, compiled function and region, and leaves
    nothing that looks like a finished run; then a real run with the rehearsal's settings (the report's) writes an
    artifact of exactly the rehearsal's bytes, at the rehearsal's step time (both on a clock of the work done, so to the
    log's last digit on any machine); record_0409's real run is its compile pair's eager run (tests/test_compile.py:
    the same settings, made once for the session, on the machine's clock: its step time is not compared).
    record_0323 runs on 2 processes (every rank rehearses; a peak memory for each). record_0501's rehearsal runs
    compiled (COMPILE_BACKEND=eager: Dynamo's graphs and guards, which do not give eager's last bits, so no real eager
    run could match its bytes, and a compiled one costs the suite another minute): its artifact is record_0427's
    code, record_0430's without its own paths, whose pair stands for it."""
    env = {**preset_data[preset], **PRESET_ENV[preset], "PRESET": preset}
    if preset == "record_0430":  # lzma: ZPAQ's seconds twice over; the per-group path is record_0501's
        env["COMPRESSOR"] = "lzma"
    # record_0501's real run is planned (issue 52): PHASED_TTT_PREFIX_DOCS=auto under a 600 s budget, reported
    compiled = {"COMPILE": "1", "COMPILE_BACKEND": "eager", "PHASED_TTT_PREFIX_DOCS": "auto",
                "EVAL_BUDGET_SECONDS": "600"} if preset == "record_0501" else {}
    nproc = 2 if preset == "record_0323" else 0
    # the rehearsal and its real run read a clock of the work done (conftest.WORK_CLOCK_RUN): their step times agree
    # on any machine, however busy (record_0409's real run is the shared eager one, on the machine's clock)
    clock = None if compiled or preset == "record_0409" else tmp_path / "work_clock_run.py"
    if clock:
        clock.write_text(WORK_CLOCK_RUN.format(repo=str(REPO), gflops=1.0))
    proc, rep, log = preflight({**env, **compiled}, tmp_path / "pf", nproc=nproc, script=clock)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rep["verdict"] == "preflight: ready" == log.strip().splitlines()[-1] and rep["problems"] == []
    stages = [s["stage"] for s in rep["stages"]]
    for want in ("reading the tokenizer and validation data", "checking the training shards",
                 "warmup (every training graph)", "training", "writing the artifact",
                 "loading the artifact", "evaluation (final_int6_roundtrip)"):
        assert want in stages, (want, stages)
    assert all(s["status"] == "ok" and s["seconds"] >= 0 for s in rep["stages"])
    h = tg.Hyperparameters({"PREFLIGHT_STEPS": "1", **env, "PREFLIGHT": "1"})
    # every training state of the schedule was timed, PREFLIGHT_STEPS steps at least
    states = {f"loop:{int(a)} seq:{b} qat:{int(c)}" for a, b, c in tg.schedule_states(h, 1000)}
    assert set(rep["training"]["states"]) == states, rep["training"]
    assert all(v["steps"] >= h.preflight_steps for v in rep["training"]["states"].values()), rep["training"]
    assert rep["training"]["timed_steps"] == h.iterations == rep["settings"]["rehearsal"]["ITERATIONS"]
    ev = rep["evaluation"]
    assert 0 < ev["slice_targets"] < ev["val_targets"] and ev["projected_s"] > 0
    assert rep["artifact"]["total_bytes"] == rep["artifact"]["model_bytes"] + rep["artifact"]["code_bytes"]
    assert rep["artifact"]["code_bytes"] == (REPO / "train_gpt.py").stat().st_size
    assert rep["world_size"] == max(nproc, 1) == len(rep["peak_memory_mib"]) and min(rep["peak_memory_mib"]) > 0
    assert "preflight_eval: final_int6_roundtrip targets:" in log and not EXACT_LINE.search(log)
    if compiled:
        assert {c["name"] for c in rep["compile"]} >= {"train_forward", "eval_forward", "ttt_lora"}
        assert all(c["graphs"] <= c["planned"] and c["eager_calls"] == 0 for c in rep["compile"])
        assert set(rep["compile_regions"]) == {"training", "post_ema", "final_int6_roundtrip", "legal_ttt"}
    if preset == "record_0501":
        assert rep["evaluation"]["tilt_build_s"].keys() == {"legal_ttt"}  # built on the whole val stream
        plan = rep["evaluation"]["ttt_plan"]  # what auto would choose for the whole val set on this machine
        assert 0 <= plan["prefix_docs"] <= plan["cap"] == plan["docs"] and plan["budget_s"] == 600.0
        assert re.search(rf"^preflight: ttt_plan PHASED_TTT_PREFIX_DOCS=auto would choose {plan['prefix_docs']} \(max "
                         rf"{plan['cap']} of {plan['docs']} docs\) ", log, re.M)
        assert re.search(rf"^ngram_tilt: .* gated:\d+/{ev['val_targets']} ", log, re.M)
    assert_nothing_complete_looking(tmp_path / "pf")
    if compiled:
        return
    same = {k: str(v) for k, v in rep["settings"]["rehearsal"].items()}
    if preset == "record_0409":  # its compile pair's eager run has exactly these settings: that run, made once
        assert {k: env[k] for k in same} == same
        _, log = eager_run(tmp_path_factory, preset, preset_data[preset], 1)
    else:
        (tmp_path / "real").mkdir()
        real = run_training({**env, **same, "RUN_ID": "real"}, tmp_path / "real", nproc=nproc, script=clock)
        assert real.returncode == 0, real.stderr[-3000:]
        log = read_log(tmp_path / "real", "real")
    size = int(re.search(r"^Serialized model int6\+\S+: (\d+) bytes", log, re.M).group(1))
    assert size == rep["artifact"]["model_bytes"]
    steps = rep["training"]["states"].values()
    rehearsed = sum(v["steps"] * v["ms_per_step"] for v in steps) / sum(v["steps"] for v in steps)
    real_ms = float(re.findall(r"^step:\d+/\d+ train_loss:\S+ train_time:\S+ step_avg:([\d.]+)ms", log, re.M)[-1])
    if clock:  # the same work a step, so the same time to the log's 0.01 ms
        assert rehearsed == pytest.approx(real_ms, abs=0.01), (rehearsed, real_ms)


def assert_not_ready(proc, rep, log, cwd, *needles):
    """Exit 1, the verdict naming the problem (every needle), in preflight.json and as the log's last line."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    verdict = rep["verdict"]
    assert verdict.startswith("preflight: NOT READY: ") and log.strip().splitlines()[-1] == verdict
    for needle in needles:
        assert needle in verdict, (needle, verdict)
    assert_nothing_complete_looking(cwd)
    return rep


def test_a_truncated_train_shard_is_not_ready_before_training(preset_data, tmp_path):  # noqa: F811
    env = {**preset_data["record_0323"], **PRESET_ENV["record_0323"]}
    data = tmp_path / "data"
    shutil.copytree(env["DATA_PATH"], data)
    shard = sorted(data.glob("fineweb_train_*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    proc, rep, log = preflight({**env, "DATA_PATH": str(data)}, tmp_path / "run")
    assert_not_ready(proc, rep, log, tmp_path / "run", shard.name)
    assert rep["stages"][-1] == {**rep["stages"][-1], "stage": "checking the training shards", "status": "failed"}
    assert "training" not in [s["stage"] for s in rep["stages"]]


def test_a_missing_byte_sidecar_is_not_ready_before_training(caseops_run_data, tmp_path):  # noqa: F811
    data = tmp_path / "data"
    shutil.copytree(caseops_run_data["DATA_PATH"], data)
    (data / "fineweb_val_bytes_000000.bin").unlink()
    env = {**caseops_run_data, **PRESET_ENV["record_0501"], "PRESET": "record_0501", "DATA_PATH": str(data)}
    proc, rep, log = preflight(env, tmp_path / "run")
    assert_not_ready(proc, rep, log, tmp_path / "run", "fineweb_val_bytes_000000.bin", "missing")
    assert rep["stages"][-1]["stage"] == "reading the tokenizer and validation data"


def test_a_ttt_rate_that_fails_only_at_evaluation_is_not_ready(preset_data, tmp_path):  # noqa: F811
    """TTT_LORA_LR=1e6 passes every start-up check; the real run would train for its ten minutes and then stop in
    the legal TTT evaluation with a NaN loss. The rehearsal finds it on its slice, in seconds."""
    env = {**preset_data["record_0427"], **PRESET_ENV["record_0427"], "PRESET": "record_0427", "TTT_LORA_LR": "1e6",
           "COMPRESSOR": "lzma"}
    proc, rep, log = preflight(env, tmp_path)
    assert_not_ready(proc, rep, log, tmp_path, "legal_ttt: val_loss is nan", "(lower TTT_LORA_LR)")
    assert rep["stages"][-1] == {**rep["stages"][-1], "stage": "evaluation (legal_ttt)", "status": "failed"}
    assert "evaluation (final_int6_roundtrip)" in [s["stage"] for s in rep["stages"]]  # the evaluations before ran


def test_an_artifact_over_the_cap_is_not_ready(preset_data, tmp_path):  # noqa: F811
    """The script counts in the artifact's bytes: a copy of train_gpt.py padded past 16,000,000 bytes."""
    script = tmp_path / "train_gpt.py"
    src = (REPO / "train_gpt.py").read_bytes()
    script.write_bytes(src + b"\n#" + b"x" * (tg.SIZE_CAP_BYTES - len(src)) + b"\n")
    env = {**preset_data["record_0323"], **PRESET_ENV["record_0323"]}
    proc, rep, log = preflight(env, tmp_path / "run", script=script)
    rep = assert_not_ready(proc, rep, log, tmp_path / "run", "over the 16000000-byte cap")
    assert rep["artifact"]["code_bytes"] == script.stat().st_size
    assert rep["artifact"]["total_bytes"] > tg.SIZE_CAP_BYTES
    assert all(s["status"] == "ok" for s in rep["stages"])  # every stage ran: the size is the one problem


def test_a_bad_setting_is_not_ready_with_exit_1(tmp_path):
    proc = run_training({"PREFLIGHT": "1", "EVAL_STRIDE": "-5"}, tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("preflight: NOT READY: EVAL_STRIDE=-5")


def test_a_finished_run_id_is_not_ready_and_its_files_stay(sample_data, tmp_path):
    """The real run would be refused (issue 47): so is its rehearsal, before any work. With OVERWRITE_RUN=1 it runs
    (here up to a missing train shard, past where a real run removes the old files) and removes none of them."""
    done = run_file(tmp_path, "pf")
    done.parent.mkdir(parents=True)
    done.write_bytes(b"a finished run's artifact")
    env = {**TINY_ENV, **sample_data, "PREFLIGHT": "1", "RUN_ID": "pf"}
    proc = run_training(env, tmp_path)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        "preflight: NOT READY: RUN_ID=pf is a finished run (runs/pf/final_model.int6.ptz exists): choose a new RUN_ID, "
        "or set OVERWRITE_RUN=1 to replace its outputs")
    assert not (tmp_path / "logs").exists()
    val_only = tmp_path / "val_only"
    val_only.mkdir()
    for f in Path(sample_data["DATA_PATH"]).glob("fineweb_val_*.bin"):
        (val_only / f.name).symlink_to(f)
    proc, rep, log = preflight({**env, "OVERWRITE_RUN": "1", "DATA_PATH": str(val_only)}, tmp_path)
    assert proc.returncode == 1 and "DATA_PATH: no files match" in rep["verdict"]
    assert rep["stages"][-1]["stage"] == "checking the training shards" and not re.search(r"^removed ", log, re.M)
    assert done.read_bytes() == b"a finished run's artifact"


def test_preflight_iterations_give_every_state_its_steps():
    for preset in tg.PRESETS:
        h = tg.Hyperparameters({"PRESET": preset, "PREFLIGHT": "1", "PREFLIGHT_STEPS": "2"})
        wanted = set(tg.schedule_states(h, 1000))
        states = tg.schedule_states(h, h.iterations)
        assert all(states.count(s) >= 2 for s in wanted), preset
        assert h.iterations == 1 or not all(tg.schedule_states(h, h.iterations - 1).count(s) >= 2 for s in wanted)
        assert h.real["ITERATIONS"] == tg.Hyperparameters({"PRESET": preset}).iterations
    assert np.isclose(tg.Hyperparameters({"PREFLIGHT": "1"}).real["max_wallclock_ms"], 600_000.0)


def test_projected_training_takes_each_states_share_of_the_schedule():
    """project_training: equal step times give the cap over that time, whatever the shares; the layer loop's share
    (1 - ENABLE_LOOPING_AT) of the capped time runs at the looped step time; with a cap that does not bind,
    ITERATIONS steps at the shares' step time."""
    h = tg.Hyperparameters({"PRESET": "record_0427", "PREFLIGHT": "1"})
    off, on = tg.state_key(False, 2048, False), tg.state_key(True, 2048, False)
    cap = h.real["max_wallclock_ms"]
    p = tg.project_training(h, {off: 100.0, on: 100.0})
    assert p["projected_steps"] == pytest.approx(cap / 100.0, abs=1) and p["projected_train_s"] == round(cap / 1e3, 1)
    assert p["shares"] == {off: pytest.approx(h.enable_looping_at, abs=2e-3), on: pytest.approx(1 - h.enable_looping_at, abs=2e-3)}
    f_on = p["shares"][on]
    p = tg.project_training(h, {off: 100.0, on: 200.0})
    assert p["projected_steps"] == pytest.approx(cap * ((1 - f_on) / 100.0 + f_on / 200.0), abs=1)
    h.real = {**h.real, "ITERATIONS": 10}
    p = tg.project_training(h, {off: 100.0, on: 200.0})
    assert p["projected_steps"] == 10 and p["projected_train_s"] == round(10 * (100.0 * (1 - f_on) + 200.0 * f_on) / 1e3, 1)
