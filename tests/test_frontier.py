"""The 2026-04-09 record's techniques (SPEC-FRONTIER 4-7, 9, 10) and PRESET: depth recurrence, parallel
residuals, skip gates, MuonEq-R, Polar Express, WARMDOWN_FRAC/MIN_LR, EMBED_WD, the presets and their log."""
from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch

import launcher
import train_gpt as tg
from conftest import REPO, TINY_ENV, clean_environ, config_error, read_log, run_file, run_training, short_val_data

# ---------------------------------------------------------------------------------------------- presets

# SPEC-FRONTIER 10, column "04-09 (logged)", as attribute -> value (plus 2, 4-7, 9, 14 for data, loops, TTT).
RECORD_0409 = {
    "vocab_size": 8192, "data_path": "./data/datasets/fineweb10B_sp8192",
    "tokenizer_path": "./data/tokenizers/fineweb_8192_bpe.model", "mlp_mult": 4.0, "xsa_last_n": 11,
    "qk_gain_init": 5.25, "num_loops": 2, "loop_start": 3, "loop_end": 5, "enable_looping_at": 0.35,
    "parallel_residual_start": 7, "skip_gates": True, "smear_gate": False, "bigram_vocab_size": 0,
    "ve_enabled": False, "matrix_lr": 0.022, "scalar_lr": 0.02, "tied_embed_lr": 0.03, "muon_momentum": 0.99,
    "muon_momentum_warmup_start": 0.92, "muon_momentum_warmup_steps": 1500, "muon_row_normalize": True,
    "muon_ns_coeffs": "fixed", "muon_wd": 0.095, "embed_wd": 0.085, "adam_wd": 0.02, "beta1": 0.9, "beta2": 0.95,
    "adam_eps": 1e-8, "warmdown_frac": 0.72, "min_lr": 0.0, "ema_enabled": True, "ema_decay": 0.9965,
    "swa_apply": False, "qat_enabled": False, "late_qat_threshold": 0.0, "warmup_steps": 20,
    "quant": "gptq", "gptq_reserve_seconds": 12.0, "gptq_calibration_batches": 64, "embed_bits": 8,
    "matrix_clip_sigmas": 12.85, "embed_clip_sigmas": 20.0, "compressor": "brotli", "eval_stride": 64,
    "ttt_enabled": True, "ttt_lr": 0.005, "ttt_epochs": 3, "ttt_momentum": 0.9, "ttt_chunk_tokens": 32768,
    "ttt_batch_seqs": 32, "ttt_grad_clip": 1.0, "ttt_freeze_blocks": 0, "val_loss_every": 4000,
    "train_batch_tokens": 786432, "train_seq_len": 2048, "eval_seq_len": 2048, "num_layers": 11, "model_dim": 512,
    "num_heads": 8, "num_kv_heads": 4, "rope_dims": 16, "logit_softcap": 30.0, "grad_clip_norm": 0.3,
    "max_wallclock_seconds": 600.0, "train_loader": "shuffled", "rope_train_seq_len": 2048,
    "muon_momentum_fp32": True, "muon_ns_ca_first": True, "grad_clip_scope": "local",
}


def test_record_0409_preset_equals_the_spec_table():
    h = tg.Hyperparameters({"PRESET": "record_0409"})
    got = {k: getattr(h, k) for k in RECORD_0409}
    assert got == RECORD_0409
    assert h.max_wallclock_ms == 588_000.0  # the loop's budget net of the 12 s GPTQ reserve


def test_record_0323_preset_is_the_default():
    a, b = tg.Hyperparameters({}), tg.Hyperparameters({"PRESET": "record_0323"})
    skip = {"run_id", "checkpoint_dir", "settings", "effective", "_environ"}  # checkpoint_dir: from the random run_id
    assert {k: v for k, v in vars(a).items() if k not in skip} == {k: v for k, v in vars(b).items() if k not in skip}
    assert b.preset == "record_0323" and a.embed_wd == a.adam_wd == 0.04


