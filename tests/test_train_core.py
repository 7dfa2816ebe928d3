"""Core of train_gpt.py: configuration, shards and the record's loader, model shape, Muon, warmup restore,
and distributed-vs-single-process equality."""
from __future__ import annotations

import ast
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import launcher
import train_gpt as tg
from conftest import REPO, SCRIPT, TINY_ENV, clean_environ, read_log, run_file, run_training, short_val_data


def cpu_runtime(h: tg.Hyperparameters) -> tg.Runtime:
    return tg.Runtime(h, torch.device("cpu"), False, True, None)


def write_shard(path, tokens, magic=tg.SHARD_MAGIC, version=tg.SHARD_VERSION, count=None):
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, len(tokens) if count is None else count)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


# ---------------------------------------------------------------------------------------------- config

def test_parses_as_python_310():
    ast.parse(SCRIPT.read_text(encoding="utf-8"), feature_version=(3, 10))


@pytest.mark.real_command
def test_import_has_no_side_effects(tmp_path):
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import train_gpt"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env=clean_environ(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no logs/, no artifacts


def test_default_model_matches_the_record(monkeypatch):
    for k in list(TINY_ENV) + ["WORLD_SIZE", "RANK", "LOCAL_RANK"]:
        monkeypatch.delenv(k, raising=False)
    h = tg.Hyperparameters()
    assert (h.num_layers, h.model_dim, h.train_batch_tokens, h.grad_accum_steps) == (11, 512, 786432, 8)
    model = tg.build_model(h)
    assert sum(p.numel() for p in model.parameters()) == 26_928_220
    sd = model.state_dict()
    expected = {
        "skip_weights": (5, 512), "qo_bank": (22, 512, 512), "kv_bank": (22, 256, 512),
        "mlp_up_bank": (11, 1536, 512), "mlp_down_bank": (11, 512, 1536), "tok_emb.weight": (1024, 512),
        "bigram.scale": (), "bigram.embed.weight": (1536, 128), "bigram.proj.weight": (512, 128),
        "smear.gate": (512,), "ve_shared.scale": (), "ve_shared.embed.weight": (1024, 128),
        "ve_shared.proj.weight": (256, 128), "ve_layer_scales.0": (1,), "ve_layer_scales.1": (1,),
    }
    for i in range(11):
        expected.update({f"blocks.{i}.attn_scale": (512,), f"blocks.{i}.mlp_scale": (512,),
                         f"blocks.{i}.resid_mix": (2, 512), f"blocks.{i}.attn.q_gain": (8,)})
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    for name, t in sd.items():
        want = torch.bfloat16 if name in tg.EMBEDDING_NAMES else torch.float32
        assert t.dtype == want, name
    # Record init: zero output/down projections, orthogonal Q/K/V/up, unit q_gain scaled to 1.5.
    n = 11
    assert torch.count_nonzero(sd["qo_bank"][n:]) == 0 and torch.count_nonzero(sd["mlp_down_bank"]) == 0
    q0 = sd["qo_bank"][0]
    assert torch.allclose(q0 @ q0.T, torch.eye(512), atol=1e-2)  # orthogonal up to the bf16 rounding of the init
    assert torch.all(sd["blocks.0.attn.q_gain"] == 1.5)
    assert torch.count_nonzero(sd["bigram.embed.weight"]) == 0


@pytest.mark.parametrize("name,value,fragment", [
    ("TRAIN_SEQ_LEN", "abc", "TRAIN_SEQ_LEN='abc' is not a valid int"),
    ("TRAIN_BATCH_TOKENS", "-5", "TRAIN_BATCH_TOKENS=-5 must be > 0"),
    ("NUM_HEADS", "3", "NUM_HEADS=3 must divide MODEL_DIM=64"),
    ("NUM_KV_HEADS", "3", "NUM_KV_HEADS=3 must divide NUM_HEADS=4"),
    ("TRAIN_BATCH_TOKENS", "4000", "TRAIN_BATCH_TOKENS=4000 must split into whole sequences"),
    ("MATRIX_LR", "fast", "MATRIX_LR='fast' is not a valid float"),
    ("TIE_EMBEDDINGS", "yes", "TIE_EMBEDDINGS='yes' must be 0 or 1"),
    ("VE_LAYERS", "2,9", "VE_LAYERS=[2, 9] must lie in [0, NUM_LAYERS=4)"),
    ("EMA_DECAY", "1.5", "EMA_DECAY=1.5 must be in [0, 1)"),
    ("DEVICE", "tpu", "DEVICE='tpu' must be cpu or cuda"),
    ("WORLD_SIZE", "3", "WORLD_SIZE=3 must divide 8"),
    ("VAL_BATCH_SIZE", "64", "VAL_BATCH_SIZE=64 gives less than one sequence"),
    ("ROPE_DIMS", "7", "ROPE_DIMS=7 must be even"),
])
def test_bad_env_values_name_the_variable(tiny_env, monkeypatch, name, value, fragment):
    monkeypatch.setenv(name, value)
    with pytest.raises(tg.ConfigError) as err:
        tg.Hyperparameters()
    assert fragment in str(err.value)


