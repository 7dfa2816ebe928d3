"""Times train_gpt.ngram_tilt_hints (#2135's token n-gram hints as tensor ops, SPEC-FRONTIER 20) against the
record's own C on one stream, checks that the outputs are identical, and prints one markdown table:

  ours on CPU | the record's token-only C pass | the record's whole build_hints_for_targets as it ran (C token and
  within-word channels, the Python word-start loop, numpy gating) | ours on CUDA when there is a GPU

    python3 scripts/bench/bench_ngram.py                          # 47,851,520 tokens (#2135's val targets), order 16
    python3 scripts/bench/bench_ngram.py --tokens 1000000 --order 8
    python3 scripts/bench/bench_ngram.py --val-dir DATA --tokenizer MODEL   # a dataset's val tokens, repeated

The stream: by default a seeded Zipf stream (vocab 8192, exponent 1.1) with earlier spans copied forward (about 4%
of it), needing no data; with --val-dir, the val shards there (fineweb_val_*.bin, e.g. the offline sample's)
repeated to --tokens. The record's files come from BENCH_ANCHORS, else shared/anchors in the checkout, else
../shared/anchors. Its two helper files are copied to a temporary folder, the C compiled there with `cc -O3
-march=native` (the record's gcc flags) and its online_ngram_tilt.py imported from there. Its word loop needs a
SentencePiece model: --tokenizer (matching the stream's vocabulary), else a stub decoder (even ids start a word,
piece i decodes to "w<i>"). Each row runs in its own process; 'peak' is that process's peak resident memory above
what it held before the call (CPU) or torch.cuda.max_memory_allocated (CUDA).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
VAL_TARGETS = 47_851_520  # #2135's log: ngram_tilt:hints total=47851520
# the run's settings of the three experts (record_0501_hparams.txt, SPEC-FRONTIER 20(e)): token channel only
RUN_SETTINGS = {"token_order": 16, "token_threshold": 0.8, "token_boost": 2.625, "within_tau": 99.0,
                "within_boost": 0.0, "word_order": 4, "word_normalize": "strip_punct_lower", "word_tau": 99.0,
                "word_boost": 0.0, "agree_add_boost": 0.0}


def record_dir():
    """#2135's folder (record_0501): BENCH_ANCHORS, else shared/anchors in the checkout, else ../shared/anchors."""
    candidates = [os.environ.get("BENCH_ANCHORS", ""), REPO / "shared" / "anchors", REPO.parent / "shared" / "anchors"]
    found = [Path(c) / "frontier" / "record_0501" for c in candidates if c]
    return next((d for d in found if (d / "online_ngram_state.c").is_file()), found[-1])


def record_helpers(workdir, cflags=("-O2",)):
    """The record's online_ngram_tilt.py imported from a copy in `workdir`, its online_ngram_state.c compiled there
    with `cc <cflags> -shared -fPIC` into the library name the wrapper loads (newer than the source, so its
    ensure_online_ngram_lib loads it and builds nothing). None without the record's files or a C compiler."""
    src = record_dir()
    if not (src / "online_ngram_tilt.py").is_file() or shutil.which("cc") is None:
        return None
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("online_ngram_tilt.py", "online_ngram_state.c"):
        shutil.copyfile(src / name, workdir / name)
    os.utime(workdir / "online_ngram_state.c", (0, 0))
    subprocess.run(["cc", *cflags, "-shared", "-fPIC", "-o", str(workdir / "libonline_ngram_state.so"),
                    str(workdir / "online_ngram_state.c")], check=True)
    spec = importlib.util.spec_from_file_location(f"record_0501_ngram_{abs(hash(str(workdir)))}",
                                                  workdir / "online_ngram_tilt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def record_token_hints(mod, targets, order):
    """The record's C token channel on `targets` (uint16-able ints), driven as build_hints_for_targets drives it
    (ring seeded with targets[0], token tables sized by suggest_table_bits(n, 0.55)), with the within-word channel
    idle (every token a boundary, smallest tables): (top_token int64, top_prob float32) as numpy arrays."""
    targets = np.ascontiguousarray(targets, dtype=np.uint16)
    if targets.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    state = mod.OnlineNgramState(
        lib=mod.ensure_online_ngram_lib(lambda *a: None), token_ctx_len=order - 1,
        token_table_bits=mod.suggest_table_bits(targets.size, load_factor=0.55), within_table_bits=12,
        starts_new_word_lut=np.zeros(65536, np.uint8), boundary_lut=np.ones(65536, np.uint8),
        seed_prefix_token=int(targets[0]))
    try:
        tok, prob = state.process_chunk(targets)[:2]
    finally:
        state.close()
    return tok.astype(np.int64), prob


class StubSentencePiece:
    """What the record's word loop asks of a SentencePiece model, for a stream without one: even ids start a word
    ('\u2581w<i>'), odd ids continue one ('w<i>'), id 1 is BOS, no byte pieces."""

    def __init__(self, vocab_size):
        self.pieces = [("\u2581" if i % 2 == 0 else "") + f"w{i}" for i in range(vocab_size)]

    def vocab_size(self):
        return len(self.pieces)

    def id_to_piece(self, i):
        return self.pieces[i]

    def bos_id(self):
        return 1

    def is_byte(self, i):
        return False

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids).replace("\u2581", " ").strip()