def test_explicit_env_overrides_the_preset():
    h = tg.Hyperparameters({"PRESET": "record_0409", "MATRIX_LR": "0.03", "NUM_LOOPS": "0", "SKIP_GATES": "0"})
    assert (h.matrix_lr, h.num_loops, h.skip_gates, h.scalar_lr) == (0.03, 0, False, 0.02)
    assert h.effective["MATRIX_LR"] == (0.03, "env")
    assert h.effective["SCALAR_LR"] == (0.02, "preset")
    assert h.effective["SEED"] == (1337, "default")
    dump = h.dump()
    assert "setting MATRIX_LR=0.03 [env]" in dump and "setting SKIP_GATES=0 [env]" in dump
    assert "setting EMBED_WD=0.085 [preset]" in dump and "setting SMEAR_GATE=0 [preset]" in dump
    assert len(dump) == len(h.settings)  # every variable read appears once


def test_auto_settings_are_dumped_resolved():
    h = tg.Hyperparameters({"ADAM_WD": "0.03"})
    assert h.embed_wd == 0.03 and "setting EMBED_WD=0.03 [default]" in h.dump()
    assert f"setting RUN_ID={h.run_id} [default]" in h.dump()


@pytest.mark.parametrize("env, fragment", [
    ({"PRESET": "record_0410"}, "PRESET='record_0410' must be record_0323 or record_0409"),
    ({"NUM_LOOPS": "2", "LOOP_START": "5", "LOOP_END": "3"}, "LOOP_START=5 and LOOP_END=3"),
    ({"NUM_LOOPS": "1", "LOOP_END": "11"}, "LOOP_END=11 must satisfy"),
    ({"NUM_LOOPS": "1000000000"}, "NUM_LAYERS=11 and NUM_LOOPS=1000000000 run 3,000,000,011 layers, over 1,024"),
    ({"NUM_LAYERS": "1025", "XSA_LAST_N": "0"}, "NUM_LAYERS=1025 and NUM_LOOPS=0 run 1,025 layers, over 1,024"),
    ({"ENABLE_LOOPING_AT": "1.0"}, "ENABLE_LOOPING_AT=1.0 must be in [0, 1)"),
    ({"PARALLEL_RESIDUAL_START": "11"}, "PARALLEL_RESIDUAL_START=11 must be a layer index"),
    ({"MUON_NS_COEFFS": "cubic"}, "MUON_NS_COEFFS='cubic' must be fixed or polar_express"),
    ({"WARMDOWN_FRAC": "-0.1"}, "WARMDOWN_FRAC=-0.1 must be in [0, 1)"),
    ({"MIN_LR": "1"}, "MIN_LR=1.0 must be in [0, 1)"),
    ({"EMBED_WD": "-1"}, "EMBED_WD=-1.0 must be >= 0"),
])
def test_bad_frontier_settings_name_the_variable(env, fragment):
    assert fragment in config_error(env)


def test_parameter_counts_of_both_presets():  # the models on the meta device: shapes without their initial draws
    assert sum(p.numel() for p in tg.meta_model(tg.Hyperparameters({})).parameters()) == 26_928_220
    # The 04-09 record's logged model_params at vocab 8192 (SPEC-FRONTIER 4-6: 8 skip rows + 8 skip gates).
    model = tg.meta_model(tg.Hyperparameters({"PRESET": "record_0409"}))
    assert sum(p.numel() for p in model.parameters()) == 35_944_536


# ---------------------------------------------------------------------------------------------- depth recurrence

