"""Artifact and evaluation of train_gpt.py (SPEC 6 and 7): byte accounting for bits per byte, int6/int8
quantisation, bank (un)packing, the int6+lzma artifact, exact-once sliding windows, legal score-first TTT,
and the script's end-to-end byte accounting, EVAL_ONLY mode and 1-vs-2-process evaluation."""
from __future__ import annotations

import ast
import copy
import io
import json
import lzma
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from conftest import (REPO, SCRIPT, WORK_CLOCK_RUN, TINY_ENV, clean_environ, read_log, run_file, run_training,
                      short_val_data)

CPU = torch.device("cpu")
SPACE = "\u2581"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one intra-op thread per module


def cpu_runtime(h: tg.Hyperparameters) -> tg.Runtime:
    """A CPU runtime with the precision the script picks on this machine (bf16 autocast or fp32)."""
    return tg.Runtime(h, CPU, False, True, None, *tg.choose_precision(h, CPU))


def hparams(monkeypatch, **overrides) -> tg.Hyperparameters:
    """Hyperparameters from the tiny environment (already set by `tiny_env`) plus overrides."""
    for k, v in overrides.items():
        monkeypatch.setenv(k, str(v))
    return tg.Hyperparameters()


def cpu_model(h: tg.Hyperparameters) -> tg.GPT:
    """The initial model as a run on this machine prepares it (Runtime.prepare_model): where the run computes in fp32
    (no native bf16), its bf16 embedding tables give fp32 rows, so the whole model computes in fp32 as the run's
    does, not in bf16 without autocast (which no run does, and which CPUs without native bf16 emulate slowly)."""
    return cpu_runtime(h).prepare_model(tg.build_model(h))


def perturbed_model(h: tg.Hyperparameters, seed: int = 0, scale: float = 0.02,
                    bank_scale: float | None = None) -> tg.GPT:
    """The deterministic initial model (cpu_model) plus seeded Gaussian noise on every parameter (so the zero-init
    attention-output and MLP-down banks are not zero). `bank_scale` overrides the noise on the banks."""
    model = cpu_model(h)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            s = bank_scale if (bank_scale is not None and name in tg.BANK_NAMES) else scale
            p.add_((torch.randn(p.shape, generator=gen) * s).to(p.dtype))
    return model


def val_tokens_for(h: tg.Hyperparameters) -> torch.Tensor:
    return tg.load_validation_tokens(h.val_files, max(h.train_seq_len, h.eval_seq_len), h.vocab_size)


def sp_processor(path: str):
    import sentencepiece as spm
    return spm.SentencePieceProcessor(model_file=path)


def lut_bytes(luts: tg.ByteLuts, ids) -> float:
    """Bytes the LUTs give the targets ids[1:] with predecessors ids[:-1]."""
    t = torch.as_tensor(list(ids), dtype=torch.int64)
    return float(luts.count(t[:-1], t[1:]).sum())


# =====================================================================================================
# 1. Byte accounting (SPEC 7)
# =====================================================================================================

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,   several   inner spaces and trailing spaces   ",
    "line one\nline two\n\n\tan indented third line\r\n",
    "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001F600",
    "Digits 1234567890, punctuation (a, b); {c} [d] \u2014 \u00abquotes\u00bb and \ufb01 ligature \uff12",
    "x",
]


@pytest.fixture(scope="module")
def tokenizer(sample_data):
    sp = sp_processor(sample_data["TOKENIZER_PATH"])
    luts = tg.build_byte_luts(sample_data["TOKENIZER_PATH"], int(sp.vocab_size()))
    return sp, luts


@pytest.mark.parametrize("text", TEXTS)
def test_bytes_of_a_document_equal_its_decoded_utf8_length(tokenizer, text):
    sp, luts = tokenizer
    ids = [sp.bos_id()] + sp.encode(text)
    assert len(ids) > 1
    assert lut_bytes(luts, ids) == len(sp.decode(ids[1:]).encode("utf-8"))


def test_non_ascii_text_uses_byte_fallback_pieces(tokenizer):
    sp, luts = tokenizer
    ids = sp.encode(TEXTS[3])
    byte_ids = [i for i in ids if sp.is_byte(i)]
    assert len(byte_ids) >= 10  # the accented letters, CJK and the emoji fall back to bytes
    for i in byte_ids:
        assert luts.base_bytes[i] == 1 and not luts.is_boundary[i] and not luts.has_leading_space[i]


def test_documents_after_mid_stream_control_tokens(tokenizer):
    """A stream of documents, each opened by BOS (and one closed by EOS): the bytes are the sum of the
    documents' own decoded lengths; control tokens count 0 bytes."""
    sp, luts = tokenizer
    bos, eos = sp.bos_id(), sp.eos_id()
    docs = [sp.encode(t) for t in TEXTS]
    stream = []
    for k, d in enumerate(docs):
        stream += [bos] + d
        if k == 2:
            stream.append(eos)
    expected = sum(len(sp.decode(d).encode("utf-8")) for d in docs)
    assert lut_bytes(luts, stream) == expected
    t = torch.tensor(stream, dtype=torch.int64)
    per = luts.count(t[:-1], t[1:])
    assert all(per[k - 1] == 0 for k in range(1, len(stream)) if stream[k] in (bos, eos))


