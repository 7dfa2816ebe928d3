"""scripts/bench/bench_gpu.sh, the one-command GPU benchmark (issue 23), tested on CPU: its tiny mode runs the same
pipeline end to end, a hung row is cut off, the log parser and the FLOPs formula, ATTENTION_BACKEND; the races of
the presets against their records' own scripts (issue 41: scripts/bench/bench_record.py and
scripts/record/record_shim)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
import time

import pytest
import torch

import train_gpt as tg
from conftest import REPO, clean_environ, config_error, hide_modules

sys.path.insert(0, str(REPO / "scripts" / "bench"))
import bench_gpu  # noqa: E402  (needs the path above)
import bench_record  # noqa: E402

HAVE_ANCHORS = bench_gpu.RECORD_SCRIPT.is_file()
HAVE_FRONTIER = all(bench_record.record_script(bench_gpu.ANCHORS, r).is_file() for r in bench_gpu.RACES)


def table_rows(text):
    """The markdown table of the output as a list of {column: cell}, checking its header."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert tuple(header) == bench_gpu.COLUMNS
    assert set(lines[1].replace("|", "")) == {"-"}
    rows = [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
    assert all(len(r) == len(header) for r in rows)
    return {r["row"]: r for r in rows}


def number(cell):
    return float(cell.replace(",", "").rstrip("%"))


def test_tiny_bench_runs_every_cpu_row_and_prints_one_table(tmp_path):
    # 4 timed steps per row, not tiny mode's 6 (record_0430's tiny context schedule still reaches 64 at its last
    # step), and 1,024 evaluation targets, not 2,048 (2 TTT chunks: the first scored, trained on, then the second)
    env = {**clean_environ(), "BENCH_TINY": "1", "BENCH_DIR": str(tmp_path), "BENCH_STEPS": "4",
           "BENCH_VAL_TOKENS": str(16 * 64 + 1)}
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "bench" / "bench_gpu.sh")], env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"tiny bench: {time.monotonic() - t0:.0f} s")
    assert (tmp_path / "table.md").read_text().strip() == proc.stdout.strip()
    assert proc.stdout.count("| row |") == 1  # one table
    rows = table_rows(proc.stdout)
    ours = ["ours p0c0", "ours p1c1 (default)", "PRESET=record_0409 loop off", "PRESET=record_0409 loop on"]
    for name in ours:
        r = rows[name]
        assert r["status"] == "ok", r
        ms, tps = number(r["ms_per_step"]), number(r["tokens_per_s"])
        assert tps == pytest.approx(512 / (ms / 1000.0), rel=1e-3, abs=1)  # TRAIN_BATCH_TOKENS=512 at tiny shapes
        assert number(r["data_wait_ms"]) >= 0 and number(r["compile_s"]) >= 0 and number(r["mfu"]) > 0
        assert r["peak_mib"] == "-"  # CUDA only
    for preset in ("record_0427", "record_0430", "record_0501"):  # packed rows (record_0430's context scaled down)
        assert rows[f"PRESET={preset} loop off"]["status"] == "ok", rows[f"PRESET={preset} loop off"]
        assert rows[f"PRESET={preset} loop on"]["status"].startswith("skipped: tiny mode runs record_0409's")
    assert rows["ours p0c1"]["settings"] == "TRAIN_PREFETCH=0 TRAIN_COPY_STREAM=1"
    # train_gpt.py --help, ours and the presets' rows (and the race's ours) forked from the row server; the matmul
    # peak, the evaluation comparison and the record's script (import-time variables of their own) new processes
    forked, new = 8 + HAVE_FRONTIER, 1 + HAVE_ANCHORS + HAVE_FRONTIER
    assert re.search(rf"^processes: {forked} forked from one that imported numpy, torch, torch._dynamo, "
                     rf"sentencepiece, train_gpt \(tiny mode: --help and the rows\), {new} new ", proc.stdout, re.M), \
        proc.stdout[:3000]
    # rows that would repeat another on CPU (copy streams and the Triton kernels need CUDA) are skipped, saying so
    for name in ("ours p0c1", "ours p1c0", "ours FUSED_MLP=1", "ours FUSED_CE=1"):
        assert rows[name]["status"].startswith("skipped: tiny mode on CPU"), rows[name]
    flops = {name: number(re.search(r"([\d.]+) MFLOP/token", rows[name]["note"]).group(1))
             for name in ("PRESET=record_0409 loop off", "PRESET=record_0409 loop on")}
    assert flops["PRESET=record_0409 loop on"] > flops["PRESET=record_0409 loop off"]  # looped layers count
    assert rows["record 2026-03-23 (its script)"]["status"].startswith("skipped: needs CUDA")
    # The races (issue 41): tiny mode runs one pair, ours and the record's own script from the same initial weights
    # on the same batches; its status is ok only when the first losses agree (bench_gpu.RACE_LOSS_TOL).
    races = [name for name in rows if name.startswith("race ")]
    assert len(races) == 2 * 2 * (1 + 3 + 1)  # (ours, its script) x (loop off, on) x (0427, 0430's 3 phases, 0501)
    pair = [f"{bench_gpu.TINY_RACE}: ours", f"{bench_gpu.TINY_RACE}: its script"]
    for name in races:
        if name not in pair:
            assert rows[name]["status"].startswith("skipped: tiny mode runs the pair"), rows[name]
    if HAVE_FRONTIER:
        ours, theirs = rows[pair[0]], rows[pair[1]]
        assert ours["status"] == "ok" and theirs["status"] == "ok", (ours, theirs)
        assert ours["settings"] == theirs["settings"] and "TRAIN_SEQ_LEN_SCHEDULE=32@0" in ours["settings"]
        assert number(ours["ours_vs_record"]) > 0 and number(theirs["data_wait_ms"]) >= 0
        assert number(theirs["compile_s"]) >= 0 and number(theirs["mfu"]) > 0
        losses = re.search(r"first losses record/ours 1: (\S+)/(\S+), 2: (\S+)/(\S+), 3: (\S+)/(\S+);",
                           theirs["note"])
        assert losses and losses.group(1) == losses.group(2), theirs["note"]  # step 1: the same to 4 decimals
        assert "packed rows torch_doc_blocks" in theirs["note"]  # the shim's CPU path, as ours on CPU
    # Our log carries the warm-up (compile) time the compile_s column is made from.
    assert re.search(r"^ *[\d.]+ warmup_time: steps:1 ms:\d+ ", (tmp_path / "bench_ours_p0c0.console.txt").read_text(),
                     re.M)
    if not HAVE_ANCHORS:
        assert rows["eval sliding window"]["status"].startswith("skipped")
        return
    for name in ("eval sliding window", "eval legal TTT"):
        r = rows[name]
        assert r["status"] == "ok", r  # the record's function's bpb = ours plus its tail re-scoring, to 1e-4
        assert number(r["ours_vs_record"]) > 0 and number(r["bpb"]) > 0
    assert number(rows["eval sliding + TTT"]["ours_vs_record"]) > 0


