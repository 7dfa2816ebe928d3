"""Artifact options of train_gpt.py beyond the record (SPEC-FRONTIER 11-12): full-Hessian GPTQ and SDClip on
small matrices, quantize_state_dict's choices (EMBED_BITS, *_CLIP_SIGMAS, Hessians), the default artifact's
pinned bytes, byte shuffle + brotli, TARGET_BYTES pruning of +-1 codes, the Hessian recorder, and the script
end to end (QUANT=gptq with brotli, EVAL_ONLY, 1 vs 2 processes, validation)."""
from __future__ import annotations

import hashlib
import io
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from conftest import TINY_ENV, config_error, read_log, run_file, run_training, short_val_data

CPU = torch.device("cpu")
XZ_MAGIC = b"\xfd7zXZ\x00"
LZMA = tg.Hyperparameters({"COMPRESSOR": "lzma"})  # serialize() as a run with COMPRESSOR=lzma


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one intra-op thread per module


def hp(**env) -> tg.Hyperparameters:
    """Hyperparameters from the given variables only (os.environ is not read)."""
    return tg.Hyperparameters({k: str(v) for k, v in env.items()})


def perturbed_model(h: tg.Hyperparameters, seed: int = 0, scale: float = 0.02) -> tg.GPT:
    """The initial model plus seeded Gaussian noise on every parameter (zero-init banks become non-zero)."""
    model = tg.build_model(h)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)
    return model


def rtn(w: torch.Tensor, s: torch.Tensor, q_max: int) -> torch.Tensor:
    """Round to nearest with the given row scales."""
    return torch.clamp(torch.round(w.float() / s.float()[:, None]), -q_max, q_max).to(torch.int8)


def h_error(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, H: torch.Tensor) -> float:
    """tr((W - q s) H (W - q s)^T) in float64."""
    d = w.double() - q.double() * s.double()[:, None]
    return float(torch.trace(d @ H.double() @ d.T))


def correlated_hessian(cols: int, seed: int, n: int = 512) -> torch.Tensor:
    """X^T X of inputs mixed by a random matrix: strongly correlated columns, a wide spectrum."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cols, generator=g, dtype=torch.float64) @ torch.randn(cols, cols, generator=g,
                                                                           dtype=torch.float64)
    return x.T @ x


def integer_hessian(cols: int, seed: int) -> torch.Tensor:
    """An SPD X^T X with integer entries and distinct diagonal: every sum over it is exact in float64, so
    permuting its columns cannot change the damping by a rounding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (256, cols), generator=g) @ torch.randint(-1, 2, (cols, cols), generator=g)
    H = (x.T @ x).double()
    H.diagonal().add_(torch.randperm(cols, generator=g).double() * 7 + 1)
    assert H.diagonal().unique().numel() == cols
    return H


def reference_gptq(w: torch.Tensor, H: torch.Tensor, s: torch.Tensor, q_max: int) -> torch.Tensor:
    """Textbook GPTQ in float64, one column at a time with the full update (no blocks): 1% damping,
    descending-diag(H) order, U = upper Cholesky factor of H^-1."""
    W, H = w.double().clone(), H.double().clone()
    H.diagonal().add_(0.01 * H.diagonal().mean())
    perm = torch.argsort(H.diagonal(), descending=True, stable=True)
    W, H = W[:, perm], H[perm][:, perm]
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    s = s.double()
    Q = torch.zeros_like(W)
    for j in range(W.size(1)):
        Q[:, j] = torch.clamp(torch.round(W[:, j] / s), -q_max, q_max)
        e = (W[:, j] - Q[:, j] * s) / U[j, j]
        W[:, j:] -= e[:, None] * U[j, j:][None, :]
    return Q[:, torch.argsort(perm)].to(torch.int8)


# =====================================================================================================
# 1. GPTQ and SDClip on small matrices
# =====================================================================================================

@pytest.mark.parametrize("q_max", [31, 7])
def test_gptq_beats_round_to_nearest_on_the_hessian_weighted_error(q_max):
    """Same scales, correlated inputs: GPTQ's tr(E H E^T) is clearly below round-to-nearest's (about 0.45x
    measured), on 300 columns (three GPTQ blocks of 128)."""
    for seed in range(3):
        H = correlated_hessian(300, seed)
        w = torch.randn(64, 300, generator=torch.Generator().manual_seed(100 + seed))
        s = (w.abs().amax(dim=1) / q_max).to(torch.float16)
        q = tg.gptq_codes(w, H, s, q_max)
        assert q.dtype == torch.int8 and q.shape == w.shape
        gptq_err, rtn_err = h_error(w, q, s, H), h_error(w, rtn(w, s, q_max), s, H)
        assert gptq_err < 0.6 * rtn_err, (seed, gptq_err, rtn_err)


def test_gptq_blocks_match_a_column_by_column_reference():
    """The lazy block updates (128 columns) give what the unblocked float64 algorithm gives, up to rounding
    ties: a missing cross-block update would leave the later blocks far off."""
    H = correlated_hessian(300, 7)
    w = torch.randn(48, 300, generator=torch.Generator().manual_seed(8))
    s = (w.abs().amax(dim=1) / 31).to(torch.float16)
    q, ref = tg.gptq_codes(w, H, s, 31), reference_gptq(w, H, s, 31)
    assert float((q == ref).float().mean()) > 0.99
    assert h_error(w, q, s, H) == pytest.approx(h_error(w, ref, s, H), rel=0.01)