def test_leading_space_rule_across_boundary_tokens(tokenizer):
    sp, luts = tokenizer
    n = int(sp.vocab_size())
    special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)]
    assert {sp.bos_id(), sp.eos_id(), sp.unk_id(), sp.pad_id()} <= set(special)
    assert bool(luts.is_boundary[special].all()) and int(luts.base_bytes[special].abs().sum()) == 0
    marked = sp.piece_to_id(SPACE + "the")
    assert sp.id_to_piece(marked) == SPACE + "the"
    plain = sp.encode("Hello")[0]
    assert not sp.id_to_piece(plain).startswith(SPACE) and not sp.is_byte(plain)
    byte = next(i for i in range(n) if sp.is_byte(i))
    bare_space = sp.piece_to_id(SPACE)
    assert sp.id_to_piece(bare_space) == SPACE

    def one(prev, tgt):
        return lut_bytes(luts, [prev, tgt])

    for b in special:  # after a boundary token the marker counts nothing
        assert one(b, marked) == 3
        assert one(b, bare_space) == 0
        assert one(marked, b) == 0  # a control target is 0 bytes
    for prev in (plain, marked, byte, bare_space):  # after any normal piece the marker is one space byte
        assert one(prev, marked) == 4
        assert one(prev, bare_space) == 1
        assert one(prev, byte) == 1
        assert one(prev, plain) == len(sp.id_to_piece(plain).encode("utf-8"))
    # Two documents concatenated: the first marked piece after each BOS counts 0 for its marker.
    stream = [sp.bos_id(), marked, marked, plain, sp.bos_id(), marked, plain]
    t = torch.tensor(stream)
    assert luts.count(t[:-1], t[1:]).tolist() == [3, 4, len(sp.id_to_piece(plain)), 0, 3,
                                                  len(sp.id_to_piece(plain))]
    assert lut_bytes(luts, [sp.bos_id(), marked, marked]) == len(sp.decode([marked, marked]).encode())


def test_bytes_of_the_sample_validation_stream(tokenizer, sample_data):
    """On the real sample val stream (documents opened by BOS), the byte count up to the last document
    boundary equals the summed UTF-8 lengths of the decoded documents."""
    sp, luts = tokenizer
    val = tg.load_validation_tokens(os.path.join(sample_data["DATA_PATH"], "fineweb_val_*.bin"), 128,
                                    int(sp.vocab_size())).long()
    bos_pos = torch.nonzero(val == sp.bos_id()).flatten().tolist()
    assert bos_pos[0] == 0 and len(bos_pos) > 20
    end = bos_pos[-1]
    total = float(luts.count(val[:end], val[1:end + 1]).sum())
    expected = sum(len(sp.decode(val[a + 1:b].tolist()).encode("utf-8")) for a, b in zip(bos_pos, bos_pos[1:]))
    assert total == expected


# =====================================================================================================
# 2. int6 / int8 quantisation and the tensor classification (SPEC 6)
# =====================================================================================================

INT6_QUANTILES = (0.999, 0.9995, 0.9999, 0.99999)


def int6_candidate_errors(w: torch.Tensor) -> tuple[np.ndarray, list[np.ndarray]]:
    """Independent recomputation (numpy, float64 errors) of the five clip candidates of SPEC 6."""
    w64 = w.double().numpy()
    a = np.abs(w.float().numpy())
    clips = [np.quantile(a, q, axis=1) for q in INT6_QUANTILES] + [a.max(axis=1)]
    errs, scales = [], []
    for c in clips:
        s = np.maximum(c.astype(np.float32) / np.float32(31.0), np.float32(1.0 / 31.0)).astype(np.float16)
        s64 = s.astype(np.float64)
        q = np.clip(np.round(w64 / s64[:, None]), -31, 31)
        errs.append(float(((w64 - q * s64[:, None]) ** 2).mean()))
        scales.append(s)
    return np.array(errs), scales


def int6_test_matrices() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    rows, cols = 32, 2048
    mats = {}
    # Heavy tails: clipping at a high quantile beats the row max.
    normal = torch.randn(rows, cols, generator=g)
    chi = torch.randn(rows, cols, 3, generator=g).pow(2).sum(-1) / 3
    mats["student_t3"] = normal / chi.sqrt()
    # Two big outliers per row.
    w = torch.randn(rows, cols, generator=g)
    w.scatter_(1, torch.randint(0, cols, (rows, 2), generator=g), 30.0)
    mats["big_outliers"] = w
    # Three mild outliers per row.
    w = torch.randn(rows, cols, generator=g)
    w.scatter_(1, torch.randint(0, cols, (rows, 3), generator=g), 8.0)
    mats["mild_outliers"] = w
    # Values on the exact int6 grid of the row max: the row max reconstructs with zero error.
    k = torch.randint(-25, 26, (rows, cols), generator=g).float()
    k[:, 7] = 31.0
    step = torch.tensor([0.05, 0.125, 0.25, 1.0], dtype=torch.float16).float().repeat(rows // 4)
    mats["on_grid"] = k * step[:, None]
    return mats


def test_int6_picks_the_lowest_error_clip_candidate():
    winners = set()
    for name, w in int6_test_matrices().items():
        q, s = tg.quantize_int6_rows(w)
        assert q.dtype == torch.int8 and q.shape == w.shape, name
        assert s.dtype == torch.float16 and s.shape == (w.shape[0],), name
        assert int(q.abs().max()) <= 31, name
        errs, scales = int6_candidate_errors(w)
        best = int(errs.argmin())
        ordered = np.sort(errs)
        assert ordered[1] > ordered[0] * 1.01 or ordered[0] == 0 < ordered[1], (name, errs)  # a clear winner
        winners.add(best)
        recon = q.double() * s.double()[:, None]
        err = float(((w.double() - recon) ** 2).mean())
        assert err == pytest.approx(errs[best], rel=1e-3, abs=1e-12), (name, err, errs)
        np.testing.assert_allclose(s.float().numpy(), scales[best].astype(np.float32), rtol=2e-3)
        # The stored values are the rounded, clamped quotients by the stored scale.
        expect_q = torch.clamp(torch.round(w.float() / s.float()[:, None]), -31, 31)
        assert torch.equal(q.float(), expect_q), name
    assert len(winners) >= 3, winners  # the matrices really discriminate between candidates


def test_int6_scale_floor_and_reconstruction_error():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 1024, generator=g) * 2.0
    q, s = tg.quantize_int6_rows(w)
    deq = q.float() * s.float()[:, None]
    assert float((w - deq).norm() / w.norm()) < 0.05
    inside = w.abs() <= 31 * s.float()[:, None]  # not clipped: off by at most half a step
    assert bool(((w - deq).abs() <= 0.5 * s.float()[:, None] * (1 + 1e-5))[inside].all())
    assert float(inside.float().mean()) > 0.99
    # Rows whose magnitude is tiny get the floor scale 1/31 (SPEC 6: "at least 1/31").
    tiny = torch.randn(8, 512, generator=g) * 1e-3
    q, s = tg.quantize_int6_rows(tiny)
    assert torch.equal(s, torch.full((8,), 1.0 / 31.0, dtype=torch.float16))
    assert int(q.abs().max()) == 0


