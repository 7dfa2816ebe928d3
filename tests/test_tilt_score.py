"""NGRAM_TILT (issue 29; SPEC-FRONTIER 20(b)-(d)): the token n-gram tilt of the final score against #2135's own
apply_tilt_to_ptl_torch_fast (../shared/anchors/frontier/record_0501, imported from a temporary copy, never copied
into the project); the tilted distribution's normalisation; which target a hint belongs to in the sliding-window
score; and the settings' one-line errors. The hints themselves: test_ngram_tilt.py; the preset's tilted LoRA TTT
against the record's: test_presets.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from conftest import config_error
from test_ngram_tilt import record  # noqa: F401 (fixture: #2135's online_ngram_tilt.py from a temporary copy)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one intra-op thread per module
CPU = torch.device("cpu")
BOOST = 2.625


def _inputs(seed=0, rows=3, width=40, vocab=64):
    """Logits of mixed sharpness, targets, and hints that hit about half the targets and are the argmax at some."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, vocab, generator=g) * torch.linspace(0.1, 12.0, width)[None, :, None]
    y = torch.randint(0, vocab, (rows, width), generator=g)
    hint = torch.where(torch.rand(rows, width, generator=g) < 0.5, y, torch.randint(0, vocab, (rows, width),
                                                                                        generator=g))
    logits.scatter_(-1, hint[..., None], 15.0 * (torch.rand(rows, width, 1, generator=g) < 0.2))
    gate = torch.rand(rows, width, generator=g) < 0.7
    return logits, y, hint, gate


def test_the_tilted_loss_equals_the_records_apply_tilt(record):
    """ngram_tilt_loss on the same nll, log q, targets, hints and gate as #2135's apply_tilt_to_ptl_torch_fast (with
    its per-position boost: BOOST where gated, 0 elsewhere): bit for bit; and token_scores, which takes nll and log q
    from one fp32 log_softmax and the hints from an NgramTilt, gives the same. Another boost does not."""
    logits, y, hint, gate = _inputs()
    logp = F.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, y[..., None]).squeeze(-1)
    log_q = logp.gather(-1, hint[..., None]).squeeze(-1)
    log_q[0, :3] = torch.tensor([1e-7, 0.0, -1e-9])  # rounding can leave log q just above 0: both clamp it
    want = record.apply_tilt_to_ptl_torch_fast(ptl=nll, log_q_hint=log_q, target_ids=y, hint_ids=hint,
                                                     gate_mask=gate, boost=torch.where(gate, BOOST, 0.0))
    got = tg.ngram_tilt_loss(nll, log_q, y, hint, gate, BOOST)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(got[~gate], nll[~gate]) and not torch.equal(got[gate], nll[gate])
    assert not torch.equal(tg.ngram_tilt_loss(nll, log_q, y, hint, gate, 3.0), want)
    # the same through token_scores: positions 0..N-1 of a flat stream, ungated hints stored as -1
    flat = torch.where(gate, hint, -1).reshape(-1).to(torch.int32)
    pos = torch.arange(y.numel()).view(y.shape)
    log_q = logp.gather(-1, hint[..., None]).squeeze(-1)
    want = record.apply_tilt_to_ptl_torch_fast(ptl=nll, log_q_hint=log_q, target_ids=y, hint_ids=hint,
                                                     gate_mask=gate, boost=torch.where(gate, BOOST, 0.0))
    untilted, score = tg.token_scores(logits, y, tg.NgramTilt(flat, BOOST), pos, torch.ones_like(gate))
    assert torch.equal(score, want) and torch.equal(untilted, F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1),
                                                                              reduction="none").view(y.shape))
    _, off = tg.token_scores(logits, y, tg.NgramTilt(flat, BOOST), pos, torch.zeros_like(gate))
    assert torch.equal(off, untilted)  # gated only where valid


def test_the_tilted_distribution_sums_to_one_at_every_position():
    """exp(-ngram_tilt_loss) over every possible target v of a position is the tilted distribution p'(v); it sums to
    1 at every position, gated or not, and equals softmax(logits + boost*onehot(hint)) (the boost moves the hint's
    logit). Without the log1p normaliser it would not sum to 1."""
    logits, _, hint, gate = _inputs(seed=1)
    V = logits.size(-1)
    logp = F.log_softmax(logits, dim=-1)
    every = torch.arange(V).expand(*hint.shape, V)  # target v in the last dim
    log_q = logp.gather(-1, hint[..., None]).expand_as(every)
    loss = tg.ngram_tilt_loss(-logp, log_q, every, hint[..., None].expand_as(every),
                              gate[..., None].expand_as(every), BOOST)
    total = (-loss.double()).exp().sum(-1)
    assert torch.allclose(total, torch.ones_like(total), rtol=0, atol=2e-6), (total - 1).abs().max()
    boosted = logits + BOOST * F.one_hot(hint, V) * gate[..., None]
    assert torch.allclose(loss, -F.log_softmax(boosted, dim=-1), rtol=0, atol=2e-5)
    unnormalised = (-(loss - torch.log1p(log_q.exp() * np.expm1(BOOST)) * gate[..., None])).exp().sum(-1)
    q = log_q[..., 0].exp()
    assert bool(((unnormalised - 1)[gate & (q > 0.01)] > 0.1).all())


