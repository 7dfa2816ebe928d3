"""FUSED_MLP / FUSED_CE (issue 21): the Triton kernels against the eager formulas, run on CPU by Triton's
interpreter. TRITON_INTERPRET=1 must be set before `import triton` (Triton's own jitted helpers, tl.sigmoid,
tl.max..., are made interpretable only then, and `import torch._dynamo` already imports triton), so the
test_interpreted_* tests run only in a process started with it: test_kernels_interpreted_in_a_fresh_process
starts one (or run `TRITON_INTERPRET=1 python -m pytest tests/test_kernels.py`). Shapes are not multiples of
the tile sizes; the interpreter is slow, so they are small."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from conftest import REPO, clean_environ, read_log, run_training, shared_run

CPU = torch.device("cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # set when this process started
HAS_TRITON = importlib.util.find_spec("triton") is not None
# Triton's CPU interpreter before 3.9 cannot run these kernels (3.7.1, the version torch 2.13.0's CUDA wheel pins:
# "KeyError: '_mlp_tile_kernel'" in its trial run, so select_fused_kernels falls back to eager); compiled for a GPU
# they build with it (test_kernels_compile_for_an_h100_without_one).
TRITON_VERSION = importlib.metadata.version("triton") if HAS_TRITON else None
OLD_INTERPRETER = HAS_TRITON and tuple(int(p) for p in TRITON_VERSION.split(".")[:2]) < (3, 9)


def needs_interpreter():
    if not HAS_TRITON:
        pytest.skip("Triton is not installed (pip install triton)")
    if OLD_INTERPRETER:
        pytest.skip(f"Triton {TRITON_VERSION}'s CPU interpreter cannot run these kernels (KeyError on the kernel's "
                    "name); Triton >= 3.9 runs them (pip install 'triton>=3.9' on a CPU-only machine)")
SMALL = {"MODEL_DIM": "32", "NUM_HEADS": "2", "NUM_KV_HEADS": "1", "VOCAB_SIZE": "64", "VE_LAYERS": "1",
         "NUM_LAYERS": "2", "XSA_LAST_N": "1"}


def hp(**env):
    return tg.Hyperparameters({**SMALL, **{k: str(v) for k, v in env.items()}})


@pytest.fixture
def interpret():
    """Both kernels switched on through select_fused_kernels under Triton's CPU interpreter; off afterwards. The C++
    that inductor builds around them on CPU (the tests that compile) in scalar loops, without the CPU vector ISA's
    templates, as the inductor test in tests/test_compile.py builds its own: the same graphs, lowering and Python
    wrapper calling the custom ops, and 4 s less of a cold Inductor cache's compiling (issue 69)."""
    needs_interpreter()
    if not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 from the process start (test_kernels_interpreted_in_a_fresh_process)")
    import torch._inductor.config as inductor_config

    lines = tg.select_fused_kernels(hp(FUSED_MLP=1, FUSED_CE=1), CPU, torch.float32)
    assert all("triton kernel (Triton interpreter on CPU" in line for line in lines), lines
    with inductor_config.patch({"cpp.vec_isa_ok": False}):
        yield
    tg._FUSED.update(mlp=False, ce=False, dtype=torch.float32, interpret=False)


