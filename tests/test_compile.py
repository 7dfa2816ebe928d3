"""The compiled path (issue 34): every preset end to end with COMPILE=1 on 1 and 2 processes, its scores against the
eager run's; the graph plan (one graph for every number of documents in a packed row, an unplanned shape inside a
timed region runs eager with a log line, a call past Dynamo's recompile limit runs eager instead of ending the run);
zero compilations inside the timed regions; and inductor itself on a tiny model's training step and LoRA TTT step.

The end-to-end runs use COMPILE_BACKEND=eager: Dynamo traces, guards, breaks graphs and recompiles exactly as with
inductor (all of that happens before the backend sees a graph), in seconds instead of minutes on 2 CPU cores; the
graph then runs as traced. Inductor's own lowering is covered by the in-process inductor test at the end."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import train_gpt as tg
from conftest import (TINY_ENV, computed_once, read_log, run_file, run_training, shared_folder, shared_run,
                      short_val_data)
from test_documents import caseops_sample, packed_runtime  # noqa: F401 (fixture: the vocab-8192 CaseOps sample)
from test_trust import assert_one_line_error
from test_presets import EXACT, RECORD_LOGS, RUN_0430, RUN_0501, RUN_SCALE, caseops_run_data  # noqa: F401 (fixture)
from test_presets import record_scored

CPU = torch.device("cpu")
# Compilation reorders float work: with the eager backend the traced graph computes packed attention in blocks
# (doc_causal_attention) where eager CPU runs take one call per document (per_document_attention), and inductor fuses
# (measured 1.6e-6 relative for the default preset, issue 34). Legal TTT trains on what it scores, so its difference
# grows: record_0430's LoRA TTT (chunks of 8, 12 and 32 tokens) ended 1.2e-5 relative apart.
REL_TOL = {"final_int6_roundtrip": 1e-5, "final_int6_sliding_window": 1e-5, "legal_ttt": 1e-4}
# The presets at three layers (loops over layer 1, lanes from layer 2: each preset's code paths, fewer layers for
# Dynamo to trace) on the CaseOps run data of tests/test_presets.py; record_0323 at the suite's TINY_ENV on the sp1024
# sample with 4,097 val tokens. Each preset's own features are on: the loop switch (record_0409 from half-way),
# progressive context (record_0430), late QAT (record_0323: threshold reached at step 3 of 4), the tilt (record_0501).
COMPILE_SCALE = {**RUN_SCALE, "NUM_LAYERS": "3", "LOOP_START": "1", "LOOP_END": "1", "PARALLEL_RESIDUAL_START": "2",
                 "XSA_LAST_N": "3"}
PRESET_ENV = {
    # TTT_FREEZE_BLOCKS=1: SGD TTT scores with its first block frozen, a graph of its own (record_0409 has none frozen)
    "record_0323": {**TINY_ENV, "LATE_QAT_THRESHOLD": "0.9", "TTT_CHUNK_TOKENS": "1024", "EVAL_STRIDE": "64",
                    "VAL_BATCH_SIZE": "4096", "TTT_FREEZE_BLOCKS": "1"},
    # the settings PREFLIGHT=1 rehearses this run with (one step in each loop state), so that the preflight pair's
    # real run is this run (tests/test_preflight.py)
    "record_0409": {**COMPILE_SCALE, "ENABLE_LOOPING_AT": "0.5", "VOCAB_SIZE": "8192", "ITERATIONS": "2",
                    "WARMDOWN_ITERS": "0", "MAX_WALLCLOCK_SECONDS": "0.0", "GPTQ_CALIBRATION_BATCHES": "1",
                    "CHECKPOINT_EVERY": "0", "VAL_LOSS_EVERY": "0", "EVAL_BUDGET_SECONDS": "0.0"},
    "record_0427": {**COMPILE_SCALE},
    "record_0430": {**COMPILE_SCALE, **RUN_0430, "TRAIN_SEQ_LEN_SCHEDULE": "64@0,128@0.5"},  # two phases: a switch
    # VAL_PREFETCH=0: eval_val's batches made in the evaluating thread, inside inference mode (on CUDA the copy
    # stream's are too); its warmup's tokens must match them, or a graph compiles inside the timer (issue 35)
    "record_0501": {**COMPILE_SCALE, **RUN_0501, "VAL_PREFETCH": "0"},
}
# record_0430's own code paths (progressive context with its LR re-warmup, TTT chunks by document length, AWQ-lite, the
# scored tail) on another LoRA preset's run, which then stands for record_0430's on 2 processes
# (tests/test_compile_ranks.py)
WITH_0430 = {**RUN_0430, "TRAIN_SEQ_LEN_SCHEDULE": PRESET_ENV["record_0430"]["TRAIN_SEQ_LEN_SCHEDULE"], "AWQ_LITE": "1",
             "AWQ_LITE_BITS": "8", "AWQ_LITE_GROUP": "64", "AWQ_LITE_TOP_K": "1", "EVAL_INCLUDE_TAIL": "1"}
# The presets whose 1-process eager artifact is evaluated again with EVAL_ONLY (tests/test_compile_presets.py), which
# must give the run's scores exactly: record_0430 (its own code: progressive context, AWQ-lite, the tail, chunks by
# length) and record_0501 (record_0427's recipe with other values and the tilt: the same code and more); on 2
# processes tests/test_artifact_eval.py evaluates an artifact like one process.
EVAL_ONLY_PRESETS = ("record_0430", "record_0501")


def run(env, cwd, nproc):
    cwd.mkdir(exist_ok=True)
    proc = run_training(env, cwd, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_log(cwd, env["RUN_ID"])


def check_preset_run(preset, nproc, data, tmp_path, tmp_path_factory, eager=True, extra=None):
    """The preset's tiny run (with `extra` settings on top) compiled (COMPILE_BACKEND=eager) on `nproc` ranks to its
    last line with the preset's own lines, its timed regions compiling nothing, each compiled function within its
    plan; with `eager`, within REL_TOL of the scores of the preset's eager run on as many ranks (eager_run, shared)."""
    env = {**data, **PRESET_ENV[preset], **(extra or {}), "PRESET": preset}
    compiled = compiled_run(tmp_path_factory, preset, data, nproc, extra)[1]
    assert_preset_lines(preset, env, compiled)
    assert_compiled_as_planned(compiled, ["training", *scored_in_log(compiled)])
    assert "compile:1" in compiled
    # issue 53: a split other than the record's (RUN_SCALE's GRAD_ACCUM_STEPS=1) is said at the start; the record's not
    split = (f"\ngrad_accum: GRAD_ACCUM_STEPS={env['GRAD_ACCUM_STEPS']} micro-batches a step, not the record's "
             f"{8 // nproc}: " if "GRAD_ACCUM_STEPS" in env else "\ngrad_accum:")
    assert (split in compiled) == ("GRAD_ACCUM_STEPS" in env), split
    if preset == "record_0323":
        assert "late_qat:enabled" in compiled and "qat:1" in compiled  # the QAT graph warmed before the timer
    if preset in ("record_0427", "record_0430", "record_0501"):
        assert re.search(r"^compile: ttt_lora graphs:\d+ planned:\d+ .* dynamic:1$", compiled, re.M)
    if not eager:
        return
    eager = eager_run(tmp_path_factory, preset, data, nproc, extra)[1]
    assert_preset_lines(preset, env, eager)
    assert_scores_close(eager, compiled)
    assert not re.search("^compile", eager, re.M) and "compile:0" in eager


