#!/usr/bin/env python3
"""Tokens per second per core of data/build_shards.py and of the two references on the same documents, in one
run: the challenge's download_hf_docs_and_tokenize.py (export_shards, plain) and the 04-27 record's
prepare_caseops_data.py (CaseOps, with its val byte sidecars), both from ../shared/anchors/data/; then the
hours the 10B-token stream would take on 2 and on 32 cores.

Documents: the offline sample builder's text (standard-library docstrings and pydoc topics, as
data/build_sample_data.py collects it) in a seeded random order, repeated (each copy numbered) to --mb
megabytes; the first --val-frac of them validation (0.5%; the challenge's 50,000 documents are a smaller part
of its stream). One tokenizer per side (plain, CaseOps), trained
on them once, is given to every builder. Each builder runs in its own process; tokens/s per core is its
tokens over its wall time and cores used (ours: --workers processes; the challenge's script:
MATCHED_FINEWEB_TOKENIZER_THREADS=1, one core; the record's script: one process), and also over the CPU
seconds it used (user + system, children included), which a busy machine disturbs less.

Run: python3 scripts/bench/bench_shards.py [--mb 16] [--vocab-size 1024] [--workers 1,2]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ANCHORS = REPO.parent / "shared" / "anchors"
STREAM_TOKENS = 10e9  # the challenge's document stream

# Each run, in a fresh interpreter: prints its token count last.
CHALLENGE_RUN = """
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("ref", {script!r}); ref = importlib.util.module_from_spec(spec)
sys.modules["ref"] = ref; spec.loader.exec_module(ref)
ref.TOKENIZER_THREADS = 1
docs = Path({docs!r})
tok = ref.build_sentencepiece_tokenizer(spec={{"vocab_size": {vocab}, "reuse_model_path": {model!r}}},
                                        docs_jsonl=docs, tokenizers_dir=Path({out!r}) / "tok")
stats = ref.export_shards(docs, tok, Path({out!r}) / "shards", num_val_docs={val}, shard_size=10**8,
                          docs_total=ref.count_docs(docs))
print(stats["tokens_total"])
"""
RECORD_RUN = """
import glob, importlib.util, sys
import numpy as np, sentencepiece as spm
sys.path.insert(0, {caps!r})
if not hasattr(spm.SentencePieceProcessor, "encode_as_immutable_proto"):  # SentencePiece 0.2.1+
    spm.SentencePieceProcessor.encode_as_immutable_proto = lambda self, t: self.encode(t, out_type="proto")
spec = importlib.util.spec_from_file_location("ref", {script!r}); ref = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ref)
sys.argv = ["prepare_caseops_data.py", "--docs", {docs!r}, "--out", {out!r}, "--sp", {model!r},
            "--val-docs", "{val}"]
