"""The 2026-04-27 model (issue 18; SPEC-FRONTIER 5, 8, 9, 18): RoPE train length, SmearGate v2 with the BOS mask,
attention gates, two-lane parallel residuals, the record's training semantics; and, with the same weights, our
logits against the records' own code (../shared/anchors/frontier, imported, never copied)."""
from __future__ import annotations

import importlib.util
import lzma
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import launcher
import train_gpt as tg
from conftest import config_error

ANCHORS = Path(__file__).resolve().parents[2] / "shared" / "anchors"
FRONTIER = ANCHORS / "frontier"


# ---------------------------------------------------------------------------------------------- the records' code

def _import_module(name, path, environ):
    """Import `path` as module `name` with `environ` set while its module-level code (Hyperparameters) runs."""
    saved = dict(os.environ)
    os.environ.update(environ)
    sys.path.insert(0, str(ANCHORS))  # flash_attn_interface: the exact CPU stand-in for FlashAttention 3
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ANCHORS))
        os.environ.clear()
        os.environ.update(saved)
    return module


def _needs_frontier():
    if not FRONTIER.is_dir():
        pytest.skip(f"{FRONTIER} (the records' own scripts) is not here")


@pytest.fixture(scope="module")
def record_0409(tmp_path_factory):
    """The 04-09 record's script: a base85 + raw-LZMA2 wrapper, decoded here (and its two Python 3.12 f-strings
    requoted on older Pythons)."""
    _needs_frontier()
    packed = (FRONTIER / "record_0409" / "train_gpt.py").read_text(encoding="utf-8")
    blob = re.search(r'b85decode\("(.*?)"\)', packed, re.S).group(1)
    source = lzma.decompress(__import__("base64").b85decode(blob), format=lzma.FORMAT_RAW,
                             filters=[{"id": lzma.FILTER_LZMA2}]).decode("utf-8")
    if sys.version_info < (3, 12):
        for new, old in (("', '.join", '", ".join'), ("glob('fineweb_train_*.bin')", 'glob("fineweb_train_*.bin")')):
            assert old in source
            source = source.replace(old, new)
    path = tmp_path_factory.mktemp("record_0409") / "record_0409_train_gpt.py"
    path.write_text(source, encoding="utf-8")
    return _import_module("record_0409_train_gpt", path, {})


def logged(record):
    """The record's logged hyperparameters (FRONTIER/record_hparams.txt), name -> text."""
    out = {}
    for line in (FRONTIER / f"{record}_hparams.txt").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            key, sep, value = line.partition(": ")
            assert sep, line
            out[key] = value
    return out


def import_record(name):
    """A record's script as shipped (FRONTIER/name/train_gpt.py), imported with its logged hyperparameters
    (FRONTIER/name_hparams.txt) in the environment."""
    _needs_frontier()
    pytest.importorskip("triton")
    env = {key.upper(): {"True": "1", "False": "0"}.get(value, value) for key, value in logged(name).items()}
    module = _import_module(f"{name}_train_gpt", FRONTIER / name / "train_gpt.py", env)
    module.BOS_ID = 1  # set by its loader, which a test does not run
    return module


@pytest.fixture(scope="module")
def record_0427():
    """The 04-27 record's script as shipped, imported with its logged hyperparameters in the environment."""
    return import_record("record_0427")