def test_quantize_rows_runs_each_clip_candidate_as_alone_and_keeps_the_lowest_mse():
    """quantize_rows stacks the candidates into one taller GPTQ pass: each candidate's codes must be what it
    gets alone (rows are independent), and the kept one has the lowest unweighted MSE."""
    H = correlated_hessian(300, 21)
    w = torch.randn(64, 300, generator=torch.Generator().manual_seed(21))
    w[:, 7] *= 6  # outliers: the clip candidates differ
    scales = list(tg.int6_candidate_scales(w))
    assert len({tuple(s.tolist()) for s in scales}) == 5
    alone = [tg.gptq_codes(w, H, s, 31) for s in scales]
    errs = [float((w - q.float() * s.float()[:, None]).pow(2).mean()) for q, s in zip(alone, scales)]
    best = int(np.argmin(errs))
    q, s = tg.quantize_rows(w, 31, scales, H)
    assert torch.equal(s, scales[best]) and torch.equal(q, alone[best])
    stacked = tg.gptq_codes(w.repeat(5, 1), H, torch.cat(scales), 31)
    assert torch.equal(stacked, torch.cat(alone))


@pytest.mark.parametrize("c", [1.0, 37.5])
def test_gptq_with_identity_hessian_is_round_to_nearest(c):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 200, generator=g)
    s = tg.sdclip_scales(w, 2.5, 31)  # 2.5 sigma: some values clamp at +-31
    q = tg.gptq_codes(w, c * torch.eye(200, dtype=torch.float64), s, 31)
    assert torch.equal(q, rtn(w, s, 31))
    assert int(q.abs().max()) == 31