def check_eval_only(preset, data, tmp_path, tmp_path_factory):
    """The preset's 1-process eager tiny run (eager_run, shared): its artifact evaluated again with EVAL_ONLY in a new
    process gives the run's *_exact lines to the last digit."""
    folder, eager = eager_run(tmp_path_factory, preset, data, 1)
    env = {**data, **PRESET_ENV[preset], "PRESET": preset, "COMPILE": "0"}
    again = run({**env, "RUN_ID": f"{preset}_1_eval", "EVAL_ONLY": str(run_file(folder, f"{preset}_1"))},
                tmp_path / "eval_only", 0)
    assert re.findall(EXACT, again, re.M) == re.findall(EXACT, eager, re.M) != []


def scored_in_log(log):
    """The scored evaluations a run's log shows, in order: the post-EMA diagnostic's line and the *_exact lines."""
    return [m.group(1) or m.group(2) for m in re.finditer(r"^DIAGNOSTIC (post_ema) |^(\w+)_exact ", log, re.M)]


def assert_preset_lines(preset, env, log):
    """What each preset's run must say it did (its settings and its own features), and the scored evaluations of its
    plan (scored_evaluations), which are its record's, read from the record's log (tests/test_presets.py: the tiny
    runs keep both diagnostics, as the records ran them)."""
    plan = tg.scored_evaluations(tg.Hyperparameters({k: v for k, v in env.items() if k != "EVAL_ONLY"}))
    assert scored_in_log(log) == list(plan), (scored_in_log(log), plan)
    if RECORD_LOGS[preset].exists():
        assert list(plan) == list(record_scored(preset)), preset
    for label, settings in plan.items():
        assert f"{label} {settings}".strip() in log.split("\nscored_evaluations: ", 1)[1].split("\n", 1)[0]
    if preset == "record_0409":
        assert "layer_loop:enabled step:" in log
    if preset in ("record_0427", "record_0430", "record_0501"):
        for line in (f"preset:{preset} overridden_by_env:", "setting TTT_MODE=lora [preset]",
                     "setting COMPRESSOR=pergroup [preset]", "setting TRAIN_LOADER=packed [preset]",
                     "bpb_bytes:sidecar", "attention_backend_packed:torch_doc_blocks",
                     "ttt_lora_phase:{0}/{0}".format(env["PHASED_TTT_NUM_PHASES"])):
            assert line in log, line
    if preset == "record_0430" or env.get("AWQ_LITE") == "1":  # its own code paths (WITH_0430 on another preset)
        source = "preset" if preset == "record_0430" else "env"
        for line in (f"setting AWQ_LITE=1 [{source}]", f"setting EVAL_INCLUDE_TAIL=1 [{source}]", "seq_len:128 step:2",
                     "chunk_by_doc_len:100:8,200:12"):
            assert line in log, line
    if preset == "record_0430":
        assert "lr:7.5e-05" in log
    if preset == "record_0501":
        for line in ("setting NGRAM_TILT=1 [preset]", "setting SMEAR_GATE_BOS_FIX=0 [preset]",
                     "smear_gate: v2 without its BOS mask", "targets:q,v,o,mlp,head", "lr:8e-05",
                     "ngram_tilt: tilting legal_ttt order:2 threshold:0.8 boost:2.625 gated:",
                     "(rank 0 builds, inside the legal_ttt timer)"):
            assert line in log, line
        assert int(re.search(r"ngram_tilt: tilting legal_ttt .* gated:(\d+)/", log).group(1)) > 0