def test_bad_env_value_is_a_one_line_error_at_start(tmp_path, sample_data):
    proc = run_training({**TINY_ENV, **sample_data, "NUM_HEADS": "3"}, tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: NUM_HEADS=3 must divide MODEL_DIM=64"
    assert not (tmp_path / "logs").exists()


def test_grad_accum_follows_world_size(tiny_env, monkeypatch):
    for ws, accum in ((1, 8), (2, 4), (8, 1), (16, 1)):
        monkeypatch.setenv("WORLD_SIZE", str(ws))
        monkeypatch.setenv("TRAIN_BATCH_TOKENS", str(128 * 32))
        assert tg.Hyperparameters().grad_accum_steps == accum
    monkeypatch.setenv("GRAD_ACCUM_STEPS", "2")
    assert tg.Hyperparameters().grad_accum_steps == 2


# ---------------------------------------------------------------------------------------------- shards

def test_shard_errors_name_the_file_and_problem(tmp_path):
    with pytest.raises(tg.ConfigError, match=r"DATA_PATH: no files match .*fineweb_train_\*\.bin"):
        tg.list_shards(str(tmp_path / "fineweb_train_*.bin"))
    cases = {
        "magic.bin": (dict(magic=123), r"magic\.bin: bad magic 123 \(expected 20240520\)"),
        "version.bin": (dict(version=7), r"version\.bin: unsupported version 7 \(expected 1\)"),
        "size.bin": (dict(count=11), r"size\.bin: size mismatch: header says 11 tokens \(1046 bytes\) but the "
                                     r"file has 1044 bytes"),
    }
    for fname, (kwargs, pattern) in cases.items():
        write_shard(tmp_path / fname, [1] * 10, **kwargs)
        with pytest.raises(tg.ConfigError, match=pattern):
            tg.load_shard(tmp_path / fname)
    (tmp_path / "short.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(tg.ConfigError, match=r"short\.bin: file is 100 bytes, shorter than the 1024-byte header"):
        tg.read_shard_header(tmp_path / "short.bin")


def test_missing_train_shards_say_how_to_get_data(tmp_path):
    with pytest.raises(tg.ConfigError) as err:
        tg.list_shards(str(tmp_path / "fineweb_train_*.bin"))
    msg = str(err.value)
    assert "\n" not in msg
    commands = {"python3 data/build_sample_data.py": "data/build_sample_data.py",
                "bash scripts/run/sample_run.sh": "scripts/run/sample_run.sh",
                "python3 data/cached_challenge_fineweb.py --variant sp1024": "data/cached_challenge_fineweb.py"}
    for command, script in commands.items():
        assert command in msg, msg
        assert (REPO / script).is_file(), script  # the hint names scripts that exist


def test_bad_shard_stops_the_run_with_one_line(tmp_path, sample_data):
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "fineweb_train_000000.bin", list(range(5000)), version=2)
    (data / "fineweb_val_000000.bin").write_bytes(b"\x00" * 10)
    proc = run_training({**TINY_ENV, "DATA_PATH": str(data), "TOKENIZER_PATH": sample_data["TOKENIZER_PATH"]},
                        tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "fineweb_val_000000.bin: file is 10 bytes" in lines[0]


# ---------------------------------------------------------------------------------------------- loader

def record_batches(stream: np.ndarray, world_size: int, rank: int, local: int, seq_len: int, steps: int):
    """SPEC 2 written out independently: micro-step k takes (local+1)*world_size consecutive tokens."""
    span = local + 1
    out, pos, n = [], 0, len(stream)
    for _ in range(steps):
        idx = (pos + np.arange(span * world_size)) % n
        chunk = stream[idx]
        pos = (pos + span * world_size) % n
        mine = chunk[rank * span:(rank + 1) * span].astype(np.int64)
        out.append((mine[:-1].reshape(-1, seq_len), mine[1:].reshape(-1, seq_len)))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_distributed_loader_matches_spec_slicing(tmp_path, world_size):
    rng = np.random.default_rng(0)
    sizes = [3001, 1234, 2222]  # odd sizes: spans straddle shard ends, and the stream wraps
    shards = [rng.integers(0, 1024, s) for s in sizes]
    for i, toks in enumerate(shards):
        write_shard(tmp_path / f"fineweb_train_{i:06d}.bin", toks)
    stream = np.concatenate(shards)
    files = tg.list_shards(str(tmp_path / "fineweb_train_*.bin"))
    seq_len, local = 16, 64
    steps = 2 * len(stream) // ((local + 1) * world_size) + 3  # wraps around at least once
    seen = []
    for rank in range(world_size):
        loader = tg.DistributedTokenLoader(files, rank, world_size, torch.device("cpu"), local, seq_len)
        expected = record_batches(stream, world_size, rank, local, seq_len, steps)
        for k, (ex, ey) in enumerate(expected):
            x, y = loader.next_batch()
            assert x.dtype == torch.int64 and x.shape == (local // seq_len, seq_len)
            assert np.array_equal(x.numpy(), ex) and np.array_equal(y.numpy(), ey), (rank, k)
            if k == 0:
                seen.append(set(range(rank * (local + 1), (rank + 1) * (local + 1))))
    # Ranks read disjoint spans of the stream in the same micro-step.
    assert all(a.isdisjoint(b) for i, a in enumerate(seen) for b in seen[i + 1:])


# ---------------------------------------------------------------------------------------------- Muon

@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (3, 32, 48), (2, 48, 32), (8, 8)])
def test_newton_schulz_is_nearly_orthogonal(shape):
    torch.manual_seed(0)
    g = torch.randn(*shape)
    out = tg.zeropower_via_newtonschulz5(g, steps=5)
    assert out.shape == g.shape and out.dtype == torch.bfloat16
    sv = torch.linalg.svdvals(out.float())
    # The quintic iteration is tuned for speed, not convergence: singular values land in ~[0.7, 1.2].
    assert sv.min() > 0.6 and sv.max() < 1.25, sv
    # And it is not trivially the identity map: the direction of g is preserved.
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    cos = (polar * out.float()).sum() / (polar.norm() * out.float().norm())
    assert cos > 0.98


def reference_ns_float64(g: np.ndarray, steps: int) -> np.ndarray:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.copy()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if transposed else x


def test_muon_step_matches_float64_reference():
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(3, 24, 16) * 0.1)  # tall matrices: scale sqrt(24/16)
    p0 = p.detach().double().clone()
    lr, mom, wd = 0.05, 0.9, 0.04
    opt = tg.Muon([p], lr=lr, momentum=mom, backend_steps=5, weight_decay=wd)
    grads = [torch.randn(3, 24, 16) for _ in range(2)]
    buf = np.zeros((3, 24, 16))
    expected = p0.numpy()
    for g in grads:
        p.grad = g.clone()
        opt.step()
        g64 = g.to(torch.bfloat16).double().numpy()  # Muon works on the bf16 gradient
        buf = mom * buf + g64
        update = g64 + mom * buf
        ortho = np.stack([reference_ns_float64(update[i], 5) for i in range(3)])
        expected = expected * (1 - lr * wd) - lr * math.sqrt(24 / 16) * ortho
    got = p.detach().double().numpy()
    step_size = lr * math.sqrt(24 / 16)
    # bf16 Newton-Schulz vs float64: agree to a few percent of one update's magnitude.
    assert np.abs(got - expected).max() < 0.05 * step_size * np.abs(ortho).max() * 2
    # Without decay the parameter would differ by lr*wd*|p|: the check above resolves weight decay.
    assert np.abs(p0.numpy() * lr * wd).max() > 0
    assert opt.state[p]["momentum_buffer"].dtype == torch.bfloat16