def test_gptq_act_order_is_undone():
    """Diagonal H with distinct entries: no error flows between columns, so whatever order GPTQ visits the
    columns in, the codes are round-to-nearest's in the original column order."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 96, generator=g)
    H = torch.diag(torch.randperm(96, generator=g).double() + 1.0)
    s = (w.abs().amax(dim=1) / 31).to(torch.float16)
    assert torch.equal(tg.gptq_codes(w, H, s, 31), rtn(w, s, 31))


def test_gptq_commutes_with_a_column_permutation():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 160, generator=g)
    H = integer_hessian(160, 5)
    s = (w.abs().amax(dim=1) / 31).to(torch.float16)
    q = tg.gptq_codes(w, H, s, 31)
    assert not torch.equal(q, rtn(w, s, 31))  # the errors really flow between columns
    perm = torch.randperm(160, generator=g)
    qp = tg.gptq_codes(w[:, perm], H[perm][:, perm], s, 31)
    assert torch.equal(qp, q[:, perm])


def test_gptq_does_not_modify_its_inputs():
    H = correlated_hessian(96, 1)
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(1))
    H[5] = 0.0
    H[:, 5] = 0.0
    w0, H0 = w.clone(), H.clone()
    tg.gptq_codes(w, H, (w.abs().amax(dim=1) / 31).to(torch.float16), 31)
    assert torch.equal(w, w0) and torch.equal(H, H0)


def test_gptq_dead_columns_get_code_zero():
    g = torch.Generator().manual_seed(6)
    dead = [0, 41, 95]
    live = [j for j in range(96) if j not in dead]
    w = torch.randn(64, 96, generator=g)
    w[:, dead] = 5.0  # large: round to nearest would give +-31 there
    s = (w[:, live].abs().amax(dim=1) / 31).to(torch.float16)
    # Diagonal H: the live columns are exactly round-to-nearest's.
    diag = torch.randperm(96, generator=g).double() + 1.0
    diag[dead] = 0.0
    q = tg.gptq_codes(w, torch.diag(diag), s, 31)
    assert bool((q[:, dead] == 0).all())
    assert torch.equal(q[:, live], rtn(w, s, 31)[:, live])
    # Full H with zero rows and columns: no NaN reaches the live columns, and GPTQ still beats rounding.
    H = correlated_hessian(96, 6)
    H[dead] = 0.0
    H[:, dead] = 0.0
    q = tg.gptq_codes(w, H, s, 31)
    assert bool((q[:, dead] == 0).all())
    H_live, w_live = H[live][:, live], w[:, live]
    gptq_err, rtn_err = h_error(w_live, q[:, live], s, H_live), h_error(w_live, rtn(w_live, s, 31), s, H_live)
    assert gptq_err < 0.7 * rtn_err, (gptq_err, rtn_err)
    assert int((q[:, live] != 0).sum()) > 0.5 * q[:, live].numel()


@pytest.mark.parametrize("q_max", [31, 63, 127])
def test_gptq_codes_stay_within_q_max(q_max):
    g = torch.Generator().manual_seed(q_max)
    w = torch.randn(64, 96, generator=g)
    s = (w.abs().amax(dim=1) / (4 * q_max)).to(torch.float16)  # scales too small: most values clamp
    q = tg.gptq_codes(w, correlated_hessian(96, q_max), s, q_max)
    assert int(q.abs().max()) == q_max
    # Identity H: clamped codes keep the sign of the weight (no int8 wrap-around at q_max 127).
    q = tg.gptq_codes(w, torch.eye(96, dtype=torch.float64), s, q_max)
    big = w.abs() > (q_max + 1) * s.float()[:, None]
    assert bool(big.any())
    assert torch.equal(q[big], (torch.sign(w[big]) * q_max).to(torch.int8))


@pytest.mark.parametrize("k", [2.5, 12.85, 20.0])
@pytest.mark.parametrize("q_max", [31, 63, 127])
def test_sdclip_scales_are_k_sigma_over_q_max(k, q_max):
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(int(k * 100) + q_max)) * 0.05
    s = tg.sdclip_scales(w, k, q_max)
    assert s.dtype == torch.float16 and s.shape == (40,)
    expect = k * np.std(w.double().numpy(), axis=1, ddof=1) / q_max  # unbiased: sqrt(96/95) = 1.005 apart
    np.testing.assert_allclose(s.float().numpy(), expect, rtol=1.2e-3)


def test_sdclip_zero_row_gets_a_positive_scale_and_codes_zero():
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(9))
    w[3] = 0.0
    s = tg.sdclip_scales(w, 12.85, 31)
    assert bool(torch.isfinite(s.float()).all()) and float(s[3]) > 0
    for q in (rtn(w, s, 31), tg.gptq_codes(w, correlated_hessian(96, 9), s, 31)):
        assert bool((q[3] == 0).all())
        assert int((q[:3] != 0).sum()) > 0


# =====================================================================================================
# 2. quantize_state_dict
# =====================================================================================================

SMALL_MODEL = {"NUM_LAYERS": "2", "MODEL_DIM": "256", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "XSA_LAST_N": "1",
               "VE_LAYERS": "1"}


@pytest.fixture(scope="module")
def flat256() -> dict[str, torch.Tensor]:
    """Unbanked state dict of a perturbed width-256 model: mlp.fc/proj (196,608) int6, tok_emb,
    bigram.embed and ve_shared.embed int8, the rest (c_q 256 x 256 = 65,536 included) fp16."""
    h = hp(**SMALL_MODEL)
    return tg.unbank_state_dict(perturbed_model(h, seed=1, scale=0.03).state_dict(), h.num_layers)


def quantized_names(meta):
    return [k for k, m in meta.items() if not isinstance(m, str)]


def test_quantize_state_dict_defaults_are_the_records_quantisers(flat256):
    for h in (None, hp()):
        w, meta = tg.quantize_state_dict(flat256, h)
        kinds = {k: m["type"] for k, m in meta.items() if not isinstance(m, str)}
        assert kinds == {"blocks.0.mlp.fc.weight": "int6", "blocks.1.mlp.fc.weight": "int6",
                         "blocks.0.mlp.proj.weight": "int6", "blocks.1.mlp.proj.weight": "int6",
                         "tok_emb.weight": "int8", "bigram.embed.weight": "int8", "ve_shared.embed.weight": "int8"}
        for name, kind in kinds.items():
            q, s = (tg.quantize_int6_rows if kind == "int6" else tg.quantize_int8_rows)(flat256[name])
            assert torch.equal(w[name + ".q"], q) and torch.equal(w[name + ".scale"], s), name
        for name in set(flat256) - set(kinds):
            assert meta[name] == "passthrough"
            assert torch.equal(w[name], flat256[name].to(torch.float16)), name


EMBEDDINGS = ("tok_emb.weight", "bigram.embed.weight", "ve_shared.embed.weight")


def test_embed_bits_7_gives_int7_embeddings(flat256):
    # Embeddings scaled up so their clip is far above the 1/63 scale floor and codes reach the range's end.
    flat = {k: (v * 40 if k in EMBEDDINGS else v) for k, v in flat256.items()}
    w8, _ = tg.quantize_state_dict(flat, hp())
    w, meta = tg.quantize_state_dict(flat, hp(EMBED_BITS=7))
    for name in EMBEDDINGS:
        assert meta[name] == {"type": "int7"}
        q, s = w[name + ".q"], w[name + ".scale"]
        assert int(q.abs().max()) == 63 and int(w8[name + ".q"].abs().max()) == 127
        eq, es = tg.quantize_int8_rows(flat[name], 63)
        assert torch.equal(q, eq) and torch.equal(s, es), name
    for name in ("blocks.0.mlp.fc.weight", "blocks.1.mlp.proj.weight"):  # matrices: unchanged int6
        assert meta[name] == {"type": "int6"} and torch.equal(w[name + ".q"], w8[name + ".q"])


def test_clip_sigmas_select_sdclip_scales(flat256):
    w, meta = tg.quantize_state_dict(flat256, hp(MATRIX_CLIP_SIGMAS=12.85, EMBED_CLIP_SIGMAS=20, EMBED_BITS=7))
    for name in quantized_names(meta):
        t = flat256[name].float()
        k, q_max = (12.85, 31) if ".mlp." in name else (20.0, 63)
        s = tg.sdclip_scales(t, k, q_max)
        assert torch.equal(w[name + ".scale"], s), name
        assert torch.equal(w[name + ".q"], rtn(t, s, q_max)), name
    default, _ = tg.quantize_state_dict(flat256, hp())
    assert not torch.equal(w["blocks.0.mlp.fc.weight.scale"], default["blocks.0.mlp.fc.weight.scale"])


def test_hessians_give_gptq_codes(flat256):
    fc, emb = "blocks.0.mlp.fc.weight", "tok_emb.weight"
    hessians = {fc: correlated_hessian(256, 11), emb: correlated_hessian(256, 12),
                "blocks.0.attn.c_q.weight": correlated_hessian(256, 13)}  # small: stays fp16
    w, meta = tg.quantize_state_dict(flat256, hp(), hessians)
    base, _ = tg.quantize_state_dict(flat256, hp())
    t = flat256[fc].float()
    q, s = tg.quantize_rows(t, 31, tg.int6_candidate_scales(t), hessians[fc])
    assert torch.equal(w[fc + ".q"], q) and torch.equal(w[fc + ".scale"], s)
    assert not torch.equal(q, base[fc + ".q"])
    t = flat256[emb].float()
    scale = base[emb + ".scale"]  # the record's int8 clip scale, now with GPTQ codes
    assert torch.equal(w[emb + ".scale"], scale)
    assert torch.equal(w[emb + ".q"], tg.gptq_codes(t, hessians[emb], scale, 127))
    assert not torch.equal(w[emb + ".q"], base[emb + ".q"])
    assert meta["blocks.0.attn.c_q.weight"] == "passthrough"
    for name in quantized_names(meta):
        if name not in hessians:
            assert torch.equal(w[name + ".q"], base[name + ".q"]), name


# =====================================================================================================
# 3. Defaults unchanged: the record's artifact bytes
# =====================================================================================================

@pytest.mark.skipif(not torch.__version__.startswith("2.13.0"),
                    reason=f"torch.save bytes depend on the torch version: pinned with 2.13.0 (requirements.txt), "
                           f"this is {torch.__version__}")
def test_default_artifact_bytes_are_pinned(tmp_path):
    """sha256 measured with the code before QUANT/COMPRESSOR/EMBED_BITS/TARGET_BYTES existed (b282ead^), the
    same with this code. The weights are a function of integers only (k / 50,000 from a seeded integer draw),
    no float kernel involved, so the bytes are the same on every CPU (checked with ATEN_CPU_CAPABILITY=avx2)."""
    h = tg.Hyperparameters({"NUM_LAYERS": "2", "XSA_LAST_N": "1", "VE_LAYERS": "1", "SEED": "7"})
    model = tg.build_model(h)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randint(-2000, 2001, p.shape, generator=g).double() / 50_000).to(p.dtype))
    path = tmp_path / "a.ptz"
    size = tg.save_artifact(str(path), model, late_qat=False)
    data = path.read_bytes()
    assert size == len(data) == 1_574_408
    assert hashlib.sha256(data).hexdigest() == "7473b4cd81af9333c54f6dae7553e98b3b8877c7498be528616a2cda9a6c0bdb"


# =====================================================================================================
# 4. Byte shuffle and brotli
# =====================================================================================================

@pytest.mark.parametrize("n", [0, 1, 2, 3, 1001])
def test_byte_shuffle_round_trip(n):
    blob = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    for stride in (2, 3):
        out = tg.byte_shuffle(blob, stride)
        assert len(out) == n + 5
        assert tg.byte_unshuffle(out) == blob


def test_byte_shuffle_layout():
    assert tg.byte_shuffle(b"abcdefg") == b"BSHF\x02" + b"aceg" + b"bdf"
    blob = bytes(range(256)) * 3
    assert tg.byte_shuffle(blob) == b"BSHF\x02" + blob[0::2] + blob[1::2]


def test_brotli_artifact_loads_to_the_lzma_tensors(tmp_path):
    """Same model, both compressors: bit-for-bit the same tensors after loading; brotli is smaller."""
    import brotli
    env = {"NUM_LAYERS": "1", "MODEL_DIM": "128", "XSA_LAST_N": "1", "VE_LAYERS": "0", "MLP_MULT": "6"}
    model = perturbed_model(hp(**env), seed=2, scale=0.03)
    sizes, loaded = {}, {}
    for comp in ("lzma", "brotli"):
        h = hp(**env, COMPRESSOR=comp)
        path = tmp_path / f"{comp}.ptz"
        sizes[comp] = tg.save_artifact(str(path), model, late_qat=True, h=h)
        assert path.stat().st_size == sizes[comp]
        loaded[comp] = tg.load_artifact(str(path), h)
    data = (tmp_path / "brotli.ptz").read_bytes()
    assert (tmp_path / "lzma.ptz").read_bytes().startswith(XZ_MAGIC) and not data.startswith(XZ_MAGIC)
    assert brotli.decompress(data)[:5] == b"BSHF\x02"
    a, b = loaded["lzma"].state_dict(), loaded["brotli"].state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert loaded["brotli"].qat_on()
    assert sizes["brotli"] < sizes["lzma"], sizes


@pytest.mark.parametrize("data", [b"definitely not an artifact", XZ_MAGIC + b"broken xz stream"])
def test_decompress_refuses_garbage_with_one_line(tmp_path, data):
    path = tmp_path / "junk.ptz"
    path.write_bytes(data)
    with pytest.raises(tg.ConfigError) as e:
        tg.decompress(data, str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(tg.ConfigError) as e:
        tg.load_artifact(str(path), hp())
    assert str(path) in str(e.value) and "\n" not in str(e.value)


# =====================================================================================================
# 5. TARGET_BYTES: pruning of +-1 codes
# =====================================================================================================

PRUNE_MODEL = {"NUM_LAYERS": "1", "MODEL_DIM": "128", "XSA_LAST_N": "1", "VE_ENABLED": "0",
               "BIGRAM_VOCAB_SIZE": "0", "MLP_MULT": "6"}


@pytest.fixture(scope="module")
def prune_setup():
    """w/meta of a small model (mlp.fc/proj int6, tok_emb int8, ~115k codes of +-1) and its lzma sizes
    unpruned and with every +-1 zeroed."""
    h = hp(**PRUNE_MODEL)
    model = perturbed_model(h, seed=3, scale=0.03)
    w, meta = tg.quantize_state_dict(tg.unbank_state_dict(model.state_dict(), h.num_layers), h)
    names = quantized_names(meta)
    assert sorted(names) == ["blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight", "tok_emb.weight"]
    # The cheapest-first order: row scale squared, ties by tensor (meta order), then flat index.
    costs = [w[n + ".scale"].float().double().pow(2)[:, None].expand(w[n + ".q"].shape).reshape(-1) for n in names]
    ones = [(w[n + ".q"].abs() == 1).reshape(-1) for n in names]
    keys = []
    for i, (c, o) in enumerate(zip(costs, ones)):
        idx = o.nonzero().squeeze(1)
        keys += zip(c[idx].tolist(), [i] * idx.numel(), idx.tolist())
    order = [(i, j) for _, i, j in sorted(keys)]

    def pruned(k):
        out = dict(w)
        for i, n in enumerate(names):
            hit = [j for ii, j in order[:k] if ii == i]
            if hit:
                q = w[n + ".q"].clone()
                q.view(-1)[torch.tensor(hit)] = 0
                out[n + ".q"] = q
        return out

    def size(ws):
        return len(tg.serialize(ws, meta, False, LZMA))

    return {"model": model, "h": h, "w": w, "meta": meta, "names": names, "pruned": pruned,
            "full": size(w), "all": size(pruned(len(order))), "count": len(order), "size": size,
            "costs": dict(zip(names, costs))}


def fits_under(meta, target):
    def fits(ws):
        blob = tg.serialize(ws, meta, False, LZMA)
        return blob if len(blob) <= target else None
    return fits


def test_prune_ones_reaches_the_target_with_the_fewest_cheapest_codes(prune_setup):
    p = prune_setup
    w, meta = p["w"], p["meta"]
    assert p["all"] < p["full"] - 10_000  # zeroing every +-1 saves a lot: the target below is reachable
    target = p["full"] - 40
    before = {k: v.clone() for k, v in w.items()}
    out, k, blob = tg.prune_ones(w, meta, fits_under(meta, target))
    assert all(torch.equal(w[n], before[n]) for n in w)  # the input is not modified
    assert 0 < k < p["count"]
    assert len(blob) <= target and blob == tg.serialize(out, meta, False, LZMA)
    assert p["size"](p["pruned"](k - 1)) > target  # one code fewer would not fit
    changed = 0
    cut_costs, kept_costs = [], []
    for n in p["names"]:
        q0, q1 = w[n + ".q"], out[n + ".q"]
        diff = q0 != q1
        assert bool((q0[diff].abs() == 1).all()) and bool((q1[diff] == 0).all()), n  # only +-1 -> 0
        changed += int(diff.sum())
        cost = p["costs"][n].view(q0.shape)
        cut_costs.append(cost[diff])
        kept_costs.append(cost[(q1.abs() == 1)])
    assert changed == k
    assert float(torch.cat(cut_costs).max()) <= float(torch.cat(kept_costs).min())  # cheapest first
    for n in out:  # exactly the reference's choice of the k cheapest
        assert torch.equal(out[n], p["pruned"](k)[n]), n


def test_prune_ones_target_met_or_unreachable(prune_setup):
    p = prune_setup
    w, meta = p["w"], p["meta"]
    out, k, blob = tg.prune_ones(w, meta, fits_under(meta, p["full"]))
    assert k == 0 and all(torch.equal(out[n], w[n]) for n in w)
    assert blob == tg.serialize(w, meta, False, LZMA)
    probes = []

    def never(ws):
        probes.append(ws)
        return None
    with pytest.raises(tg.RunError, match="TARGET_BYTES"):
        tg.prune_ones(w, meta, never)
    # It gave up only after trying with every +-1 code zeroed.
    assert all(int((probes[-1][n + ".q"].abs() == 1).sum()) == 0 for n in p["names"])


def test_prune_ones_with_no_quantised_matrix_keeps_a_fitting_blob_or_says_why():
    """A model small enough that every tensor is stored fp16 (the tiny test runs, with the presets' TARGET_BYTES):
    a fitting blob is written as it is; one that does not fit is a RunError naming TARGET_BYTES, not a torch.cat
    error about an empty list."""
    w, meta = {"a": torch.ones(3, dtype=torch.float16)}, {"a": "passthrough"}
    assert tg.prune_ones(w, meta, lambda ws: b"blob") == (w, 0, b"blob")
    with pytest.raises(tg.RunError, match="TARGET_BYTES cannot be met: no quantised matrix"):
        tg.prune_ones(w, meta, lambda ws: None)


def test_save_artifact_with_target_bytes_fits(prune_setup, tmp_path):
    p = prune_setup
    code = 50_000
    target = code + p["full"] - 60  # lzma: save_artifact serialises the same w/meta (late_qat False)
    h = hp(**PRUNE_MODEL, TARGET_BYTES=target)
    lines = []
    path = tmp_path / "t.ptz"
    size = tg.save_artifact(str(path), p["model"], False, h, code_bytes=code, log=lines.append)
    assert size == path.stat().st_size and size + code <= target
    m = re.fullmatch(rf"target_bytes:{target} pruned_ones:(\d+) total:(\d+) margin:(\d+) bytes", lines[-1])
    assert m and int(m.group(1)) > 0 and int(m.group(2)) == size + code, lines
    assert int(m.group(3)) == target - size - code
    tg.load_artifact(str(path), h)  # still a valid artifact


# =====================================================================================================
# 6. Hessian recorder and collect_hessians
# =====================================================================================================

class FixedBatches:
    """A loader that hands out the given (x, y) batches in turn."""

    def __init__(self, batches):
        self.batches, self.calls = list(batches), 0

    def next_batch(self):
        x = self.batches[self.calls]
        self.calls += 1
        return x, x


def fp32_runtime(h):
    return tg.Runtime(h, CPU, False, True, None, None, "fp32")


@pytest.fixture(scope="module")
def recorder_setup():
    h = hp(**SMALL_MODEL, AUTOCAST_DTYPE="fp32", GPTQ_CALIBRATION_BATCHES=2)
    rt = fp32_runtime(h)
    model = rt.prepare_model(perturbed_model(h, seed=4, scale=0.05))
    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, h.vocab_size, (2, 48), generator=g) for _ in range(2)]
    return {"h": h, "rt": rt, "model": model, "batches": batches}


def test_collect_hessians_equal_independent_x_transpose_x(recorder_setup):
    """X captured by module hooks (not by the recorder) and recomputed: the block inputs give the MLP input,
    the attention input is c_q/c_k/c_v's X, attn.proj's H maps to the attention output's Gram matrix, and
    the final RMSNorm output is the tied embedding's X. H is the mean over the calibration batches."""
    s = recorder_setup
    model, n = s["model"], s["model"].num_layers
    seen = {"block_in": [], "attn_in": [], "attn_out": [], "last_out": []}
    hooks = []
    for i, block in enumerate(model.blocks):
        hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: seen["block_in"].append((i, a[0], a[1]))))
        hooks.append(block.attn.register_forward_pre_hook(lambda m, a, i=i: seen["attn_in"].append((i, a[0]))))
        hooks.append(block.attn.register_forward_hook(lambda m, a, o, i=i: seen["attn_out"].append((i, o))))
    hooks.append(model.blocks[-1].register_forward_hook(lambda m, a, o: seen["last_out"].append(o)))
    loader = FixedBatches(s["batches"])
    try:
        hess = tg.collect_hessians(s["rt"], model, loader)
    finally:
        for hk in hooks:
            hk.remove()
    assert loader.calls == 2
    assert tg._RECORDER[0] is None and model.training
    parts = (".attn.c_q.weight", ".attn.c_k.weight", ".attn.c_v.weight", ".attn.proj.weight", ".mlp.fc.weight",
             ".mlp.proj.weight")
    assert set(hess) == {f"blocks.{i}{part}" for i in range(n) for part in parts} | {"tok_emb.weight"}

    def gram(xs):
        x = torch.cat([t.detach().reshape(-1, t.size(-1)).double() for t in xs])
        return x.T @ x / len(s["batches"])

    def close(a, b, what):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=what)

    for i, block in enumerate(model.blocks):
        w = model.block_weights(i)
        x_in = [(x, x0) for j, x, x0 in seen["block_in"] if j == i]
        a_in = [x for j, x in seen["attn_in"] if j == i]
        a_out = [o for j, o in seen["attn_out"] if j == i]
        mix = block.resid_mix
        mixed = [mix[0] * x + mix[1] * x0 for x, x0 in x_in]
        for got, x in zip(a_in, mixed):  # the hooks' attention input is the recomputed one
            torch.testing.assert_close(got, F.rms_norm(x, (x.size(-1),)) * block.ln_scale)
        H_q = hess[f"blocks.{i}.attn.c_q.weight"]
        assert torch.equal(H_q, hess[f"blocks.{i}.attn.c_k.weight"])
        assert torch.equal(H_q, hess[f"blocks.{i}.attn.c_v.weight"])
        close(H_q, gram(a_in), f"c_q {i}")
        fc_in = [F.rms_norm(x + block.attn_scale * o, (x.size(-1),)) * block.ln_scale for x, o in zip(mixed, a_out)]
        close(hess[f"blocks.{i}.mlp.fc.weight"], gram(fc_in), f"fc {i}")
        hidden = [F.leaky_relu(x @ w[4].T, 0.5).square() for x in fc_in]
        close(hess[f"blocks.{i}.mlp.proj.weight"], gram(hidden), f"mlp.proj {i}")
        proj = w[3].double()  # attn output = Y proj^T, so proj H proj^T = (attn output)^T (attn output)
        close(proj @ hess[f"blocks.{i}.attn.proj.weight"].double() @ proj.T, gram(a_out), f"attn.proj {i}")
    final = [F.rms_norm(o, (o.size(-1),)) for o in seen["last_out"]]
    close(hess["tok_emb.weight"], gram(final), "tok_emb")
    assert hess["blocks.0.mlp.proj.weight"].shape == (768, 768) and hess["tok_emb.weight"].shape == (256, 256)


