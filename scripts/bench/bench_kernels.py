#!/usr/bin/env python3
"""Time FUSED_MLP's and FUSED_CE's Triton kernels (issue 21) against eager and torch.compile'd PyTorch, on a GPU.

    python3 scripts/bench/bench_kernels.py [--tokens 98304] [--dim 512] [--hidden 2048] [--vocab 8192] [--reps 20]
                                     [--no-step]

Defaults are one GPU's share of the 04-27 record (SPEC-FRONTIER 15, 18): the MLP on 98,304 x 512 bf16
activations with a 2,048-wide hidden layer, the softcapped cross-entropy on 98,304 x 8,192 bf16 logits.
For each: forward, forward + backward, and the backward alone (their difference), as the median of --reps
timed runs after warm-up (CUDA events). First, check_kernels compares both kernels' numbers on the GPU with
fp64 (the bounds of tests/test_kernels.py) and exits 1 on a mismatch, before any timing. The MLP's rate is in
TFLOP/s (forward 4·M·K·N, forward + backward 12·M·K·N); the cross-entropy's, which does next to no arithmetic, in GB/s of the least traffic it needs (read
the logits; with backward read them twice and write their gradient). Then a full training step of
train_gpt.py (Trainer.step, PRESET=record_0409 model, 8 micro-batches of 48 x 2,048 tokens, bf16, compiled as
a run compiles it) with both switches off and on. Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402


def time_ms(fn, reps, warmup=3):
    """Median milliseconds of fn() over reps runs (CUDA events), after warm-up runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def forward_backward(fn, inputs, grad):
    def run():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)
    return run


def forward_only(fn, inputs):
    def run():
        with torch.no_grad():
            fn(*inputs)
    return run


def report(title, variants, inputs, grad, reps, rate):
    """Times each (name, fn) on inputs; prints ms, rate and the ratios to the first two (eager, compiled)."""
    rows = {}
    for name, fn in variants:
        fwd = time_ms(forward_only(fn, inputs), reps)
        both = time_ms(forward_backward(fn, inputs, grad), reps)
        rows[name] = {"forward": fwd, "forward+backward": both, "backward": both - fwd}
    for phase in ("forward", "backward", "forward+backward"):
        cells = []
        for name, _ in variants:
            ms = rows[name][phase]
            cells.append(f"{name} {ms:8.3f} ms {rate(phase, ms)}")
        fused = rows["fused"][phase]
        print(f"{title:<4} {phase:<17} " + " | ".join(cells) +
              f" | eager/fused {rows['eager'][phase] / fused:5.2f}x compiled/fused {rows['compiled'][phase] / fused:5.2f}x",
              flush=True)


def rel(a, b):
    """max |a - b| / max |b|, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def mlp_outputs(fn, inputs, grad):
    """fn's output and the gradients of its inputs for upstream `grad`, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out] + [t.grad for t in leaves]


def check_kernels(dev):
    """Before any timing, the kernels' numbers on the GPU against fp64 on the same bf16 values (the bounds of
    tests/test_kernels.py, which checks them on CPU through Triton's interpreter): the MLP's output and three
    gradients within twice eager bf16's error (and under 5%), the cross-entropy's losses to 1e-5 and its gradient
    to bf16 rounding. One line per kernel; returns False on a mismatch."""
    gen = torch.Generator(device=dev).manual_seed(3)
    M, K, N = 4_000, 512, 2_048  # rows not a multiple of any tile
    x = torch.randn(M, K, device=dev, generator=gen).bfloat16()
    w1 = (torch.randn(N, K, device=dev, generator=gen) / K ** 0.5).bfloat16()
    w2 = (torch.randn(K, N, device=dev, generator=gen) / N ** 0.5).bfloat16()
    g = torch.randn(M, K, device=dev, generator=gen).bfloat16()
    exact = mlp_outputs(tg.leaky_relu2_mlp, [t.double() for t in (x, w1, w2)], g.double())
    eager = mlp_outputs(tg.leaky_relu2_mlp, [x, w1, w2], g)
    fused = mlp_outputs(tg.fused_leaky_relu2_mlp, [x, w1, w2], g)
    ok_mlp, cells = True, []
    for name, a, e, b in zip(("out", "dx", "dW_up", "dW_down"), fused, eager, exact):
        r, re_ = rel(a, b), rel(e, b)
        ok_mlp &= r <= 2 * re_ + 1e-6 and r < 0.05
        cells.append(f"{name} {r:.2e} (eager {re_:.2e})")
    print(f"check mlp {'ok' if ok_mlp else 'MISMATCH'}: rel error against fp64, " + ", ".join(cells), flush=True)
    R, V, cap = 3_000, 8_192, 30.0
    logits = (torch.randn(R, V, device=dev, generator=gen) * 20).bfloat16()
    targets = torch.randint(0, V, (R,), device=dev, generator=gen)
    up = torch.rand(R, device=dev, generator=gen)
    xe = logits.double().requires_grad_()
    want = F.cross_entropy(cap * torch.tanh(xe / cap), targets, reduction="none")
    want.backward(up.double())
    xf = logits.clone().requires_grad_()
    losses, _ = torch.ops.pgolf.softcapped_ce(xf, targets, cap)
    losses.backward(up)
    r_loss, r_grad = rel(losses, want), rel(xf.grad, xe.grad)
    ok_ce = r_loss <= 1e-5 and r_grad <= 2 ** -8
    print(f"check ce {'ok' if ok_ce else 'MISMATCH'}: rel error against fp64, losses {r_loss:.2e} (bound 1e-5), "
          f"gradient {r_grad:.2e} (bound {2 ** -8:.2e})", flush=True)
    return ok_mlp and ok_ce