def assert_scores_close(eager, compiled):
    want, got = re.findall(EXACT, eager, re.M), re.findall(EXACT, compiled, re.M)
    assert want and [k for k, _ in want] == [k for k, _ in got]
    for (label, a), (_, b) in zip(want, got):
        for x, y in zip(re.findall(r"[\d.]+", a), re.findall(r"[\d.]+", b)):
            assert abs(float(x) - float(y)) <= REL_TOL[label] * abs(float(x)), (label, a, b)


def assert_compiled_as_planned(log, regions):
    """Every timed region compiled nothing and ran nothing eager; every compiled function within its plan."""
    found = {r: (int(g), int(e), int(c)) for r, g, e, c in re.findall(
        r"^compile_region: (\S+) graphs_compiled:(\d+) eager_calls:(\d+) compiled_calls:(\d+)$", log, re.M)}
    assert sorted(found) == sorted(regions), found
    # none compiled or ran eager, and each ran compiled graphs (the post-EMA diagnostic included: the evaluation's,
    # issue 51)
    assert all(graphs == eager == 0 and calls > 0 for graphs, eager, calls in found.values()), found
    lines = re.findall(r"^compile: (\S+) graphs:(\d+) planned:(\d+) recompiles:\d+ compile_s:[\d.]+ eager_calls:(\d+)",
                       log, re.M)
    assert lines and all(int(g) <= int(p) and e == "0" for _, g, p, e in lines), lines
    assert not re.search(r"^compile: \S+ ran eager", log, re.M)
    # issue 46: the evaluation's graphs are compiled before the training clock: the counts logged after training's
    # warmup (every function made by then) are the run's last, so nothing compiled from the first timed step on;
    # but val_forward, validation inside training, which pauses the clock (train_time) and compiles at its first call
    first, last = {}, {}
    for name, graphs, _, _ in (line for line in lines if line[0] != "val_forward"):
        first.setdefault(name, graphs)
        last[name] = graphs
    if "warmup_time:" in log:
        assert {"eval_forward", "eval_logits"} <= first.keys() and first == last, (first, last)


