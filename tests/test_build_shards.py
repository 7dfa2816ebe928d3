"""data/build_shards.py (issue 70): a variant's shards from documents, equal byte for byte to the challenge's
download_hf_docs_and_tokenize.py and the 04-27 record's prepare_caseops_data.py (imported from
../shared/anchors/, skipped where absent) on tiny offline documents; the same bytes for any worker count and
after a kill; bad lines and a full disk."""
from __future__ import annotations

import importlib.util
import json
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "data"))

import build_shards  # noqa: E402
import caseops  # noqa: E402
import shards  # noqa: E402

ANCHORS = REPO.parent / "shared" / "anchors"
CHALLENGE = ANCHORS / "data" / "download_hf_docs_and_tokenize.py"
CASEOPS_REF = ANCHORS / "data" / "prepare_caseops_data_0427.py"
RECORD_0427 = ANCHORS / "frontier" / "record_0427"
VOCAB, VAL_DOCS, SHARD, TOKENIZER_DOCS = 400, 40, 2500, 250
# Shards of 2,500 tokens, chunks of 20 kB: several of each, so shard cuts fall inside chunks and documents.
SMALL = ["--vocab-size", str(VOCAB), "--val-docs", str(VAL_DOCS), "--shard-tokens", str(SHARD),
         "--tokenizer-docs", str(TOKENIZER_DOCS), "--chunk-bytes", "20000"]


def write_documents(path: Path) -> Path:
    """Offline documents: the paragraphs of Python's pydoc help topics, and a few with capitals, non-ASCII text
    and literal CaseOps operators."""
    import pydoc_data.topics

    paras = [p.strip() for k in sorted(pydoc_data.topics.topics) for p in pydoc_data.topics.topics[k].split("\n\n")]
    docs = list(dict.fromkeys(p for p in paras if len(p) >= 80))[:360]  # no document twice
    docs[3:3] = ["The USA and the UK: McDonald's iPhone, HTTPServer. ÉCOLE été 漢字 😀 \ue001 \ue004 ﬁne",
                 "  edge  whitespace\tand\u00a0NBSP  ", "ALL CAPS LINE\nTitle Line\nx1Y2Z",
                 "\x07Bell and \ufeffBOM, Mid\x07dle ＦＵＬＬ ｗｉｄｔｈ e\u0301t\u00e9 A\u0308BC\x07",
                 "\u2581Lead \u2581 Blank Sign, zero\u200bwidth, x\u2028y \u00b4acute"]
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return path


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    return write_documents(tmp_path_factory.mktemp("docs") / "docs_selected.jsonl")


def build(docs: Path, out: Path, *extra: str) -> Path:
    assert build_shards.main(["--docs", str(docs), "--out", str(out), *SMALL, *extra]) == 0
    return out


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name.startswith("fineweb_")}


@pytest.fixture(scope="module")
def plain(docs, tmp_path_factory) -> Path:
    return build(docs, tmp_path_factory.mktemp("plain") / "sp", "--tokenizer-sample", "first", "--workers", "1")


@pytest.fixture(scope="module")
def cased(docs, tmp_path_factory) -> Path:
    return build(docs, tmp_path_factory.mktemp("caseops") / "sp", "--caseops", "--workers", "2")


def load(path: Path, name: str):
    if not path.is_file():
        pytest.skip(f"{path} not present")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ equalities