def _randomise(model, seed=0):
    """Every parameter random (the zero-initialised projections would hide most of the forward)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.02 if p.ndim >= 2 and "gate" not in name else 0.3
            p.copy_((torch.randn(p.shape, generator=g) * scale + (1.0 if p.ndim < 2 or "skip" in name else 0.0))
                    .to(p.dtype))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def as_ran(record_model, cast=lambda f: f.to(torch.bfloat16)):
    """A record's model with every RoPE `inv_freq` buffer as `GPT(h).bfloat16()` left it in the run (bf16), the
    rest in fp32 for an exact comparison. `cast` replaces the bf16 cast (e.g. bf16-rounded values kept in fp32)."""
    for module in record_model.modules():
        if "inv_freq" in module._buffers:
            module.inv_freq = cast(module.inv_freq)
    return record_model


# ---------------------------------------------------------------------------------------------- RoPE train length

@pytest.mark.parametrize("preset, train_len", [("record_0323", 1024), ("record_0409", 2048)])
@pytest.mark.parametrize("seq_len", [1024, 2048, 3072])
def test_rotary_tables_equal_the_formula_with_the_presets_train_length(preset, train_len, seq_len):
    h = tg.Hyperparameters({"PRESET": preset})
    assert h.rope_train_seq_len == train_len
    model = tg.GPT(tg.Hyperparameters({"PRESET": preset, "MODEL_DIM": "64", "NUM_HEADS": "2", "NUM_KV_HEADS": "1"}))
    rd, base = 16, 10000.0
    if seq_len > train_len:  # NTK: base * (T / T_train) ** (rd / (rd - 2))
        base = base * (seq_len / train_len) ** (rd / (rd - 2))
    freqs = torch.arange(seq_len, dtype=torch.float64)[:, None] / base ** (torch.arange(0, rd, 2) / rd)[None, :]
    cos, sin = tg.rotary_tables(seq_len, model.rope_dims, model.rope_base, "cpu", model.rope_train_len)
    assert torch.allclose(cos[0, :, 0].double(), freqs.cos(), atol=2e-4)
    assert torch.allclose(sin[0, :, 0].double(), freqs.sin(), atol=2e-4)


def _record_rotary(module, rope_dims, train_len):
    """The record's own Rotary module (04-27 on: yarn off; 04-09: no yarn argument)."""
    try:
        return module.Rotary(32, base=10000.0, train_seq_len=train_len, rope_dims=rope_dims, yarn=False)
    except TypeError:
        return module.Rotary(32, base=10000.0, train_seq_len=train_len, rope_dims=rope_dims)


@pytest.mark.parametrize("name", ["record_0427", "record_0430", "record_0501"])
def test_rope_frequencies_bf16_give_each_records_rotary_tables_as_it_ran(request, name):
    """ROPE_FREQS_BF16=1 (rope_frequencies_bf16): #1855, #2014 and #2135 read their bf16 inv_freq buffer back with
    .float(); their own Rotary with the buffer as .bfloat16() leaves it gives our tables bit for bit, and its fp32
    buffer gives our ROPE_FREQS_BF16=0 tables (so the test can fail)."""
    record = request.getfixturevalue(name) if name == "record_0427" else import_record(name)
    for T in (64, 2048):
        ours_on = tg.rotary_tables(T, 16, 10000.0, "cpu", 2048, freqs_bf16=True)
        ours_off = tg.rotary_tables(T, 16, 10000.0, "cpu", 2048)
        fp32 = _record_rotary(record, 16, 2048)(T, torch.device("cpu"), torch.float32)
        bf16 = as_ran(_record_rotary(record, 16, 2048))(T, torch.device("cpu"), torch.float32)
        for ours, theirs in ((ours_on, bf16), (ours_off, fp32)):
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), (name, T)
        assert not torch.equal(ours_on[0], ours_off[0])


def test_rope_frequencies_bf16_leave_ntk_stretched_tables_in_fp32_and_are_on_in_the_record_presets():
    """Beyond ROPE_TRAIN_SEQ_LEN the records build fresh fp32 frequencies (the 03-23 record always does): the
    setting changes nothing there. Off by default (03-23), on in record_0409 and every preset built on it."""
    stretched = tg.rotary_tables(3072, 16, 10000.0, "cpu", 1024, freqs_bf16=True)
    assert all(torch.equal(a, b) for a, b in zip(stretched, tg.rotary_tables(3072, 16, 10000.0, "cpu", 1024)))
    assert not tg.Hyperparameters({}).rope_freqs_bf16
    for preset in tg.PRESETS:
        assert tg.Hyperparameters({"PRESET": preset}).rope_freqs_bf16 == (preset != "record_0323"), preset
    assert not tg.Hyperparameters({"PRESET": "record_0427", "ROPE_FREQS_BF16": "0"}).rope_freqs_bf16


def test_rope_train_seq_len_is_validated():
    assert "ROPE_TRAIN_SEQ_LEN=0 must be > 0" in config_error({"ROPE_TRAIN_SEQ_LEN": "0"})


# ---------------------------------------------------------------------------------------------- PRESET=record_0409

SMALL_0409 = {"NUM_LAYERS": "5", "MODEL_DIM": "64", "NUM_HEADS": "2", "NUM_KV_HEADS": "1", "VOCAB_SIZE": "256",
              "LOOP_START": "1", "LOOP_END": "2", "XSA_LAST_N": "5", "PARALLEL_RESIDUAL_START": "3"}