ref.main()
files = glob.glob({out!r} + "/datasets/*/fineweb_train_*.bin") + glob.glob({out!r} + "/datasets/*/fineweb_val_0*.bin")
print(sum((len(open(f, "rb").read()) - 1024) // 2 for f in files))
"""


def timed(cmd, env=None):
    """(wall seconds, CPU seconds of the child and its children, stdout) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd[:3]))} failed: {proc.stderr.strip()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout


def make_documents(path, mb):
    sys.path.insert(0, str(REPO / "data"))
    import build_sample_data

    docs, _ = build_sample_data.collect_documents(extended=True)
    random.Random(0).shuffle(docs)  # the long pydoc topics come first; web documents have no such order
    with open(path, "w", encoding="utf-8") as f:
        written, n = 0, 0
        while written < mb * 1e6:  # each copy of a document numbered: no val document repeats in train
            line = json.dumps({"text": f"{docs[n % len(docs)]}\n[{n // len(docs)}]"}) + "\n"
            f.write(line)
            written, n = written + len(line.encode()), n + 1
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=16, help="megabytes of documents (default 16)")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--val-frac", type=float, default=0.005,
                    help="fraction of documents in validation (default 0.005; the challenge's 50,000 documents are "
                         "a smaller part of its stream)")
    ap.add_argument("--workers", default="1,2", help="our worker counts to time (default 1,2)")
    args = ap.parse_args()
    challenge, record = ANCHORS / "data" / "download_hf_docs_and_tokenize.py", ANCHORS / "data" / \
        "prepare_caseops_data_0427.py"
    caps = ANCHORS / "frontier" / "record_0427"
    builder = [sys.executable, str(REPO / "data" / "build_shards.py")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        docs = tmp / "docs.jsonl"
        n_docs = make_documents(docs, args.mb)
        val = max(1, int(n_docs * args.val_frac))
        print(f"documents: {n_docs} ({docs.stat().st_size / 1e6:.1f} MB), {val} val; vocabulary "
              f"{args.vocab_size}; {os.cpu_count()} cores here")
        common = ["--docs", str(docs), "--vocab-size", str(args.vocab_size), "--val-docs", str(val),
                  "--tokenizer-docs", "5000"]
        models = {}
        for side in ("plain", "caseops"):  # the tokenizers, trained once (not timed)
            out = tmp / f"tok_{side}"
            timed([*builder, *common, "--out", str(out), "--workers", "2", *(["--caseops"] if side == "caseops" else [])])
            models[side] = str(out / "tokenizer.model")
        for side in ("plain", "caseops"):
            runs = [(int(x), []) for x in args.workers.split(",")] + [(1, ["--no-word-cache"])]
            for w, extra in runs:
                out = tmp / f"ours_{side}_{w}{'_whole' if extra else ''}"
                wall, cpu, _ = timed([*builder, *common, "--out", str(out), "--workers", str(w), "--tokenizer",
                                      models[side], *extra, *(["--caseops"] if side == "caseops" else [])])
                tokens = sum(s["tokens"] for s in json.loads((out / "manifest.json").read_text())["shards"])
                rows.append((side, f"ours, {w} worker{'s' * (w > 1)}{', --no-word-cache' if extra else ''}",
                             tokens, wall, cpu, w, True))
            script, code = (challenge, CHALLENGE_RUN) if side == "plain" else (record, RECORD_RUN)
            name = ("the challenge's download_hf_docs_and_tokenize.py, 1 thread" if side == "plain" else
                    "the record's prepare_caseops_data.py (one process)")
            if not script.is_file():
                print(f"skipped: {script} not present")
                continue
            out = tmp / f"ref_{side}"
            wall, cpu, stdout = timed([sys.executable, "-c", code.format(
                script=str(script), docs=str(docs), vocab=args.vocab_size, model=models[side], out=str(out),
                val=val, caps=str(caps))], env={"MATCHED_FINEWEB_TOKENIZER_THREADS": "1"})
            rows.append((side, name, int(stdout.split()[-1]), wall, cpu, 1, side == "plain"))
    print()
    print("| side | builder | tokens | wall s | CPU s | tokens/s per core (wall) | tokens/s per CPU s | "
          "10B tokens on 2 cores | on 32 cores |")
    print("|---|---|---|---|---|---|---|---|---|")
    for side, name, tokens, wall, cpu, cores, scales in rows:
        per_core = tokens / wall / cores
        hours = [STREAM_TOKENS / (per_core * (c if scales else 1)) / 3600 for c in (2, 32)]
        print(f"| {side} | {name} | {tokens:,} | {wall:.2f} | {cpu:.2f} | {per_core:,.0f} | {tokens / cpu:,.0f} | "
              f"{hours[0]:.2f} h | {hours[1]:.2f} h |")
    print()
    print("Projections assume tokens/s per core scales with cores (ours: one worker a core; the challenge's "
          "script: its encode threads, though its per-document loop is one thread); the record's script is one "
          "process, so its time is the same on any number of cores.")
    for side in ("plain", "caseops"):
        ref = [r for r in rows if r[0] == side and not r[1].startswith("ours")]
        for o in [r for r in rows if r[0] == side and r[1].startswith("ours, 1 ")] if ref else []:
            r = ref[0]
            print(f"{side}: {o[1]} / reference, tokens/s per core: {o[2] / o[3] / (r[2] / r[3]):.2f}x "
                  f"(per CPU second: {o[2] / o[4] / (r[2] / r[4]):.2f}x)")
    print("The documents repeat (each copy numbered), so the word cache finds more of its words than on FineWeb; "
          "--no-word-cache is its worst case.")


if __name__ == "__main__":
    main()