def test_a_hung_row_is_cut_off_at_its_time_limit_and_reported():
    cmd = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"]
    t0 = time.monotonic()
    status, code, lines = bench_gpu.run_logged(cmd, os.environ.copy(), REPO, timeout=3)
    assert time.monotonic() - t0 < 30
    assert status == "timeout" and code != 0 and [ln for _, ln in lines] == ["started"]
    assert bench_gpu.failure_note(status, code, lines, 3).startswith("timeout: no result within 3 s")
    # A run that fails ends its row with its error line; one stopped at a matching line is 'stopped'.
    failed = bench_gpu.run_logged([sys.executable, "-c", "import sys; print('x'); sys.exit('error: bad input')"],
                                  os.environ.copy(), REPO, timeout=60)
    assert bench_gpu.failure_note(*failed, 60) == "failed (exit 1): error: bad input"
    crashed = bench_gpu.run_logged([sys.executable, "-c", "print('step:1/9'); raise RuntimeError('CUDA error: boom')"],
                                   os.environ.copy(), REPO, timeout=60)
    assert bench_gpu.failure_note(*crashed, 60) == "failed (exit 1): RuntimeError: CUDA error: boom"
    stopped = bench_gpu.run_logged(cmd, os.environ.copy(), REPO, timeout=60, stop_when=r"^started")
    assert stopped[0] == "stopped"