def test_hessians_are_fp32_products_under_bf16_autocast(recorder_setup):
    """Calibration runs under the run's autocast; X^T X must still be an fp32 product of the (bf16) activations:
    a bf16-rounded product is not positive definite on trained-like activations (a full-size CPU run's
    Cholesky failed that way)."""
    s = recorder_setup
    h = hp(**SMALL_MODEL, AUTOCAST_DTYPE="bf16", GPTQ_CALIBRATION_BATCHES=1)
    rt = tg.Runtime(h, CPU, False, True, None, torch.bfloat16, "bf16")
    seen = []

    class Capture(tg.HessianRecorder):
        def add(self, x, w):
            if self.names.get(w.data_ptr()) == "blocks.0.mlp.proj.weight":
                seen.append(x.detach())
            super().add(x, w)

    model = s["model"]
    rec = Capture(model)
    tg._RECORDER[0] = rec
    try:
        with torch.no_grad(), rt.autocast():
            model.forward_logits(s["batches"][0])
    finally:
        tg._RECORDER[0] = None
    assert seen and seen[0].dtype == torch.bfloat16
    x = seen[0].reshape(-1, seen[0].size(-1)).float()
    assert torch.equal(rec.sums["blocks.0.mlp.proj.weight"], (x.T @ x).double())