@pytest.fixture(scope="module")
def preset_data(caseops_run_data, sample_data, tmp_path_factory):
    """record_0323 on the sp1024 sample with its first 4,097 val tokens; the others on the CaseOps run data. One
    folder each for the session (conftest.computed_once), so that the runs of every file can share an eager run."""
    short = computed_once(shared_folder(tmp_path_factory) / "sp1024_short",
                          lambda out: short_val_data(sample_data, out, 4097))
    return {"record_0323": {"DATA_PATH": str(short), "TOKENIZER_PATH": sample_data["TOKENIZER_PATH"]},
            **{p: caseops_run_data for p in PRESET_ENV if p != "record_0323"}}


def compiled_run(tmp_path_factory, preset, data, nproc, extra=None):
    """The preset's tiny run (PRESET_ENV, `extra` on top) compiled (COMPILE_BACKEND=eager) on `nproc` ranks, made once
    for the session (conftest.shared_run; RUN_ID PRESET_NPROC_c): its folder, its log and its environment."""
    env = {**data, **PRESET_ENV[preset], **(extra or {}), "PRESET": preset, "COMPILE": "1", "COMPILE_BACKEND": "eager"}
    name = f"{preset}_{nproc}_c"
    folder = shared_run(tmp_path_factory, name, env, nproc)
    return folder, read_log(folder, name), env


def eager_run(tmp_path_factory, preset, data, nproc, extra=None):
    """The preset's tiny run (PRESET_ENV, `extra` on top) eager on `nproc` ranks, made once for the session
    (conftest.shared_run) and shared by everything compared with it: the compiled run on as many ranks
    (tests/test_compile_presets.py, tests/test_compile_ranks.py) and, on one rank, the preflight pairs whose
    rehearsal settings it has (tests/test_preflight.py). Its folder and log; the folder is read-only to the tests."""
    name = f"{preset}_{nproc}"
    folder = shared_run(tmp_path_factory, name, {**data, **PRESET_ENV[preset], **(extra or {}), "PRESET": preset,
                                                 "COMPILE": "0"}, nproc)
    return folder, read_log(folder, name)


# The presets' compiled runs on 1 process (check_preset_run): tests/test_compile_presets.py; on 2:
# tests/test_compile_ranks.py. Files of their own, so that pytest-xdist spreads the suite's longest runs.


# ---------------------------------------------------------------------------------------------- the graph plan