# A row's script that prints what a new `python3 SCRIPT` process would have, then ends as PROBE_END says.
PROBE = """
import os, random, sys
print("argv", sys.argv[1:], os.path.basename(sys.argv[0]))
print("path0", sys.path[0] == os.path.dirname(os.path.realpath(__file__)), "cwd", os.path.basename(os.getcwd()))
print("main", __name__, "stdin", sys.stdin.read())
print("env", sorted((k, v) for k, v in os.environ.items() if k.startswith("PROBE_")), "OMP" in str(os.environ))
print("own process group", os.getpgid(0) == os.getpid())
print("to stderr", file=sys.stderr)
print("random", random.random())
end = os.environ["PROBE_END"]
if end == "exit":
    sys.exit("error: bad input")
if end == "raise":
    raise RuntimeError("CUDA error: boom")
if end == "hang":
    import time
    time.sleep(120)
"""


def test_tiny_rows_forked_from_the_row_server_run_as_new_processes(tmp_path, monkeypatch):
    """bench_gpu.RowServer (tiny mode): a row forked from the server prints what a new `python3 SCRIPT` prints (its
    argv, sys.path[0], folder, __main__, empty stdin, exactly its environment, its own process group, stderr into the
    same lines) and ends as one (status 0, a SystemExit message, a traceback), but for its own random seed; a hung
    one is cut off at its time limit and one stopped at a line is 'stopped'. A row whose import-time variables differ
    from the server's (OMP_NUM_THREADS here) starts anew."""
    env = {k: v for k, v in clean_environ().items() if not k.startswith("PROBE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    (tmp_path / "row").mkdir()
    server = bench_gpu.RowServer()
    monkeypatch.setattr(bench_gpu, "ROWS", server)
    server.start_server(env)
    try:
        assert server.sock is not None, server.why_not
        cmd = [sys.executable, str(script), "--flag", "x"]
        runs = {}
        for how in ("new", "forked"):
            for end in ("", "exit", "raise"):
                run_env = {**env, "PROBE_A": "1", "PROBE_END": end}
                if how == "new":
                    run_env["OMP_NUM_THREADS"] = "2"  # an import-time variable: not the server's
                assert server.serves(cmd, run_env) == (how == "forked")
                runs[how, end] = bench_gpu.run_logged(cmd, run_env, tmp_path / "row", timeout=60)
        assert server.forked == 3 and server.new == 3

        def seen(run):
            return [line for _, line in run[2] if not line.startswith("random ")]

        for end, want in (("", None), ("exit", "failed (exit 1): error: bad input"),
                          ("raise", "failed (exit 1): RuntimeError: CUDA error: boom")):
            new, forked = runs["new", end], runs["forked", end]
            assert seen(forked) == seen(new) and forked[:2] == new[:2] == ("exited", 0 if want is None else 1)
            if want:
                assert bench_gpu.failure_note(*forked, 60) == want
        assert seen(runs["forked", ""])[:5] == [
            "argv ['--flag', 'x'] probe.py", "path0 True cwd row", "main __main__ stdin ",
            "env [('PROBE_A', '1'), ('PROBE_END', '')] True", "own process group True"]
        randoms = {line for run in runs.values() for _, line in run[2] if line.startswith("random ")}
        assert len(randoms) == 6  # fresh seeds in each forked row too
        hang = {**env, "PROBE_END": "hang"}
        t0 = time.monotonic()
        status, code, lines = bench_gpu.run_logged(cmd, hang, tmp_path / "row", timeout=1)
        assert time.monotonic() - t0 < 30 and status == "timeout" and code == -9, (status, code)
        assert bench_gpu.run_logged(cmd, hang, tmp_path / "row", timeout=60, stop_when=r"^own process group")[0] \
            == "stopped"
        assert server.forked == 5
    finally:
        server.stop()
    assert server.proc is None


def test_a_system_that_cannot_fork_rows_starts_each_anew_and_says_why(monkeypatch):
    import socket

    monkeypatch.delattr(socket, "send_fds")
    server = bench_gpu.RowServer()
    server.start_server(clean_environ())
    assert server.proc is None and not server.serves([sys.executable, "x.py"], clean_environ())
    assert server.summary() == "processes: each new (this system cannot fork rows: no os.fork or socket.send_fds here)"


def timed(*lines, dt=1.0):
    return [(i * dt, ln) for i, ln in enumerate(lines)]


def test_training_numbers_come_from_the_log_lines():
    ours = timed("device:cuda:0 world_size:1 grad_accum_steps:8 attention_backend:flash_attn_3 compile:1",
                 "warmup_step:1/2", "warmup_step:2/2", "warmup_time: steps:2 ms:30000 (compile and first steps)",
                 "step:1/5 train_loss:6.9 train_time:700ms step_avg:700.00ms data_wait_ms:0.20",
                 "step:2/5 train_loss:6.8 train_time:1300ms step_avg:650.00ms data_wait_ms:0.20",
                 "step:5/5 train_loss:6.1 train_time:3100ms step_avg:620.00ms data_wait_ms:0.10",
                 "data_wait: total_ms:0.9 mean_ms_per_step:0.180 max_step_ms:0.300",
                 "peak memory allocated: 21000 MiB reserved: 22000 MiB")
    got = bench_gpu.parse_training(ours)
    assert got["ms_per_step"] == (3100 - 700) / 4 and got["data_wait_ms"] == 0.18 and got["peak_mib"] == 21000
    assert got["backend"] == "flash_attn_3" and got["compile_s"] == pytest.approx(30.0 - 2 * 0.6)
    # The record logs no warm-up time: it is taken from the arrival times of its lines (2 s per line here).
    record = timed("seed:1337", "warmup_step:1/2", "warmup_step:2/2",
                   "step:1/3 train_loss:6.9 train_time:600ms step_avg:600.00ms",
                   "step:3/3 train_loss:6.5 train_time:1800ms step_avg:600.00ms", dt=2.0)
    got = bench_gpu.parse_training(record)
    assert got["ms_per_step"] == 600 and got["compile_s"] == pytest.approx(4.0 - 2 * 0.6) and "peak_mib" not in got
    with pytest.raises(ValueError, match="train step lines missing"):
        bench_gpu.parse_training(timed("warmup_step:1/1", "error: training failed: CUDA out of memory"))


SMALL = {"NUM_LAYERS": "4", "MODEL_DIM": "64", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "VE_LAYERS": "2,3",
         "XSA_LAST_N": "2", "TRAIN_SEQ_LEN": "128"}
SMALL_0409 = {**SMALL, "PRESET": "record_0409", "LOOP_START": "1", "LOOP_END": "2", "PARALLEL_RESIDUAL_START": "2",
              "XSA_LAST_N": "4"}


@pytest.mark.skipif(not HAVE_ANCHORS, reason="../shared/anchors (the record's files) is not here")
def test_the_records_own_log_parses():
    """The record's seed-1337 log (8xH100) read as the benchmark reads a run: its step time agrees with the
    step_avg it logged at its last step, and its peak memory and 20 warm-up steps are found."""
    text = (bench_gpu.RECORD_SCRIPT.parent / "train_seed1337.log").read_text(encoding="utf-8")
    got = bench_gpu.parse_training(timed(*text.splitlines()))
    last_avg = float(re.findall(r"^step:\d+/\d+ train_loss:\S+ train_time:\d+ms step_avg:([\d.]+)ms", text, re.M)[-1])
    assert got["ms_per_step"] == pytest.approx(last_avg, rel=0.01)
    assert got["peak_mib"] == 21471 and got["warmup_steps"] == 20 and "data_wait_ms" not in got


@pytest.mark.parametrize("environ,looping,runs", [(SMALL, False, 4), (SMALL_0409, False, 4), (SMALL_0409, True, 8)])
def test_flops_per_token_counts_the_matmul_weights_and_causal_attention(environ, looping, runs):
    h = tg.Hyperparameters(environ)
    model = tg.GPT(h)
    banks = sum(getattr(model, b).numel() for b in ("qo_bank", "kv_bank", "mlp_up_bank", "mlp_down_bank"))
    assert len(sum(model.orders[looping], [])) == runs  # how many times blocks run per token
    per_layer_banks = banks // h.num_layers  # every physical layer has one slice of each bank
    want = 6 * (runs * per_layer_banks + model.tok_emb.weight.numel()) + 6 * runs * h.train_seq_len * h.model_dim
    assert bench_gpu.flops_per_token(h, looping) == want
    # The record's shapes: 11 blocks of 2,359,296 matmul weights, the tied 1024 x 512 head, causal attention.
    record = 6 * (11 * 2_359_296 + 1024 * 512) + 6 * 11 * 2048 * 512
    assert bench_gpu.flops_per_token(tg.Hyperparameters({}), False) == record


def test_attention_backend_setting(monkeypatch):
    assert "ATTENTION_BACKEND='flash' must be auto or" in config_error({"ATTENTION_BACKEND": "flash"})
    cpu = tg.torch.device("cpu")
    assert tg.select_attention_backend(cpu) == "sdpa" and tg.select_attention_backend(cpu, "sdpa") == "sdpa"
    with pytest.raises(tg.ConfigError, match="ATTENTION_BACKEND=flash_attn_4 needs CUDA"):
        tg.select_attention_backend(cpu, "flash_attn_4")
    # On CUDA a named kernel that cannot be imported is refused, where auto falls through to SDPA.
    monkeypatch.setattr(tg, "import_flash_attn", lambda module: None)
    cuda = tg.torch.device("cuda")
    assert tg.select_attention_backend(cuda) == "sdpa"
    with pytest.raises(tg.ConfigError, match=r"ATTENTION_BACKEND=flash_attn_3: cannot import flash_attn_interface"):
        tg.select_attention_backend(cuda, "flash_attn_3")
    # stands for the module: its flash_attn_func is the module's name, and it has no varlen function
    monkeypatch.setattr(tg, "import_flash_attn", lambda module: types.SimpleNamespace(flash_attn_func=module))
    assert tg.select_attention_backend(cuda, "flash_attn_4") == "flash_attn_4"
    assert tg._ATTENTION["fn"] == "flash_attn.cute"
    assert tg.select_attention_backend(cuda) == "flash_attn_3"  # auto never picks FA4 (not measured yet)
    tg.select_attention_backend(cpu)


def test_each_packing_preset_has_torch_varlen_against_the_masked_path():
    """On CUDA every preset that packs documents gets the pair ATTENTION_BACKEND=torch_varlen / sdpa (the masked
    fallback), loops off, otherwise its row's settings; tiny mode (CPU) skips both, an old PyTorch the first."""
    tiny = bench_gpu.bench_config({"BENCH_TINY": "1"})
    cuda = {**tiny, "tiny": False}
    packing = [p for p in ("record_0409", "record_0427", "record_0430", "record_0501")
               if tg.PRESETS[p].get("TRAIN_LOADER") == "packed"]
    assert packing == ["record_0427", "record_0430", "record_0501"]
    for cfg, varlen_ok in ((cuda, True), (cuda, False), (tiny, False)):
        plan = {**bench_gpu.backend_plan(True), "torch_varlen": varlen_ok}
        rows = {r["name"]: r for r in bench_gpu.plan_rows(cfg, "", tg.PRESETS, plan)}
        assert sum("packed" in name for name in rows) == 2 * len(packing)
        for preset in packing:
            varlen, masked = rows[f"PRESET={preset} packed torch_varlen"], rows[f"PRESET={preset} packed masked (sdpa)"]
            off = rows[f"PRESET={preset} loop off"]["env"]
            assert varlen["env"] == {**off, "ATTENTION_BACKEND": "torch_varlen"}
            assert masked["env"] == {**off, "ATTENTION_BACKEND": "sdpa"}
            assert masked["kind"] == ("skip" if cfg["tiny"] else "ours")
            assert varlen["kind"] == ("ours" if varlen_ok else "skip")
    lines = timed("device:cuda:0 world_size:1 grad_accum_steps:8 attention_backend:sdpa compile:1",
                  "attention_backend_packed:torch_varlen (document-packed rows, SPEC-FRONTIER 3)",
                  "step:1/3 train_loss:6.9 train_time:600ms step_avg:600.00ms",
                  "step:3/3 train_loss:6.5 train_time:1800ms step_avg:600.00ms")
    got = bench_gpu.parse_training(lines)
    assert got["backend"] == "sdpa" and got["packed_backend"] == "torch_varlen"
    cells = bench_gpu.training_cells({"name": "x", "env": {}}, {**got, "status": "ok", "tokens_per_s": 1.0,
                                                              "flops_per_token": 1e6, "log": "x.txt"}, None, None)
    assert cells["note"].startswith("backend sdpa; packed rows torch_varlen;")


@pytest.mark.parametrize("missing", [(), ("zpaq",), ("brotli",)])
def test_preset_rows_train_with_lzma_where_their_compressor_is_missing(monkeypatch, missing):
    """The GPU image has neither brotli nor zpaq: a preset row whose COMPRESSOR needs a missing package trains with
    COMPRESSOR=lzma (only its training steps are measured) instead of stopping at start; otherwise no override."""
    hide_modules(monkeypatch, *missing)
    rows = {r["name"]: r for r in bench_gpu.plan_rows(bench_gpu.bench_config({"BENCH_TINY": "1"}), "", tg.PRESETS,
                                                        bench_gpu.backend_plan(True))}
    assert tg.PRESETS["record_0427"]["COMPRESSOR"] == "pergroup" and tg.PRESETS["record_0409"]["COMPRESSOR"] == "brotli"
    for name in ("PRESET=record_0427 loop on", "PRESET=record_0430 loop off"):
        assert rows[name]["env"].get("COMPRESSOR") == ("lzma" if missing else None), name
    assert rows["PRESET=record_0409 loop on"]["env"].get("COMPRESSOR") == ("lzma" if "brotli" in missing else None)


# ---------------------------------------------------------------------------------------------- the races (issue 41)


def load_shim():
    """scripts/record/record_shim/flash_attn_interface.py under a name of its own (the name flash_attn_interface stays
    the anchors' stand-in for the tests that import the records)."""
    shim_file = REPO / "scripts" / "record" / "record_shim" / "flash_attn_interface.py"
    spec = importlib.util.spec_from_file_location("record_shim_under_test", shim_file)
    shim = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = shim  # Dynamo looks a traced function's module up by name
    spec.loader.exec_module(shim)
    return shim


def reference_attention(q, k, v, starts):
    """Causal attention within each [a, b) of starts on (N, H, D), KV heads repeated for their query heads, by
    explicit softmax in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    out = torch.zeros_like(q)
    for a, b in zip(starts[:-1], starts[1:]):
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) / q.size(-1) ** 0.5
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:b])
    return out


def test_the_record_shim_runs_our_attention_path_with_the_records_calls():
    """The shim's two functions, called as the records call them, against explicit attention: flash_attn_func on
    (B, T, H, D) with GQA; flash_attn_varlen_func on packed (N, H, D) with a cu_seqlens padded as the records pad
    it (repeats of N: empty segments), eager (our per-document path) and inside torch.compile(fullgraph=True) (our
    masked blocks); both return the output tensor alone; the shim uses this process's train_gpt module."""
    shim = load_shim()
    assert shim.tg is tg and (shim.VARLEN is None) == (tg.import_torch_varlen() is None)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, h, 16, generator=g) for h in (4, 2, 2))
    y = shim.flash_attn_func(q, k, v, causal=True)
    assert isinstance(y, torch.Tensor) and y.shape == q.shape
    for b in range(2):
        torch.testing.assert_close(y[b], reference_attention(q[b], k[b], v[b], [0, 24]).float(), atol=1e-5, rtol=1e-5)
    n, starts = 40, [0, 9, 10, 27, 40]
    q, k, v = (torch.randn(n, h, 16, generator=g) for h in (4, 2, 2))
    cu = torch.tensor(starts + [n] * 3, dtype=torch.int32)  # padded to a bucket with the total, as the records do

    def call(q, k, v, cu):
        return shim.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=17,
                                           max_seqlen_k=17, causal=True, window_size=(-1, -1))

    want = reference_attention(q, k, v, starts).float()
    got = call(q, k, v, cu)
    assert isinstance(got, torch.Tensor) and got.shape == q.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="eager", fullgraph=True)(q, k, v, cu)
    torch.testing.assert_close(compiled, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError, match="no sliding window"):
        shim.flash_attn_varlen_func(q, k, v, cu, cu, 17, 17, causal=True, window_size=(8, 0))