def test_recorder_leaves_the_forward_unchanged(recorder_setup):
    s = recorder_setup
    model, x = s["model"], s["batches"][0]
    with torch.no_grad():
        plain = model.forward_logits(x)
        rec = tg.HessianRecorder(model)
        tg._RECORDER[0] = rec
        try:
            recorded = model.forward_logits(x)
        finally:
            tg._RECORDER[0] = None
    assert torch.equal(plain, recorded)
    assert len(rec.sums) == 6 * model.num_layers + 1


def test_collect_hessians_resets_the_recorder_after_an_error(recorder_setup):
    s = recorder_setup

    class Broken:
        def next_batch(self):
            raise OSError("shard vanished")
    with pytest.raises(OSError):
        tg.collect_hessians(s["rt"], s["model"], Broken())
    assert tg._RECORDER[0] is None and s["model"].training


# =====================================================================================================
# 7. The script end to end
# =====================================================================================================

VAL_TOKENS = 8193

GPTQ_ENV = {**TINY_ENV, **SMALL_MODEL, "ITERATIONS": "2", "WARMUP_STEPS": "0", "WARMDOWN_ITERS": "1",
            "TTT_ENABLED": "0", "EVAL_STRIDE": "0", "OMP_NUM_THREADS": "1", "QUANT": "gptq"}