def test_int8_rows_clip_scale_and_reconstruction():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(48, 1500, generator=g)
    w[:4, 3] = 50.0  # one outlier in each of the first rows
    w[5] *= 1e-4  # a row under the floor
    q, s = tg.quantize_int8_rows(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert s.dtype == torch.float16 and s.shape == (48,)
    assert int(q.abs().max()) <= 127
    clip = np.quantile(np.abs(w.numpy()), 0.9999984, axis=1).astype(np.float32)
    expect_s = np.maximum(clip / np.float32(127.0), np.float32(1.0 / 127.0)).astype(np.float16)
    np.testing.assert_allclose(s.float().numpy(), expect_s.astype(np.float32), rtol=2e-3)
    assert s[5] == torch.tensor(1.0 / 127.0, dtype=torch.float16)
    deq = q.float() * s.float()[:, None]
    inside = w.abs() <= torch.from_numpy(clip)[:, None]
    bound = 0.6 * s.float()[:, None].expand_as(w)
    assert bool(((w - deq).abs() <= bound)[inside].all())
    assert float((w - deq)[6:].norm() / w[6:].norm()) < 0.01  # rows without outlier or floor


def classify(meta: dict) -> dict[str, str]:
    return {k: (v if isinstance(v, str) else v["type"]) for k, v in meta.items()}


def test_quantize_state_dict_classification_tiny_model(tiny_env):
    h = tg.Hyperparameters()
    flat = tg.unbank_state_dict(perturbed_model(h).state_dict(), h.num_layers)
    w, meta = tg.quantize_state_dict(flat)
    kinds = classify(meta)
    assert set(kinds) == set(flat)
    # In the tiny model only the hashed-bigram and value-embedding tables exceed 65,536 elements; the
    # token embedding (1024 x 64) is exactly 65,536 and therefore fp16 passthrough.
    assert {k for k, v in kinds.items() if v != "passthrough"} == {"bigram.embed.weight", "ve_shared.embed.weight"}
    assert kinds["bigram.embed.weight"] == "int8" and kinds["ve_shared.embed.weight"] == "int8"
    for name, v in kinds.items():
        if v == "passthrough":
            assert w[name].dtype == torch.float16 and w[name].shape == flat[name].shape, name
        else:
            assert w[name + ".q"].dtype == torch.int8 and w[name + ".scale"].dtype == torch.float16


def test_quantize_state_dict_classification_full_size_names():
    g = torch.Generator().manual_seed(3)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.5

    flat = {
        "blocks.0.attn.c_q.weight": r(512, 512), "blocks.0.attn.proj.weight": r(512, 512),
        "blocks.0.attn.c_k.weight": r(256, 512), "blocks.0.attn.c_v.weight": r(256, 512),
        "blocks.0.mlp.fc.weight": r(1536, 512), "blocks.0.mlp.proj.weight": r(512, 1536),
        "blocks.1.attn.c_q.weight": r(256, 256),  # exactly 65,536 elements: passthrough
        "blocks.1.attn.c_k.weight": r(257, 256),  # 65,792: int6
        "tok_emb.weight": r(1024, 512).bfloat16(), "bigram.embed.weight": r(1536, 128).bfloat16(),
        "ve_shared.embed.weight": r(1024, 128).bfloat16(), "lm_head.weight": r(1024, 512),
        "bigram.proj.weight": r(512, 128), "ve_shared.proj.weight": r(256, 128),
        "blocks.0.attn.q_gain": r(8), "blocks.0.attn_scale": r(512), "blocks.0.resid_mix": r(2, 512),
        "skip_weights": r(5, 512), "bigram.scale": torch.tensor(0.05), "step_counter": torch.arange(5),
    }
    w, meta = tg.quantize_state_dict(flat)
    kinds = classify(meta)
    int6 = {"blocks.0.attn.c_q.weight", "blocks.0.attn.proj.weight", "blocks.0.attn.c_k.weight",
            "blocks.0.attn.c_v.weight", "blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight",
            "blocks.1.attn.c_k.weight"}
    int8 = {"tok_emb.weight", "bigram.embed.weight", "ve_shared.embed.weight", "lm_head.weight"}
    assert {k for k, v in kinds.items() if v == "int6"} == int6
    assert {k for k, v in kinds.items() if v == "int8"} == int8
    assert {k for k, v in kinds.items() if v == "passthrough"} == set(flat) - int6 - int8
    assert torch.equal(w["step_counter"], flat["step_counter"])  # non-float: stored as it is
    assert w["blocks.1.attn.c_q.weight"].dtype == torch.float16
    for name in int6:
        assert int(w[name + ".q"].abs().max()) <= 31 and w[name + ".scale"].shape == (flat[name].shape[0],)
    for name in int8:
        assert int(w[name + ".q"].abs().max()) > 31  # really the 8-bit range
    back = tg.dequantize_state_dict(w, meta, flat, "synthetic")
    for name, t in flat.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        if name in int6 or name in int8:
            expect = w[name + ".q"].float() * w[name + ".scale"].float()[:, None]
            assert torch.equal(back[name], expect.to(t.dtype)), name
            rel = float((back[name].float() - t.float()).norm() / t.float().norm())
            assert rel < (0.06 if name in int6 else 0.01), (name, rel)


# =====================================================================================================
# 3. Unbank / rebank (SPEC 6)
# =====================================================================================================

def test_unbank_names_and_rebank_round_trip(tiny_env):
    h = tg.Hyperparameters()
    n = h.num_layers
    sd = perturbed_model(h, seed=5).state_dict()
    flat = tg.unbank_state_dict(sd, n)
    per_layer = {}
    for i in range(n):
        per_layer.update({
            f"blocks.{i}.attn.c_q.weight": sd["qo_bank"][i], f"blocks.{i}.attn.proj.weight": sd["qo_bank"][n + i],
            f"blocks.{i}.attn.c_k.weight": sd["kv_bank"][i], f"blocks.{i}.attn.c_v.weight": sd["kv_bank"][n + i],
            f"blocks.{i}.mlp.fc.weight": sd["mlp_up_bank"][i], f"blocks.{i}.mlp.proj.weight": sd["mlp_down_bank"][i],
        })
    others = {k for k in sd if k not in tg.BANK_NAMES}
    assert set(flat) == others | set(per_layer)
    for k, v in per_layer.items():
        assert flat[k].ndim == 2 and torch.equal(flat[k], v), k
    for k in others:
        assert torch.equal(flat[k], sd[k]), k
    back = tg.rebank_state_dict(flat, n)
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


# =====================================================================================================
# 4. Artifact round trip (SPEC 6)
# =====================================================================================================

FRESH_PROCESS_EVAL = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import train_gpt as tg
h = tg.Hyperparameters()
rt = tg.Runtime(h, torch.device("cpu"), False, True, None, *tg.choose_precision(h, torch.device("cpu")))
model = rt.prepare_model(tg.load_artifact(sys.argv[2], h))  # as a run evaluates it on this machine
val = tg.load_validation_tokens(h.val_files, max(h.train_seq_len, h.eval_seq_len), h.vocab_size)
val = val[:int(sys.argv[3]) + 1]
luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
print(repr(tg.eval_val(rt, model, val, luts)))
"""


def test_artifact_round_trip_and_fresh_process_eval(tiny_env, monkeypatch, tmp_path):
    # Width 128 with MLP_MULT=5 makes the MLP matrices 640 x 128 = 81,920 elements: int6 in the artifact,
    # next to int8 embeddings and fp16 passthrough tensors.
    h = hparams(monkeypatch, MODEL_DIM=128, MLP_MULT=5)
    model = perturbed_model(h, seed=11, scale=0.02, bank_scale=0.6)
    path = tmp_path / "model.int6.ptz"
    size = tg.save_artifact(str(path), model, late_qat=False)
    assert size == path.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.int6.ptz"]  # no temporary left behind
    blob = path.read_bytes()
    payload = lzma.decompress(blob)
    assert lzma.compress(payload, preset=6) == blob  # lzma, preset 6
    obj = torch.load(io.BytesIO(payload), map_location="cpu")
    assert set(obj) == {"w", "m", "late_qat"} and obj["late_qat"] is False
    kinds = set(classify(obj["m"]).values())
    assert kinds == {"int6", "int8", "passthrough"}, kinds
    assert classify(obj["m"])["blocks.0.mlp.fc.weight"] == "int6"

    sd = model.state_dict()
    flat = tg.unbank_state_dict(sd, h.num_layers)
    w, meta = tg.quantize_state_dict(flat)
    expected = tg.rebank_state_dict(tg.dequantize_state_dict(w, meta, flat, "memory"), h.num_layers)
    loaded = tg.load_artifact(str(path), h)
    got = loaded.state_dict()
    assert set(got) == set(sd)
    for k in sd:
        assert got[k].dtype == sd[k].dtype, k
        assert torch.equal(got[k], expected[k]), k
    assert not torch.equal(got["mlp_down_bank"], sd["mlp_down_bank"])  # it really was quantised

    mem_model = cpu_model(h)
    mem_model.load_state_dict(expected, strict=True)
    num_targets = 2048
    val = val_tokens_for(h)[:num_targets + 1]
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    mem_loss, mem_bpb = tg.eval_val(cpu_runtime(h), mem_model, val, luts)
    assert math.isfinite(mem_loss) and math.isfinite(mem_bpb)

    env = {**clean_environ(), "OMP_NUM_THREADS": str(torch.get_num_threads())}  # tiny_env is in os.environ
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS_EVAL, str(REPO), str(path), str(num_targets)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh_loss, fresh_bpb = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert fresh_loss == pytest.approx(mem_loss, rel=1e-6, abs=0)
    assert fresh_bpb == pytest.approx(mem_bpb, rel=1e-6, abs=0)


# =====================================================================================================
# 5. Sliding windows (SPEC 7)
# =====================================================================================================

@pytest.mark.parametrize("num_targets,seq_len,stride", [
    (1000, 128, 64), (1024, 128, 64), (1025, 128, 64), (1000, 128, 128), (1024, 128, 128),
    (128, 128, 64), (129, 128, 64), (777, 100, 7), (300, 128, 1), (5000, 2048, 64), (4097, 2048, 2048),
])
def test_sliding_windows_score_every_target_once(num_targets, seq_len, stride):
    windows = tg.sliding_windows(num_targets, seq_len, stride)
    assert windows[0] == (0, 0)
    counts = np.zeros(num_targets, dtype=np.int64)
    for k, (start, first) in enumerate(windows):
        assert 0 <= start and start + seq_len <= num_targets, (k, start)  # a full-length window
        assert 0 <= first < seq_len
        counts[start + first:start + seq_len] += 1
        if k > 0:
            assert first >= seq_len - stride, (k, start, first)  # >= seq_len - stride tokens of context
            if k < len(windows) - 1:
                assert seq_len - first == stride  # a middle window scores exactly its last `stride` targets
            assert start > windows[k - 1][0]
    assert (counts == 1).all()
    assert len(windows) == 1 + math.ceil((num_targets - seq_len) / stride)  # no wasted window


def test_sliding_windows_need_one_full_window():
    with pytest.raises(tg.ConfigError, match="EVAL_SEQ_LEN"):
        tg.sliding_windows(100, 128, 64)


def test_eval_sliding_per_token_covers_the_val_set_exactly_once(tiny_env):
    h = tg.Hyperparameters()
    rt = cpu_runtime(h)
    model = perturbed_model(h, seed=2)
    val = val_tokens_for(h)
    n = val.numel() - 1
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    per_token = torch.full((val.numel(),), float("nan"), dtype=torch.float64)
    loss, bpb = tg.eval_sliding(rt, model, model.forward_logits, val, luts, per_token=per_token)
    assert math.isnan(per_token[0])
    assert int(torch.isfinite(per_token[1:]).sum()) == n
    assert float(per_token[1:].sum()) / n == pytest.approx(loss, rel=1e-12)
    nbytes = float(luts.count(val[:-1].long(), val[1:].long()).sum())
    assert bpb == pytest.approx(loss / math.log(2) * n / nbytes, rel=1e-12)
    # The scored-token count of the window sums is N: with all N slots filled, none was scored twice.
    windows = tg.sliding_windows(n, h.eval_seq_len, h.eval_stride)
    with torch.inference_mode():
        sums = tg.score_windows(rt, model.forward_logits, val, windows, luts, h.eval_batch_seqs)
    assert int(sums[1]) == n and float(sums[2]) == nbytes
    # Independent check of the position mapping: one window's nll straight from the logits.
    for start, first in (windows[0], windows[len(windows) // 2], windows[-1]):
        x = val[start:start + h.eval_seq_len].long()
        y = val[start + 1:start + h.eval_seq_len + 1].long()
        with torch.inference_mode(), rt.autocast():
            logits = model.forward_logits(x[None].expand(h.eval_batch_seqs, -1).contiguous())[0]
        nll = F.cross_entropy(logits.float(), y, reduction="none").double()
        got = per_token[start + first + 1:start + h.eval_seq_len + 1]
        torch.testing.assert_close(got, nll[first:], rtol=0, atol=1e-4)


# =====================================================================================================
# 6. Legal score-first TTT (SPEC 7)
# =====================================================================================================

TTT_CHUNK = 4096
TTT_CHUNKS = 4


@pytest.fixture(scope="module")
def ttt_setup(sample_data):
    """Tiny config with 4 TTT chunks of 4096 tokens; a perturbed model; the baseline TTT result."""
    with pytest.MonkeyPatch.context() as mp:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            mp.delenv(k, raising=False)
        for k, v in {**TINY_ENV, **sample_data, "TTT_CHUNK_TOKENS": str(TTT_CHUNK), "TTT_EPOCHS": "2"}.items():
            mp.setenv(k, v)
        h = tg.Hyperparameters()
        mp.setenv("TTT_EPOCHS", "0")
        h0 = tg.Hyperparameters()
    model = perturbed_model(h, seed=3)
    init = copy.deepcopy(model.state_dict())
    val = val_tokens_for(h)[:TTT_CHUNKS * TTT_CHUNK + 1].clone()
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    base = run_ttt(h, init, val, luts)
    return {"h": h, "h0": h0, "init": init, "val": val, "luts": luts, "base": base}


def run_ttt(h, init_state, val, luts):
    model = cpu_model(h)
    model.load_state_dict(init_state, strict=True)
    per_token = torch.full((val.numel(),), float("nan"), dtype=torch.float64)
    loss, bpb = tg.eval_ttt(cpu_runtime(h), model, model.forward_logits, model, val, luts, per_token=per_token)
    return {"loss": loss, "bpb": bpb, "per_token": per_token, "state": model.state_dict()}


def test_ttt_scores_every_target_once_and_adapts_the_weights(ttt_setup):
    base, init, val = ttt_setup["base"], ttt_setup["init"], ttt_setup["val"]
    n = val.numel() - 1
    pt = base["per_token"]
    assert math.isnan(pt[0]) and int(torch.isfinite(pt[1:]).sum()) == n
    assert float(pt[1:].sum()) / n == pytest.approx(base["loss"], rel=1e-12)
    changed = [k for k in init if not torch.equal(init[k], base["state"][k])]
    assert {"qo_bank", "kv_bank", "mlp_up_bank", "mlp_down_bank", "tok_emb.weight"} <= set(changed)


@pytest.mark.parametrize("where", ["after_chunk_1", "inside_chunk_1"])
def test_ttt_score_of_a_token_never_depends_on_later_tokens(ttt_setup, where):
    """Change the val stream from stream index j on and rerun TTT from the same weights: every target
    before j keeps its exact nll. j right after chunk 1 catches training on a later chunk before scoring
    an earlier one; j inside chunk 1 also catches training on a chunk before scoring it."""
    j = 2 * TTT_CHUNK + 1 if where == "after_chunk_1" else TTT_CHUNK + TTT_CHUNK // 2 + 1
    h, val, luts, base = ttt_setup["h"], ttt_setup["val"], ttt_setup["luts"], ttt_setup["base"]
    changed = val.clone()
    gen = torch.Generator().manual_seed(99)
    changed[j:] = torch.randint(4, h.vocab_size, (val.numel() - j,), generator=gen).to(val.dtype)
    assert (changed[j:] != val[j:]).float().mean() > 0.9
    other = run_ttt(h, ttt_setup["init"], changed, luts)
    a, b = base["per_token"], other["per_token"]
    torch.testing.assert_close(b[1:j], a[1:j], rtol=0, atol=1e-6)
    # Teeth: the tokens from j on were scored differently (the comparison above is not vacuous).
    assert int(torch.isfinite(b[1:]).sum()) == val.numel() - 1
    differs = (b[j:] - a[j:]).abs() > 1e-3
    assert float(differs.double().mean()) > 0.5


def test_ttt_with_zero_epochs_is_the_sliding_window_eval(ttt_setup):
    h0, val, luts = ttt_setup["h0"], ttt_setup["val"], ttt_setup["luts"]
    assert h0.ttt_epochs == 0
    ttt = run_ttt(h0, ttt_setup["init"], val, luts)
    model = cpu_model(h0)
    model.load_state_dict(ttt_setup["init"], strict=True)
    per_token = torch.full((val.numel(),), float("nan"), dtype=torch.float64)
    loss, bpb = tg.eval_sliding(cpu_runtime(h0), model, model.forward_logits, val, luts, per_token=per_token)
    assert ttt["loss"] == pytest.approx(loss, rel=1e-12, abs=0)
    assert ttt["bpb"] == pytest.approx(bpb, rel=1e-12, abs=0)
    assert f"{ttt['loss']:.8f} {ttt['bpb']:.8f}" == f"{loss:.8f} {bpb:.8f}"
    torch.testing.assert_close(ttt["per_token"], per_token, rtol=0, atol=1e-6, equal_nan=True)
    for k, v in ttt_setup["init"].items():
        assert torch.equal(ttt["state"][k], v), k
    # ...while TTT with epochs > 0 (the baseline) gives another result.
    assert ttt_setup["base"]["loss"] != loss


# =====================================================================================================
# 7-9. The script end to end: byte accounting, 1 vs 2 processes, EVAL_ONLY
# =====================================================================================================

SMALL_CHUNK = 2048
SMALL_VAL_TOKENS = 4 * SMALL_CHUNK + 1


def run_output(log: str) -> str:
    """The part of a run's log after the source text and version header."""
    m = re.search(r"^val_tokens:\d+$", log, re.M)
    assert m, "no val_tokens line in the log"
    return log[m.start():]


def _exact(log: str, label: str) -> tuple[float, float]:
    found = re.findall(rf"^{label}_exact val_loss:(\d+\.\d{{8}}) val_bpb:(\d+\.\d{{8}})$", log, re.M)
    assert len(found) == 1, (label, found)
    return float(found[0][0]), float(found[0][1])


def _exact_line(log: str, label: str) -> str:
    lines = [ln for ln in log.splitlines() if ln.startswith(f"{label}_exact ")]
    assert len(lines) == 1, (label, lines)
    return lines[0]


@pytest.fixture(scope="module")
def small_data(sample_data, tmp_path_factory) -> dict[str, str]:
    """DATA_PATH with the sample train shards and a val shard cut to 4 TTT chunks of 2048 (+1) tokens."""
    return short_val_data(sample_data, tmp_path_factory.mktemp("small_data"), SMALL_VAL_TOKENS)


@pytest.fixture(scope="module")
def run_env(small_data) -> dict[str, str]:
    # One OpenMP thread per process: see one_torch_thread.
    return {**TINY_ENV, **small_data, "TTT_ENABLED": "1", "TTT_CHUNK_TOKENS": str(SMALL_CHUNK),
            "EVAL_STRIDE": "64", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def trained_run(run_env, tmp_path_factory):
    """One full tiny CPU run (4 training steps, TTT on)."""
    cwd = tmp_path_factory.mktemp("trained")
    code_bytes = len(SCRIPT.read_bytes())
    proc = run_training({**run_env, "RUN_ID": "trained", "LATE_QAT_THRESHOLD": "0.6"}, cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"cwd": cwd, "log": read_log(cwd, "trained"), "code_bytes": code_bytes, "proc": proc}


def test_full_run_logs_results_and_byte_accounting(trained_run, run_env, monkeypatch):
    cwd, log = trained_run["cwd"], trained_run["log"]
    tail = run_output(log)
    assert tail.startswith(f"val_tokens:{SMALL_VAL_TOKENS - 1}\n")
    assert re.findall(r"^step:(\d+)/4 train_loss:\d+\.\d{4} train_time:\d+ms step_avg:\d+\.\d{2}ms\b",
                      tail, re.M) == ["1", "2", "3", "4"]
    for label in ("final_int6_roundtrip", "final_int6_sliding_window", "legal_ttt"):
        loss, bpb = _exact(tail, label)
        assert 0 < loss < 10 and 0 < bpb < 10
    assert re.search(r"^legal_ttt val_loss:\d+\.\d{4} val_bpb:\d+\.\d{4} eval_time:\d+ms$", tail, re.M)
    assert re.search(r"^final_int6_sliding_window val_loss:\d+\.\d{4} val_bpb:\d+\.\d{4} stride:64 "
                     r"eval_time:\d+ms$", tail, re.M)

    def one(pattern):
        found = re.findall(pattern, tail, re.M)
        assert len(found) == 1, (pattern, found)
        return int(found[0])

    raw = one(r"^Serialized model: (\d+) bytes$")
    model_bytes = one(r"^Serialized model int6\+lzma: (\d+) bytes$")
    code = one(r"^Code size: (\d+) bytes$")
    total = one(r"^Total submission size int6\+lzma: (\d+) bytes$")
    assert raw == run_file(cwd, "trained", "final_model.pt").stat().st_size
    assert model_bytes == run_file(cwd, "trained").stat().st_size
    assert code == trained_run["code_bytes"]
    assert total == model_bytes + code
    assert "OVER_LIMIT" not in tail
    # The logged round-trip result is that of the artifact on disk.
    for k, v in run_env.items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    h = tg.Hyperparameters()
    model = tg.load_artifact(str(run_file(cwd, "trained")), h)
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    rt = cpu_runtime(h)
    loss, bpb = tg.eval_val(rt, rt.prepare_model(model), val_tokens_for(h), luts)
    logged = _exact(tail, "final_int6_roundtrip")
    assert loss == pytest.approx(logged[0], abs=2e-8 + 1e-6 * loss)
    assert bpb == pytest.approx(logged[1], abs=2e-8 + 1e-6 * bpb)


def test_two_processes_evaluate_like_one(run_env, tmp_path):
    """Same weights (no training steps) in a 2-process gloo run and a 1-process run of the full script:
    the artifact is byte-identical and all three evaluations agree to float rounding."""
    env = {**run_env, "ITERATIONS": "0", "WARMUP_STEPS": "0"}
    logs = {}
    for nproc in (0, 2):
        cwd = tmp_path / f"n{nproc}"
        cwd.mkdir()
        proc = run_training({**env, "RUN_ID": f"n{nproc}"}, cwd, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        log = read_log(cwd, f"n{nproc}")
        assert re.search(rf"^device:cpu world_size:{max(nproc, 1)} ", log, re.M)
        logs[nproc] = run_output(log)
    assert run_file(tmp_path / "n0", "n0").read_bytes() == run_file(tmp_path / "n2", "n2").read_bytes()
    for label, rel in (("final_int6_roundtrip", 1e-6), ("final_int6_sliding_window", 1e-6), ("legal_ttt", 1e-5)):
        one, two = _exact(logs[0], label), _exact(logs[2], label)
        assert two[0] == pytest.approx(one[0], rel=rel, abs=2e-8), (label, one, two)
        assert two[1] == pytest.approx(one[1], rel=rel, abs=2e-8), (label, one, two)
    # TTT really trained in both (its result differs from the plain sliding-window one).
    assert _exact(logs[0], "legal_ttt") != _exact(logs[0], "final_int6_sliding_window")


# train_gpt.main() in a fresh interpreter, with the modules imported between the start of the evaluation's clock
# (reading the artifact) and its end written to argv[1] as JSON
CLOCK_IMPORTS = """
import json, sys
sys.path.insert(0, {repo!r})
import train_gpt as tg
seen, load, evaluate = {{}}, tg.load_artifact, tg.evaluate_artifact
def load_artifact(*a, **k):
    seen["before"] = set(sys.modules)
    return load(*a, **k)
def evaluate_artifact(*a, **k):
    evaluate(*a, **k)
    seen["imported"] = sorted(set(sys.modules) - seen["before"])
tg.load_artifact, tg.evaluate_artifact = load_artifact, evaluate_artifact
out, sys.argv[1:] = sys.argv[1], []
try:
    tg.main()
finally:
    open(out, "w").write(json.dumps(seen.get("imported")))
"""


def test_eval_only_reproduces_the_training_run(trained_run, run_env, tmp_path):
    """All three results, legal TTT included: the artifact records that late QAT was on at the end of
    training (trained_run switches it on at step 3), and EVAL_ONLY's TTT trains with it as the run did. Run in a
    fresh interpreter: nothing is imported inside the evaluation's clock (SGD TTT's first optimizer imported
    torch._dynamo there, 2.9 s of a 3.2 s evaluation; issue 51). On 1 rank its budget is none, and it says why."""
    assert "late_qat:enabled step:3" in trained_run["log"]
    artifact = run_file(trained_run["cwd"], "trained")
    env = {**clean_environ(), **run_env, "RUN_ID": "evalonly", "EVAL_ONLY": str(artifact), "ITERATIONS": "1000"}
    env.pop("EVAL_BUDGET_SECONDS", None)
    proc = subprocess.run([sys.executable, "-c", CLOCK_IMPORTS.format(repo=str(REPO)), str(tmp_path / "imports.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = json.loads((tmp_path / "imports.json").read_text())
    assert imported == [], (len(imported), imported[:20])
    log = read_log(tmp_path, "evalonly")
    assert "\neval_budget_seconds:0 (auto: EVAL_ONLY on WORLD_SIZE=1, not the track's 8: " in log
    tail = run_output(log)
    assert not re.search(r"^step:", tail, re.M) and "warmup_step" not in tail
    assert "Serialized model" not in tail and not (tmp_path / "runs").exists()  # EVAL_ONLY writes no run folder
    assert f"eval_only artifact:{artifact} bytes:{artifact.stat().st_size}" in tail
    assert "late_qat:1" in tail
    for label in ("final_int6_roundtrip", "final_int6_sliding_window", "legal_ttt"):
        assert _exact_line(tail, label) == _exact_line(trained_run["log"], label)


def test_late_qat_changes_what_ttt_learns(ttt_setup):
    """Why the artifact carries the late-QAT flag: TTT trains through the fake-quantised small projections
    when it is on, so its result differs from TTT without it (bigram and value-embedding paths made strong
    enough here that the int6 rounding of their projections shows in bf16)."""
    h, val, luts = ttt_setup["h"], ttt_setup["val"][:2 * TTT_CHUNK + 1], ttt_setup["luts"]
    init = {k: v.clone() for k, v in ttt_setup["init"].items()}
    init["bigram.scale"].fill_(1.0)
    init["ve_shared.scale"].fill_(1.0)
    results = []
    for qat in (False, True):
        model = cpu_model(h)
        model.load_state_dict(init, strict=True)
        model.set_qat(qat)
        results.append(tg.eval_ttt(cpu_runtime(h), model, model.forward_logits, model, val, luts))
    assert results[0] != results[1]


def _lzma_garbage(path: Path) -> None:
    path.write_bytes(lzma.compress(b"this is not a torch archive", preset=6))


EVAL_ONLY_BAD = [
    pytest.param("missing", lambda p: None, id="missing"),
    pytest.param("not_lzma", lambda p: p.write_text("plain text, not an artifact\n"), id="not_lzma"),
    pytest.param("empty", lambda p: p.write_bytes(b""), id="empty"),
    pytest.param("lzma_not_artifact", _lzma_garbage, id="lzma_not_artifact"),
    pytest.param("directory", lambda p: p.mkdir(), id="directory"),
]


@pytest.mark.parametrize("name,make", EVAL_ONLY_BAD)
def test_eval_only_bad_file_is_a_one_line_error(run_env, tmp_path, name, make):
    path = tmp_path / f"{name}.ptz"
    make(path)
    proc = run_training({**run_env, "RUN_ID": "bad", "EVAL_ONLY": str(path)}, tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert len(lines) == 1 and lines[0].startswith("error:") and str(path) in lines[0], lines


def test_eval_only_artifact_of_other_settings_is_a_one_line_error(trained_run, run_env, tmp_path):
    artifact = run_file(trained_run["cwd"], "trained")
    proc = run_training({**run_env, "RUN_ID": "bad", "EVAL_ONLY": str(artifact), "MLP_MULT": "2"}, tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert len(lines) == 1 and lines[0].startswith("error:") and str(artifact) in lines[0], lines


# =====================================================================================================
# 10. size_report
# =====================================================================================================

@pytest.mark.parametrize("model_bytes,code_bytes,over", [
    (15_887_928, 89_458, False), (15_910_542, 89_458, False), (15_910_543, 89_458, True),
    (16_000_000, 1, True), (0, 0, False), (20_000_000, 123_456, True),
])
def test_size_report(model_bytes, code_bytes, over):
    lines = tg.size_report(model_bytes, code_bytes)
    total = model_bytes + code_bytes
    assert f"Code size: {code_bytes} bytes" in lines
    assert f"Serialized model int6+lzma: {model_bytes} bytes" in lines
    assert f"Total submission size int6+lzma: {total} bytes" in lines
    flagged = [ln for ln in lines if "OVER_LIMIT" in ln]
    if over:
        assert len(flagged) == 1 and f"total_bytes:{total}" in flagged[0] and "cap:16000000" in flagged[0]
        assert f"over by {total - 16_000_000} bytes" in flagged[0]
    else:
        assert flagged == []
    assert len(lines) == 3 + int(over)


# ---------------------------------------------------------------------------------------------- the evaluation's budget

def _evaluation_time(log):
    loop, total = re.search(r"^evaluation_time: ttt_loop:(\d+\.\d)s total:(\d+\.\d)s$", log, re.M).groups()
    return float(loop), float(total)


def test_a_budget_below_the_whole_evaluation_stops_ttt_adapting_and_scores_every_target(trained_run, run_env,
                                                                                         tmp_path):
    """Issue 46, SGD TTT, EVAL_ONLY of the trained run's artifact with TTT at 8 epochs (training then costs about 4
    times TTT's scoring a chunk): unguarded (EVAL_BUDGET_SECONDS=0), then under 60% of that run's whole evaluation,
    which TTT's scoring and the rest fit in with room for about one training step. The guarded run ends inside the
    budget plus the margin, logs the plan and stop lines and budget_limited, and scores exactly the unguarded run's
    targets and bytes (a bpb / loss ratio is tokens / (bytes ln 2)) with another score; EVAL_TTT_STOP_AT at the
    logged step gives its score to the last digit, even under a tenth of that budget; what comes before TTT is the
    unguarded run's. Every run reads a clock that counts the work done (conftest.WORK_CLOCK_RUN), not the machine's
    time: the same stop on a fast, slow or busy machine."""
    artifact = next(trained_run["cwd"].rglob("final_model.int6.ptz"))
    clock = tmp_path / "work_clock_run.py"  # the clock reads the work done: the same decisions on any machine
    clock.write_text(WORK_CLOCK_RUN.format(repo=str(REPO), gflops=1.0))
    logs = {}
    for name in ("full", "guarded", "stop"):
        if name == "full":
            extra = {"EVAL_BUDGET_SECONDS": "0"}
        elif name == "guarded":
            budget = round(0.6 * _evaluation_time(run_output(logs["full"]))[1], 1)
            extra = {"EVAL_BUDGET_SECONDS": str(budget)}
        else:
            step = int(re.search(r"^eval_budget: TTT stops adapting before step (\d+) \(chunk \d+/4\) elapsed:\S+ "
                                 r"projected_end:\S+ with it", logs["guarded"], re.M).group(1))
            # under a tenth of the budget that stopped it: the setting alone decides, never the clock (issue 51)
            extra = {"EVAL_TTT_STOP_AT": str(step), "DIAGNOSTIC_ROUNDTRIP": "0", "EVAL_BUDGET_SECONDS": str(budget / 10)}
        (tmp_path / name).mkdir()
        proc = run_training({**run_env, **extra, "RUN_ID": name, "EVAL_ONLY": str(artifact), "TTT_EPOCHS": "8"},
                            tmp_path / name, script=clock)
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs[name] = read_log(tmp_path / name, name)
    base, guarded, stop = (run_output(logs[k]) for k in ("full", "guarded", "stop"))
    margin = max(0.02 * budget, 1.0)
    assert _evaluation_time(guarded)[1] <= budget + margin, (budget, guarded[-3000:])
    assert re.search(rf"^eval_budget: budget:{budget:g}s margin:{margin:.1f}s elapsed:\S+ scoring_alone:", guarded, re.M)
    assert re.search(rf"^legal_ttt val_loss:\S+ val_bpb:\S+ eval_time:\d+ms budget_limited:1 adapted_steps:{step}$",
                     guarded, re.M)
    assert re.search(rf"^legal_ttt val_loss:\S+ val_bpb:\S+ eval_time:\d+ms ttt_stop_at:{step}$", stop, re.M)
    assert _exact_line(guarded, "legal_ttt") == _exact_line(stop, "legal_ttt")
    (loss0, bpb0), (loss1, bpb1) = _exact(base, "legal_ttt"), _exact(guarded, "legal_ttt")
    assert bpb1 / loss1 == pytest.approx(bpb0 / loss0, rel=3e-8)  # the same targets and bytes
    assert (loss1, bpb1) != (loss0, bpb0)  # adaptation stopped before the last trained chunk
    for label in ("final_int6_roundtrip", "final_int6_sliding_window"):  # what comes before TTT is untouched
        assert _exact_line(guarded, label) == _exact_line(base, label)
    assert re.search(rf"^eval_budget_seconds:{budget / 10:g} eval_ttt_stop_at:{step} \(no clock decision", logs["stop"],
                     re.M)
    # DIAGNOSTIC_ROUNDTRIP=0: no round-trip lines, and the record tools do not ask for them; EVAL_ONLY: no post-EMA
    assert "\ndiagnostics: post_ema:0 roundtrip:0\n" in logs["stop"] and "final_int6_roundtrip" not in stop
    assert "\nscored_evaluations: final_int6_sliding_window stride:64, legal_ttt mode:sgd epochs:8\n" in logs["stop"]
    sys.path.insert(0, str(REPO / "scripts" / "record"))
    import recordlib
    missing = recordlib.missing_final_lines(recordlib.parse_log(tmp_path / "stop" / "logs" / "stop.txt"))
    assert not any(m.startswith("final_int6_roundtrip") for m in missing) and "legal_ttt" not in missing, missing
