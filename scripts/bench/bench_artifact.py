#!/usr/bin/env python3
"""Measure the artifact options on one trained model: bytes and roundtrip gap per quantiser and compressor.

Trains the model the environment describes (train_gpt.py's settings, e.g. `source scripts/run/sample_env.sh`)
with QUANT=gptq, so the Hessians come from the training batches after the loop, then quantises the same
final (EMA) weights every way and prints one markdown table:

  variant | embed bits | lzma bytes | brotli bytes | brotli/lzma | roundtrip bpb | gap (roundtrip - post-EMA)

plus the Hessian collection and GPTQ solve seconds, and the code bytes (readable and packed).

    source scripts/run/sample_env.sh && python3 scripts/bench/bench_artifact.py
    DEVICE=cpu NUM_LAYERS=11 MODEL_DIM=512 ITERATIONS=20 ... python3 scripts/bench/bench_artifact.py

--variants 0427 measures the 2026-04-27 record's options instead (per-class SDClip, LQER, AWQ-lite) with
brotli and COMPRESSOR=pergroup bytes and their seconds; --then-stand-in adds the stand-in table from the same run.

--stand-in replaces the trained matrices by Student-t rows (trained-like heavy tails) before quantising; the
Hessians stay the trained model's; the gap column then says how much the quantisation error costs a model
whose other weights are trained but whose matrices are synthetic (labelled as such).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "pack"))  # pack_code
import train_gpt as tg  # noqa: E402

VARIANTS = (  # (label, settings over the run's)
    ("gptq_lite (record)", {"QUANT": "gptq_lite"}),
    ("gptq_lite, int7 embeddings", {"QUANT": "gptq_lite", "EMBED_BITS": "7"}),
    ("gptq, clip candidates", {"QUANT": "gptq"}),
    ("gptq + SDClip 12.85/20", {"QUANT": "gptq", "MATRIX_CLIP_SIGMAS": "12.85", "EMBED_CLIP_SIGMAS": "20"}),
    ("gptq + SDClip 12.85/15, int7 embeddings",
     {"QUANT": "gptq", "MATRIX_CLIP_SIGMAS": "12.85", "EMBED_CLIP_SIGMAS": "15", "EMBED_BITS": "7"}),
)
NEWEST = {"QUANT": "gptq", "MLP_CLIP_SIGMAS": "11.5", "ATTN_CLIP_SIGMAS": "13", "EMBED_CLIP_SIGMAS": "14",
          "EMBED_BITS": "7"}
VARIANTS_0427 = (  # --variants 0427: the 2026-04-27 record's options (issue 19), one after another
    ("per-class SDClip 11.5/13/14, int7 embeddings", NEWEST),
    ("+ LQER rank 4, top 3, group 64 (04-27)", {**NEWEST, "LQER_RANK": "4"}),
    ("+ AWQ-lite int8, top 1 group of 64 (#1945)", {**NEWEST, "LQER_RANK": "4", "AWQ_LITE": "1"}),
)


def stand_in_matrices(model, seed=0):
    """Each bank matrix replaced by Student-t (3 degrees of freedom) entries with its own RMS per row."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in tg.BANK_NAMES:
            bank = getattr(model, name)
            rms = bank.float().pow(2).mean(dim=-1, keepdim=True).sqrt().cpu()
            z = torch.randn(bank.shape, generator=g)
            chi = torch.randn((*bank.shape, 3), generator=g).pow(2).sum(-1) / 3.0
            t = z / chi.sqrt()
            t = t / t.pow(2).mean(dim=-1, keepdim=True).sqrt() * rms
            bank.copy_(t.to(bank.device, bank.dtype))