@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's caches live on the code objects for the whole process, and CompiledFunction raises its limits: each
    test starts from none and leaves the limits as it found them."""
    torch._dynamo.reset()
    config = torch._dynamo.config
    limits = config.recompile_limit, config.accumulated_recompile_limit
    yield
    config.recompile_limit, config.accumulated_recompile_limit = limits
    torch._dynamo.reset()


def _compiled_trainer(monkeypatch, data, **env):
    rt = packed_runtime(monkeypatch, data, COMPILE=1, COMPILE_BACKEND="eager", TRAIN_PREFETCH=0,
                        TRAIN_BATCH_TOKENS=512, GRAD_ACCUM_STEPS=1, TRAIN_SEQ_LEN=8, NUM_LAYERS=1, VE_LAYERS="0",
                        XSA_LAST_N=1, **env)
    lines = []
    rt.log = lambda msg, console=True: lines.append(msg)
    torch.manual_seed(0)
    return rt, tg.Trainer(rt, tg.build_model(rt.h)), lines


def _docs(n_tokens, entries, cut):
    cu = np.linspace(0, n_tokens, entries).round().astype(np.int32)
    return tg.DocBounds(torch.from_numpy(cu), cut, cut)


def test_one_graph_serves_every_number_of_documents_in_a_packed_row(tiny_env, monkeypatch):
    """cu_seqlens' length is dynamic: a row needing more entries than any warm bucket of the records (256) compiles
    nothing new inside the timed region, and gives the eager loss."""
    rt, trainer, lines = _compiled_trainer(monkeypatch, tiny_env["DATA_PATH"])
    x = torch.randint(0, 1024, (1, 512))
    y = torch.randint(0, 1024, (1, 512))
    trainer.forward(x, y, _docs(512, 64, 8))
    assert trainer.forward.graphs == 1
    with tg.compile_region("training"):
        for entries in (65, 128, 320, 513):
            got = trainer.forward(x, y, _docs(512, entries, 8))
            want = trainer.model(x, y, _docs(512, entries, 8))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert trainer.forward.graphs == 1 and trainer.forward.eager_calls == 0 and lines == []


def test_a_shape_outside_the_plan_in_a_timed_region_runs_eager_once_with_a_log_line(tiny_env, monkeypatch):
    rt, trainer, lines = _compiled_trainer(monkeypatch, tiny_env["DATA_PATH"])
    x, y = torch.randint(0, 1024, (2, 256)), torch.randint(0, 1024, (2, 256))
    trainer.forward(x[:1], y[:1], _docs(256, 64, 8))
    with tg.compile_region("training"):
        for _ in range(2):  # an odd batch: two rows where the plan warmed one
            got = trainer.forward(x, y, _docs(512, 64, 8))
    torch.testing.assert_close(got, trainer.model(x, y, _docs(512, 64, 8)), rtol=0, atol=0)
    assert trainer.forward.graphs == 1 and trainer.forward.eager_calls == 2
    assert trainer.forward.region_graphs == {} and trainer.forward.region_eager == {"training": 2}
    assert lines == ["compile: train_forward ran eager in training: a shape not warmed before the timer"]
    tg.log_compile_region(rt, "training")
    assert lines[-1] == "compile_region: training graphs_compiled:0 eager_calls:2 compiled_calls:0"


def test_past_dynamos_recompile_limit_the_call_runs_eager_and_the_run_goes_on(tiny_env, monkeypatch):
    rt, trainer, lines = _compiled_trainer(monkeypatch, tiny_env["DATA_PATH"])
    torch._dynamo.config.recompile_limit = 1
    model = trainer.model
    x, y = torch.randint(0, 1024, (1, 512)), torch.randint(0, 1024, (1, 512))
    trainer.forward(x, y, _docs(512, 64, 8))
    model.looping = not model.looping  # a second graph the limit of 1 refuses (fullgraph=True: a hard failure)
    got = trainer.forward(x, y, _docs(512, 64, 8))
    torch.testing.assert_close(got, model(x, y, _docs(512, 64, 8)), rtol=0, atol=0)
    assert trainer.forward.eager_calls == 1
    assert lines == ["compile: train_forward ran eager in -: past Dynamo's recompile limit 1"]


def test_compile_backend_is_checked_before_any_work(tmp_path):
    assert tg.Hyperparameters({}).compile_backend == "inductor"
    tg.check_compile_backend("aot_eager")
    proc = run_training({**TINY_ENV, "COMPILE": "1", "COMPILE_BACKEND": "inductr", "RUN_ID": "cb",
                         "DATA_PATH": str(tmp_path / "no_data")}, tmp_path, timeout=60)
    assert_one_line_error(proc, 2, "error: COMPILE_BACKEND='inductr' is not a torch.compile backend (inductor, ")
    assert list(tmp_path.iterdir()) == []  # refused before the log
    eager = run_training({**TINY_ENV, "COMPILE": "0", "COMPILE_BACKEND": "inductr", "RUN_ID": "cb",
                          "DATA_PATH": str(tmp_path / "no_data")}, tmp_path, timeout=60)
    assert "COMPILE_BACKEND" not in eager.stderr and "TOKENIZER_PATH" in eager.stderr  # not compiling: not read


def test_the_plan_sets_dynamos_limit_and_counts_every_training_state(monkeypatch, tiny_env):
    torch._dynamo.config.recompile_limit = 8
    rt, trainer, _ = _compiled_trainer(monkeypatch, tiny_env["DATA_PATH"], NUM_LOOPS=1, LOOP_START=0, LOOP_END=0,
                                       TRAIN_SEQ_LEN_SCHEDULE="8@0,16@0.3,32@0.6", LATE_QAT_THRESHOLD=0.5,
                                       ROPE_TRAIN_SEQ_LEN=32)
    states = tg.training_graph_states(rt)
    assert len(states) == 2 * 3 * 2 and trainer.forward.planned == 12  # loops x cut lengths x QAT
    assert trainer.val_forward.planned == 3 * 2  # row shapes x loops (eval mode reads no QAT flag)
    assert torch._dynamo.config.recompile_limit == 18  # the plan's total (12 + 6), above Dynamo's 8
    eager = packed_runtime(monkeypatch, tiny_env["DATA_PATH"], COMPILE=0, LATE_QAT_THRESHOLD=0.5)
    assert tg.qat_states(eager) == [False]  # eager has no graphs to warm


def test_warmup_compiles_every_training_state_and_the_timed_steps_compile_nothing(tiny_env, monkeypatch):
    """record_0430's shape of training (loop switch, three context phases, late QAT) on a one-layer model: the warmup
    compiles each (looping, cut, QAT) graph once; steps in every state afterwards, in the timed region, none."""
    rt, trainer, lines = _compiled_trainer(monkeypatch, tiny_env["DATA_PATH"], NUM_LOOPS=1, LOOP_START=0,
                                           LOOP_END=0, TRAIN_SEQ_LEN_SCHEDULE="8@0,16@0.5", LATE_QAT_THRESHOLD=0.5,
                                           ROPE_TRAIN_SEQ_LEN=16, WARMUP_STEPS=1)
    loader = tg.warmup_and_restore(rt, trainer)
    assert trainer.forward.graphs == trainer.forward.planned == 8
    assert sum(line.startswith("warmup_step:") for line in lines) == 8
    model = trainer.model
    with tg.compile_region("training"):
        for looping, cut, qat in tg.training_graph_states(rt, model.looping):
            model.looping = looping
            model.set_qat(qat)
            loader.set_cut_len(cut)
            trainer.step(loader, 1.0, 0.9)
    loader.shutdown()
    assert trainer.forward.region_graphs == {} and trainer.forward.region_eager == {}


# ---------------------------------------------------------------------------------------------- inductor

@pytest.fixture
def inductor_cpu_build():
    """Inductor's C++ for the test below, its settings restored after by Inductor's own config.patch (pytest's
    monkeypatch undo deletes a config entry instead of restoring it: a later in-process compilation in the same
    worker would fail reading it). The graphs' C++ kernels built with their wrapper as one file a graph, not one
    compiler call a kernel (44 here): the same lowering and kernels, 76 s -> 51 s with a cold Inductor cache on a
    2-core EPYC (issue 53); and as scalar loops, without the CPU vector ISA's templates (Inductor's CPU code runs only
    where a CPU run asks for COMPILE=1 COMPILE_BACKEND=inductor; GPUs get Triton kernels): the same graphs, lowering
    and numbers to check, 55-59 s -> 37-42 s (issue 69)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp_wrapper": True, "cpp.vec_isa_ok": False}):
        yield