@pytest.mark.skipif(not HAVE_FRONTIER, reason="../shared/anchors/frontier (the records' scripts) is not here")
def test_record_env_is_the_logged_run_with_the_rows_settings_in_the_records_names():
    logged = bench_record.logged_env(bench_gpu.ANCHORS, "record_0501")
    assert logged["SMEAR_GATE_BOS_FIX"] == "0" and logged["ASYM_LOGIT_RESCALE"] == "1"  # header; dump (True -> 1)
    assert logged["MATRIX_LR"] == "0.028" and logged["NUM_LOOPS"] == "2"
    assert not {"WORLD_SIZE", "GRAD_ACCUM_STEPS", "SEED", "QK_GAIN_SCHEDULE"} & set(logged)  # run-local, a list
    assert bench_record.logged_env(bench_gpu.ANCHORS, "record_0430")["ASYM_LOGIT_RESCALE"] == "1"  # its launch
    ours = {"PRESET": "record_0430", "PARALLEL_RESIDUAL_START": "2", "TRAIN_SEQ_LEN_SCHEDULE": "16@0,32@0.1,64@0.7",
            "NUM_LOOPS": "0", "VAL_BATCH_SIZE": "4096", "TRAIN_LOG_EVERY": "4", "ATTENTION_BACKEND": "sdpa",
            "SEED": "1337"}
    env = bench_record.record_env(bench_gpu.ANCHORS, "record_0430", ours, tiny=True)
    assert (env["PARALLEL_START_LAYER"], env["VAL_BATCH_TOKENS"], env["NUM_LOOPS"], env["SEED"]) == ("2", "4096", "0",
                                                                                                     "1337")
    # ours: L from fraction p on; the record's: L until fraction p; its TRAIN_SEQ_LEN is the schedule's longest
    assert (env["TRAIN_SEQ_SCHEDULE"], env["TRAIN_SEQ_LEN"]) == ("16@0.1,32@0.7,64@1", "64")
    assert (env["TRAIN_LOG_EVERY"], env["VAL_LOSS_EVERY"], env["CASEOPS_ENABLED"]) == ("1", "0", "0")
    assert (env["FUSED_CE_ENABLED"], env["TORCHDYNAMO_DISABLE"], env["CUDA_VISIBLE_DEVICES"]) == ("0", "1", "")
    assert not {"PRESET", "ATTENTION_BACKEND", "PARALLEL_RESIDUAL_START"} & set(env)
    full = bench_record.record_env(bench_gpu.ANCHORS, "record_0427", {}, tiny=False)  # on CUDA: as the record ran
    assert full["FUSED_CE_ENABLED"] == "1" and not {"TORCHDYNAMO_DISABLE", "CUDA_VISIBLE_DEVICES"} & set(full)
    with pytest.raises(ValueError, match="no mapping to the record's settings for QK_GAIN_INIT"):
        bench_record.record_env(bench_gpu.ANCHORS, "record_0427", {"QK_GAIN_INIT": "5"}, tiny=True)