@pytest.mark.parametrize("n, loops, a, b, encoder, decoder", [
    (11, 0, 3, 5, [0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10]),  # the record's U-Net
    (11, 2, 3, 5, [0, 1, 2, 3, 4, 5, 3, 4], [5, 3, 4, 5, 6, 7, 8, 9, 10]),  # 04-09 and NEWEST
    (11, 2, 4, 5, [0, 1, 2, 3, 4, 5, 4], [5, 4, 5, 6, 7, 8, 9, 10]),  # 04-05
    (11, 1, 4, 5, [0, 1, 2, 3, 4, 5], [4, 5, 6, 7, 8, 9, 10]),  # 03-31's one extra pass of 4, 5
    (4, 3, 0, 0, [0, 0, 0], [0, 1, 2, 3]),
    (6, 1, 5, 5, [0, 1, 2], [3, 4, 5, 5]),
])
def test_virtual_layer_order(n, loops, a, b, encoder, decoder):
    assert tg.virtual_layers(n, loops, a, b) == (encoder, decoder)


def _looped_hparams(**over):
    env = {**TINY_ENV, "NUM_LAYERS": "6", "VE_LAYERS": "4,5", "NUM_LOOPS": "2", "LOOP_START": "1",
           "LOOP_END": "3", **over}
    return tg.Hyperparameters(env)


def _trace_forward(model, ids):
    """Runs forward_logits, recording each block call (physical index, output) and each skip merge (row, input)."""
    calls, merges = [], []
    block, merge = model._block, model._merge_skip

    def traced_block(i, *args):
        out = block(i, *args)
        calls.append((i, out))
        return out

    def traced_merge(j, x, skip):
        merges.append((j, skip))
        return merge(j, x, skip)

    model._block, model._merge_skip = traced_block, traced_merge
    try:
        logits = model.forward_logits(ids)
    finally:
        del model._block, model._merge_skip
    return logits, calls, merges


@pytest.mark.parametrize("looping", [False, True])
@pytest.mark.parametrize("loops, a, b", [(2, 1, 3), (1, 0, 2), (3, 2, 2)])
def test_skip_pairing_is_lifo_over_the_virtual_order(looping, loops, a, b):
    h = _looped_hparams(NUM_LOOPS=str(loops), LOOP_START=str(a), LOOP_END=str(b))
    model = tg.GPT(h)
    model.looping = looping
    encoder, decoder = model.orders[looping]
    rows = min(len(half) for half in model.orders[True])
    assert model.skip_weights.shape[0] == rows  # sized for the looped shape
    ids = torch.randint(0, h.vocab_size, (2, 16))
    _, calls, merges = _trace_forward(model, ids)
    assert [i for i, _ in calls] == encoder + decoder
    # decoder step j takes the output of encoder step len(encoder)-1-j, for j < rows while any are left
    want = [(j, len(encoder) - 1 - j) for j in range(min(len(decoder), rows, len(encoder)))]
    assert [j for j, _ in merges] == [j for j, _ in want]
    for (j, skip), (_, e) in zip(merges, want):
        assert skip is calls[e][1]


def test_repeats_share_weights_and_per_layer_scalars():
    h = _looped_hparams()
    model = tg.GPT(h)
    plain_params = sum(p.numel() for p in model.parameters())
    model.looping = True
    seen = []
    hooks = [blk.register_forward_hook(lambda m, args, out, i=i: seen.append((i, args[2]))) for i, blk in
             enumerate(model.blocks)]
    model.forward_logits(torch.randint(0, h.vocab_size, (1, 8)))
    for hk in hooks:
        hk.remove()
    assert [i for i, _ in seen] == [0, 1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 5]
    for i, w in seen:  # every pass of layer i uses layer i's bank slices (same storage)
        assert [t.data_ptr() for t in w] == [t.data_ptr() for t in model.block_weights(i)]
    assert sum(p.numel() for p in model.parameters()) == plain_params
    assert [blk.ln_scale for blk in model.blocks] == [1 / math.sqrt(i + 1) for i in range(6)]
    # one backward: a looped layer's scalars collect gradient from all three passes, the extra skip rows train
    model.zero_grad()
    model(torch.randint(0, h.vocab_size, (1, 8)), torch.randint(0, h.vocab_size, (1, 8))).backward()
    assert model.skip_weights.grad.abs().sum(dim=1).gt(0).all()