def test_inductor_compiles_a_tiny_training_step_and_lora_ttt_step_with_the_eager_numbers(tiny_env, monkeypatch,
                                                                                         inductor_cpu_build):
    """Inductor's lowering of the model (and of our custom ops, where the kernels are on) on CPU: one training
    forward+backward of a packed row and one LoRA TTT step (dynamic shapes), against eager."""
    pytest.importorskip("triton")  # inductor's CPU path imports it only for GPUs; kept as torch's own dependency
    rt = packed_runtime(monkeypatch, tiny_env["DATA_PATH"], COMPILE=1, COMPILE_BACKEND="inductor", NUM_LAYERS=1,
                        VE_LAYERS="0", XSA_LAST_N=1, MODEL_DIM=32, NUM_HEADS=2, NUM_KV_HEADS=1, TRAIN_SEQ_LEN=16,
                        TTT_MODE="lora", TTT_LORA_RANK=2, TTT_BATCH_SIZE=2)
    rt.log = lambda msg, console=True: None
    torch.manual_seed(0)
    model = rt.prepare_model(tg.build_model(rt.h))  # fp32 compute, as a run without autocast (the precision check)
    compiled = tg.compile_fn(rt, "train_forward", model, model.graph_state, 1)
    x, y = torch.randint(0, 1024, (1, 64)), torch.randint(0, 1024, (1, 64))
    docs = _docs(64, 64, 16)
    got = compiled(x, y, docs)
    (g_got,) = torch.autograd.grad(got, model.qo_bank)
    want = model(x, y, docs)
    (g_want,) = torch.autograd.grad(want, model.qo_bank)
    # fused kernels reassociate sums (in bf16, inductor also skips eager's rounding of intermediates: 6% of the
    # largest gradient entry measured here; fp32 compute, as CPU runs without native bf16 have, is compared)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-5 * float(g_want.abs().max()))
    lora_fn, how = tg.lora_forward(rt, model, 1)
    assert how == "compiled"
    lora = tg.LoRAAdapters(2, model, rt.h, torch.Generator().manual_seed(0))
    ids = torch.randint(0, 1024, (2, 16))
    model.eval()
    with tg.weights_trainable(model, False):
        out = lora_fn(ids, lora=lora)
        ref = model.forward_logits(ids, lora=lora)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
        grads = torch.autograd.grad(out.float().square().mean(), list(lora.parameters()), allow_unused=True)
        refs = torch.autograd.grad(ref.float().square().mean(), list(lora.parameters()), allow_unused=True)
    for a, b in zip(grads, refs):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    assert compiled.graphs == 1 and lora_fn.graphs == 1