def rel(a, b):
    """max |a - b| / max |b|, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def leaves(*tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


def mlp_grads(fn, x, w1, w2, g):
    out = fn(x, w1, w2)
    out.backward(g.to(out.dtype))
    return [out, x.grad, w1.grad, w2.grad]


def mlp_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    m, k, n = (3, 50), 70, 200  # 150 rows: neither fp32's 64 x 64 x 32 tiles nor bf16's 128 x 128 x 64 divide it
    x = torch.randn(*m, k, generator=gen, dtype=torch.float64)
    w1 = torch.randn(n, k, generator=gen, dtype=torch.float64) / k ** 0.5
    w2 = torch.randn(k, n, generator=gen, dtype=torch.float64) / n ** 0.5
    return x, w1, w2, torch.randn(*m, k, generator=gen, dtype=torch.float64)


def fused_op(x, w1, w2):
    return torch.ops.pgolf.fused_mlp(x, w1, w2)[0]


def test_interpreted_fused_mlp_forward_and_gradients_fp32(interpret):
    x, w1, w2, g = mlp_inputs()
    exact = mlp_grads(tg.leaky_relu2_mlp, *leaves(x, w1, w2, dtype=torch.float64), g)
    fused = mlp_grads(fused_op, *leaves(x, w1, w2, dtype=torch.float32), g)
    for name, a, b in zip(("out", "dx", "dW_up", "dW_down"), fused, exact):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert rel(a, b) <= 1e-5, (name, rel(a, b))


def test_interpreted_fused_mlp_forward_and_gradients_bf16(interpret):
    """bf16 inputs: the kernel rounds where eager does (pre, post, out), the backward once where eager rounds
    twice; so against the exact result on the same bf16 values it is at most 2x eager bf16's error."""
    x, w1, w2, g = mlp_inputs(1)
    bf = [t.bfloat16().double() for t in (x, w1, w2, g)]
    exact = mlp_grads(tg.leaky_relu2_mlp, *leaves(*bf[:3], dtype=torch.float64), bf[3])
    eager = mlp_grads(tg.leaky_relu2_mlp, *leaves(x, w1, w2, dtype=torch.bfloat16), g)
    fused = mlp_grads(fused_op, *leaves(x, w1, w2, dtype=torch.bfloat16), g)
    pre, post = torch.ops.pgolf.fused_mlp(*(t.bfloat16() for t in (x, w1, w2)))[1:]
    pre_exact = (bf[0] @ bf[1].T).reshape(-1, w1.size(0))
    assert pre.dtype == torch.bfloat16 and rel(pre, pre_exact) <= 2 ** -8
    assert torch.equal(post, F.leaky_relu(pre, 0.5).square())  # post from the rounded pre, as eager
    for name, a, e, b in zip(("out", "dx", "dW_up", "dW_down"), fused, eager, exact):
        assert a.dtype == torch.bfloat16
        assert rel(a, b) <= 2 * rel(e, b) + 1e-6 and rel(a, b) < 0.05, (name, rel(a, b), rel(e, b))


def ce_inputs(dtype, rows=37, vocab=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 20).to(dtype)
    return logits, torch.randint(0, vocab, (rows,), generator=gen), torch.rand(rows, generator=gen)


def ce_exact(logits, targets, g, cap=30.0):
    """Per-row losses, logsumexp of the softcapped logits and the logits' gradient for upstream g, in fp64."""
    x = logits.detach().double().requires_grad_()
    z = cap * torch.tanh(x / cap)
    losses = F.cross_entropy(z, targets, reduction="none")
    losses.backward(g.double())
    return losses, torch.logsumexp(z, dim=-1), x.grad