def test_plain_equals_the_challenge_script(docs, plain, tmp_path):
    """The challenge's tokenizer builder (tokenizer_specs.json's spec, the first TOKENIZER_DOCS documents) learns
    the pieces ours learns; with our tokenizer its export_shards writes our shards byte for byte."""
    import sentencepiece as spm

    ref = load(CHALLENGE, "challenge_download_hf_docs_and_tokenize")
    spec = json.loads((CHALLENGE.parent / "tokenizer_specs.json").read_text())["tokenizers"][0]
    spec = {**spec, "vocab_size": VOCAB, "tokenizer_train_docs": TOKENIZER_DOCS}
    theirs = ref.build_sentencepiece_tokenizer(spec=spec, docs_jsonl=docs, tokenizers_dir=tmp_path / "tok")
    ours = spm.SentencePieceProcessor(model_file=str(plain / "tokenizer.model"))
    their_sp = spm.SentencePieceProcessor(model_file=theirs["manifest"]["model_path"])
    assert [ours.id_to_piece(i) for i in range(VOCAB)] == [their_sp.id_to_piece(i) for i in range(VOCAB)]

    reuse = {**spec, "reuse_model_path": str(plain / "tokenizer.model")}
    tok = ref.build_sentencepiece_tokenizer(spec=reuse, docs_jsonl=docs, tokenizers_dir=tmp_path / "reuse")
    stats = ref.export_shards(docs, tok, tmp_path / "ref", num_val_docs=VAL_DOCS, shard_size=SHARD,
                              docs_total=ref.count_docs(docs))
    ours_files = files(plain)
    assert len(ours_files) == stats["files_total"] > 4 and stats["files_val"] > 1
    assert ours_files == files(tmp_path / "ref")
    manifest = json.loads((plain / "manifest.json").read_text())
    assert manifest["tokens"] == {"val": stats["tokens_val"], "train": stats["tokens_train"]}


def test_caseops_equals_the_records_script(docs, cased, tmp_path, monkeypatch):
    """prepare_caseops_data.py (04-27) with --val-docs VAL_DOCS and our tokenizer writes our shards and val byte
    sidecars byte for byte (its 10**7-token shards shrunk to ours through its module constant)."""
    import sentencepiece as spm

    if not (RECORD_0427 / "lossless_caps.py").is_file():
        pytest.skip(f"{RECORD_0427 / 'lossless_caps.py'} not present")
    monkeypatch.syspath_prepend(str(RECORD_0427))
    ref = load(CASEOPS_REF, "record_prepare_caseops_data")
    monkeypatch.setattr(ref, "SHARD_TOKENS", SHARD)
    # SentencePiece 0.2.1+ serves the script's encode_as_immutable_proto as encode(out_type="proto").
    if not hasattr(spm.SentencePieceProcessor, "encode_as_immutable_proto"):
        monkeypatch.setattr(spm.SentencePieceProcessor, "encode_as_immutable_proto",
                            lambda self, text: self.encode(text, out_type="proto"), raising=False)
    monkeypatch.setattr(sys, "argv", ["prepare_caseops_data.py", "--docs", str(docs), "--out", str(tmp_path),
                                      "--sp", str(cased / "tokenizer.model"), "--val-docs", str(VAL_DOCS)])
    ref.main()
    theirs = files(tmp_path / "datasets" / "fineweb10B_sp8192_lossless_caps_caseops_v1_reserved")
    ours = files(cased)
    assert sum(n.startswith("fineweb_val_bytes_") for n in ours) > 1 and len(ours) > 6
    assert ours == theirs
    val = np.concatenate([shards.read_shard(cased / n) for n in ours if n.startswith("fineweb_val_0")])
    side = np.concatenate([shards.read_shard(cased / n) for n in ours if n.startswith("fineweb_val_bytes_")])
    texts = [json.loads(line)["text"] for line in docs.read_text(encoding="utf-8").splitlines()[:VAL_DOCS]]
    # The sidecar counts each document's UTF-8 bytes but what SentencePiece drops at its start or end (no token
    # stands for it): document 4's two blanks at each end, document 6's first bell, document 7's first blank sign.
    assert side.size == val.size and int(side[val == 1].max()) == 0
    assert int(side.sum()) == sum(len(t.encode("utf-8")) for t in texts) - 4 - 1 - 3
    assert json.loads((cased / "manifest.json").read_text())["checks"]["val_documents_with_uncounted_edges"] == 3


# ------------------------------------------------------------- same bytes always

