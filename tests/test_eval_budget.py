"""The evaluation's budget (issue 46): EVAL_BUDGET_SECONDS and EVAL_TTT_STOP_AT refused in one line when bad; LoRA
TTT stopped by the guard or at a given step scores every target once with the unguarded run's bytes, the batches
before the stop as the unguarded run scores them, and the same totals either way; a stop before the first step is
TTT at learning rate 0; two gloo ranks whose clocks disagree stop at one step. The SGD TTT run under a budget:
tests/test_artifact_eval.py; nothing compiled after the training clock starts: tests/test_compile.py."""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

import train_gpt as tg
from conftest import config_error
from test_ttt_lora import CPU, LORA_ENV, PHASE_ENV, luts_for, setup, stream  # noqa: F401 (setup: a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# 9 documents in batches of 3 longest first (sizes 1, 3, 3, 3) with two phases: on one process the adaptation steps
# are batch 1, batch 2, phase 1, batch 3, phase 2, batch 4 (steps 0 to 5)
ENV = {**LORA_ENV, **PHASE_ENV, "EVAL_BUDGET_SECONDS": "0"}


@pytest.mark.parametrize("environ, message", [
    ({"EVAL_BUDGET_SECONDS": "-1"}, "EVAL_BUDGET_SECONDS=-1.0 must be >= 0"),
    ({"EVAL_BUDGET_SECONDS": "ten"}, "EVAL_BUDGET_SECONDS='ten' is not a valid float"),
    ({"EVAL_BUDGET_SECONDS": "nan"}, "EVAL_BUDGET_SECONDS='nan' must be a finite number"),
    ({"EVAL_TTT_STOP_AT": "-2"}, "EVAL_TTT_STOP_AT=-2 must be >= 0 (the adaptation steps TTT takes) or -1 (all)"),
    ({"EVAL_TTT_STOP_AT": "1.5"}, "EVAL_TTT_STOP_AT='1.5' is not a valid int"),
    ({"DIAGNOSTIC_ROUNDTRIP": "yes"}, "DIAGNOSTIC_ROUNDTRIP='yes' must be 0 or 1"),
])
def test_bad_budget_settings_are_one_line_errors(environ, message):
    assert config_error(environ) == message


def test_the_budget_defaults_to_the_training_cap_and_the_lora_presets_skip_the_diagnostics():
    assert tg.Hyperparameters({}).eval_budget_seconds == 600.0
    assert tg.Hyperparameters({"MAX_WALLCLOCK_SECONDS": "0"}).eval_budget_seconds == 0.0
    assert tg.Hyperparameters({"MAX_WALLCLOCK_SECONDS": "300", "EVAL_BUDGET_SECONDS": "0"}).eval_budget_seconds == 0.0
    # a replay's evaluation (fewer GPUs than the record's) is not held to the record's 600 s unless asked
    assert tg.Hyperparameters({"PRESET": "record_0427", "TRAIN_CLOCK": "record"}).eval_budget_seconds == 0.0
    assert tg.Hyperparameters({"REPLAY_WORLD_SIZE": "8"}).eval_budget_seconds == 0.0
    assert tg.Hyperparameters({"REPLAY_WORLD_SIZE": "8", "EVAL_BUDGET_SECONDS": "900"}).eval_budget_seconds == 900.0
    for preset, on in (("record_0323", True), ("record_0409", True), ("record_0427", False), ("record_0430", False),
                       ("record_0501", False)):
        h = tg.Hyperparameters({"PRESET": preset})
        assert h.diagnostic_post_ema is on and h.diagnostic_roundtrip is on, preset
    # PREFLIGHT=1 evaluates its slice unguarded and projects the real budget
    h = tg.Hyperparameters({"PREFLIGHT": "1"})
    assert h.eval_budget_seconds == 0.0 and h.real["EVAL_BUDGET_SECONDS"] == 600.0


class StepClock(tg.EvalBudget):
    """A budget whose clock reads `rate` x 10 s per adaptation step taken (a machine as slow as the test says)."""

    rate = 1.0

    def elapsed(self):
        return 10.0 * self.rate * self.steps


def lora_sums(h, model, state, tokens, luts, budget=None):
    model.load_state_dict(state)
    per_token = torch.full((tokens.numel(),), float("nan"), dtype=torch.float64)
    rt = tg.Runtime(h, CPU, False, True, None)
    if budget is not None:
        budget = budget(rt, time.perf_counter())
    sums = tg.lora_ttt_sums(rt, model, tokens, luts, per_token, budget=budget)
    return sums, per_token, budget