def quantise_all(rt, h, env, variants, flat, template, hessians, model, val_tokens, luts, compressors, seconds=None):
    """Every variant on the same weights: (label, embed bits, {compressor: bytes}, roundtrip bpb, quantise s).
    `seconds` (a dict): filled with {compressor: (compress s, decompress s)} of the first variant."""
    rows = []
    for label, over in variants:
        hv = tg.Hyperparameters({**env, **over})
        t0 = time.perf_counter()
        w, meta = tg.quantize_state_dict(flat, hv, hessians if hv.quant == "gptq" else None)
        solve = time.perf_counter() - t0
        sizes = {}
        for c in compressors:
            t0 = time.perf_counter()
            blob = tg.serialize(w, meta, False, tg.Hyperparameters({**env, **over, "COMPRESSOR": c}))
            t1 = time.perf_counter()
            sizes[c] = len(blob)
            if seconds is not None and not rows:
                tg.pergroup_deserialize(blob, "memory") if c == "pergroup" else tg.decompress(blob, "memory")
                seconds[c] = (t1 - t0, time.perf_counter() - t1)
        back = tg.rebank_state_dict(tg.dequantize_state_dict(w, meta, template, "memory"), model.num_layers)
        probe = rt.prepare_model(tg.build_model(h))
        probe.load_state_dict(back, strict=True)
        _, bpb = tg.eval_val(rt, probe, val_tokens, luts)
        rows.append((label, hv.embed_bits, sizes, bpb, solve))
        print(f"  {label}: {sizes} bpb {bpb:.5f} ({solve:.1f}s)", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stand-in", action="store_true", help="synthetic Student-t matrices (see above)")
    ap.add_argument("--variants", choices=("0409", "0427"), default="0409",
                    help="0409: the table above; 0427: the 2026-04-27 record's options, with brotli and pergroup "
                         "bytes, then codec seconds and (--then-stand-in) the stand-in table from the same run")
    ap.add_argument("--then-stand-in", action="store_true",
                    help="--variants 0427: after the trained table, a second one with stand-in matrices")
    args = ap.parse_args()
    env = {**os.environ, "QUANT": "gptq", "RUN_ID": os.environ.get("RUN_ID", "bench_artifact")}
    h = tg.Hyperparameters(env)
    rt = tg.setup_runtime(h)
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    val_tokens = tg.load_validation_tokens(h.val_files, max(h.train_seq_len, h.eval_seq_len), h.vocab_size)
    model = rt.prepare_model(tg.build_model(h))
    t0 = time.perf_counter()
    _, hessians = tg.train(rt, model, val_tokens, luts)
    print(f"trained {h.iterations} steps + Hessians in {time.perf_counter() - t0:.0f}s", flush=True)
    if args.stand_in:
        stand_in_matrices(model)
    if args.variants == "0427":
        return main_0427(args, rt, h, env, model, hessians, val_tokens, luts)
    base_loss, base_bpb = tg.eval_val(rt, model, val_tokens, luts)
    flat = tg.unbank_state_dict(model.state_dict(), model.num_layers)
    template = {k: v.detach().cpu() for k, v in flat.items()}

    # Hessian collection time at these shapes, per calibration batch (one more pass, timed alone).
    loader = tg.make_train_loader(rt)
    t0 = time.perf_counter()
    tg.collect_hessians(rt, model, loader)
    loader.shutdown()
    hess_s = (time.perf_counter() - t0) / h.gptq_calibration_batches

    rows = quantise_all(rt, h, env, VARIANTS, flat, template, hessians, model, val_tokens, luts, ("lzma", "brotli"))
    solve = {r[0]: r[4] for r in rows}
    n_mat = sum(1 for k, t in flat.items() if k in hessians and t.numel() > tg.PASSTHROUGH_MAX_NUMEL)
    print(f"\nmodel: {h.num_layers}L d{h.model_dim} vocab {h.vocab_size}, {h.iterations} steps of "
          f"{h.train_batch_tokens} tokens{' (stand-in matrices)' if args.stand_in else ''}; "
          f"post-EMA val_bpb {base_bpb:.5f}; {n_mat} tensors GPTQ'd")
    print("| variant | embed bits | lzma bytes | brotli bytes | brotli vs lzma | roundtrip bpb | gap | quantise s |")
    print("|---|---|---|---|---|---|---|---|")
    for label, bits, sizes, bpb, _ in rows:
        lz, br = sizes["lzma"], sizes["brotli"]
        print(f"| {label} | {bits} | {lz:,} | {br:,} | {100.0 * (br - lz) / lz:+.1f}% | {bpb:.5f} | "
              f"{bpb - base_bpb:+.5f} | {solve[label]:.1f} |")
    print(f"\nHessian collection: {hess_s:.2f}s per calibration batch of "
          f"{h.train_batch_tokens // (h.world_size * h.grad_accum_steps)} tokens ({rt.device})")
    src = (REPO / "train_gpt.py").read_text(encoding="utf-8")
    try:
        import pack_code
        print(f"code: readable {len(src.encode())} bytes, packed {len(pack_code.pack(src).encode())} bytes")
    except ImportError:
        print(f"code: readable {len(src.encode())} bytes")


def main_0427(args, rt, h, env, model, hessians, val_tokens, luts):
    tables = [("trained" if not args.stand_in else "stand-in matrices", False)]
    if args.then_stand_in and not args.stand_in:
        tables.append(("stand-in matrices (same run, same Hessians)", True))
    for title, swap in tables:
        if swap:
            stand_in_matrices(model)
        _, base_bpb = tg.eval_val(rt, model, val_tokens, luts)
        flat = tg.unbank_state_dict(model.state_dict(), model.num_layers)
        template = {k: v.detach().cpu() for k, v in flat.items()}
        seconds = {} if not swap else None
        rows = quantise_all(rt, h, env, VARIANTS_0427, flat, template, hessians, model, val_tokens, luts,
                            ("brotli", "pergroup"), seconds)
        print(f"\nmodel: {h.num_layers}L d{h.model_dim} MLP x{h.mlp_mult:g} vocab {h.vocab_size}, {h.iterations} "
              f"steps of {h.train_batch_tokens} tokens, {title}; post-EMA val_bpb {base_bpb:.5f}")
        print("| variant | brotli bytes | pergroup bytes | pergroup vs brotli | roundtrip bpb | gap | quantise s |")
        print("|---|---|---|---|---|---|---|")
        for label, _, sizes, bpb, solve in rows:
            br, pg = sizes["brotli"], sizes["pergroup"]
            print(f"| {label} | {br:,} | {pg:,} | {pg - br:+,} | {bpb:.5f} | {bpb - base_bpb:+.5f} | {solve:.1f} |",
                  flush=True)
        if seconds:
            print(f"\nseconds at this size, first row ({rt.device}, torch threads {torch.get_num_threads()}): " +
                  "; ".join(f"{c} compress {cs:.1f} decompress {ds:.1f}" for c, (cs, ds) in seconds.items()),
                  flush=True)


if __name__ == "__main__":
    main()