def test_workers_chunks_and_resume_give_the_same_bytes(docs, plain, tmp_path, monkeypatch, capsys):
    """2 workers and other chunks: the same shards and tokenizer as 1 worker. A build killed at its 5th shard,
    run again and stopped by a full disk 9 shards later, run again and killed with every shard written, then run
    again with the same command, ends byte for byte as the uninterrupted one."""
    args = ["--docs", str(docs), "--out", str(tmp_path / "sp"), *SMALL, "--tokenizer-sample", "first",
            "--workers", "2", "--chunk-bytes", "7000"]
    real, calls = build_shards.write_shard, []

    def killed_at(n, error):
        def write(path, tokens):
            calls.append(path)
            if len(calls) == n:
                raise error
            real(path, tokens)
        return write

    monkeypatch.setattr(build_shards, "write_shard", killed_at(5, KeyboardInterrupt))
    assert build_shards.main(args) == 130
    assert not (tmp_path / "sp").exists() and (tmp_path / "sp.partial").is_dir()
    assert not list((tmp_path / "sp.partial").glob("*.tmp"))
    monkeypatch.setattr(build_shards, "write_shard", killed_at(len(calls) + 9, OSError(28, "No space left on device")))
    assert build_shards.main(args) == 1
    assert capsys.readouterr().err.count("No space left") == 1
    monkeypatch.setattr(build_shards, "write_shard", real)
    write_json = build_shards.write_json_atomic

    def killed_at_manifest(path, obj):
        if path.endswith("manifest.json"):
            raise KeyboardInterrupt
        write_json(path, obj)

    monkeypatch.setattr(build_shards, "write_json_atomic", killed_at_manifest)  # every shard written, then a kill
    assert build_shards.main(args) == 130
    monkeypatch.setattr(build_shards, "write_json_atomic", write_json)
    assert build_shards.main(args) == 0
    assert "resuming the build" in capsys.readouterr().out
    assert files(tmp_path / "sp") == files(plain)
    assert (tmp_path / "sp" / "tokenizer.model").read_bytes() == (plain / "tokenizer.model").read_bytes()
    ours, theirs = (json.loads((d / "manifest.json").read_text()) for d in (tmp_path / "sp", plain))
    assert ours["shards"] == theirs["shards"] and ours["checks"] == theirs["checks"]
    assert not (tmp_path / "sp.partial").exists()


# ------------------------------------------------------------------ bad inputs

@pytest.mark.parametrize("line, words", [(b"{not json}\n", "not JSON"), (b'{"txt": "a"}\n', 'no "text" string'),
                                         (b'{"text": "caf\xe9"}\n', "not UTF-8"),
                                         (b'{"text": "a\\ud800b"}\n', "not UTF-8 text")])
