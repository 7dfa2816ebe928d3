#!/usr/bin/env python3
"""Cost of the PyTorch varlen attention path (train_gpt.doc_causal_attention, SPEC-FRONTIER 3) against dense
causal attention over the whole packed row: one call each, fp32 on CPU (CUDA if --device cuda), 8 query and
4 KV heads of 64, segments cut every --seg tokens, best of 3.

Run: python scripts/bench/bench_varlen.py [--sizes 4096,8192,16384,32768] [--seg 2048] [--dense-max 16384]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402


def best_ms(fn, device, repeats=3):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1000.0 * (time.perf_counter() - t0))
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,8192,16384,32768")
    ap.add_argument("--seg", type=int, default=2048)
    ap.add_argument("--dense-max", type=int, default=16384, help="largest N also timed densely (N^2)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    print("| packed tokens N | doc blocks (ms) | dense causal over the whole row (ms) |")
    print("|---|---|---|")
    for n in (int(v) for v in args.sizes.split(",")):
        q, k, v = (torch.randn(1, n, h, 64, device=device) for h in (8, 4, 4))
        cu = torch.from_numpy(tg.packed_cu_seqlens(torch.full((n,), 7).numpy(), args.seg)).to(device)
        docs = tg.DocBounds(cu, args.seg)
        doc = best_ms(lambda: tg.causal_attention(q, k, v, docs), device)
        dense = best_ms(lambda: tg.causal_attention(q, k, v), device) if n <= args.dense_max else None
        print(f"| {n:,} | {doc:,.0f} | {'-' if dense is None else f'{dense:,.0f}'} |", flush=True)


if __name__ == "__main__":
    main()