def scored_before(tokens, h, batches):
    """The targets of the first `batches` batches of the queue (longest first)."""
    mask = torch.zeros(tokens.numel(), dtype=torch.bool)
    for _, batch in tg.lora_ttt_queue(tg.lora_ttt_documents(tokens), h.ttt_batch_size)[:batches]:
        for a, n in batch:
            mask[a + 1:a + n] = True
    return mask


def adam_at_zero(opt):
    for g in opt.param_groups:
        g["lr"] = 0.0
    return opt


def test_lora_ttt_stopped_anywhere_scores_every_target_once_and_the_guard_stops_as_the_setting_does(setup,
                                                                                                    monkeypatch):
    """EVAL_TTT_STOP_AT=k for k = 0..6: every target 1..N-1 scored once, the token and byte counts of the unguarded
    run exactly, and the batches adapted before the stop scored as the unguarded run scores them (bit for bit);
    k = 6 (after the last step) is the unguarded run; k = 0 equals TTT at learning rate 0 (LoRA's AdamW and the phases' TTT_LR),
    every total. A budget of 30 s on a clock reading 10 s a step stops before step 3 (20 s + the next step + the
    rest + 1 s margin fit, 30 s do not) and gives EVAL_TTT_STOP_AT=3's totals."""
    _, model, state = setup
    tokens = stream()
    luts = luts_for(tokens, True)
    h = tg.Hyperparameters(ENV)
    full, full_pt, _ = lora_sums(h, model, state, tokens, luts)
    stopped = {}
    for k, batches_before in ((0, 0), (1, 1), (2, 2), (3, 2), (4, 3), (6, 4)):
        hk = tg.Hyperparameters({**ENV, "EVAL_TTT_STOP_AT": str(k)})
        sums, pt, budget = lora_sums(hk, model, state, tokens, luts, tg.EvalBudget)
        stopped[k] = sums
        assert budget.steps == k and (budget.stopped is None) == (k == 6), (k, budget.stopped)
        assert not torch.isnan(pt[1:]).any() and torch.isnan(pt[0])
        assert torch.equal(sums[1:], full[1:]), k  # the same targets and bytes
        before = scored_before(tokens, h, batches_before)
        assert torch.equal(pt[before], full_pt[before]), k
        if k < 6:
            assert not torch.equal(pt[~before][1:], full_pt[~before][1:]), k
    assert torch.equal(stopped[6], full)
    inner = tg.lora_optimizer
    monkeypatch.setattr(tg, "lora_optimizer", lambda *a: adam_at_zero(inner(*a)))  # TTT_LORA_LR must be > 0
    still, _, _ = lora_sums(tg.Hyperparameters({**ENV, "TTT_LR": "0"}), model, state, tokens, luts)
    monkeypatch.undo()
    assert torch.equal(stopped[0], still)
    hb = tg.Hyperparameters({**ENV, "EVAL_BUDGET_SECONDS": "30"})
    sums, _, budget = lora_sums(hb, model, state, tokens, luts, StepClock)
    assert budget.steps == 3 and budget.cause == "budget" and budget.stopped == "document batch 3/4"
    assert torch.equal(sums, stopped[3])
    # EVAL_TTT_STOP_AT makes no clock decision (issue 51): under that 30 s budget on a clock 3 times as slow (the
    # guard alone would stop before step 1), it takes exactly its 4 steps and gives their score
    hs = tg.Hyperparameters({**ENV, "EVAL_BUDGET_SECONDS": "30", "EVAL_TTT_STOP_AT": "4"})
    StepClock.rate = 3.0
    try:
        sums, _, budget = lora_sums(hs, model, state, tokens, luts, StepClock)
    finally:
        StepClock.rate = 1.0
    assert budget.steps == 4 and budget.cause == "EVAL_TTT_STOP_AT" and torch.equal(sums, stopped[4])


def budget_rank_main(out):
    """One rank of the 2-process test (a fresh process; its settings in os.environ): the toy model and stream of
    tests/test_ttt_lora.py through LoRA TTT under a 30 s budget on StepClock, rank r's clock at 1 + r times the
    rate; saves (steps taken, where it stopped) and the summed totals."""
    from test_ttt_lora import rank_setup
    h, rt, model, tokens = rank_setup()
    budget = StepClock(rt, 0.0)
    budget.rate = 1.0 + h.rank
    sums = tg.lora_ttt_sums(rt, model, tokens, luts_for(tokens, True), budget=budget)
    torch.save({"steps": budget.steps, "stopped": budget.stopped, "sums": rt.all_reduce(sums)}, out)
    tg.leave(0)