def test_bad_line_is_one_line_naming_it(docs, tmp_path, capsys, line, words):
    lines = docs.read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines[:300]) + line + b"".join(lines[300:]))
    assert build_shards.main(["--docs", str(bad), "--out", str(tmp_path / "sp"), *SMALL, "--workers", "1",
                              "--tokenizer", str(REPO / "no-such")]) == 2  # a missing --tokenizer first
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--tokenizer" in err
    assert build_shards.main(["--docs", str(bad), "--out", str(tmp_path / "sp"), *SMALL, "--workers", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"bad.jsonl line 301: {words}" in err, err
    assert not (tmp_path / "sp").exists() and not (tmp_path / "sp.partial" / "manifest.json").exists()


def test_caseops_without_protobuf_is_one_line_before_any_work(docs, tmp_path, capsys, monkeypatch):
    """--caseops reads token surfaces through SentencePiece's protobuf output: without protobuf, one line with its
    pip install, before anything is written."""
    from conftest import hide_modules

    hide_modules(monkeypatch, "google.protobuf")
    assert build_shards.main(["--docs", str(docs), "--out", str(tmp_path / "sp"), *SMALL, "--caseops"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install protobuf" in err, err
    assert not (tmp_path / "sp").exists() and not (tmp_path / "sp.partial").exists()


def test_full_disk_leaves_nothing_complete(docs, plain, tmp_path):
    """A file-size limit (writes fail as on a full disk: the tokenizer's 250 kB do not fit) stops the build with
    one line and leaves nothing that looks complete (no folder, no manifest, no temporary file); the same
    command without the limit then finishes with the uninterrupted build's bytes."""
    args = [sys.executable, str(REPO / "data" / "build_shards.py"), "--docs", str(docs), "--out",
            str(tmp_path / "sp"), *SMALL, "--tokenizer-sample", "first", "--workers", "1"]

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))

    proc = subprocess.run(args, capture_output=True, text=True, preexec_fn=small_files, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "File too large" in proc.stderr, proc.stderr
    part = tmp_path / "sp.partial"
    assert not (tmp_path / "sp").exists() and not (part / "manifest.json").exists()
    assert not list(part.glob("*.tmp")) and not list(part.glob("fineweb_*")) and not list(part.glob("*.model"))
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert files(tmp_path / "sp") == files(plain)


def test_manifest_and_checks(plain, cased):
    manifest = json.loads((plain / "manifest.json").read_text())
    assert manifest["split"]["val_docs"] == VAL_DOCS and manifest["split"]["challenge"] is False
    assert manifest["checks"]["val_documents_decoded_and_byte_counted"] == VAL_DOCS
    assert manifest["checks"]["val_documents_in_train"] == 0
    import hashlib

    for entry in manifest["shards"]:
        data = (plain / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == 1024 + 2 * entry["tokens"]
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256((plain / "tokenizer.model").read_bytes()).hexdigest()
    assert "--out" in manifest["command"] and manifest["command"].startswith("python3 data/build_shards.py")
    cm = json.loads((cased / "manifest.json").read_text())
    assert [s["file"] for s in cm["sidecars"]] == [f"fineweb_val_bytes_{i:06d}.bin" for i in range(len(cm["sidecars"]))]
    for entry in cm["sidecars"]:
        assert hashlib.sha256((cased / entry["file"]).read_bytes()).hexdigest() == entry["sha256"]


def test_val_document_in_train_is_found(tmp_path, docs):
    """Documents repeated from val into train are counted by the fingerprints; past 0.1% the build refuses."""
    lines = docs.read_bytes().splitlines(keepends=True)
    dup = tmp_path / "dup.jsonl"
    dup.write_bytes(b"".join(lines) + lines[7] + lines[11])
    assert build_shards.main(["--docs", str(dup), "--out", str(tmp_path / "sp"), *SMALL, "--workers", "1"]) == 1
    assert not (tmp_path / "sp").exists()


TRICKY = ["", " ", "a", "a  b", "\u2581", "a\u2581\u2581b", "x \u00b4y", "\ufb01ne", "\u3000word", "tab\there\n\nnext",
          "  lead", "trail  ", "12345 678", "\u6f22\u5b57 \u304b\u306a", "\U0001f600 x", "a\u00a0b", "\u2581 \u2581",
          "The END. iPhone \ue001x \ue004\ue001", "e\u0301 \u0301e", "\x00 nul", "x" * 5000 + " y"]


@pytest.mark.parametrize("side", ["plain", "cased"])
def test_word_cache_gives_sentencepiece_tokens(docs, side, request):
    """Words through the cache (the default) give SentencePiece's own tokens of each whole document: every test
    document and odd blanks, normalisations and operators, cold and warm; --no-word-cache encodes whole."""
    folder = request.getfixturevalue(side)
    model = (folder / "tokenizer.model").read_bytes()
    enc = build_shards.Encoder(model, str(docs), VAL_DOCS, side == "cased")
    assert enc.words is not None
    texts = [json.loads(line)["text"] for line in docs.read_text(encoding="utf-8").splitlines()] + TRICKY
    if side == "cased":
        texts = [caseops.encode(t) for t in texts]
    whole = np.concatenate([[1] + ids for ids in enc.sp.encode(texts, out_type=int)]).astype(np.uint16)
    assert np.array_equal(enc._encode_train(texts, 1), whole)  # cold
    back = np.concatenate([[1] + ids for ids in enc.sp.encode(texts[::-1], out_type=int)]).astype(np.uint16)
    assert np.array_equal(enc._encode_train(texts[::-1], 1), back)  # warm
    assert build_shards.Encoder(model, str(docs), VAL_DOCS, side == "cased", word_cache=False).words is None


# ------------------------------------------------------------ training on it

def test_train_gpt_runs_on_a_built_variant_and_refuses_another_vocab(plain, tmp_path):
    """train_gpt.py on the built variant (vocabulary 400, which no preset uses): training, the artifact, the
    evaluations and TTT, the split said in the log. VOCAB_SIZE other than the tokenizer's: one line at start."""
    from conftest import TINY_ENV, read_log, run_training

    env = {**TINY_ENV, "DATA_PATH": str(plain), "TOKENIZER_PATH": str(plain / "tokenizer.model"),
           "VOCAB_SIZE": "1024", "RUN_ID": "other_vocab"}
    proc = run_training(env, tmp_path)
    assert proc.returncode != 0
    err = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(err) == 1 and f"{plain / 'tokenizer.model'} has {VOCAB} pieces but VOCAB_SIZE=1024" in err[0], err
    assert not re.search(r"^(warmup_)?step:\d", read_log(tmp_path, "other_vocab"), re.M)  # refused before training
    env = {**env, "VOCAB_SIZE": str(VOCAB), "RUN_ID": "own_vocab", "ITERATIONS": "2", "TRAIN_BATCH_TOKENS": "2048",
           "TTT_EPOCHS": "1", "TTT_CHUNK_TOKENS": "1024", "EVAL_STRIDE": "64"}
    proc = run_training(env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(tmp_path, "own_vocab")
    for line in (f"data_split: NOT the challenge's: the first {VAL_DOCS} documents are validation",
                 "step:2/2", "final_int6_roundtrip_exact", "legal_ttt_exact val_loss:"):
        assert line in log, line


def test_train_gpt_reads_the_caseops_variant_with_its_sidecars(cased):
    """train_gpt.py's own readers take the CaseOps build: its tokenizer is a CaseOps one (operators at 4-7) and the
    val bytes come from the sidecars, equal to their sum over the scored targets."""
    import train_gpt as tg

    luts = tg.build_byte_luts(str(cased / "tokenizer.model"), VOCAB)
    pattern = str(cased / "fineweb_val_*.bin")
    val = tg.load_validation_tokens(pattern, 128, VOCAB, include_tail=True)
    luts, kind = tg.load_byte_sidecar(pattern, val, luts)
    assert luts.caseops and kind == "sidecar"
    side = np.concatenate([shards.read_shard(f) for f in sorted(cased.glob("fineweb_val_bytes_*.bin"))])
    assert int(luts.sidecar.sum()) == int(side[:val.numel()].sum()) and luts.sidecar.numel() == val.numel()


def test_caseops_fast_paths_equal_the_character_decoder():
    """caseops.decode and original_byte_counts's fast paths (build_shards checks every val document with them) give
    what the character-at-a-time decoder gives, or refuse what it refuses, on random strings and random cuts."""
    import random

    rng = random.Random(0)
    alphabet = "aAbZ \n1\u00e9" + "".join(caseops.OPERATORS)

    def outcome(fn, arg):
        try:
            return fn(arg)
        except caseops.CaseOpsError:
            return "refused"

    for _ in range(6000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        assert outcome(caseops.decode, text) == outcome(caseops.decode_slowly, text), text
        enc = caseops.encode(text)
        cuts = sorted(rng.sample(range(len(enc) + 1), min(3, len(enc) + 1)))
        for pieces in ([enc[a:b] for a, b in zip([0] + cuts, cuts + [len(enc)])], list(enc), list(text)):
            assert outcome(caseops.original_byte_counts, pieces) == outcome(caseops.byte_counts_slowly, pieces)