def test_plain_order_leaves_the_extra_skip_rows_untouched():
    h = _looped_hparams(SKIP_GATES="1")
    model = tg.GPT(h)
    assert model.skip_weights.shape[0] == 6 and len(model.orders[False][0]) == 3
    model(torch.randint(0, h.vocab_size, (1, 8)), torch.randint(0, h.vocab_size, (1, 8))).backward()
    used = model.skip_weights.grad.abs().sum(dim=1).gt(0).tolist()
    assert used == [True, True, True, False, False, False]


def test_looping_changes_the_function_not_the_parameters():
    h = _looped_hparams()
    model = tg.GPT(h)
    ids = torch.randint(0, h.vocab_size, (1, 8))
    with torch.no_grad():
        for bank in (model.qo_bank, model.mlp_down_bank):  # zero-init output projections: blocks start as identity
            bank.normal_(0, 0.1)
        plain = model.forward_logits(ids)
        model.looping = True
        looped = model.forward_logits(ids)
    assert not torch.allclose(plain, looped)


# ---------------------------------------------------------------------------------------------- blocks and skips

def _randomised_block(h, cls, i):
    torch.manual_seed(0)
    blk = cls(h, i)
    with torch.no_grad():
        for p in blk.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1)
    d, kv, hid = h.model_dim, h.num_kv_heads * h.head_dim, h.mlp_hidden
    w = (torch.randn(d, d) / 8, torch.randn(kv, d) / 8, torch.randn(kv, d) / 8, torch.randn(d, d) / 8,
         torch.randn(hid, d) / 8, torch.randn(d, hid) / 16)
    return blk, w


def _mlp(x, w):
    return torch.nn.functional.leaky_relu(x @ w[4].T, 0.5).square() @ w[5].T


@pytest.mark.parametrize("parallel", [False, True])
def test_blocks_equal_their_formulas(parallel):
    h = tg.Hyperparameters({**TINY_ENV})
    blk, w = _randomised_block(h, tg.Block, 2)
    blk.parallel = parallel
    x, x0 = torch.randn(2, 8, h.model_dim), torch.randn(2, 8, h.model_dim)
    rope = tg.rotary_tables(8, h.rope_dims, h.rope_base, x.device)
    c = 1 / math.sqrt(3)
    x_in = blk.resid_mix[0] * x + blk.resid_mix[1] * x0
    attn = blk.attn(tg.rms_norm(x_in) * c, w[:4], None, rope)
    if parallel:  # x_in + a*Attn(n) + b*MLP(n), n = RMS(x_in)*c (SPEC-FRONTIER 5)
        want = x_in + blk.attn_scale * attn + blk.mlp_scale * _mlp(tg.rms_norm(x_in) * c, w)
    else:  # sequential: the MLP reads x_in + a*Attn
        x1 = x_in + blk.attn_scale * attn
        want = x1 + blk.mlp_scale * _mlp(tg.rms_norm(x1) * c, w)
    got = blk(x, x0, w, None, rope)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    blk.parallel = not parallel
    other = blk(x, x0, w, None, rope)
    assert not torch.allclose(got, other, atol=1e-3)  # the two forms really differ


def test_parallel_residual_follows_the_physical_index():
    h = tg.Hyperparameters({"PARALLEL_RESIDUAL_START": "7"})
    assert [b.parallel for b in tg.meta_model(h).blocks] == [False] * 7 + [True] * 4
    assert not any(b.parallel for b in tg.meta_model(tg.Hyperparameters({})).blocks)
    assert all(b.parallel for b in tg.meta_model(tg.Hyperparameters({"PARALLEL_RESIDUAL_START": "0"})).blocks)