def test_two_ranks_whose_clocks_disagree_stop_adapting_at_one_step(tmp_path):
    """Rank 1's clock runs twice as fast as rank 0's (20 s a step against 10 s): alone, rank 1 would stop before step
    2 (40 s), rank 0 before step 3 (30 s). The ranks take the larger projection (one all-reduce a decision), so both
    stop before step 2, in the same place, and finish with the same totals (a rank still adapting would wait in a
    phase's all-reduce that the other never joins)."""
    import launcher
    from conftest import REPO, clean_environ
    port = launcher.free_port()
    code = (f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]; import test_eval_budget as t; "
            "t.budget_rank_main(sys.argv[1])")
    procs = []
    for rank in range(2):
        env = {**clean_environ(), **ENV, "EVAL_BUDGET_SECONDS": "30", "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "DEVICE": "cpu", "AUTOCAST_DTYPE": "fp32", "OMP_NUM_THREADS": "1", "RUN_ID": "ranks",
               "DIST_TIMEOUT_SECONDS": "60"}
        procs.append(launcher.start(["-c", code, str(tmp_path / f"rank{rank}.pt")], env, tmp_path))
    for p in procs:
        p.wait(timeout=300)
    assert all(p.returncode == 0 for p in procs), [p.output()[1][-2000:] for p in procs]
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert a["steps"] == b["steps"] == 2 and a["stopped"] == b["stopped"] is not None, (a, b)
    assert torch.equal(a["sums"], b["sums"])


# ---------------------------------------------------------------------------------------------- issue 51's defects

def test_eval_only_on_another_world_size_is_unbudgeted_by_default_and_says_so(tmp_path):
    """EVAL_ONLY's auto budget: the track's (MAX_WALLCLOCK_SECONDS) only on the track's 8 ranks; on any other number
    none, so that a record's artifact scored on one GPU gets its whole TTT; EVAL_BUDGET_SECONDS still wins."""
    artifact = tmp_path / "final_model.int6.ptz"
    artifact.write_bytes(b"x")
    one = tg.Hyperparameters({"EVAL_ONLY": str(artifact)})
    assert one.eval_budget_seconds == 0.0 and "EVAL_ONLY on WORLD_SIZE=1, not the track's 8" in one.eval_budget_note
    eight = tg.Hyperparameters({"EVAL_ONLY": str(artifact), "WORLD_SIZE": "8", "RANK": "0"})
    assert eight.eval_budget_seconds == 600.0 and eight.eval_budget_note == ""
    assert tg.Hyperparameters({"EVAL_ONLY": str(artifact), "EVAL_BUDGET_SECONDS": "90"}).eval_budget_seconds == 90.0
    assert tg.Hyperparameters({}).eval_budget_note == ""  # a training run's auto is its cap, as before


class Logged(SimpleNamespace):
    """A runtime stand-in that keeps its log lines (one process, CPU)."""

    def __init__(self, **h):
        super().__init__(h=SimpleNamespace(**{"eval_ttt_stop_at": -1, "world_size": 1, **h}), lines=[],
                         device=torch.device("cpu"))

    def log(self, line, console=True):
        self.lines.append(line)

    def all_reduce(self, t, op=None):
        return t