def test_race_rows_pair_each_setting_with_the_records_script_on_the_same_kernels():
    """On CUDA: every race has our row (ATTENTION_BACKEND=torch_varlen, or the masked sdpa where varlen_attn is
    missing) and the record's with the same settings; record_0430 one pair per context phase; each of our rows is
    compared (ours_vs_record) with its record's, and a record row's first losses are set beside its pair's."""
    cuda = {**bench_gpu.bench_config({"BENCH_TINY": "1"}), "tiny": False, "preset_layers": {}}
    for varlen in (True, False):
        plan = {**bench_gpu.backend_plan(True), "torch_varlen": varlen}
        rows = {r["name"]: r for r in bench_gpu.race_rows(cuda, tg.PRESETS, plan)}
        assert len(rows) == 20
        for name, row in rows.items():
            other = rows[row.get("vs") or row.get("pair")]
            assert other["env"] == row["env"] and row["env"]["ATTENTION_BACKEND"] == ("torch_varlen" if varlen
                                                                                     else "sdpa")
            # without ../shared/anchors/frontier the record's row is planned as a skip, saying so
            assert row["kind"] == ("ours" if name.endswith(": ours") else "record_script" if HAVE_FRONTIER else "skip")
            assert "AUTOCAST_DTYPE" not in row["env"]  # bf16 autocast on CUDA, as the records
        phases = [r["env"].get("TRAIN_SEQ_LEN_SCHEDULE") for n, r in rows.items() if "record_0430" in n]
        assert sorted(set(phases)) == ["1024@0", "2048@0", "3072@0"]
        assert rows["race record_0501 loop on: ours"]["env"]["ENABLE_LOOPING_AT"] == "0"
        assert rows["race record_0427 loop off: its script"]["env"]["NUM_LOOPS"] == "0"
    ours = {"status": "ok", "losses": {1: 9.0118, 2: 9.4110, 3: 9.1976}}
    record = {"status": "ok", "losses": {1: 9.0118, 2: 9.4113, 3: 9.1966}}
    tiny = {"tiny": True}
    assert bench_gpu.race_cells(tiny, {"status": "ok", "note": "x"}, ours, record) == {
        "status": "ok", "note": "first losses record/ours 1: 9.0118/9.0118, 2: 9.4113/9.4110, 3: 9.1966/9.1976; x"}
    record["losses"][1] = 9.0125  # the first step differs: not the same weights, batch or math
    assert bench_gpu.race_cells(tiny, {"status": "ok", "note": ""}, ours, record)["status"].startswith(
        "losses differ from ours' at steps [1]")
    assert bench_gpu.race_cells({"tiny": False}, {"status": "ok", "note": ""}, ours, record)["status"] == "ok"
