#!/usr/bin/env python3
"""Choose COMPRESSOR=pergroup's back end: compress the same per-group blobs (train_gpt.pergroup_layout: roles,
row similarity order, column-major) with each candidate and print one markdown table of bytes and seconds.

The codes come from a full-size model of the 2026-04-27 record's shape (11L d512, MLP 4x, vocab 8192) whose
bank matrices and token embedding are trained-like stand-ins (Student-t rows, bench_artifact.stand_in_matrices),
quantised by round-to-nearest with the record's per-class SDClip (MLP 11.5, attention 13, embeddings 14 at int7):
no training and no Hessians, so the code statistics, not the bpb, are what this measures.

    python3 scripts/bench/bench_pergroup.py            # every candidate installed; lrzip if the binary exists
    python3 scripts/bench/bench_pergroup.py --sort     # also time the records' O(n^2) Python row sort at 8192 rows
    python3 scripts/bench/bench_pergroup.py --orders   # only: tok_emb and c_q groups, L2 vs L1 vs no row order, ZPAQ-5
    python3 scripts/bench/bench_pergroup.py --threads  # only: the artifact's ZPAQ groups one by one vs at once

Candidates: brotli q11 lgwin 24 (pip brotli), zstd level 22 with long-distance matching and a 2^27 window
(pip zstandard), PPMd variant H order 3..16 (pip pyppmd), ZPAQ levels 3..5 in one thread (pip zpaq), and
`lrzip -z -L 9` (Debian's lrzip, ZPAQ inside: the records' choice, a reference only).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))  # bench_artifact
import train_gpt as tg  # noqa: E402
from bench_artifact import stand_in_matrices  # noqa: E402

RECORD_SHAPE = {"VOCAB_SIZE": "8192", "MLP_MULT": "4", "BIGRAM_VOCAB_SIZE": "0", "VE_ENABLED": "0",
                "MLP_CLIP_SIGMAS": "11.5", "ATTN_CLIP_SIGMAS": "13", "EMBED_CLIP_SIGMAS": "14", "EMBED_BITS": "7"}


def lrzip(data):
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "g.bin")
        Path(src).write_bytes(data)
        subprocess.run(["lrzip", "-q", "-z", "-L", "9", "-o", src + ".lrz", src], check=True, capture_output=True)
        t0 = time.perf_counter()
        subprocess.run(["lrzip", "-q", "-d", "-o", src + ".out", src + ".lrz"], check=True, capture_output=True)
        assert Path(src + ".out").read_bytes() == data
        return Path(src + ".lrz").read_bytes(), time.perf_counter() - t0


def candidates():
    """(label, compress(data), decompress(data, raw length)) of every back end installed."""
    import brotli
    out = [("brotli q11 lgwin24", lambda d: brotli.compress(d, quality=11, lgwin=24), lambda d, n: brotli.decompress(d))]
    try:
        import zstandard as zstd
        params = zstd.ZstdCompressionParameters.from_level(22, enable_ldm=True, window_log=27)
        out.append(("zstd 22 --long=27", lambda d: zstd.ZstdCompressor(compression_params=params).compress(d),
                    lambda d, n: zstd.ZstdDecompressor(max_window_size=2 ** 27).decompress(d)))
    except ImportError:
        print("zstandard not installed: skipped")
    try:
        import pyppmd
        for order in (3, 4, 6, 16):  # variant H (7-Zip's); low orders suit near-iid codes best
            out.append((f"PPMd H order {order} 256 MB",
                        lambda d, o=order: pyppmd.compress(d, max_order=o, mem_size=256 << 20, variant="H"),
                        lambda d, n, o=order: pyppmd.Ppmd7Decoder(o, 256 << 20).decode(d, n)))
    except ImportError:
        print("pyppmd not installed: skipped")
    try:
        import zpaq
        for level in (3, 4, 5):
            out.append((f"zpaq level {level}, 1 thread", lambda d, lv=level: zpaq.compress(d, lv, threads=1),
                        lambda d, n: zpaq.decompress(d)))
    except ImportError:
        print("zpaq not installed: skipped")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sort", action="store_true", help="also time the records' Python row sort (minutes)")
    ap.add_argument("--orders", action="store_true", help="only compare row orders (see above)")
    ap.add_argument("--threads", action="store_true", help="only: pergroup_serialize / pergroup_deserialize with "
                    "the groups one by one (1 worker) and at once (torch's thread count), in one run")
    args = ap.parse_args()
    torch.manual_seed(0)
    h = tg.Hyperparameters(RECORD_SHAPE)
    model = tg.build_model(h)
    stand_in_matrices(model)
    with torch.no_grad():  # the tied embedding too: Student-t rows (SDClip codes do not depend on the RMS)
        g = torch.Generator().manual_seed(1)
        emb = model.tok_emb.weight
        t = torch.randn(emb.shape, generator=g) / (torch.randn((*emb.shape, 3), generator=g).pow(2).mean(-1)).sqrt()
        emb.copy_(t / t.pow(2).mean(-1, keepdim=True).sqrt() * 0.05)
    flat = tg.unbank_state_dict(model.state_dict(), model.num_layers)
    w, meta = tg.quantize_state_dict(flat, h)
    if args.orders:
        return compare_orders(w)
    if args.threads:
        return compare_threads({"w": w, "m": meta, "late_qat": False})
    t0 = time.perf_counter()
    blobs, perms, rest, _ = tg.pergroup_layout(w)
    layout_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    order = tg.similarity_order(w["tok_emb.weight.q"].numpy())
    sort_s = time.perf_counter() - t0
    raw = sum(len(b) for b in blobs.values())
    print(f"model {h.num_layers}L d{h.model_dim} vocab {h.vocab_size} MLP x{h.mlp_mult:g}; {raw:,} code bytes in "
          f"{len(blobs)} groups; layout (3 sorted roles, 23 row sorts) {layout_s:.1f}s; "
          f"8192x512 row sort {sort_s:.1f}s; torch threads {torch.get_num_threads()}")
    if args.sort:
        rec = tg_record()
        t0 = time.perf_counter()
        theirs = rec._similarity_sort_l1(w["tok_emb.weight.q"].numpy())
        print(f"records' _similarity_sort_l1 at 8192 rows: {time.perf_counter() - t0:.1f}s; same order: "
              f"{bool((theirs == order).all())}")
    rows = []
    cands = candidates()
    if shutil.which("lrzip"):
        cands.append(("lrzip -z -L 9 (binary, reference)", None, None))
    else:
        print("lrzip binary not found: reference skipped (apt-get install lrzip)")
    for label, comp, decomp in cands:
        total, c_s, d_s = 0, 0.0, 0.0
        per = []
        for role in tg.PERGROUP_ROLES:
            t0 = time.perf_counter()
            if comp is None:
                out, dt = lrzip(blobs[role])
                c_s += time.perf_counter() - t0 - dt
                d_s += dt
            else:
                out = comp(blobs[role])
                c_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                assert decomp(out, len(blobs[role])) == blobs[role], label
                d_s += time.perf_counter() - t0
            per.append(len(out))
            total += len(out)
        rows.append((label, per, total, c_s, d_s))
        print(f"  {label}: {total:,} bytes, {c_s:.1f}s / {d_s:.1f}s", flush=True)
    print(f"\n| back end | {' | '.join(tg.PERGROUP_ROLES)} | all groups | compress s | decompress s |")
    print("|---|" + "---|" * (len(tg.PERGROUP_ROLES) + 3))
    for label, per, total, c_s, d_s in rows:
        print(f"| {label} | {' | '.join(f'{n:,}' for n in per)} | {total:,} | {c_s:.1f} | {d_s:.1f} |")
    print(f"\nraw group bytes: {' | '.join(f'{len(blobs[r]):,}' for r in tg.PERGROUP_ROLES)}")


def compare_orders(w):
    """ZPAQ-5 bytes of the tok_emb and c_q groups with rows in L2 chain order (ours), L1 chain order (the
    records'), and unsorted; the chains' seconds."""
    import zpaq
    print("| group | order | chain s | ZPAQ-5 bytes |\n|---|---|---|---|")
    for role in ("tok_emb.weight", "attn.c_q.weight"):
        names = sorted((n for n in w if n.endswith(role + ".q")), key=lambda n: (len(n), n))
        for metric in ("l2", "l1", "none"):
            t0, parts = time.perf_counter(), []
            for n in names:
                a = w[n].numpy()
                if metric != "none":
                    a = a[tg.similarity_order(a, metric).astype("int64")]
                parts.append(a.T.copy().tobytes())
            chain_s = time.perf_counter() - t0
            print(f"| {role} | {metric} | {chain_s:.1f} | {len(zpaq.compress(b''.join(parts), 5, threads=1)):,} |",
                  flush=True)


def compare_threads(obj):
    """pergroup_serialize and pergroup_deserialize of one artifact with 1 worker, then with torch's thread count
    (pergroup_codec_map): seconds of each, and whether the bytes and the decoded tensors are the same."""
    n = torch.get_num_threads()
    print("| workers | serialize s | deserialize s | bytes | same bytes | same tensors |\n|---|---|---|---|---|---|")
    first = None
    for workers in (1, n):
        t0 = time.perf_counter()
        data = tg.pergroup_serialize(obj, workers=workers)
        ser = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = tg.pergroup_deserialize(data, "memory", workers=workers)
        de = time.perf_counter() - t0
        same = all(torch.equal(back["w"][k], t) for k, t in obj["w"].items())
        first = first or data
        print(f"| {workers} | {ser:.1f} | {de:.1f} | {len(data):,} | {data == first} | {same} |", flush=True)


def tg_record():
    """The 2026-04-27 record's script, imported (FlashAttention-3 stubbed: only its artifact code is used)."""
    import importlib.util
    import types
    path = REPO.parent / "shared" / "anchors" / "frontier" / "record_0427" / "train_gpt.py"
    stub = types.ModuleType("flash_attn_interface")
    stub.flash_attn_func = stub.flash_attn_varlen_func = None
    sys.modules.setdefault("flash_attn_interface", stub)
    spec = importlib.util.spec_from_file_location("record_0427", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    main()