def test_the_over_time_warning_and_the_plan_warning_read_the_budget():
    """A 400 s evaluation under EVAL_BUDGET_SECONDS=60 is flagged against the budget (it was compared with
    MAX_WALLCLOCK_SECONDS only); without a budget the training cap is the limit; the plan's warning states the end it
    compared, the margin included."""
    rt = Logged(eval_budget_seconds=60.0, max_wallclock_seconds=0.0)
    tg.log_evaluation_time(rt, 10.0, 400.0)
    assert rt.lines == ["evaluation_time: ttt_loop:10.0s total:400.0s",
                        "warning: the whole evaluation took 400.0s, over the evaluation's 60s limit "
                        "(EVAL_BUDGET_SECONDS)"]
    rt = Logged(eval_budget_seconds=0.0, max_wallclock_seconds=600.0)
    tg.log_evaluation_time(rt, None, 400.0)
    tg.log_evaluation_time(rt, 650.0, 700.0)
    assert rt.lines[1:] == ["evaluation_time: ttt_loop:650.0s total:700.0s",
                            "warning: the TTT loop took 650.0s, over the evaluation's 600s limit (MAX_WALLCLOCK_SECONDS)",
                            "warning: the whole evaluation took 700.0s, over the evaluation's 600s limit "
                            "(MAX_WALLCLOCK_SECONDS)"]
    rt = Logged(eval_budget_seconds=1.0)
    budget = StepClock(rt, 0.0)
    budget.plan({"legal_ttt": 0.5})  # ends at 0.5 s, 1.5 s with the 1 s margin: past the 1 s budget
    assert rt.lines[-1].startswith("eval_budget: warning: scoring alone is projected to end at 0.5s, 1.5s with the "
                                   "1.0s margin, past the 1s budget: TTT will not adapt")
    rt = Logged(eval_budget_seconds=1.0, eval_ttt_stop_at=2)  # the setting decides: no warning about adapting
    StepClock(rt, 0.0).plan({"legal_ttt": 0.5})
    assert len(rt.lines) == 1 and not any("warning" in line for line in rt.lines)


def test_preflight_counts_each_stage_of_scoring_alone_once():
    """A constructed rehearsal (1,000 of 100,000 val targets: x100): the post-EMA diagnostic 0.1 s -> 10 s and the
    artifact's load 3 s (not scaled) once each, the round trip and TTT by the warmup's projection at the real shapes
    (19 s and 300 s) plus the tilt's 2 s build: 334 s by hand (it said 347 s, the first two counted twice). Under a
    340 s budget scoring alone fits, so no 'no TTT could fit'."""
    pf = tg.Preflight.__new__(tg.Preflight)
    pf.rt = SimpleNamespace(h=SimpleNamespace(real={"EVAL_BUDGET_SECONDS": 340.0, "MAX_WALLCLOCK_SECONDS": 600.0},
                                              phased_ttt_prefix_auto=False))
    pf.targets, pf.scored, pf.tilt_build_s = (1000, 100000), {"final_int6_roundtrip", "legal_ttt"}, {"legal_ttt": 2.0}
    pf.stages = [{"stage": "evaluating the final weights", "seconds": 0.1}, {"stage": "loading the artifact", "seconds": 3.0},
                 {"stage": "evaluation (final_int6_roundtrip)", "seconds": 0.2},
                 {"stage": "evaluation (legal_ttt)", "seconds": 6.0}]
    pf.scoring_alone = {"final_int6_roundtrip": 19.0, "legal_ttt": 300.0}
    ev = pf.evaluation()
    assert ev["projected_s"] == 10.0 + 3.0 + 20.0 + 2.0 + 4.0 * 100  # the unguarded projection: 435 s
    assert ev["scoring_alone_s"] == 10.0 + 3.0 + 19.0 + 300.0 + 2.0 and ev["guard_cuts_ttt"]
    assert tg.Preflight.problems({"compile_regions": {}, "evaluation": ev}, None) == []
    pf.scoring_alone = {"final_int6_roundtrip": 19.0, "legal_ttt": 320.0}  # 354 s: over, and said so
    assert "scoring alone is projected to take 354s" in tg.Preflight.problems(
        {"compile_regions": {}, "evaluation": pf.evaluation()}, None)[0]


def test_overwrite_run_removes_the_finished_runs_rehearsal_report_but_not_a_newer_one(tmp_path, monkeypatch):
    """OVERWRITE_RUN=1 removes the finished run's raw model, artifact and its preflight.json (no newer than its
    artifact); a preflight.json written since (a rehearsal for this run) stays."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "runs" / "r1"
    folder.mkdir(parents=True)
    report, raw, art = folder / "preflight.json", folder / "final_model.pt", folder / "final_model.int6.ptz"
    for f, t in ((report, 100), (raw, 200), (art, 200)):
        f.write_text("x")
        os.utime(f, (t, t))
    h = tg.Hyperparameters({"RUN_ID": "r1", "OVERWRITE_RUN": "1"})
    assert sorted(tg.stale_outputs(h)) == sorted(os.path.join("runs", "r1", n) for n in
                                                 ("final_model.pt", "final_model.int6.ptz", "preflight.json"))
    os.utime(report, (300, 300))
    assert "runs/r1/preflight.json" not in tg.stale_outputs(h)