def record_whole_hints(mod, targets, tokenizer, vocab_size):
    """The record's build_hints_for_targets with #2135's settings, as it ran at evaluation (its C pass with both
    channels, its Python word loop, numpy gating): {hint_ids, gate_mask, boost}. tokenizer None: the stub."""
    if tokenizer is None:
        mod.spm = types.SimpleNamespace(SentencePieceProcessor=lambda model_file: StubSentencePiece(vocab_size))
    return mod.build_hints_for_targets(target_token_ids_np=np.ascontiguousarray(targets, dtype=np.uint16),
                                       tokenizer_path=tokenizer or "stub", vocab_size=vocab_size,
                                       log0=lambda *a: None, **RUN_SETTINGS)


def zipf_stream(n, vocab=8192, seed=0):
    """n tokens: Zipf(1.1) over the vocabulary, then 1 span per 16,384 tokens (20-299 long) copied from earlier."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, vocab + 1) ** 1.1)
    out = np.searchsorted(cdf / cdf[-1], rng.random(n)).astype(np.uint16)
    for _ in range(n // 16384):
        length = int(rng.integers(20, 300))
        if n < 2 * length:
            break
        dst = int(rng.integers(length, n - length + 1))
        src = int(rng.integers(0, dst - length + 1))
        out[dst:dst + length] = out[src:src + length]
    return out


def val_stream(val_dir, n):
    """The val targets of the shards in val_dir (val_tokens[1:]), repeated to n tokens."""
    sys.path.insert(0, str(REPO))
    import train_gpt as tg

    shards = sorted(Path(val_dir).glob("fineweb_val_[0-9]*.bin"))
    if not shards:
        raise SystemExit(f"--val-dir: no fineweb_val_*.bin in {val_dir}")
    val = np.concatenate([tg.load_shard(f) for f in shards])[1:].astype(np.uint16)
    return np.resize(val, n)


def current_rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_row(args):
    """One row in this process: reads the stream, runs, saves the outputs, prints one JSON line."""
    work = Path(args.work)
    targets = np.load(work / "stream.npy")
    info = {"row": args.row}
    if args.row.startswith("ours"):
        import torch
        sys.path.insert(0, str(REPO))
        import train_gpt as tg

        dev = torch.device("cuda" if args.row == "ours cuda" else "cpu")
        x = torch.from_numpy(targets.astype(np.int32)).to(dev)
        if dev.type == "cuda":
            tg.ngram_tilt_hints(x[:100_000], args.order)  # CUDA context, kernels
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = current_rss()
        t0 = time.perf_counter()
        tok, prob = tg.ngram_tilt_hints(x, args.order)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        info["seconds"] = time.perf_counter() - t0
        info["peak"] = (torch.cuda.max_memory_allocated() if dev.type == "cuda"
                        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
        info["threads"] = torch.get_num_threads()
        np.save(work / f"{args.row.replace(' ', '_')}_tok.npy", tok.cpu().numpy())
        np.save(work / f"{args.row.replace(' ', '_')}_prob.npy", prob.cpu().numpy())
    else:
        mod = record_helpers(work / "record", ("-O3", "-march=native"))
        before = current_rss()
        t0 = time.perf_counter()
        if args.row == "record token C":
            tok, prob = record_token_hints(mod, targets, args.order)
            info["seconds"] = time.perf_counter() - t0
            np.save(work / "record_tok.npy", tok)
            np.save(work / "record_prob.npy", prob)
        else:
            vocab = 8192
            if args.tokenizer:
                import sentencepiece as spm
                vocab = spm.SentencePieceProcessor(model_file=args.tokenizer).vocab_size()
            part = targets[:args.whole_tokens]
            res = record_whole_hints(mod, part, args.tokenizer, max(vocab, int(part.max()) + 1))
            info["seconds"] = time.perf_counter() - t0
            np.save(work / "whole_hint.npy", res["hint_ids"])
            np.save(work / "whole_gate.npy", res["gate_mask"])
        info["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    print("ROW " + json.dumps(info), flush=True)


def same(work, a, b):
    return all(np.array_equal(np.load(work / f"{a}_{k}.npy").view(np.int32 if k == "prob" else np.int64),
                              np.load(work / f"{b}_{k}.npy").view(np.int32 if k == "prob" else np.int64))
               for k in ("tok", "prob"))


def whole_matches(work, threshold):
    """The record's whole path (on a prefix of the stream) gates where our prob >= float32(threshold), with our token
    there and hint 0 elsewhere (hints are causal: a prefix's hints are the prefix of the hints)."""
    n = np.load(work / "whole_gate.npy").size
    tok, prob = np.load(work / "ours_cpu_tok.npy")[:n], np.load(work / "ours_cpu_prob.npy")[:n]
    gate = prob >= np.float32(threshold)
    return (np.array_equal(np.load(work / "whole_gate.npy"), gate)
            and np.array_equal(np.load(work / "whole_hint.npy"), np.where(gate, tok, 0)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=VAL_TARGETS)
    p.add_argument("--order", type=int, default=RUN_SETTINGS["token_order"])
    p.add_argument("--val-dir", help="a dataset folder: its fineweb_val_*.bin targets, repeated (default: Zipf)")
    p.add_argument("--tokenizer", help="SentencePiece model for the record's word loop (default: a stub decoder)")
    p.add_argument("--skip-whole", action="store_true", help="leave out the record's whole build_hints_for_targets")
    p.add_argument("--whole-tokens", type=int, default=VAL_TARGETS // 10,
                   help="run the record's whole path on the first N tokens only (default 4,785,152: its Python word "
                        "loop's dicts take about 0.45 KB per token, 21 GB for all 47.85M)")
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.row:
        return run_row(args)
    if args.tokens < 1 or args.whole_tokens < 1:
        raise SystemExit("--tokens and --whole-tokens: must be at least 1")
    with tempfile.TemporaryDirectory(prefix="bench_ngram_") as tmp:
        work = Path(tmp)
        stream = val_stream(args.val_dir, args.tokens) if args.val_dir else zipf_stream(args.tokens)
        np.save(work / "stream.npy", stream)
        have_c = record_helpers(work / "probe") is not None
        import torch
        rows = ["ours cpu"]
        rows += ["record token C"] + ([] if args.skip_whole or args.order != RUN_SETTINGS["token_order"]
                                      else ["record whole path"]) if have_c else []
        rows += ["ours cuda"] if torch.cuda.is_available() else []
        results = {}
        for row in rows:
            cmd = [sys.executable, __file__, "--row", row, "--work", tmp, "--order", str(args.order)]
            cmd += ["--tokenizer", args.tokenizer] if args.tokenizer else []
            cmd += ["--whole-tokens", str(args.whole_tokens)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            if proc.returncode != 0 or not line:
                raise SystemExit(f"row {row!r} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            results[row] = json.loads(line[0][4:])
        identical = {"ours cpu": "reference"}
        if "record token C" in results:
            identical["record token C"] = "yes" if same(work, "ours_cpu", "record") else "NO"
        if "record whole path" in results:
            identical["record whole path"] = ("yes (gate, hint)" if whole_matches(work, RUN_SETTINGS["token_threshold"])
                                              else "NO")
        if "ours cuda" in results:
            identical["ours cuda"] = "yes" if same(work, "ours_cpu", "ours_cuda") else "NO"
        gated = int((np.load(work / "ours_cpu_prob.npy") >= np.float32(RUN_SETTINGS["token_threshold"])).sum())
    whole_n = min(args.whole_tokens, args.tokens)
    stream_name = f"val targets of {args.val_dir}, repeated" if args.val_dir else "Zipf(1.1), vocab 8192, spans copied"
    print(f"{args.tokens:,} tokens ({stream_name}), order {args.order}; {gated:,} positions with prob >= 0.8")
    print("| row | seconds | peak memory | identical to ours on CPU | note |")
    print("|---|---|---|---|---|")
    threads = results["ours cpu"]["threads"]
    notes = {"ours cpu": f"torch {torch.__version__}, {threads} thread{'s' if threads > 1 else ''}",
             "record token C": "cc -O3 -march=native, within channel idle, 1 thread",
             "record whole path": "build_hints_for_targets, #2135's settings, "
                                  + ("tokenizer " + Path(args.tokenizer).name if args.tokenizer else "stub decoder"),
             "ours cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else ""}
    if "record whole path" in results and whole_n < args.tokens:
        scaled = results["record whole path"]["seconds"] * args.tokens / whole_n
        notes["record whole path"] += f"; first {whole_n:,} tokens only (x{args.tokens / whole_n:.1f} linear: {scaled:.0f} s)"
    for row, r in results.items():
        print(f"| {row} | {r['seconds']:.2f} | {r['peak'] / 2**30:.2f} GiB | {identical[row]} | {notes[row]} |")
    return 0 if all(v != "NO" for v in identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