def bench_mlp(args, dev):
    M, K, N = args.tokens, args.dim, args.hidden
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, K, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
    w1 = (torch.randn(N, K, device=dev, generator=gen) / K ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(K, N, device=dev, generator=gen) / N ** 0.5).bfloat16().requires_grad_()
    grad = torch.randn(M, K, device=dev, generator=gen, dtype=torch.bfloat16)
    variants = [("eager", tg.leaky_relu2_mlp), ("compiled", torch.compile(tg.leaky_relu2_mlp, fullgraph=True)),
                ("fused", tg.fused_leaky_relu2_mlp)]
    flops = {"forward": 4 * M * K * N, "backward": 8 * M * K * N, "forward+backward": 12 * M * K * N}
    report("mlp", variants, (x, w1, w2), grad, args.reps,
           lambda phase, ms: f"{flops[phase] / ms / 1e9:6.1f} TFLOP/s")


def bench_ce(args, dev):
    R, V = args.tokens, args.vocab
    gen = torch.Generator(device=dev).manual_seed(1)
    logits = (torch.randn(R, V, device=dev, generator=gen) * 5).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (R,), device=dev, generator=gen)
    cap = 30.0
    variants = [("eager", lambda x: tg.softcapped_ce(x, targets, cap)),
                ("compiled", torch.compile(lambda x: tg.softcapped_ce(x, targets, cap), fullgraph=True)),
                ("fused", lambda x: tg.fused_softcapped_ce(x, targets, cap))]
    nbytes = {"forward": R * V * 2, "backward": 2 * R * V * 2, "forward+backward": 3 * R * V * 2}
    report("ce", variants, (logits,), torch.ones((), device=dev), args.reps,
           lambda phase, ms: f"{nbytes[phase] / ms / 1e6:7.1f} GB/s")


class SameBatch:
    """A loader that hands out one fixed batch."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def next_batch(self):
        return self.x, self.y


def bench_training_step(args, dev):
    results = {}
    for on in ("0", "1"):
        torch._dynamo.reset()
        h = tg.Hyperparameters({"PRESET": "record_0409", "FUSED_MLP": on, "FUSED_CE": on, "MAX_WALLCLOCK_SECONDS": "0"})
        rt = tg.Runtime(h, dev, False, True, None, torch.bfloat16, "bf16 autocast")
        tg.select_attention_backend(dev)
        for line in tg.select_fused_kernels(h, dev, torch.bfloat16):
            print(line, flush=True)
        model = rt.prepare_model(tg.build_model(h))
        trainer = tg.Trainer(rt, model)
        rows = h.train_batch_tokens // h.grad_accum_steps // h.train_seq_len
        gen = torch.Generator(device=dev).manual_seed(2)
        ids = torch.randint(0, h.vocab_size, (rows, h.train_seq_len + 1), device=dev, generator=gen)
        loader = SameBatch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
        step = lambda: trainer.step(loader, 1.0, 0.95)  # noqa: E731
        results[on] = time_ms(step, max(args.reps // 4, 3), warmup=3)
        print(f"step FUSED_MLP={on} FUSED_CE={on}: {results[on]:.1f} ms per step "
              f"({h.grad_accum_steps} x {rows} x {h.train_seq_len} tokens, compile:{int(tg.compile_enabled(rt))})",
              flush=True)
        del trainer, model
        torch.cuda.empty_cache()
    print(f"step off/on {results['0'] / results['1']:.3f}x", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=98_304)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2_048)
    parser.add_argument("--vocab", type=int, default=8_192)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-step", action="store_true", help="skip the full training step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels.py needs CUDA (a GPU): this machine has none, nothing timed")
        return 0
    dev = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = True
    h = tg.Hyperparameters({"FUSED_MLP": "1", "FUSED_CE": "1", "MODEL_DIM": str(args.dim),
                            "MLP_MULT": str(args.hidden / args.dim), "VOCAB_SIZE": str(args.vocab)})
    lines = tg.select_fused_kernels(h, dev, torch.bfloat16)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; " + "; ".join(lines), flush=True)
    if not (tg._FUSED["mlp"] and tg._FUSED["ce"]):
        print("the kernels do not run here (see above)")
        return 1
    if not check_kernels(dev):
        return 1
    bench_mlp(args, dev)
    bench_ce(args, dev)
    if not args.no_step:
        bench_training_step(args, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