def test_muon_update_scale_and_decay_are_per_shape():
    """Wide matrices use scale 1; weight decay multiplies by (1 - lr*wd) before the update."""
    p = torch.nn.Parameter(torch.ones(1, 8, 16))
    opt = tg.Muon([p], lr=0.1, momentum=0.0, backend_steps=5, weight_decay=0.5)
    p.grad = torch.zeros(1, 8, 16)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((1, 8, 16), 0.95))  # zero update, pure decay


# ---------------------------------------------------------------------------------------------- warmup

def test_warmup_restores_weights_optimizer_state_and_data_position(tiny_env, monkeypatch):
    monkeypatch.setenv("WARMUP_STEPS", "2")
    h = tg.Hyperparameters()
    rt = cpu_runtime(h)
    model = rt.prepare_model(tg.build_model(h))  # fp32 compute, as a run without autocast
    trainer = tg.Trainer(rt, model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loader = tg.warmup_and_restore(rt, trainer)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    for opt in trainer.optimizers:
        assert opt.state_dict()["state"] == {}

    # A training step after the restore equals the first step of an untouched model, optimiser and loader.
    trainer.step(loader, 1.0, tg.muon_momentum_at(h, 0))
    model2 = rt.prepare_model(tg.build_model(h))
    fresh = tg.make_train_loader(rt)
    tg.Trainer(rt, model2).step(fresh, 1.0, tg.muon_momentum_at(h, 0))
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    assert not torch.equal(model.state_dict()["qo_bank"], before["qo_bank"])  # the step did something
    for _ in range(3):  # and both loaders continue in lockstep
        (x, y), (fx, fy) = loader.next_batch(), fresh.next_batch()
        assert torch.equal(x, fx) and torch.equal(y, fy)


def test_lr_schedule_by_steps_and_by_time(tiny_env, monkeypatch):
    monkeypatch.setenv("ITERATIONS", "100")
    monkeypatch.setenv("WARMDOWN_ITERS", "20")
    h = tg.Hyperparameters()
    assert tg.lr_multiplier(h, 50, 0.0) == 1.0
    assert tg.lr_multiplier(h, 90, 0.0) == pytest.approx(0.5)
    monkeypatch.setenv("MAX_WALLCLOCK_SECONDS", "10")
    h = tg.Hyperparameters()
    # 100 ms/step -> warmdown spans 2000 ms; 1000 ms remain -> 0.5.
    assert tg.lr_multiplier(h, 90, 9000.0) == pytest.approx(0.5)
    assert tg.lr_multiplier(h, 10, 1000.0) == 1.0
    assert tg.muon_momentum_at(h, 0) == pytest.approx(0.92)
    assert tg.muon_momentum_at(h, 750) == pytest.approx(0.955)
    assert tg.muon_momentum_at(h, 5000) == pytest.approx(0.99)


# ---------------------------------------------------------------------------------------------- end to end

STEP_TRAIN = re.compile(r"^step:(\d+)/(\d+) train_loss:\d+\.\d{4} train_time:\d+ms step_avg:\d+\.\d{2}ms", re.M)
STEP_VAL = re.compile(r"^step:(\d+)/(\d+) val_loss:\d+\.\d{4} val_bpb:\d+\.\d{4} train_time:\d+ms "
                      r"step_avg:\d+\.\d{2}ms", re.M)


def test_tiny_cpu_run_writes_the_log(tmp_path, sample_data):
    env = {**TINY_ENV, **sample_data, "RUN_ID": "tiny", "ITERATIONS": "6", "VAL_LOSS_EVERY": "3",
           "TTT_ENABLED": "0", "EVAL_STRIDE": "0"}
    proc = run_training(env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(tmp_path, "tiny")
    assert log.startswith(SCRIPT.read_text(encoding="utf-8"))  # the log opens with the exact source
    tail = log[len(SCRIPT.read_text(encoding="utf-8")):]
    assert "Running PyTorch " + torch.__version__ in tail
    assert [int(m.group(1)) for m in STEP_TRAIN.finditer(tail)] == [1, 2, 3, 4, 5, 6]
    assert [int(m.group(1)) for m in STEP_VAL.finditer(tail)] == [0, 3, 6]
    assert "\nwarmup_step:1/1\n" in tail
    assert re.search(r"^DIAGNOSTIC post_ema val_loss:\d+\.\d{4} val_bpb:\d+\.\d{4} eval_time:\d+ms$", tail, re.M)
    assert re.search(r"^final_int6_roundtrip_exact val_loss:\d+\.\d{8} val_bpb:\d+\.\d{8}$", tail, re.M)
    losses = [float(x) for x in re.findall(r"^step:\d+/6 train_loss:(\d+\.\d+)", tail, re.M)]
    assert losses[-1] < losses[0]  # it learns


def test_runs_in_one_folder_keep_their_own_outputs(tmp_path, sample_data):
    """Issue 47: two runs of other RUN_IDs in one folder each keep what they wrote in runs/RUN_ID/, byte for byte; a
    third under a finished RUN_ID is refused at start in one line (exit 2), touching neither run's files; with
    OVERWRITE_RUN=1 it runs, removing that name's old outputs first (a log line each)."""
    (tmp_path / "data").mkdir()
    env = {**TINY_ENV, **short_val_data(sample_data, tmp_path / "data", 2 * 128 + 1), "ITERATIONS": "1",
           "WARMDOWN_ITERS": "1", "TTT_ENABLED": "0", "EVAL_STRIDE": "0"}
    names = ("final_model.pt", "final_model.int6.ptz")

    def outputs(run_id):  # what the run wrote: its raw weights, artifact and log
        return [run_file(tmp_path, run_id, name).read_bytes() for name in names] + [read_log(tmp_path, run_id)]

    wrote = {}
    for run_id, seed in (("a", "1"), ("b", "2")):
        proc = run_training({**env, "RUN_ID": run_id, "SEED": seed}, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        wrote[run_id] = outputs(run_id)
    assert wrote["a"][1] != wrote["b"][1] and outputs("a") == wrote["a"]
    proc = run_training({**env, "RUN_ID": "a", "SEED": "3"}, tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: RUN_ID=a is a finished run (runs/a/final_model.int6.ptz exists): choose a new RUN_ID, or set "
        "OVERWRITE_RUN=1 to replace its outputs"), proc.stderr[-3000:]
    assert {r: outputs(r) for r in wrote} == wrote
    proc = run_training({**env, "RUN_ID": "a", "SEED": "3", "OVERWRITE_RUN": "1"}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(tmp_path, "a")
    for name in names:
        assert f"\nremoved runs/a/{name} of the earlier run (OVERWRITE_RUN=1)\n" in log
    assert log.index("removed runs/a/") < log.index("\nval_tokens:")  # before any work
    assert outputs("a")[1] != wrote["a"][1] and outputs("b") == wrote["b"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["a", "b"]


def test_two_process_gloo_equals_one_process(tmp_path, tiny_env, monkeypatch):
    """Parallel Muon's sharded path + all-reduced replicated grads reach the single-process weights."""
    extra = {"ITERATIONS": "3", "WARMUP_STEPS": "0", "GRAD_CLIP_NORM": "0", "EMA_ENABLED": "0",
             "TTT_ENABLED": "0", "EVAL_STRIDE": "0", "NUM_LAYERS": "3", "VE_LAYERS": "1,2"}
    for k, v in extra.items():
        monkeypatch.setenv(k, v)
    init = tg.build_model(tg.Hyperparameters()).state_dict()  # both runs start here (SEED=1337)
    results, val_losses = {}, {}
    for nproc in (0, 2):
        cwd = tmp_path / f"n{nproc}"
        cwd.mkdir()
        proc = run_training({**tiny_env, **extra, "RUN_ID": f"n{nproc}"}, cwd, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"world_size:{max(nproc, 1)} grad_accum_steps:{8 // max(nproc, 1)}" in read_log(cwd, f"n{nproc}")
        results[nproc] = torch.load(run_file(cwd, f"n{nproc}", "final_model.pt"))
        val_losses[nproc] = float(re.search(r"^step:3/3 val_loss:(\S+)", read_log(cwd, f"n{nproc}"), re.M).group(1))
    diff2 = moved2 = 0.0
    for name, a in results[0].items():
        a, b, a0 = a.float(), results[2][name].float(), init[name].float()
        diff, moved = (a - b).norm().item(), (a - a0).norm().item()
        diff2, moved2 = diff2 + diff ** 2, moved2 + moved ** 2
        if name in tg.BANK_NAMES:
            # Newton-Schulz expands the gradient's tiny singular directions, where bf16 rounding of the
            # averaged gradient decides the direction; the bulk of the update must still agree.
            assert diff <= 0.25 * moved, (name, diff, moved)
    # Overall the two runs agree far more closely than how far the 3 steps moved the weights
    # (a rank's gradient dropped or mis-sharded would put this near 1).
    assert math.sqrt(diff2) <= 0.1 * math.sqrt(moved2), (math.sqrt(diff2), math.sqrt(moved2))
    assert (results[0]["qo_bank"] - init["qo_bank"]).abs().max() > 1e-3
    assert abs(val_losses[0] - val_losses[2]) < 0.01, val_losses


def test_ttt_freeze_blocks_keeps_their_weights_and_bank_rows(tiny_env, monkeypatch):
    monkeypatch.setenv("TTT_FREEZE_BLOCKS", "1")
    monkeypatch.setenv("TTT_CHUNK_TOKENS", "1024")
    h = tg.Hyperparameters()
    rt = cpu_runtime(h)
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    val = tg.load_validation_tokens(h.val_files, h.eval_seq_len, h.vocab_size)[:3 * 1024 + 1]
    model = rt.prepare_model(tg.build_model(h))
    with torch.no_grad():  # non-zero output/down banks so every row gets a gradient
        model.qo_bank.add_(torch.randn_like(model.qo_bank) * 0.02)
        model.mlp_down_bank.add_(torch.randn_like(model.mlp_down_bank) * 0.02)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tg.eval_ttt(rt, model, model.forward_logits, model, val, luts)
    after = model.state_dict()
    n = h.num_layers
    for bank, rows in tg.frozen_bank_rows(h).items():
        assert rows == ([0, n] if bank in ("qo_bank", "kv_bank") else [0])
        assert torch.equal(after[bank][rows], before[bank][rows]), bank
        others = [i for i in range(after[bank].shape[0]) if i not in rows]
        assert not torch.equal(after[bank][others], before[bank][others]), bank
    for k in before:
        if k.startswith("blocks.0."):
            assert torch.equal(after[k], before[k]), k
    assert not torch.equal(after["blocks.1.attn_scale"], before["blocks.1.attn_scale"])
    assert all(p.requires_grad for p in model.parameters())  # restored for whoever uses the model next


PARALLEL_MUON_SCRIPT = r'''
import sys, torch, torch.distributed as dist
sys.path.insert(0, {repo!r})
import train_gpt as tg

shapes = [(5, 8, 6), (3, 4, 12), (7, 16, 16)]  # row counts not divisible by 2: padded shards


def grads_for(rank, step):
    g = torch.Generator().manual_seed(100 + 10 * step + rank)
    # Small integers / 16: every value and every two-rank average is exact in bf16.
    return [torch.randint(-8, 9, s, generator=g).float() / 16 for s in shapes]


def run_muon(rank_or_avg, momentum, steps=3):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    opt = tg.Muon(params, lr=0.05, momentum=momentum, backend_steps=5, weight_decay=0.04)
    for step in range(steps):
        if rank_or_avg == "avg":
            grads = [(a + b) / 2 for a, b in zip(grads_for(0, step), grads_for(1, step))]
        else:
            grads = grads_for(rank_or_avg, step)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params], opt


# Single process, before the process group exists, on the average of both ranks' gradients.
expected = {m: run_muon("avg", m)[0] for m in (0.0, 0.9)}

dist.init_process_group("gloo")
rank = dist.get_rank()
# Momentum 0: every elementwise op is exact, so the sharded result must be bit-identical.
got, _ = run_muon(rank, 0.0)
for e, g in zip(expected[0.0], got):
    assert torch.equal(e, g), (e - g).abs().max()
# Momentum 0.9: CPU bf16 kernels round a tensor's vector tail differently, so shards differ from the
# whole bank by an ulp before Newton-Schulz; the updates must still agree closely.
got, opt = run_muon(rank, 0.9)
for e, g, p0 in zip(expected[0.9], got, run_muon("avg", 0.9, steps=0)[0]):
    assert (e - g).norm() <= 0.1 * (e - p0).norm(), ((e - g).norm(), (e - p0).norm())
# Each rank keeps only its shard of the momentum (ceil(rows / 2) matrices, bf16).
for p, s in zip(opt.param_groups[0]["params"], shapes):
    buf = opt.state[p]["momentum_buffer"]
    assert buf.shape == ((s[0] + 1) // 2, *s[1:]) and buf.dtype == torch.bfloat16
print("parallel-muon-ok", rank)
tg.leave(0)
'''


def test_parallel_muon_equals_single_process_muon(tmp_path):
    """Sharded path (reduce-scatter, Newton-Schulz on the local shard, all-gather, apply one bank behind)
    gives exactly the single-process update of the averaged gradient, including padded shards."""
    script = tmp_path / "pm.py"
    script.write_text(PARALLEL_MUON_SCRIPT.replace("{repo!r}", repr(str(REPO))))
    proc = launcher.run_ranks([script], {**clean_environ(), "OMP_NUM_THREADS": "1"}, tmp_path, 2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("parallel-muon-ok") == 2
