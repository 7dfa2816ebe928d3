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


@pytest.fixture(scope="module")
def record_0409(tmp_path_factory):
    """The 04-09 record's script: a base85 + raw-LZMA2 wrapper, decoded here (and its two Python 3.12 f-strings
    requoted on older Pythons)."""
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


@pytest.fixture(scope="module")
def record_0427():
    """The 04-27 record's script as shipped, imported with its logged hyperparameters in the environment."""
    pytest.importorskip("triton")
    env = {}
    for line in (FRONTIER / "record_0427_hparams.txt").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition(": ")
            env[key.upper()] = {"True": "1", "False": "0"}.get(value, value)
    module = _import_module("record_0427_train_gpt", FRONTIER / "record_0427" / "train_gpt.py", env)
    module.BOS_ID = 1  # set by its loader, which a test does not run
    return module


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


def test_rope_train_seq_len_is_validated():
    assert "ROPE_TRAIN_SEQ_LEN=0 must be > 0" in config_error({"ROPE_TRAIN_SEQ_LEN": "0"})


# ---------------------------------------------------------------------------------------------- PRESET=record_0409

SMALL_0409 = {"NUM_LAYERS": "5", "MODEL_DIM": "128", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "VOCAB_SIZE": "512",
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
    """Same weights, fp32, one 2048-token row: the 04-09 record's RoPE has no NTK stretch at 2048."""
    h = tg.Hyperparameters({"PRESET": "record_0409", **SMALL_0409})
    rh = _record_h(record_0409, h)
    rh.parallel_residual_start, rh.skip_gates_enabled = h.parallel_residual_start, h.skip_gates
    ours, theirs = tg.GPT(h), record_0409.GPT(rh)
    _randomise(ours)
    theirs.load_state_dict(tg.unbank_state_dict(ours.state_dict(), h.num_layers), strict=True)
    ours.looping = theirs.looping_active = looping
    ids = torch.randint(0, h.vocab_size, (1, 2048), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs.forward_logits(ids)
        got = ours.forward_logits(ids)
        assert _rel(got, want) < 1e-6
        ours.rope_train_len = 1024  # the old hard-coded length: a visible difference, so the test can fail
        assert _rel(ours.forward_logits(ids), want) > 1e-4