def test_a_hint_at_input_position_p_tilts_the_target_at_p_plus_1_in_the_sliding_window():
    """EVAL_STRIDE sliding-window scoring with an NgramTilt whose only gated entries are hits (hint[p] =
    val_tokens[p + 1]): the per-token scores (per_token[t] for target t) fall exactly at t = p + 1 and stay
    bit-identical elsewhere; the totals are the mean of the per-token scores."""
    h = tg.Hyperparameters({"MODEL_DIM": "32", "NUM_HEADS": "2", "NUM_KV_HEADS": "1", "NUM_LAYERS": "2",
                            "VOCAB_SIZE": "64", "BIGRAM_VOCAB_SIZE": "0", "VE_ENABLED": "0", "XSA_LAST_N": "0",
                            "EVAL_SEQ_LEN": "32", "EVAL_STRIDE": "8", "TRAIN_SEQ_LEN": "32", "EVAL_BATCH_SEQS": "4",
                            "VAL_BATCH_SIZE": "256", "TTT_ENABLED": "0", "NGRAM_TILT": "1"})
    torch.manual_seed(0)
    model = tg.GPT(h)
    tokens = torch.randint(0, 64, (121,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    luts = tg.ByteLuts(torch.ones(64, dtype=torch.int16), torch.zeros(64, dtype=torch.bool),
                       torch.zeros(64, dtype=torch.bool))
    rt = tg.Runtime(h, CPU, False, True, None)
    gated = torch.tensor([0, 5, 31, 32, 77, 119])  # input positions; 119 is the last one
    hint = torch.full((tokens.numel() - 1,), -1, dtype=torch.int32)
    hint[gated] = tokens[gated + 1]
    runs = []
    for tilt in (None, tg.NgramTilt(hint, BOOST)):
        per_token = torch.full((tokens.numel(),), float("nan"), dtype=torch.float64)
        loss, _ = tg.eval_sliding(rt, model, model.forward_logits, tokens, luts, per_token, tilt=tilt)
        assert loss == pytest.approx(per_token[1:].mean().item(), rel=1e-12)
        runs.append(per_token)
    plain, tilted = runs
    moved = torch.nonzero(tilted[1:] != plain[1:]).flatten() + 1  # per_token[0]: no target
    assert moved.tolist() == (gated + 1).tolist() and bool((tilted[moved] < plain[moved]).all())


@pytest.mark.parametrize("env, name", [
    ({"NGRAM_TILT_ORDER": "1"}, "NGRAM_TILT_ORDER=1"), ({"NGRAM_TILT_ORDER": "34"}, "NGRAM_TILT_ORDER=34"),
    ({"NGRAM_TILT_THRESHOLD": "0"}, "NGRAM_TILT_THRESHOLD=0"), ({"NGRAM_TILT_THRESHOLD": "1.01"},
                                                                 "NGRAM_TILT_THRESHOLD=1.01"),
    ({"NGRAM_TILT_BOOST": "-0.5"}, "NGRAM_TILT_BOOST=-0.5"), ({"NGRAM_TILT": "2"}, "NGRAM_TILT='2'"),
    ({"NGRAM_TILT": "1", "TTT_ENABLED": "0", "EVAL_STRIDE": "0"}, "NGRAM_TILT=1"),
    ({"SMEAR_GATE_BOS_FIX": "no"}, "SMEAR_GATE_BOS_FIX='no'")])
def test_bad_tilt_settings_are_one_line_errors_naming_the_variable(env, name):
    assert name in config_error(env)


def test_the_settings_edges_are_accepted():
    for env in ({"NGRAM_TILT_ORDER": "2"}, {"NGRAM_TILT_ORDER": "33"}, {"NGRAM_TILT_THRESHOLD": "1"},
                {"NGRAM_TILT_BOOST": "0"}, {"NGRAM_TILT": "1", "TTT_ENABLED": "0"},
                {"NGRAM_TILT": "1", "EVAL_STRIDE": "0", "TTT_MODE": "lora"}):
        tg.Hyperparameters(env)
    assert tg.NGRAM_ORDERS == range(2, 34)