def test_skip_gates_start_as_an_even_mix_and_follow_the_sigmoid():
    h = tg.Hyperparameters({**TINY_ENV, "SKIP_GATES": "1"})
    model = tg.GPT(h)
    assert torch.equal(model.skip_gates, torch.zeros_like(model.skip_weights))
    with torch.no_grad():
        model.skip_weights.uniform_(0.5, 1.5)
    x, skip = torch.randn(2, 4, h.model_dim), torch.randn(2, 4, h.model_dim)
    w = model.skip_weights[1]
    assert torch.allclose(model._merge_skip(1, x, skip), 0.5 * x + 0.5 * (w * skip), atol=1e-6)
    with torch.no_grad():
        model.skip_gates[1].fill_(2.0)
    s = 1 / (1 + math.exp(-2.0))
    assert torch.allclose(model._merge_skip(1, x, skip), s * x + (1 - s) * (w * skip), atol=1e-6)
    ungated = tg.GPT(tg.Hyperparameters({**TINY_ENV}))
    assert ungated.skip_gates is None
    assert torch.equal(ungated._merge_skip(0, x, skip), x + ungated.skip_weights[0] * skip)


def test_switches_drop_bigram_value_embeddings_and_smeargate():
    h = tg.Hyperparameters({**TINY_ENV, "BIGRAM_VOCAB_SIZE": "0", "VE_ENABLED": "0", "SMEAR_GATE": "0"})
    names = [n for n, _ in tg.GPT(h).named_parameters()]
    assert not any(n.startswith(("bigram", "ve_", "smear")) for n in names)
    full = [n for n, _ in tg.GPT(tg.Hyperparameters({**TINY_ENV})).named_parameters()]
    assert any(n.startswith("smear") for n in full) and any(n.startswith("bigram") for n in full)


# ---------------------------------------------------------------------------------------------- optimiser