@pytest.mark.parametrize("gpu_layout", [False, True], ids=["interpreter_rows", "cuda_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_fused_ce_losses_lse_and_gradient(interpret, monkeypatch, dtype, gpu_layout):
    """Against fp64 on the same input values: losses and lse to 1e-5 (fp32 arithmetic inside the kernel
    whatever the input dtype), the gradient to 1e-5 in fp32 and to bf16 rounding in bf16. cuda_rows runs the
    GPU layout (one row per program, 1024 columns per block: 3 blocks over 2500 columns)."""
    vocab = 2500 if gpu_layout else 300
    if gpu_layout:
        monkeypatch.setattr(tg, "ce_rows_config", lambda x: (1, 1024, 4))
    logits, targets, g = ce_inputs(dtype, rows=21 if gpu_layout else 37, vocab=vocab)
    x = logits.clone().requires_grad_()
    losses, lse = torch.ops.pgolf.softcapped_ce(x, targets, 30.0)
    losses.backward(g)
    exact = ce_exact(logits, targets, g)
    assert losses.dtype == lse.dtype == torch.float32 and x.grad.dtype == dtype
    assert rel(losses, exact[0]) <= 1e-5 and rel(lse, exact[1]) <= 1e-5
    assert rel(x.grad, exact[2]) <= (1e-5 if dtype == torch.float32 else 2 ** -8)


def test_interpreted_fused_ce_mean_matches_the_eager_training_loss(interpret):
    """fused_softcapped_ce is the eager loss (fp32 logits, so the eager softcap is fp32 too) and its gradient."""
    logits, targets, _ = ce_inputs(torch.float32, rows=24, vocab=70)
    a, b = (logits.view(2, 12, 70).clone().requires_grad_() for _ in range(2))
    fused = tg.fused_softcapped_ce(a, targets.view(2, 12), 30.0)
    eager = tg.softcapped_ce(b, targets.view(2, 12), 30.0)
    fused.backward()
    eager.backward()
    assert rel(fused, eager) <= 1e-6 and rel(a.grad, b.grad) <= 1e-5


def test_interpreted_fused_ce_skips_padding_targets_as_the_eager_loss_does(interpret):
    """A packed row's piece is padded with IGNORE targets (MICRO_BATCH_SPLIT, issue 40): the fused kernels give those
    rows loss 0 and gradient 0, and the padded mean is the eager loss's (F.cross_entropy's ignore_index) with its
    gradient; the rows that are not padding keep exactly the values they have without padding."""
    logits, targets, _ = ce_inputs(torch.float32, rows=24, vocab=70)
    padded = targets.clone()
    padded[5:9] = tg.IGNORE
    padded[-3:] = tg.IGNORE
    a, b = (logits.view(2, 12, 70).clone().requires_grad_() for _ in range(2))
    fused = tg.fused_softcapped_ce(a, padded.view(2, 12), 30.0, padded=True)
    eager = tg.softcapped_ce(b, padded.view(2, 12), 30.0)
    fused.backward()
    eager.backward()
    assert rel(fused, eager) <= 1e-6 and rel(a.grad, b.grad) <= 1e-5
    pad = padded == tg.IGNORE
    assert float(a.grad.view(24, 70)[pad].abs().max()) == 0.0
    x = logits.clone().requires_grad_()
    losses, lse = torch.ops.pgolf.softcapped_ce(x, padded, 30.0)
    whole, whole_lse = torch.ops.pgolf.softcapped_ce(logits, targets, 30.0)
    assert torch.equal(losses[~pad], whole[~pad]) and float(losses[pad].abs().max()) == 0.0
    assert torch.equal(lse, whole_lse)


def test_interpreted_custom_ops_under_torch_compile_fullgraph_give_the_eager_loss(interpret):
    """One graph (fullgraph=True, inductor on CPU) around both custom ops: same loss and gradients as eager."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 20, 32, generator=gen)
    w1, w2 = (torch.randn(s, generator=gen).requires_grad_() for s in ((48, 32), (50, 48)))
    targets = torch.randint(0, 50, (2, 20), generator=gen)

    def loss(fused, x, w1, w2, targets):
        logits = (tg.fused_leaky_relu2_mlp if fused else tg.leaky_relu2_mlp)(x, w1 / 8, w2 / 8)
        return (tg.fused_softcapped_ce if fused else tg.softcapped_ce)(logits, targets, 30.0)

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    got = compiled(True, x, w1, w2, targets)
    got_grads = torch.autograd.grad(got, (w1, w2))
    want = loss(False, x, w1, w2, targets)
    want_grads = torch.autograd.grad(want, (w1, w2))
    assert rel(got, want) <= 1e-6
    assert all(rel(a, b) <= 1e-5 for a, b in zip(got_grads, want_grads))
    assert compiled(True, x, w1, w2, targets).item() == got.item()


# ---- the lse output's gradient and training's objective (issue 47): a term on the rows' logsumexp, e.g. z-loss


def lse_inputs(dtype):
    """ce_inputs with padding rows (IGNORE targets) and an upstream gradient for the lse output."""
    logits, targets, g = ce_inputs(dtype)
    targets[5:9] = tg.IGNORE
    targets[-2:] = tg.IGNORE
    return logits, targets, g, torch.randn(targets.numel(), generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_fused_ce_lse_output_has_the_eager_formulas_gradient(interpret, dtype):
    """d lse / d logits = softmax(z) times the softcap's derivative: the backward kernel adds the lse output's
    gradient gl to the losses' g. Against fp64 autograd of the eager formula on the same input values, padding rows
    included (loss 0, no gradient from the loss; their lse is the row's, with its gradient), and with only the lse
    used (the losses' gradient None); to 1e-5 in fp32 and to bf16 rounding in bf16, as the losses' gradient."""
    logits, targets, g, gl = lse_inputs(dtype)
    xe = logits.detach().double().requires_grad_()
    z = 30.0 * torch.tanh(xe / 30.0)
    want_losses = F.cross_entropy(z, targets, reduction="none", ignore_index=tg.IGNORE)
    want_lse = torch.logsumexp(z, dim=-1)
    want_both = torch.autograd.grad((want_losses * g.double() + want_lse * gl.double()).sum(), xe, retain_graph=True)[0]
    want_lse_only = torch.autograd.grad((want_lse * gl.double()).sum(), xe)[0]
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    x = logits.clone().requires_grad_()
    losses, lse = torch.ops.pgolf.softcapped_ce(x, targets, 30.0)
    torch.autograd.backward([losses, lse], [g, gl])
    assert rel(losses, want_losses) <= 1e-5 and rel(lse, want_lse) <= 1e-5
    assert x.grad.dtype == dtype and rel(x.grad, want_both) <= tol
    pad = targets == tg.IGNORE
    assert rel(x.grad[pad], want_lse_only[pad]) <= tol  # padding rows: the lse's gradient alone
    x = logits.clone().requires_grad_()
    (torch.ops.pgolf.softcapped_ce(x, targets, 30.0)[1] * gl).sum().backward()
    assert rel(x.grad, want_lse_only) <= tol


def z_loss(ce, coef=0.05):
    """The z-loss term of docs/frontier.md "Adding a technique": coef x the mean squared lse over the scored rows."""
    return coef * (ce.lse.square() * ce.scored).sum() / ce.scored.sum()


def test_interpreted_a_z_loss_on_padded_rows_is_the_eager_formula_fused_and_eager(interpret):
    """fused_softcapped_ce(..., lse=True) on a padded piece, its mean plus a z-loss: the eager formula's loss and
    gradient (fp64 autograd of the mean CE over the scored rows plus coef x their mean lse^2), padding rows' gradient
    exactly 0; the same through the eager fallback (fp64 logits: no kernel), and softcapped_ce(..., lse=True)."""
    logits, targets, _, _ = lse_inputs(torch.float32)
    xe = logits.double().requires_grad_()
    z = 30.0 * torch.tanh(xe / 30.0)
    keep = targets != tg.IGNORE
    want = F.cross_entropy(z, targets, ignore_index=tg.IGNORE) + 0.05 * torch.logsumexp(z, -1)[keep].square().mean()
    (want_grad,) = torch.autograd.grad(want, xe)
    for fn, dtype in ((lambda x: tg.fused_softcapped_ce(x, targets, 30.0, padded=True, lse=True), torch.float32),
                      (lambda x: tg.fused_softcapped_ce(x, targets, 30.0, padded=True, lse=True), torch.float64),
                      (lambda x: tg.softcapped_ce(x, targets, 30.0, lse=True), torch.float32)):
        x = logits.to(dtype).clone().requires_grad_()
        ce = fn(x)
        loss = ce.mean + z_loss(ce)
        loss.backward()
        assert rel(loss, want) <= 1e-6 and rel(x.grad, want_grad) <= 1e-5, dtype
        assert float(x.grad[~keep].abs().max()) == 0.0


def test_interpreted_the_lse_gradient_is_computed_only_where_a_term_reads_the_lse(interpret, monkeypatch):
    """The default loss's backward kernel runs as before (LSE_GRAD off: no extra load or term), eager and under
    torch.compile (fullgraph, inductor): the lse output nothing read has no gradient (None, not zeros); a term that
    reads it switches LSE_GRAD on, in both."""
    logits, targets, _, _ = lse_inputs(torch.float32)
    launched = []
    ce_rows = tg.ce_rows
    monkeypatch.setattr(tg, "ce_rows", lambda kernel, *a, **k: launched.append(k.get("LSE_GRAD")) or ce_rows(
        kernel, *a, **k))

    def default(x):
        return tg.fused_softcapped_ce(x, targets, 30.0, padded=True)

    def with_term(x):
        ce = tg.fused_softcapped_ce(x, targets, 30.0, padded=True, lse=True)
        return ce.mean + z_loss(ce)
    for fn, lse_grad in ((default, False), (with_term, True)):
        for compiled in (False, True):
            torch._dynamo.reset()
            x = logits.clone().requires_grad_()
            launched.clear()
            (torch.compile(fn, fullgraph=True) if compiled else fn)(x).backward()
            assert launched == [None, lse_grad], (fn.__name__, compiled, launched)  # the forward kernel, the backward


def training_loss_extension(monkeypatch, fused):
    """training_loss is the Trainer's objective: by default today's loss bit for bit (GPT.forward's formula before
    issue 47, written out here), and training_loss replaced by one with a z-loss term (docs/frontier.md "Adding a
    technique") changes the loss and every gradient by the term's, as autograd of the eager formula gives it."""
    h = hp(AUTOCAST_DTYPE="fp32", TRAIN_SEQ_LEN=24)
    rt = tg.Runtime(h, CPU, False, True, None)
    model = rt.prepare_model(tg.build_model(h))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # weights off their initial zeros, so that every one has a gradient
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
    x, y = (torch.randint(0, 64, (2, 24), generator=gen) for _ in range(2))
    params = [p for p in model.parameters() if p.requires_grad]
    trainer = tg.Trainer(rt, model)
    assert model.training and tg._FUSED["ce"] == fused

    def grads(loss):
        return [loss.detach()] + [torch.zeros_like(p) if d is None else d for p, d in
                                  zip(params, torch.autograd.grad(loss, params, allow_unused=True))]
    default = grads(trainer.forward(x, y))
    logits = model.outputs(x).logits
    if fused:
        before = torch.ops.pgolf.softcapped_ce(logits.reshape(-1, 64), y.reshape(-1), 30.0)[0].mean()
    else:
        capped = tg.softcap_logits(logits, 30.0)
        before = F.cross_entropy(capped.float().reshape(-1, capped.size(-1)), y.reshape(-1), ignore_index=tg.IGNORE)
    assert all(torch.equal(a, b) for a, b in zip(default, grads(before)))

    def training_loss(h, model, ids, targets, docs=None, padded=False):
        out = model.outputs(ids, docs)
        ce = model.cross_entropy(out.logits, targets, padded, lse=True)
        return ce.mean + z_loss(ce)
    monkeypatch.setattr(tg, "training_loss", training_loss)
    with_z = grads(trainer.forward(x, y))

    def eager(with_ce):
        z = 30.0 * torch.tanh(model.outputs(x).logits.reshape(-1, 64) / 30.0)
        term = 0.05 * torch.logsumexp(z, -1).square().mean()
        return grads(F.cross_entropy(z, y.reshape(-1)) + term if with_ce else term)
    want, term = eager(True), eager(False)
    assert float(term[0]) > 0.2 * float(default[0])  # lse ~ log 64 here: a term a fifth of the loss
    # the loss and gradients with the term: the eager formula's, to fp32 reassociation (the bf16 embedding's gradient:
    # to its rounding); the change of each fp32 gradient: the term's gradient
    assert rel(with_z[0], want[0]) <= 1e-6 and rel(with_z[0] - default[0], term[0]) <= 1e-5
    for p, got, w, d, t in zip(params, with_z[1:], want[1:], default[1:], term[1:]):
        assert float(t.abs().max()) > 0 and rel(got, w) <= (1e-5 if p.dtype == torch.float32 else 2 ** -8)
        assert p.dtype != torch.float32 or rel(got - d, t) <= 1e-4, (rel(got - d, t), p.shape)


def test_training_loss_is_the_trainers_objective_and_takes_a_z_loss_term_eager(monkeypatch):
    training_loss_extension(monkeypatch, fused=False)


def test_interpreted_training_loss_is_the_trainers_objective_and_takes_a_z_loss_term_fused(interpret, monkeypatch):
    training_loss_extension(monkeypatch, fused=True)


def test_fallback_lines_name_the_reason(monkeypatch):
    """Off by default; asked for where the kernels cannot run: eager, and the log line says why."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    try:
        assert tg.select_fused_kernels(hp(), CPU, torch.float32) == ["fused_mlp: eager (FUSED_MLP=0)",
                                                                      "fused_ce: eager (FUSED_CE=0)"]
        if HAS_TRITON:
            lines = tg.select_fused_kernels(hp(FUSED_MLP=1, FUSED_CE=1), CPU, torch.float32)
            assert lines[1] == ("fused_ce: eager, fallback: no CUDA device (on CPU the kernels run only in "
                                "Triton's interpreter, TRITON_INTERPRET=1) (FUSED_CE=1)")
            assert not tg._FUSED["mlp"] and not tg._FUSED["ce"]
        monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
        assert tg.select_fused_kernels(hp(FUSED_CE=1), CPU, torch.float32) == [
            "fused_mlp: eager (FUSED_MLP=0)",
            "fused_ce: eager, fallback: Triton is not installed (pip install triton) (FUSED_CE=1)"]
    finally:
        tg._FUSED.update(mlp=False, ce=False, dtype=torch.float32, interpret=False)


def test_interpreted_unsupported_dtype_falls_back(interpret):
    lines = tg.select_fused_kernels(hp(FUSED_MLP=1), CPU, torch.float64)
    assert lines[0] == "fused_mlp: eager, fallback: unsupported dtype torch.float64 (FUSED_MLP=1)"
    x, w1, w2, _ = mlp_inputs()
    assert torch.equal(tg.fused_leaky_relu2_mlp(x, w1, w2), tg.leaky_relu2_mlp(x, w1, w2))


def test_interpreted_gptq_calibration_sees_the_mlp_with_fused_mlp_on(interpret):
    """collect_hessians runs the model in eval mode, where Block.mlp is eager: with FUSED_MLP on, the same
    Hessians (mlp.fc and mlp.proj included) as with it off; and a recorder in training mode sees the MLP too."""
    h = hp(AUTOCAST_DTYPE="fp32", GPTQ_CALIBRATION_BATCHES=2, FUSED_MLP=1)
    rt = tg.Runtime(h, CPU, False, True, None, None, "fp32")
    model = rt.prepare_model(tg.build_model(h))
    with torch.no_grad():
        model.mlp_down_bank.normal_(std=0.05, generator=torch.Generator().manual_seed(3))
    batches = [torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(2)]

    class Loader:
        def __init__(self):
            self.it = iter(batches)

        def next_batch(self):
            x = next(self.it)
            return x, x

    on = tg.collect_hessians(rt, model, Loader())
    rec = tg.HessianRecorder(model)  # a recorder listening in training mode also turns the kernel off
    tg._RECORDER[0] = rec
    try:
        with torch.no_grad():
            model.forward_logits(batches[0])
    finally:
        tg._RECORDER[0] = None
    assert model.training and {"blocks.1.mlp.fc.weight", "blocks.1.mlp.proj.weight"} <= set(rec.sums)
    tg._FUSED["mlp"] = False
    off = tg.collect_hessians(rt, model, Loader())
    assert {"blocks.0.mlp.fc.weight", "blocks.1.mlp.proj.weight"} <= set(on) and set(on) == set(off)
    assert all(torch.equal(on[k], off[k]) for k in on)


TINY_KERNEL_RUN = {
    "NUM_LAYERS": "2", "MODEL_DIM": "32", "NUM_HEADS": "2", "NUM_KV_HEADS": "1", "VE_LAYERS": "1",
    "XSA_LAST_N": "1", "TRAIN_SEQ_LEN": "64", "EVAL_SEQ_LEN": "64", "TRAIN_BATCH_TOKENS": "512",
    "GRAD_ACCUM_STEPS": "1", "VAL_BATCH_SIZE": "4096", "ITERATIONS": "2", "WARMUP_STEPS": "0",
    "WARMDOWN_ITERS": "1", "MAX_WALLCLOCK_SECONDS": "0", "VAL_LOSS_EVERY": "0", "TRAIN_LOG_EVERY": "1",
    "TTT_ENABLED": "0", "EVAL_STRIDE": "0", "SEED": "1337", "AUTOCAST_DTYPE": "fp32",
}


def test_kernels_compile_for_an_h100_without_one():
    """Triton's whole GPU build (frontend, MLIR passes, ptxas from its wheel) of the bf16 kernels for sm_90, as a
    launch specialises them (unit strides are constants): catches what the interpreter accepts and a GPU does
    not. The MLP tiles use Hopper's warpgroup MMA with a 3-stage copy pipeline."""
    if INTERPRETED or not HAS_TRITON:
        pytest.skip("needs Triton's compiler (a process without TRITON_INTERPRET=1)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    kernels = tg.triton_kernels()
    bm, bn, bk, warps, stages = tg.mlp_tile_config(torch.bfloat16)
    mlp_sig = {**{name: "*bf16" for name in ("a_ptr", "b_ptr", "out_ptr", "aux_ptr")},
               **{name: "i32" for name in ("M", "N", "K", "s_am", "s_bn", "s_bk")}}
    mlp = {"IEEE": False, "UPCAST": False, "ROUND_BF16": False, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
           "GROUP_M": 8, "s_ak": 1}
    ce_sig = {"x_ptr": "*bf16", "t_ptr": "*i64", "R": "i32", "V": "i32", "s_row": "i32", "cap": "fp32"}
    ce = {"ROWS": 1, "BLOCK_V": 1024}  # ce_rows_config's CUDA layout
    builds = [("_mlp_tile_kernel", mlp_sig, {**mlp, "FORWARD": True, "s_bk": 1}, warps, stages),  # B = W_up
              ("_mlp_tile_kernel", mlp_sig, {**mlp, "FORWARD": False, "s_bn": 1}, warps, stages),  # B = W_down^T
              ("_ce_fwd_kernel", {**ce_sig, "loss_ptr": "*fp32", "lse_ptr": "*fp32"}, ce, 4, 1),
              *(("_ce_bwd_kernel", {**ce_sig, "lse_ptr": "*fp32", "g_ptr": "*fp32", "gl_ptr": "*fp32", "dx_ptr": "*bf16"},
                 {**ce, "ROUND_BF16": False, "LSE_GRAD": lse_grad}, 4, 1) for lse_grad in (False, True))]
    for name, sig, consts, num_warps, num_stages in builds:
        fn = kernels[name]
        signature = {arg: "constexpr" if arg in consts else sig[arg] for arg in fn.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)  # the record's shapes
                   if signature[arg] != "constexpr" and arg not in ("R", "cap")}
        compiled = triton_compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=aligned),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
        assert len(compiled.asm["cubin"]) > 0, name
        if name == "_mlp_tile_kernel":
            assert "warp_group_dot" in compiled.asm["ttgir"] and "async_copy" in compiled.asm["ttgir"]


def test_kernels_interpreted_in_a_fresh_process():
    """The test_interpreted_* tests, in a process that sets TRITON_INTERPRET=1 before anything imports triton."""
    if INTERPRETED:
        pytest.skip("this process runs them itself")
    needs_interpreter()
    env = {**clean_environ(), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_interpreted",
                           __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "skipped" not in proc.stdout, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert "16 passed" in proc.stdout, proc.stdout[-2000:]


KERNEL_RUN_ID = "kernels"


def kernel_run(tmp_path_factory, sample_data) -> Path:
    """The folder of the tiny run with both kernels interpreted (TINY_KERNEL_RUN, FUSED_MLP=1 FUSED_CE=1,
    TRITON_INTERPRET=1; RUN_ID kernels), made once for the session: the eager comparison here and the packed file's
    twin (tests/test_pack_code.py) read the same run."""
    env = {**TINY_KERNEL_RUN, **sample_data, "FUSED_MLP": "1", "FUSED_CE": "1", "TRITON_INTERPRET": "1"}
    return shared_run(tmp_path_factory, KERNEL_RUN_ID, env)


def test_tiny_training_run_with_both_kernels_matches_the_eager_run(tmp_path, tmp_path_factory, sample_data):
    """Two steps with FUSED_MLP=1 FUSED_CE=1 (interpreted kernels; the second step's loss and the final one
    follow updates through both backward kernels) give the eager run's losses within bf16 rounding, and the log
    says the kernels ran."""
    needs_interpreter()
    losses = {}
    for on in (0, 1):
        if on:
            log = read_log(kernel_run(tmp_path_factory, sample_data), KERNEL_RUN_ID)
        else:
            env = {**TINY_KERNEL_RUN, **sample_data, "RUN_ID": "k", "FUSED_MLP": "0", "FUSED_CE": "0",
                   "TRITON_INTERPRET": "0"}
            proc = run_training(env, tmp_path)
            assert proc.returncode == 0, proc.stderr[-3000:]
            log = read_log(tmp_path, "k")
        for name in ("mlp", "ce"):
            assert (f"fused_{name}: triton kernel (Triton interpreter on CPU" if on else
                    f"fused_{name}: eager (FUSED_{name.upper()}=0)") in log
        losses[on] = [float(v) for v in re.findall(r"^step:\d+/2 train_loss:([0-9.]+)", log, re.M)]
        losses[on].append(float(re.search(r"final_int6_roundtrip_exact val_loss:([0-9.]+)", log).group(1)))
    assert len(losses[0]) == 3
    for a, b in zip(losses[1], losses[0]):
        assert abs(a - b) <= 2 ** -8 * abs(b), losses


def test_bench_kernels_says_it_needs_cuda_on_cpu(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py"])
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(REPO / "scripts" / "bench" / "bench_kernels.py"), run_name="__main__")
    assert done.value.code == 0
    assert "bench_kernels.py needs CUDA" in capsys.readouterr().out


# torch 2.13.0's CUDA wheel for Linux x86_64 (what `pip install torch==2.13.0` takes on a GPU machine; `===2.13.0`
# fetches it anywhere) declares, in its METADATA, read on 2026-11-25 from torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl:
#   Requires-Dist: triton==3.7.1; platform_system == "Linux" and python_version < "3.15"
TORCH_CUDA_TRITON_PIN = "3.7.1"


def test_requirements_admit_the_triton_that_torchs_cuda_wheel_pins():
    """requirements-dev.txt's triton line must admit torch's own pin, or a GPU machine's test install cannot resolve
    (issue 34: 'triton>=3.9' could not); requirements.txt, which requirements-gpu.txt includes, names no triton
    (torch's CUDA wheel brings its own)."""
    from packaging.requirements import Requirement

    def requirements(name):
        lines = [line.split("#")[0].strip() for line in (REPO / name).read_text().splitlines()]
        return {r.name: r for r in (Requirement(line) for line in lines if line and not line.startswith("-"))}

    run, dev = requirements("requirements.txt"), requirements("requirements-dev.txt")
    torch_req, triton_req = run["torch"], dev["triton"]
    assert "triton" not in run and "-r requirements.txt" in (REPO / "requirements-dev.txt").read_text()
    assert "2.13.0" in torch_req.specifier, "the pin above was read for torch 2.13.0: read it again for the new one"
    assert triton_req.specifier.contains(TORCH_CUDA_TRITON_PIN), triton_req
    assert triton_req.marker.evaluate({"sys_platform": "linux", "platform_machine": "x86_64"})
    assert "-r requirements.txt" in (REPO / "requirements-gpu.txt").read_text()
    assert not Requirement("triton>=3.9").specifier.contains(TORCH_CUDA_TRITON_PIN)  # the guard can fail
