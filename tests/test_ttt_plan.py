"""PHASED_TTT_PREFIX_DOCS=auto (issue 52): the phased LoRA TTT's prefix planned to fit the evaluation's budget, on the
toy model and stream of tests/test_ttt_lora.py (10 documents in batches of 3, two phases) with scripted rates and
clocks: a budget that fits k prefix documents gives k, and the run then ends inside it without a guard stop, scores
every target once with the unguarded bytes, and equals the run told k; a generous budget gives the cap; one below
the steps alone gives 0 and the plan's warning; two gloo ranks whose clocks disagree choose one prefix; bad values
are refused in one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import train_gpt as tg
from conftest import REPO, config_error
from test_eval_budget import ENV, lora_sums
from test_ttt_lora import CPU, luts_for, setup, stream  # noqa: F401 (setup: a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# scripted rates: a LoRA step of 1e-6 s a forward token, a phase row of 10 s (the phases decide the plan)
RATES = {"lora_fit": ((0.0, 1e-6), (0.0, 1e-6)), "phase_row_s": 10.0}


class Scripted(tg.EvalBudget):
    """A budget with the scripted rates as the warmup's and a clock that reads `start` s plus 0.5 s a step taken."""

    start = 0.0

    def __init__(self, rt, t0, costs=None):
        super().__init__(rt, t0, dict(RATES))
        self.lines = []
        rt.log = lambda line, console=True: self.lines.append(line)

    def elapsed(self):
        return self.start + 0.5 * self.steps


def plan(tokens, before=0.0, budget=1000.0, **env):
    hp = tg.Hyperparameters({**ENV, "PHASED_TTT_PREFIX_DOCS": "auto", "EVAL_BUDGET_SECONDS": "600", **env})
    queue_ = tg.lora_ttt_queue(tg.lora_ttt_documents(tokens), hp.ttt_batch_size)
    return tg.plan_prefix_docs(hp, queue_, RATES, before, budget)


def direct_rows(h, queue_, prefix):
    """The phase rows of a prefix as lora_ttt_sums trains them (lora_ttt_phases, phase_rows): one prefix at a time."""
    return sum(tg.phase_rows(h, sum(n for _, n in docs)) for docs in tg.lora_ttt_phases(h, queue_, prefix)[2])


def test_every_prefix_phase_rows_at_once_equal_the_phases_one_prefix_at_a_time():
    """prefix_phase_rows (the plan's whole table, vectorised) against lora_ttt_phases for every prefix of random
    queues: document lengths, batch sizes and phase counts, the segments' corner cases (a boundary reached only by
    the last batch, or never; two boundaries in one batch) included."""
    import random
    for trial in range(60):
        rnd = random.Random(trial)
        docs = [(1000 * i, rnd.choice([2, 3, 5, 40, 41, 90, 200])) for i in range(rnd.randint(1, 40))]
        h = tg.Hyperparameters({**ENV, "TTT_BATCH_SIZE": str(rnd.randint(1, 7)),
                                "PHASED_TTT_NUM_PHASES": str(rnd.randint(1, 4))})
        queue_ = tg.lora_ttt_queue(docs, h.ttt_batch_size)
        prefixes = np.arange(len(docs) + 3)
        assert tg.prefix_phase_rows(h, queue_, prefixes).tolist() == [direct_rows(h, queue_, int(p)) for p in prefixes]


def test_a_budget_that_fits_k_prefix_docs_gives_k_and_the_run_equals_the_run_told_k(setup):
    """Up to 7 of the 10 documents, 2 phases: a longer prefix can cost fewer phase rows (its phases come after
    shorter batches), so the plan takes the largest that fits, not the first that does not: with the budget of
    prefix 5 (3 does not fit) it chooses 5. That run logs the choice, ends inside the budget without a guard stop,
    scores every target once with the unguarded bytes, and equals the run told PHASED_TTT_PREFIX_DOCS=5."""
    _, model, state = setup
    tokens = stream()
    luts = luts_for(tokens, True)
    h = tg.Hyperparameters({**ENV, "PHASED_TTT_PREFIX_DOCS": "auto", "PHASED_TTT_PREFIX_DOCS_MAX": "7",
                            "EVAL_BUDGET_SECONDS": "600"})
    queue_ = tg.lora_ttt_queue(tg.lora_ttt_documents(tokens), h.ttt_batch_size)
    steps = sum(tg.lora_batch_seconds(h, b, RATES["lora_fit"])[0] for _, b in queue_)
    ends = [steps + 10.0 * direct_rows(h, queue_, p) for p in range(8)]
    k = 5
    budget = ends[k] / 0.98 + 0.01  # its margin is 2% of it
    margin = tg.EvalBudget.margin_for(budget)
    fits = [p for p in range(8) if ends[p] + margin <= budget]
    assert max(fits) == k and 3 not in fits, ends
    prefix, parts = plan(tokens, budget=budget, PHASED_TTT_PREFIX_DOCS_MAX="7")
    assert prefix == k and parts["fits"] and (parts["cap"], parts["docs"]) == (7, 10)
    assert parts["end_s"] == pytest.approx(ends[k])
    env = {**ENV, "PHASED_TTT_PREFIX_DOCS": "auto", "PHASED_TTT_PREFIX_DOCS_MAX": "7", "EVAL_BUDGET_SECONDS": str(budget)}
    sums, per_token, guard = lora_sums(tg.Hyperparameters(env), model, state, tokens, luts, Scripted)
    line = next(x for x in guard.lines if x.startswith("ttt_plan: "))
    assert line.startswith(f"ttt_plan: PHASED_TTT_PREFIX_DOCS=auto -> {k} (max 7 of 10 docs, 2 phases) before_ttt:0.0s ")
    assert guard.stopped is None and guard.elapsed() + guard.margin <= budget  # inside the budget, no guard stop
    told, told_pt, _ = lora_sums(tg.Hyperparameters({**ENV, "PHASED_TTT_PREFIX_DOCS": str(k)}), model, state, tokens,
                                 luts)
    assert torch.equal(sums, told) and torch.equal(per_token[1:], told_pt[1:])
    none, _, _ = lora_sums(tg.Hyperparameters({**ENV, "PHASED_TTT_PREFIX_DOCS": "0"}), model, state, tokens, luts)
    assert torch.equal(sums[1:], none[1:]) and not torch.isnan(per_token[1:]).any()  # every target, its bytes
    assert not torch.equal(sums[0], none[0])  # the phases adapted