def _record_h(module, ours):
    """The record's Hyperparameters with our model's shape settings."""
    rh = module.Hyperparameters()
    for name in ("num_layers", "model_dim", "num_heads", "num_kv_heads", "vocab_size", "mlp_mult", "loop_start",
                 "loop_end", "num_loops", "xsa_last_n", "qk_gain_init", "rope_dims", "rope_base", "train_seq_len",
                 "logit_softcap", "tied_embed_init_std"):
        setattr(rh, name, getattr(ours, name))
    rh.embedding_dim = ours.model_dim
    return rh


@pytest.mark.parametrize("looping", [False, True])
def test_record_0409_preset_logits_equal_the_records_code_at_sequence_2048(record_0409, looping):
    """Same weights, fp32, one 2048-token row: the 04-09 record's RoPE has no NTK stretch at 2048. Its frequencies
    as its compiled run used them (docs/frontier.md): the bf16 buffer's values, positions and angles in fp32 (its
    eager code would also round the positions and angles to bf16, which Inductor's Triton kernel does not)."""
    h = tg.Hyperparameters({"PRESET": "record_0409", **SMALL_0409})
    assert h.rope_freqs_bf16
    rh = _record_h(record_0409, h)
    rh.parallel_residual_start, rh.skip_gates_enabled = h.parallel_residual_start, h.skip_gates
    ours, theirs = tg.GPT(h), record_0409.GPT(rh)
    _randomise(ours)
    theirs.load_state_dict(tg.unbank_state_dict(ours.state_dict(), h.num_layers), strict=True)
    as_ran(theirs, lambda f: f.to(torch.bfloat16).float())
    ours.looping = theirs.looping_active = looping
    ids = torch.randint(0, h.vocab_size, (1, 2048), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs.forward_logits(ids)
        got = ours.forward_logits(ids)
        assert _rel(got, want) < 1e-6
        ours.rope_freqs_bf16 = False  # fp32 frequencies: a visible difference, so the test can fail
        assert _rel(ours.forward_logits(ids), want) > 1e-4
        if not looping:  # the old hard-coded length
            ours.rope_freqs_bf16, ours.rope_train_len = True, 1024
            assert _rel(ours.forward_logits(ids), want) > 1e-4


# ---------------------------------------------------------------------------------------------- SmearGate v2

def test_smear_gate_v2_equals_its_formula_and_is_the_identity_at_init():
    smear = tg.SmearGateBOS(4, bos_id=1)
    e, ids = torch.randn(2, 6, 8), torch.tensor([[1, 5, 6, 1, 7, 8], [9, 1, 2, 3, 1, 1]])
    assert torch.equal(smear(e, ids), e)  # w = 0, lam = 0
    with torch.no_grad():
        smear.gate.copy_(torch.randn(1, 4))
        smear.lam.fill_(0.7)
    want = e.clone()
    for b in range(2):
        for t in range(1, 6):
            g = torch.sigmoid((smear.gate[0] * e[b, t, :4]).sum())
            want[b, t] = e[b, t] + 0.7 * g * e[b, t - 1] * float(ids[b, t] != 1)
    assert torch.allclose(smear(e, ids), want, atol=1e-6)
    assert not torch.allclose(want[:, 1:], e[:, 1:])


def _first_block_input(model, ids, path):
    """The input of block 0's query projection (position-wise: it depends on x0 at each position alone), captured
    through the GPTQ recorder hook that `linear` calls, on the training/TTT path (model(ids, targets)) or the
    evaluation/calibration path (forward_logits)."""
    seen = []

    class Capture:
        def add(self, x, w):
            if not seen:
                seen.append(x.detach().clone())

    tg._RECORDER[0] = Capture()
    try:
        with torch.no_grad():
            model(ids, ids) if path == "train" else model.forward_logits(ids)
    finally:
        tg._RECORDER[0] = None
    return seen[0]


@pytest.mark.parametrize("path", ["train", "eval"])
def test_a_bos_position_receives_nothing_from_the_previous_document_on_every_path(path):
    h = tg.Hyperparameters({"SMEAR_GATE": "2", "MODEL_DIM": "64", "NUM_HEADS": "2", "NUM_KV_HEADS": "1",
                            "VOCAB_SIZE": "64", "BIGRAM_VOCAB_SIZE": "0", "VE_ENABLED": "0", "NUM_LAYERS": "2",
                            "XSA_LAST_N": "0"})
    model = tg.GPT(h)
    _randomise(model)
    assert model.smear is None and model.smear_bos.lam.abs().item() > 0
    ids = torch.tensor([[1, 5, 6, 7, 1, 9, 10, 11]])  # two documents; the second starts at position 4
    other = ids.clone()
    other[0, 3] = 40  # the previous document's last token
    base, changed = _first_block_input(model, ids, path), _first_block_input(model, other, path)
    assert torch.equal(base[0, 4], changed[0, 4])  # BOS: unchanged
    assert not torch.allclose(base[0, 3], changed[0, 3])
    nobos, nobos_changed = ids.clone(), other.clone()
    nobos[0, 4] = nobos_changed[0, 4] = 2  # not a BOS: the smear carries the change
    assert not torch.allclose(_first_block_input(model, nobos, path)[0, 4],
                              _first_block_input(model, nobos_changed, path)[0, 4])


# ---------------------------------------------------------------------------------------------- attention gates

def _gate_attention(kind, std="0", scale="1.0"):
    h = tg.Hyperparameters({"ATTN_GATE": kind, "ATTN_GATE_INIT_STD": std, "ATTN_GATE_SCALE": scale,
                            "MODEL_DIM": "64", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "GATE_WINDOW": "12"})
    return h, tg.CausalSelfAttention(h, use_xsa=True)


@pytest.mark.parametrize("kind, at_init", [("sparse", 0.5), ("output", 1.0), ("dense", 0.5)])
def test_attention_gates_equal_their_formulas_and_their_init_mix(kind, at_init):
    h, attn = _gate_attention(kind, scale="0.5")
    torch.manual_seed(0)
    d, kv = 64, 32
    x = torch.randn(2, 8, d)
    eye = torch.eye(d)  # out-projection = identity: the output is y itself, per head
    w = (torch.randn(d, d) / 8, torch.randn(kv, d) / 8, torch.randn(kv, d) / 8, eye)
    rope = tg.rotary_tables(8, h.rope_dims, h.rope_base, "cpu")
    gate = attn.attn_gate
    ungated = tg.CausalSelfAttention(tg.Hyperparameters({k: v for k, v in h._environ.items() if k != "ATTN_GATE"}),
                                     use_xsa=True)
    ungated.q_gain = attn.q_gain
    y = ungated(x, w, None, rope).view(2, 8, 4, 16)
    assert torch.allclose(attn(x, w, None, rope).view(2, 8, 4, 16), at_init * y, atol=1e-6)
    assert gate.weight.shape == (4, 64 if kind == "dense" else 12) and not gate.weight.any()
    with torch.no_grad():
        gate.weight.copy_(torch.randn_like(gate.weight))
    z = x[..., :gate.weight.size(1)] @ gate.weight.T
    g = {"sparse": torch.sigmoid(0.5 * z), "output": 2 * torch.sigmoid(z), "dense": torch.sigmoid(z)}[kind]
    assert torch.allclose(attn(x, w, None, rope).view(2, 8, 4, 16), y * g[..., None], atol=1e-5)


def test_attention_gate_init_std_draws_normal_weights():
    _, attn = _gate_attention("dense", std="0.005")
    assert 0.004 < attn.attn_gate.weight.std().item() < 0.006


# ---------------------------------------------------------------------------------------------- two lanes

def test_two_lane_block_equals_the_spec_update_equations():
    h = tg.Hyperparameters({"MODEL_DIM": "64", "NUM_HEADS": "4", "NUM_KV_HEADS": "2"})
    torch.manual_seed(0)
    blk, lanes = tg.Block(h, 3), tg.TwoLaneResidual(5)
    with torch.no_grad():
        for p in (*blk.parameters(), *lanes.parameters()):
            p.copy_(torch.randn_like(p) * 0.5 + 1)
    d, kv, hid = 64, 32, h.mlp_hidden
    w = (torch.randn(d, d) / 8, torch.randn(kv, d) / 8, torch.randn(kv, d) / 8, torch.randn(d, d) / 8,
         torch.randn(hid, d) / 8, torch.randn(d, hid) / 16)
    a, m, x0 = torch.randn(2, 8, d), torch.randn(2, 8, d), torch.randn(2, 8, d)
    rope = tg.rotary_tables(8, h.rope_dims, h.rope_base, "cpu")
    c = 1 / math.sqrt(4)
    A = blk.attn_scale * blk.attn(tg.rms_norm(blk.resid_mix[0] * a + blk.resid_mix[1] * x0) * c, w[:4], None, rope)
    M = blk.mlp_scale * (torch.nn.functional.leaky_relu(tg.rms_norm(m) * c @ w[4].T, 0.5).square() @ w[5].T)
    pi, rho = lanes.post[3], lanes.resid[3]
    got_a, got_m = blk((a, m), x0, w, None, rope, lanes=lanes)
    assert torch.allclose(got_a, rho[0] * a + pi[0, 0] * A + pi[1, 0] * M, atol=1e-5)
    assert torch.allclose(got_m, rho[1] * m + pi[0, 1] * A + pi[1, 1] * M, atol=1e-5)


# The 04-27 record's model as our settings (SPEC-FRONTIER 18), on top of PRESET=record_0409.
NEWEST = {"PRESET": "record_0409", "QK_GAIN_INIT": "5.0", "SMEAR_GATE": "2", "ATTN_GATE": "sparse",
          "ATTN_GATE_SCALE": "0.5", "PARALLEL_MODE": "lanes", "PARALLEL_RESIDUAL_START": "8"}
NARROW = {"MODEL_DIM": "64", "NUM_HEADS": "2", "NUM_KV_HEADS": "1", "VOCAB_SIZE": "512"}


@pytest.mark.parametrize("looping, start, lane_steps", [
    (False, 8, [8, 9, 10]), (True, 8, [8, 9, 10]),
    (True, 4, [5, 3, 4, 5, 6, 7, 8, 9, 10]),  # from the first decoder step with physical >= 4, every later step
])
def test_lanes_start_at_the_first_decoder_step_at_or_past_the_start_layer(monkeypatch, looping, start, lane_steps):
    model = tg.GPT(tg.Hyperparameters({**NEWEST, **NARROW, "PARALLEL_RESIDUAL_START": str(start)}))
    model.looping = looping
    ran, forward = [], tg.TwoLaneResidual.forward

    def spy(self, i, *args):
        ran.append(i)
        return forward(self, i, *args)

    monkeypatch.setattr(tg.TwoLaneResidual, "forward", spy)
    with torch.no_grad():
        model.forward_logits(torch.randint(0, 512, (1, 16)))
    assert ran == lane_steps
    assert not any(b.parallel for b in model.blocks)


# ---------------------------------------------------------------------------------------------- the 04-27 model

def test_newest_switches_give_the_records_parameter_count_and_init(monkeypatch):
    h = tg.Hyperparameters(NEWEST)
    monkeypatch.setattr(tg.GPT, "_init_weights", lambda self, h: None)  # the banks' orthogonal init: slow, not checked
    model = tg.GPT(h)
    assert sum(p.numel() for p in model.parameters()) == 35_945_671  # SPEC-FRONTIER 18, the record's model_params
    assert (model.lanes.post == 1).all() and torch.allclose(model.lanes.resid, torch.tensor(1.1))
    assert not model.smear_bos.gate.any() and not model.smear_bos.lam.any() and model.smear is None
    for b in model.blocks:
        assert b.attn.attn_gate.kind == "sparse" and not b.attn.attn_gate.weight.any()
        assert b.attn.attn_gate.weight.shape == (8, 12) and b.attn.attn_gate.scale == 0.5
        assert (b.attn.q_gain == 5.0).all() and (b.resid_mix[0] == 1).all() and not b.resid_mix[1].any()
    assert (model.skip_weights == 1).all() and not model.skip_gates.any()
    assert model.bigram is None and model.ve_shared is None


def _to_record_names(state):
    """Our parameter names -> the 04-27 record's (its banks are laid out as ours)."""
    renames = {"lanes.post": "parallel_post_lambdas", "lanes.resid": "parallel_resid_lambdas",
               "smear_bos.gate": "smear_gate.weight", "smear_bos.lam": "smear_lambda"}
    return {renames.get(k, k.replace(".attn.attn_gate.weight", ".attn.attn_gate_w")): v for k, v in state.items()}


@pytest.mark.parametrize("looping", [False, True])
def test_newest_logits_equal_the_04_27_records_code(record_0427, looping):
    """Same weights, fp32: rows of one document each (BOS first), the record's packed varlen forward with
    cu_seqlens at the row boundaries against our dense causal forward of the rows."""
    h = tg.Hyperparameters({**NEWEST, **NARROW})
    rh = _record_h(record_0427, h)
    assert (rh.parallel_start_layer, rh.sparse_attn_gate_scale, rh.gate_window) == (8, 0.5, 12)
    ours, theirs = tg.GPT(h), as_ran(record_0427.GPT(rh))
    theirs.eval()
    _randomise(ours)
    theirs.load_state_dict(_to_record_names(ours.state_dict()), strict=True)
    ours.looping = theirs.looping_active = looping
    rows, T = 3, 96
    ids = torch.randint(2, h.vocab_size, (rows, T), generator=torch.Generator().manual_seed(2))
    ids[:, 0] = 1
    cu = torch.arange(0, rows * T + 1, T, dtype=torch.int32)
    with torch.no_grad():
        want = theirs.forward_logits(ids.reshape(1, -1), cu_seqlens=cu, max_seqlen=T).view(rows, T, -1)
        got = ours.forward_logits(ids)
    assert _rel(got, want) < 1e-6, _rel(got, want)
    with torch.no_grad():  # the test can fail: the record's code default gate scale 1.0 instead of its logged 0.5
        for b in ours.blocks:
            b.attn.attn_gate.scale = 1.0
        assert _rel(ours.forward_logits(ids), want) > 1e-4


@pytest.mark.parametrize("looping", [False, True])
def test_newest_logits_on_a_packed_row_equal_the_04_27_records_varlen_forward(record_0427, looping):
    """Same weights, fp32, one packed row of several documents (BOS at 0, 70, 150, 151 and 230; a one-token
    document among them): our forward with the row's DocBounds (issue 17's varlen path, cu_seqlens padded to a
    bucket) against the record's forward_logits with the unpadded cu_seqlens of the same documents. SmearGate v2
    and attention must both stop at every BOS for the two to agree."""
    h = tg.Hyperparameters({**NEWEST, **NARROW})
    ours, theirs = tg.GPT(h), as_ran(record_0427.GPT(_record_h(record_0427, h)))
    theirs.eval()
    _randomise(ours, seed=3)
    theirs.load_state_dict(_to_record_names(ours.state_dict()), strict=True)
    ours.looping = theirs.looping_active = looping
    T, starts = 288, [0, 70, 150, 151, 230]
    ids = torch.randint(2, h.vocab_size, (1, T), generator=torch.Generator().manual_seed(4))
    ids[0, starts] = 1
    ours_cu = torch.from_numpy(tg.packed_cu_seqlens(ids[0].numpy(), T))
    assert ours_cu.numel() % 64 == 0 and ours_cu[:6].tolist() == starts + [T]
    cu = torch.tensor(starts + [T], dtype=torch.int32)
    with torch.no_grad():
        want = theirs.forward_logits(ids, cu_seqlens=cu, max_seqlen=80)
        got = ours.forward_logits(ids, tg.DocBounds(ours_cu, T))
        dense = ours.forward_logits(ids)
    assert _rel(got, want) < 1e-6, _rel(got, want)
    assert _rel(dense, want) > 1e-4  # the test can fail: without the boundaries documents attend to each other


# ---------------------------------------------------------------------------------------------- training semantics

def _eager_ns(record):
    """The record's Newton-Schulz as written (it wraps it in torch.compile, whose fused kernels round otherwise)."""
    return record.zeropower_via_newtonschulz5._torchdynamo_orig_callable


@pytest.mark.parametrize("shape", [(24, 40), (48, 40)])
def test_newton_schulz_ca_first_is_the_04_09_records_function(record_0409, shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    theirs = _eager_ns(record_0409)(g, steps=5)
    ours = tg.zeropower_via_newtonschulz5(g[None], 5, ca_first=True)[0]
    assert torch.equal(ours, theirs)
    assert not torch.equal(tg.zeropower_via_newtonschulz5(g[None], 5)[0], theirs)  # c(AA): rounds differently


def _muon_steps(step_fn, p, grads):
    for g in grads:
        p.grad = g.clone()
        step_fn()
    return p.detach().clone()


@pytest.mark.parametrize("fp32_momentum_ca_first", [True, False])
def test_muon_with_fp32_momentum_and_ca_first_is_the_04_09_records_muon(record_0409, fp32_momentum_ca_first,
                                                                           monkeypatch):
    monkeypatch.setattr(record_0409, "zeropower_via_newtonschulz5", _eager_ns(record_0409))
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(32, 48, generator=gen) * 0.1
    grads = [torch.randn(32, 48, generator=gen) for _ in range(4)]
    theirs_p = torch.nn.Parameter(w0.clone())
    theirs = record_0409.Muon([theirs_p], lr=0.02, momentum=0.95, backend_steps=5, weight_decay=0.095,
                              row_normalize=True)
    ours_p = torch.nn.Parameter(w0[None].clone())
    ours = tg.Muon([ours_p], lr=0.02, momentum=0.95, backend_steps=5, weight_decay=0.095, row_normalize=True,
                   momentum_fp32=fp32_momentum_ca_first, ns_ca_first=fp32_momentum_ca_first)
    want = _muon_steps(theirs.step, theirs_p, grads)
    got = _muon_steps(ours.step, ours_p, [g[None] for g in grads])[0]
    assert torch.equal(got, want) == fp32_momentum_ca_first
    assert ours.state[ours_p]["momentum_buffer"].dtype == (torch.float32 if fp32_momentum_ca_first else torch.bfloat16)


def test_record_0409_preset_uses_the_records_muon_arithmetic_and_the_default_does_not():
    h, d = tg.Hyperparameters({"PRESET": "record_0409"}), tg.Hyperparameters({})
    assert (h.muon_momentum_fp32, h.muon_ns_ca_first) == (True, True)
    assert (d.muon_momentum_fp32, d.muon_ns_ca_first, d.grad_clip_scope) == (False, False, "local")
    assert "GRAD_CLIP_SCOPE='global' must be local or reduced" in config_error({"GRAD_CLIP_SCOPE": "global"})


class _Batches:
    def __init__(self, h):
        self.gen, self.h = torch.Generator().manual_seed(5), h

    def next_batch(self):
        x = torch.randint(0, self.h.vocab_size, (2, 32), generator=self.gen)
        return x, torch.roll(x, -1, 1)


def _trainer(env):
    from conftest import TINY_ENV
    h = tg.Hyperparameters({**TINY_ENV, "TRAIN_SEQ_LEN": "32", "TRAIN_BATCH_TOKENS": "512", "GRAD_ACCUM_STEPS": "1",
                            "GRAD_CLIP_NORM": "0.05", **env})
    rt = tg.Runtime(h, torch.device("cpu"), False, True, None, autocast_dtype=None)
    return h, tg.Trainer(rt, rt.prepare_model(tg.build_model(h)))


def test_tied_embedding_is_held_and_updated_in_bf16_with_an_fp32_ema():
    h, trainer = _trainer({})
    ema = tg.WeightAverager(h, trainer.model)
    before = trainer.model.tok_emb.weight.detach().clone()
    trainer.step(_Batches(h), 1.0, 0.95)
    ema.update(0, 1.0)
    w = trainer.model.tok_emb.weight
    assert w.dtype == torch.bfloat16 and not torch.equal(w, before)
    assert ema.ema["tok_emb.weight"].dtype == torch.float32


CLIP_SCRIPT = r"""
import sys
sys.path.insert(0, {repo!r})
import torch, torch.distributed as dist
import train_gpt as tg

BANKS, REPLICATED = [(3, 8, 6), (5, 4, 4)], [(6,), (2, 3)]


def grads(rank):
    g = torch.Generator().manual_seed(7 + rank)
    # integers / 8: every value and every two-rank mean is exact in bf16; norms far above the clip
    return [torch.randint(-64, 65, s, generator=g).float() / 8 for s in BANKS + REPLICATED]


def params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in BANKS + REPLICATED]


class Rt:
    distributed = True
    def all_reduce(self, t):
        dist.all_reduce(t)
        return t


mean = [(a + b) / 2 for a, b in zip(grads(0), grads(1))]
ref = params()
for p, g in zip(ref, mean):
    p.grad = g.clone()
torch.nn.utils.clip_grad_norm_(ref, 1.0)  # one process, the mean gradient

dist.init_process_group("gloo")
rank = dist.get_rank()
for scope in ("reduced", "local"):
    ps = params()
    for p, g in zip(ps, grads(rank)):
        p.grad = g.clone()
    if scope == "local":
        torch.nn.utils.clip_grad_norm_(ps, 1.0)
    muon = tg.Muon(ps[:2], lr=0.1, momentum=0.0, backend_steps=5, weight_decay=0.0)
    muon.launch_reduce_scatters()
    for p in ps[2:]:
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    if scope == "reduced":
        tg.clip_reduced_grads(Rt(), muon, ps[2:], 1.0)
    shards = muon.reduced_bank_grads()
    got = [s[:b[0] - rank * s.size(0)] for s, b in zip(shards, BANKS)]  # this rank's real rows
    want = [r.grad[rank * s.size(0):(rank + 1) * s.size(0)] for r, s in zip(ref[:2], shards)]
    same = all(torch.allclose(g.float(), w, rtol=1e-2, atol=1e-3) for g, w in zip(got, want))
    same = same and all(torch.allclose(p.grad, r.grad, rtol=1e-6) for p, r in zip(ps[2:], ref[2:]))
    print(f"clip-{{scope}}-equals-one-process:{{int(same)}} rank:{{rank}}", flush=True)
tg.leave(0)
"""


def test_reduced_clip_on_two_ranks_equals_one_process_with_the_mean_gradient(tmp_path):
    """GRAD_CLIP_SCOPE=reduced: after the reduce-scatters and all-reduces, 2 gloo ranks hold the clipped mean
    gradient of one process (bank shards in bf16); the local clip (the default, as the records) does not."""
    from conftest import REPO, clean_environ
    script = tmp_path / "clip.py"
    script.write_text(CLIP_SCRIPT.replace("{repo!r}", repr(str(REPO))).replace("{{", "{").replace("}}", "}"))
    proc = launcher.run_ranks([script], {**clean_environ(), "OMP_NUM_THREADS": "1"}, tmp_path, 2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"clip-reduced-equals-one-process:1 rank:{rank}" in proc.stdout, proc.stdout
        assert f"clip-local-equals-one-process:0 rank:{rank}" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------------------------- a tiny run

def test_tiny_two_rank_run_with_every_04_27_switch_trains_quantizes_evaluates_and_reloads(tmp_path, sample_data):
    """Every forward path with SmearGate v2, the sparse gate and the two lanes (training, GPTQ calibration, the
    artifact's evaluations, TTT), on 2 gloo ranks with the reduced clip; EVAL_ONLY reproduces the scores."""
    from conftest import TINY_ENV, read_log, run_file, run_training, short_val_data
    data = short_val_data(sample_data, tmp_path, 4 * 128 + 1)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**TINY_ENV, **data, **NEWEST, "RUN_ID": "n0427", "VOCAB_SIZE": "1024", "WARMDOWN_ITERS": "0",
           "NUM_LAYERS": "5", "LOOP_START": "1", "LOOP_END": "2", "XSA_LAST_N": "5", "PARALLEL_RESIDUAL_START": "3",
           "ITERATIONS": "4", "WARMUP_STEPS": "1", "GPTQ_CALIBRATION_BATCHES": "1", "VE_LAYERS": "3,4",
           "GRAD_CLIP_SCOPE": "reduced", "BETA2": "0.99", "MUON_MOMENTUM": "0.97"}
    proc = run_training(env, run_dir, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(run_dir, "n0427")
    for line in ("setting SMEAR_GATE=2 [env]", "setting ATTN_GATE=sparse [env]", "setting PARALLEL_MODE=lanes [env]",
                 "setting GRAD_CLIP_SCOPE=reduced [env]", "setting ROPE_TRAIN_SEQ_LEN=2048 [preset]"):
        assert f"\n{line}\n" in log, line
    exact = re.findall(r"^(final_int6_roundtrip|final_int6_sliding_window|legal_ttt)_exact (.*)$", log, re.M)
    assert [k for k, _ in exact] == ["final_int6_roundtrip", "final_int6_sliding_window", "legal_ttt"]
    again = run_training({**env, "RUN_ID": "n0427_eval", "EVAL_ONLY": str(run_file(run_dir, "n0427"))},
                         run_dir, nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.findall(r"^(final_int6_roundtrip|final_int6_sliding_window|legal_ttt)_exact (.*)$",
                      read_log(run_dir, "n0427_eval"), re.M) == exact