@pytest.fixture(scope="module")
def gptq_data(sample_data, tmp_path_factory) -> dict[str, str]:
    """The sample train shards with a val shard cut to 8,192 targets (fast evaluations)."""
    return short_val_data(sample_data, tmp_path_factory.mktemp("gptq_data"), VAL_TOKENS)


def one_int(pattern, log):
    found = re.findall(pattern, log, re.M)
    assert len(found) == 1, (pattern, found)
    return found[0]


def test_gptq_brotli_run_and_eval_only(gptq_data, tmp_path):
    import brotli
    env = {**GPTQ_ENV, **gptq_data, "GPTQ_CALIBRATION_BATCHES": "2", "COMPRESSOR": "brotli",
           "MATRIX_CLIP_SIGMAS": "12.85"}
    cwd = tmp_path / "run"
    cwd.mkdir()
    proc = run_training({**env, "RUN_ID": "gptq"}, cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(cwd, "gptq")
    assert one_int(r"^gptq: hessians:(\d+) batches:2x1 time:\d+ms train\+hessians:\d+ms$", log) == "13"
    used, total = one_int(r"^gptq: (\d+) of (\d+) tensors with a Hessian quantised by GPTQ .*\(scales: SDClip\)",
                          log)
    assert (int(used), int(total)) == (5, 13)  # mlp.fc/proj of 2 layers + tok_emb; c_q.. are fp16 at width 256
    artifact = run_file(cwd, "gptq")
    assert int(one_int(r"^Serialized model int6\+brotli: (\d+) bytes$", log)) == artifact.stat().st_size
    raw = brotli.decompress(artifact.read_bytes())
    assert raw[:5] == b"BSHF\x02"
    # The artifact's codes are GPTQ's: they differ from rounding the saved final weights to nearest
    # (same SDClip scales), while the scales and the fp16 passthrough tensors agree.
    stored = torch.load(io.BytesIO(tg.byte_unshuffle(raw)), map_location="cpu")["w"]
    final = torch.load(run_file(cwd, "gptq", "final_model.pt"), map_location="cpu")
    rtn_w, meta = tg.quantize_state_dict(tg.unbank_state_dict(final, 2), hp(**SMALL_MODEL, MATRIX_CLIP_SIGMAS=12.85))
    gptq_names = {"blocks.0.mlp.fc.weight", "blocks.1.mlp.fc.weight", "blocks.0.mlp.proj.weight",
                  "blocks.1.mlp.proj.weight", "tok_emb.weight"}
    for name in quantized_names(meta):  # bigram.embed, ve_shared.embed: no Hessian, rounded
        assert torch.equal(stored[name + ".scale"], rtn_w[name + ".scale"]), name
        assert torch.equal(stored[name + ".q"], rtn_w[name + ".q"]) == (name not in gptq_names), name
    assert torch.equal(stored["blocks.0.attn.c_q.weight"], rtn_w["blocks.0.attn.c_q.weight"])
    # EVAL_ONLY of the brotli artifact in a fresh process gives the logged round-trip result exactly.
    proc = run_training({**env, "RUN_ID": "evalonly", "EVAL_ONLY": str(artifact)}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = one_int(r"^(final_int6_roundtrip_exact .*)$", log)
    assert one_int(r"^(final_int6_roundtrip_exact .*)$", read_log(tmp_path, "evalonly")) == line


def test_two_process_hessians_give_the_one_process_artifact(gptq_data, tmp_path):
    """No training steps (1- and 2-process training differ in float rounding; test_train_core), 4 calibration
    micro-batches on 1 process vs 2 per rank on 2: the same batches in total, the same artifact bytes."""
    env = {**GPTQ_ENV, **gptq_data, "ITERATIONS": "0"}
    for nproc, batches in ((0, 4), (2, 2)):
        cwd = tmp_path / f"n{nproc}"
        cwd.mkdir()
        proc = run_training({**env, "RUN_ID": "h", "GPTQ_CALIBRATION_BATCHES": str(batches)}, cwd, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert re.search(rf"^gptq: hessians:13 batches:{batches}x{max(nproc, 1)} ", read_log(cwd, "h"), re.M)
    for name in ("final_model.pt", "final_model.int6.ptz"):
        assert run_file(tmp_path / "n0", "h", name).read_bytes() == run_file(tmp_path / "n2", "h", name).read_bytes()


@pytest.mark.parametrize("env, fragment", [
    ({"QUANT": "bogus"}, "QUANT='bogus' must be gptq_lite or gptq"),
    ({"EMBED_BITS": "6"}, "EMBED_BITS=6 must be 8 or 7"),
    ({"COMPRESSOR": "zstd"}, "COMPRESSOR='zstd' must be lzma or brotli"),
    ({"QUANT": "gptq", "GPTQ_RESERVE_SECONDS": "600"}, "GPTQ_RESERVE_SECONDS=600.0 leaves no training time"),
    ({"QUANT": "gptq", "GPTQ_RESERVE_SECONDS": "30", "MAX_WALLCLOCK_SECONDS": "20"}, "GPTQ_RESERVE_SECONDS=30.0"),
    ({"TARGET_BYTES": "-1"}, "TARGET_BYTES=-1 must be >= 0"),
    ({"GPTQ_CALIBRATION_BATCHES": "0"}, "GPTQ_CALIBRATION_BATCHES=0 must be > 0"),
    ({"MATRIX_CLIP_SIGMAS": "-2"}, "MATRIX_CLIP_SIGMAS=-2.0 must be >= 0"),
])
def test_bad_artifact_settings_name_the_variable(env, fragment):
    assert fragment in config_error(env)


def test_reserve_only_counts_for_gptq_under_a_cap():
    assert hp(QUANT="gptq_lite", GPTQ_RESERVE_SECONDS=900).max_wallclock_ms == 600_000.0
    assert hp(QUANT="gptq", GPTQ_RESERVE_SECONDS=900, MAX_WALLCLOCK_SECONDS=0).max_wallclock_ms is None
    assert hp(QUANT="gptq", GPTQ_RESERVE_SECONDS=12.5).max_wallclock_ms == 587_500.0


def test_target_bytes_below_the_script_is_exit_2(gptq_data, tmp_path, monkeypatch, capsys):
    """Checked in run() (it needs the script's size): main() exits 2 with one line naming TARGET_BYTES,
    before any training."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    code_bytes = len(Path(tg.__file__).read_bytes())
    for k, v in {**GPTQ_ENV, **gptq_data, "RUN_ID": "tb", "TARGET_BYTES": str(code_bytes)}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["train_gpt.py"])
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as e:
            tg.main()
    finally:
        torch.set_num_threads(threads)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: TARGET_BYTES={code_bytes} leaves no room beside this script's {code_bytes} bytes"]
    log = read_log(tmp_path, "tb")
    assert re.search(r"^val_tokens:\d+$", log, re.M) and not re.search(r"^(step|model_params):", log, re.M)
    assert log.rstrip().endswith(err[0]) and not run_file(tmp_path, "tb", "final_model.pt").exists()