def test_a_generous_budget_gives_the_cap_and_one_below_the_steps_gives_zero_with_a_warning(setup):
    _, model, state = setup
    tokens = stream()
    assert plan(tokens, PHASED_TTT_PREFIX_DOCS_MAX="7")[0] == 7
    assert plan(tokens)[0] == 10  # no cap: every document
    prefix, parts = plan(tokens, before=1000.0)  # the evaluation before TTT already took the budget
    assert prefix == 0 and not parts["fits"]
    env = {**ENV, "PHASED_TTT_PREFIX_DOCS": "auto", "EVAL_BUDGET_SECONDS": "5"}
    Scripted.start = 10.0
    try:
        sums, _, guard = lora_sums(tg.Hyperparameters(env), model, state, tokens, luts_for(tokens, True), Scripted)
    finally:
        Scripted.start = 0.0
    assert any(x.startswith("ttt_plan: PHASED_TTT_PREFIX_DOCS=auto -> 0 ") for x in guard.lines), guard.lines
    assert any(x.startswith("ttt_plan: warning: even without phases TTT is projected to end at ") for x in guard.lines)
    assert guard.cause == "budget" and guard.steps == 0  # the guard then stops it before its first step
    assert " PHASED_TTT_PREFIX_DOCS=0 on 1 ranks" in next(x for x in guard.lines if "stops adapting" in x)
    # a prefix shorter than the phases: phase 1's boundary is 0 docs, so it trains on none (it stopped the run)
    _, per_token, _ = lora_sums(tg.Hyperparameters({**ENV, "PHASED_TTT_PREFIX_DOCS": "1"}), model, state, tokens,
                                luts_for(tokens, True))
    assert not torch.isnan(per_token[1:]).any()


@pytest.mark.parametrize("environ, message", [
    ({"PHASED_TTT_PREFIX_DOCS": "auto"}, "PHASED_TTT_PREFIX_DOCS=auto plans the global SGD phases of TTT_MODE=lora, "
                                         "not TTT_MODE=sgd"),
    ({"PHASED_TTT_PREFIX_DOCS": "auto", "TTT_MODE": "lora", "EVAL_BUDGET_SECONDS": "0"},
     "PHASED_TTT_PREFIX_DOCS=auto fits the prefix to the evaluation's budget: it needs EVAL_BUDGET_SECONDS > 0 (auto "
     "gives 0 here: set it, or give the prefix as a number)"),
    ({"PHASED_TTT_PREFIX_DOCS": "auto", "TTT_MODE": "lora", "EVAL_TTT_STOP_AT": "3"},
     "PHASED_TTT_PREFIX_DOCS=auto reads the clock; with EVAL_TTT_STOP_AT, which reads none, give the prefix as a "
     "number (a stop line names the prefix its run chose)"),
    ({"PHASED_TTT_PREFIX_DOCS_MAX": "-1"}, "PHASED_TTT_PREFIX_DOCS_MAX=-1 must be >= 0 (0: every val document)"),
    ({"PHASED_TTT_PREFIX_DOCS_MAX": "many"}, "PHASED_TTT_PREFIX_DOCS_MAX='many' is not a valid int"),
    ({"PHASED_TTT_PREFIX_DOCS": "Auto"}, "PHASED_TTT_PREFIX_DOCS=Auto must be a number of documents >= 0, or auto"),
])
def test_bad_plan_settings_are_one_line_errors(environ, message):
    assert config_error(environ) == message