POLAR_EXPRESS = [  # SPEC-FRONTIER 9
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def _manual_ns(g, coeffs):
    x = g.double()
    transposed = x.size(-2) > x.size(-1)
    x = x.mT if transposed else x
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for a, b, c in coeffs:
        m = x @ x.mT
        x = a * x + (b * m + c * (m @ m)) @ x
    return x.mT if transposed else x


@pytest.mark.parametrize("steps", [3, 5, 7])
def test_polar_express_uses_the_listed_per_step_coefficients(steps):
    torch.manual_seed(0)
    g = torch.randn(2, 24, 16, dtype=torch.float64)
    got = tg.zeropower_via_newtonschulz5(g, steps, dtype=torch.float64, coeffs="polar_express")
    assert torch.allclose(got, _manual_ns(g, POLAR_EXPRESS[:min(steps, 5)]), atol=1e-10)
    fixed = tg.zeropower_via_newtonschulz5(g, steps, dtype=torch.float64)
    assert torch.allclose(fixed, _manual_ns(g, [(3.4445, -4.7750, 2.0315)] * steps), atol=1e-10)
    assert not torch.allclose(got, fixed, atol=1e-3)
    assert tg.ns_schedule("polar_express", steps) == POLAR_EXPRESS[:min(steps, 5)]


def test_muon_row_normalize_normalises_rows_before_newton_schulz():
    torch.manual_seed(0)
    g = torch.randn(2, 8, 16) * torch.logspace(-2, 2, 8)[None, :, None]  # rows of very different norms
    lr = 0.1
    results = {}
    for row_norm in (False, True):
        p = torch.nn.Parameter(torch.zeros(2, 8, 16))
        opt = tg.Muon([p], lr=lr, momentum=0.0, backend_steps=5, weight_decay=0.0, ns_dtype=torch.float32,
                      row_normalize=row_norm)
        p.grad = g.clone()
        opt.step()
        results[row_norm] = -p.detach() / lr
    u = g.bfloat16().float()  # Muon works on the bf16 gradient
    rows = (u / u.norm(dim=-1, keepdim=True)).bfloat16().float()  # normalised in fp32, kept in bf16 as u
    assert torch.allclose(results[True], tg.zeropower_via_newtonschulz5(rows, 5, dtype=torch.float32), atol=1e-5)
    assert torch.allclose(results[False], tg.zeropower_via_newtonschulz5(u, 5, dtype=torch.float32), atol=1e-5)
    assert not torch.allclose(results[True], results[False], atol=1e-2)
    assert torch.allclose(tg.normalize_rows(u).norm(dim=-1), torch.ones(2, 8))


def test_embed_wd_reaches_the_embedding_adamw_only():
    h = tg.Hyperparameters({**TINY_ENV, "EMBED_WD": "0.085", "ADAM_WD": "0.02"})
    muon, adams = tg.build_optimizers(h, tg.GPT(h))
    assert [a.param_groups[0]["weight_decay"] for a in adams] == [0.085, 0.02]
    assert muon.param_groups[0]["weight_decay"] == h.muon_wd


# ---------------------------------------------------------------------------------------------- schedule

def test_warmdown_frac_and_min_lr_by_time():
    h = tg.Hyperparameters({"MAX_WALLCLOCK_SECONDS": "100", "WARMDOWN_FRAC": "0.72", "MIN_LR": "0.1"})
    assert h.max_wallclock_ms == 100_000
    for ms, want in ((0, 1.0), (20_000, 1.0), (28_000, 1.0), (64_000, 0.5), (82_000, 0.25), (95_000, 0.1),
                     (100_000, 0.1), (120_000, 0.1)):
        assert tg.lr_multiplier(h, 10, ms) == pytest.approx(want), ms
    assert tg.lr_multiplier(h, 10, 92_800) == pytest.approx(0.1)  # the floor is reached at frac 1 - 0.1 * 0.72
    no_floor = tg.Hyperparameters({"MAX_WALLCLOCK_SECONDS": "100", "WARMDOWN_FRAC": "0.72"})
    assert tg.lr_multiplier(no_floor, 10, 95_000) == pytest.approx(0.05 / 0.72)
    # with QUANT=gptq the fraction is of the budget net of the reserve (SPEC-FRONTIER 10)
    gptq = tg.Hyperparameters({"MAX_WALLCLOCK_SECONDS": "100", "WARMDOWN_FRAC": "0.5", "QUANT": "gptq",
                               "GPTQ_RESERVE_SECONDS": "20"})
    assert tg.lr_multiplier(gptq, 10, 60_000) == pytest.approx(0.5)


def test_warmdown_frac_by_steps_without_a_cap():
    h = tg.Hyperparameters({"MAX_WALLCLOCK_SECONDS": "0", "ITERATIONS": "100", "WARMDOWN_FRAC": "0.5"})
    assert [tg.lr_multiplier(h, s, 0.0) for s in (0, 50, 75, 100)] == pytest.approx([1.0, 1.0, 0.5, 0.0])
    assert tg.training_fraction(h, 35, 123.0) == 0.35


def test_min_lr_floors_the_record_warmdown_too_and_is_off_by_default():
    h = tg.Hyperparameters({"MAX_WALLCLOCK_SECONDS": "0", "ITERATIONS": "100", "WARMDOWN_ITERS": "20"})
    assert tg.lr_multiplier(h, 99, 0.0) == pytest.approx(0.05)
    floored = tg.Hyperparameters({"MAX_WALLCLOCK_SECONDS": "0", "ITERATIONS": "100", "WARMDOWN_ITERS": "20",
                                  "MIN_LR": "0.2"})
    assert tg.lr_multiplier(floored, 99, 0.0) == pytest.approx(0.2)
    assert tg.lr_multiplier(floored, 85, 0.0) == pytest.approx(0.75)


def test_warmdown_frac_replaces_the_default_iters_and_conflicts_with_explicit_iters():
    h = tg.Hyperparameters({"WARMDOWN_FRAC": "0.5"})
    assert h.warmdown_iters == 0 and "setting WARMDOWN_ITERS=0 [default]" in h.dump()
    assert "WARMDOWN_FRAC=0.72 and WARMDOWN_ITERS=3500 both set the warmdown" in config_error(
        {"PRESET": "record_0409", "WARMDOWN_ITERS": "3500"})


# ---------------------------------------------------------------------------------------------- runs

CLOCK_WRAPPER = """
import os, sys, time
sys.path.insert(0, {repo!r})
import torch
import train_gpt as tg

class SkewedClock:
    '''perf_counter running `rate` times as fast as the real one (a machine `rate` times slower, as the run sees it).'''
    def __init__(self, rate):
        self.rate, self.start = rate, time.perf_counter()
    def __getattr__(self, name):
        return getattr(time, name)
    def perf_counter(self):
        return self.start + (time.perf_counter() - self.start) * self.rate

rank = int(os.environ.get("RANK", "0"))
if len(sys.argv) > 1:  # the wall clock at the rate given as the script's argument (main() takes no arguments)
    tg.time = SkewedClock(float(sys.argv.pop(1)))
else:  # rank r's clock runs 1 + r times as fast, on a clock the test controls: TRAIN_CLOCK=ms:X becomes ms:(1 + r)X
    kind, _, ms = os.environ["TRAIN_CLOCK"].partition(":")
    assert kind == "ms", os.environ["TRAIN_CLOCK"]
    os.environ["TRAIN_CLOCK"] = f"ms:{{float(ms) * (1 + rank):g}}"
train = tg.train

def train_and_save(rt, model, *args):
    out = train(rt, model, *args)
    torch.save(model.state_dict(), f"rank{{rank}}.pt")
    return out

tg.train = train_and_save
tg.main()
"""


def test_two_ranks_with_different_clocks_switch_looping_at_one_step_and_agree(tmp_path, sample_data):
    """Rank 1's clock runs twice as fast (a step counts 100 ms on rank 0, 200 ms on rank 1: TRAIN_CLOCK=ms, a clock
    the test controls, so the steps below are the same on a fast, slow or busy machine): the cap, the LR warmdown
    and the loop switch must still act at the same step on both ranks, the one the slower clock (the agreed elapsed
    time, the ranks' largest) gives: the switch once 0.3 of the 1.5 s cap has passed (after step 3, 600 ms), the
    stop at the cap (step 8, 1600 ms; the log's replayed_time is rank 0's own, 800 ms); rank 0's own clock would have
    switched after step 5 and stopped after step 15. Both end with equal weights."""
    wrapper = tmp_path / "clock_run.py"
    wrapper.write_text(CLOCK_WRAPPER.format(repo=str(REPO)))
    env = {**clean_environ(), **TINY_ENV, **sample_data, "RUN_ID": "clock", "OMP_NUM_THREADS": "1",
           "ITERATIONS": "100000", "MAX_WALLCLOCK_SECONDS": "1.5", "TRAIN_CLOCK": "ms:100", "WARMDOWN_ITERS": "0",
           "WARMDOWN_FRAC": "0.5", "NUM_LOOPS": "1", "LOOP_START": "1", "LOOP_END": "2", "ENABLE_LOOPING_AT": "0.3",
           "TRAIN_LOG_EVERY": "0", "TTT_ENABLED": "0", "EVAL_STRIDE": "0", "WARMUP_STEPS": "0"}
    proc = launcher.run_ranks([wrapper], env, tmp_path, 2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(tmp_path, "clock")
    switch = re.search(r"^layer_loop:enabled step:(\d+) frac:(\S+) encoder:\[0, 1, 2\] decoder:\[1, 2, 3\]$", log,
                       re.M)
    stop = re.search(r"^stopping_early: wallclock_cap train_time:\d+ms step:(\d+)/100000 replayed_time:(\d+)ms$", log,
                     re.M)
    assert switch and stop, log[-3000:]
    assert (int(switch.group(1)), switch.group(2), int(stop.group(1)), stop.group(2)) == (3, "0.4000", 8, "800"), \
        (switch.group(0), stop.group(0))
    a, b = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_tiny_record_0409_run_logs_preset_settings_loop_switch_and_evaluates(tmp_path, sample_data):
    data = short_val_data(sample_data, tmp_path, 4 * 128 + 1)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**TINY_ENV, **data, "PRESET": "record_0409", "RUN_ID": "p0409", "VOCAB_SIZE": "1024",
           "WARMDOWN_ITERS": "0", "NUM_LAYERS": "5", "LOOP_START": "1", "LOOP_END": "2", "XSA_LAST_N": "5",
           "PARALLEL_RESIDUAL_START": "3", "ITERATIONS": "6", "WARMUP_STEPS": "1", "GPTQ_CALIBRATION_BATCHES": "2",
           "VE_LAYERS": "3,4"}
    proc = run_training(env, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(run_dir, "p0409")
    assert re.search(r"^preset:record_0409 overridden_by_env:DATA_PATH,TOKENIZER_PATH,VOCAB_SIZE,WARMDOWN_ITERS,"
                     r"XSA_LAST_N,LOOP_START,LOOP_END,PARALLEL_RESIDUAL_START,GPTQ_CALIBRATION_BATCHES$", log, re.M), log[-4000:]
    for line in ("setting NUM_LOOPS=2 [preset]", "setting LOOP_START=1 [env]", "setting MUON_ROW_NORMALIZE=1 [preset]",
                 "setting QUANT=gptq [preset]", "setting COMPRESSOR=brotli [preset]", "setting SEED=1337 [env]",
                 "setting EMA_DECAY=0.9965 [preset]", "setting TTT_LR=0.005 [preset]"):
        assert f"\n{line}\n" in log, line
    assert "\nwarmup_step:1/1\nwarmup_step:1/1 looping:1\n" in log
    assert ("layer_loop: encoder:[0, 1] decoder:[2, 3, 4], looped from ENABLE_LOOPING_AT=0.35: "
            "encoder:[0, 1, 2, 1] decoder:[2, 1, 2, 3, 4]") in log
    # step-based fraction without a cap: 3/6 >= 0.35 after step 3 (2/6 is not)
    assert "\nlayer_loop:enabled step:3 frac:0.5000 encoder:[0, 1, 2, 1] decoder:[2, 1, 2, 3, 4]\n" in log
    assert re.search(r"^gptq: hessians:\d+ batches:2x1 ", log, re.M)
    exact = re.findall(r"^(final_int6_roundtrip|final_int6_sliding_window|legal_ttt)_exact (.*)$", log, re.M)
    assert [k for k, _ in exact] == ["final_int6_roundtrip", "final_int6_sliding_window", "legal_ttt"]
    # the artifact alone reproduces it: a fresh process reads it back and evaluates looped
    again = run_training({**env, "RUN_ID": "p0409_eval", "EVAL_ONLY": str(run_file(run_dir, "p0409"))}, run_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.findall(r"^(final_int6_roundtrip|final_int6_sliding_window|legal_ttt)_exact (.*)$",
                      read_log(run_dir, "p0409_eval"), re.M) == exact


def test_a_looped_artifact_loads_looped(tmp_path):
    h = _looped_hparams(ENABLE_LOOPING_AT="0.5")
    model = tg.build_model(h)
    tg.save_artifact(str(tmp_path / "a.ptz"), model, False, h)
    assert tg.load_artifact(str(tmp_path / "a.ptz"), h).looping is True
    plain = tg.Hyperparameters({**TINY_ENV})
    tg.save_artifact(str(tmp_path / "b.ptz"), tg.build_model(plain), False, plain)
    assert tg.load_artifact(str(tmp_path / "b.ptz"), plain).looping is False


def test_compare_script_refuses_an_unknown_variant_in_one_line():
    proc = subprocess.run(["bash", str(REPO / "scripts" / "bench" / "compare_frontier.sh")], capture_output=True,
                          text=True, env={**clean_environ(), "VARIANTS": "default bogus"}, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("scripts/bench/compare_frontier.sh: unknown variant 'bogus' (choose from: default "
                                   "loops parallel skip_gates no_extras qk525 muon_eq_r polar_express warmdown_frac "
                                   "min_lr embed_wd preset_1024 default_8192 preset_8192 default_caseops preset_0427 "
                                   "preset_0430)")