def plan_rank_main(out):
    """One rank of the 2-process test: the toy model and stream through LoRA TTT with PHASED_TTT_PREFIX_DOCS=auto on
    the scripted rates, rank r's clock starting at 20 r s; saves its own plan's choice and the run's."""
    from test_ttt_lora import rank_setup
    h, rt, model, tokens = rank_setup()
    budget = Scripted(rt, 0.0)
    budget.start = 20.0 * h.rank
    queue_ = tg.lora_ttt_queue(tg.lora_ttt_documents(tokens), h.ttt_batch_size)
    alone = tg.plan_prefix_docs(h, queue_, RATES, budget.elapsed(), h.eval_budget_seconds)[0]
    tg.lora_ttt_sums(rt, model, tokens, luts_for(tokens, True), budget=budget)
    chosen = next(x for x in budget.lines if x.startswith("ttt_plan: ")).split(" -> ")[1].split()[0]
    torch.save({"alone": alone, "chosen": int(chosen), "stopped": budget.stopped}, out)
    tg.leave(0)


def test_two_ranks_whose_clocks_disagree_choose_one_prefix(tmp_path):
    """Rank 1's evaluation before TTT took 20 s more than rank 0's: alone they would choose different prefixes; the
    plan takes the later start (one collective) and both choose rank 1's."""
    import launcher
    from conftest import REPO, clean_environ
    port = launcher.free_port()
    code = (f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]; import test_ttt_plan as t; "
            "t.plan_rank_main(sys.argv[1])")
    procs = []
    budget = plan(stream(), WORLD_SIZE="2", PHASED_TTT_PREFIX_DOCS_MAX="10")[1]["end_s"] + 10.0  # rank 0 alone: all
    for rank in range(2):
        env = {**clean_environ(), **ENV, "PHASED_TTT_PREFIX_DOCS": "auto", "EVAL_BUDGET_SECONDS": str(budget),
               "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DEVICE": "cpu", "AUTOCAST_DTYPE": "fp32",
               "OMP_NUM_THREADS": "1", "RUN_ID": "plan", "DIST_TIMEOUT_SECONDS": "60"}
        procs.append(launcher.start(["-c", code, str(tmp_path / f"rank{rank}.pt")], env, tmp_path))
    for p in procs:
        p.wait(timeout=300)
    assert all(p.returncode == 0 for p in procs), [p.output()[1][-2000:] for p in procs]
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert a["alone"] > b["alone"], (a, b)
    assert a["chosen"] == b["chosen"] == b["alone"], (a, b)


def test_the_projected_auto_table_is_the_records_logs():
    """docs/evaluation.md's table of what auto would choose on 8xH100, recomputed from each record's seed-42 log: its
    phases' seconds (ttpp/ttpr lines), the rest of our plan's evaluation (tests/test_presets.py's projected whole
    evaluation, less those phases), the seconds per trained doc, the largest prefix whose phases fit 600 s less the
    12 s margin, and what the record's 2500 leaves."""
    import re
    from test_presets import FRONTIER, OUR_HINTS_S
    docs = (REPO / "docs" / "evaluation.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(record_0\d{3})` \| ([\d.+ ]+) \| ([\d.]+) s \| ([\d.]+) \| (\d+) docs \| ([\d.]+) s \|$",
                      docs, re.M)
    assert [r[0] for r in rows] == ["record_0427", "record_0430", "record_0501"]
    whole = dict(re.findall(r"^\| `(record_\d{4})` \| .* \| ([\d.]+) s \+ [^|]*\|$", docs, re.M))
    for preset, phases, rest, rate, choice, left in rows:
        log = FRONTIER / preset / "train_seed42.log"
        if not log.exists():
            continue
        text = log.read_text(encoding="utf-8")
        begin = [float(x) for x in re.findall(r"^ttpp: phase:\d+/\d+ pd:\d+ gd:\d+ t:([\d.]+)s", text, re.M)]
        end = [float(x) for x in re.findall(r"^ttpr: phase:\d+/\d+ t:([\d.]+)s", text, re.M)]
        bounds = [int(x) for x in re.findall(r"^ttpp: phase:\d+/\d+ pd:\d+ gd:(\d+)", text, re.M)]
        secs = [b - a for a, b in zip(begin, end)]
        assert phases == " + ".join(f"{x:.1f}" for x in secs), (preset, phases, secs)
        ttt_s = float(re.search(r"^quantized_ttt_phased val_loss:\S+ val_bpb:\S+ eval_time:(\d+)ms$", text, re.M)[1]) / 1000
        hints = re.search(r"^ngram_tilt:precompute_done elapsed=([\d.]+)s", text, re.M)
        ours = ttt_s - (float(hints[1]) - OUR_HINTS_S if hints else 0.0)  # our plan's whole evaluation: TTT alone
        assert f"{ours:.1f}" == whole[preset], preset
        per_doc, base = sum(secs) / sum(bounds), ours - sum(secs)
        assert (f"{base:.1f}", f"{per_doc:.5f}") == (rest, rate), preset
        n = len(bounds)  # phase k trains on P (k + 1) / n docs: P (n + 1) / 2 in all
        assert int((600 - tg.EvalBudget.margin_for(600) - base) / (per_doc * (n + 1) / 2)) == int(choice), preset
        assert f"{600 - ours:.1f}" == left, preset
