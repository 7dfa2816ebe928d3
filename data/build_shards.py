"""Build a tokenizer variant's shards from the challenge's documents (docs_selected.jsonl).

    python3 data/build_shards.py --docs DOCS.jsonl --vocab-size V [--caseops] [--tokenizer MODEL] --out DIR
        [--val-docs 50000] [--shard-tokens N] [--tokenizer-docs 200000] [--tokenizer-sample train|first]
        [--workers N] [--chunk-bytes B] [--no-word-cache]

DOCS.jsonl holds one JSON object with a "text" string a line (cached_challenge_fineweb.py --with-docs fetches
the challenge's). The first --val-docs documents (50,000, the challenge's split) are validation, the rest
train. Without --tokenizer a SentencePiece BPE tokenizer of V pieces is trained with the settings of the
challenge's tokenizer_specs.json exports (BPE, byte fallback, split digits, nmt_nfkc, no dummy prefix, ids
pad 0 <s> 1 </s> 2 <unk> 3, character coverage 0.999, whole documents as sentences with NULs blanked and ends
stripped) on the first --tokenizer-docs train documents (--tokenizer-sample first: the file's first documents,
validation included, as the challenge's script chose them); with --caseops on their CaseOps encodings, the four
case operators user-defined symbols 4-7.

Every document becomes <s> + its tokens (CaseOps-encoded first with --caseops), in file order, cut into shards
of --shard-tokens tokens (10**8 as the challenge's export, 10**7 with --caseops as the CaseOps export; the last
of each split shorter) in the challenge's shard format (data/shards.py):

    DIR/tokenizer.model, tokenizer.vocab
    DIR/fineweb_val_XXXXXX.bin, fineweb_train_XXXXXX.bin
    DIR/fineweb_val_bytes_XXXXXX.bin   (--caseops: per val token the UTF-8 bytes of original text it stands
                                        for, as the CaseOps records' prepare_caseops_data.py writes them)
    DIR/manifest.json                  (counts, the split, sha256 of the tokenizer and of every shard, the
                                        checks, the command)

The work is cut into chunks of whole lines fixed by the file alone (--chunk-bytes, 4 MiB), tokenized by
--workers processes (default: every core) and written in file order, so the bytes do not depend on the number
of workers (nor on the chunk size). Train documents are encoded word by word through a cache of each word's
tokens: SentencePiece segments every blank-led word on its own when no piece holds a blank after its start
(checked on the model), so the tokens are the same; every 64th document is also encoded whole and compared
(--no-word-cache: every document whole). Val documents are always encoded whole. Before the
manifest is written: every val document decodes back to its text (through the CaseOps inverse with --caseops;
plain: the text as the tokenizer normalises it), its byte count as the evaluation counts it (the sidecar, or
the tokenizer's byte tables) equals the UTF-8 bytes of that text, and the train shards hold no more than
0.1% of the val documents (fingerprints of data/shards.py, then an exact comparison).

The build happens in DIR.partial and becomes DIR only once complete: a killed build (or a full disk) leaves no
DIR; the same command then continues from the last shard written and ends with the same bytes as an
uninterrupted build. A bad line (not UTF-8, not JSON, no "text" string) is one error line naming its number.
"""

import hashlib
import io
import json
import os
import shlex
import shutil
import sys
import time

import numpy as np

import caseops
from shards import (HEADER_BYTES, VAL_OVERLAP_TOLERANCE, OneLineParser, UsageError, ValDocuments,
                    document_fingerprints, read_shard,
                    run_command, shard_num_tokens, write_file_atomic, write_shard)

CHALLENGE_VAL_DOCS = 50_000  # the challenge's split: the first 50,000 documents are validation
SHARD_TOKENS = 10**8  # the challenge's export (download_hf_docs_and_tokenize.py)
CASEOPS_SHARD_TOKENS = 10**7  # the CaseOps export (prepare_caseops_data.py)
CHUNK_BYTES = 1 << 22  # a work item: the whole lines starting in 4 MiB of the documents file
TOKENIZER_DOCS = 200_000
BOS_ID = 1
WORD_CACHE_SIZE = 1 << 19  # words a worker keeps
WORD_CHECK_EVERY = 64  # every 64th train document is also encoded whole: the word cache must agree
STATE = "build_state.json"
MANIFEST = "manifest.json"
MODEL = "tokenizer.model"
# The challenge's SentencePiece settings (its tokenizer_specs.json builder); num_threads is stored in the model
# file, so it is fixed (SentencePiece's default) to keep the model's bytes off the machine's core count.
SP_TRAINER_OPTIONS = dict(model_type="bpe", character_coverage=0.999, byte_fallback=True, split_digits=True,
                          normalization_rule_name="nmt_nfkc", add_dummy_prefix=False, pad_id=0, bos_id=1,
                          eos_id=2, unk_id=3, hard_vocab_limit=False, num_threads=16, minloglevel=2)


class BuildError(Exception):
    """A failed build or check: one stderr line, exit status 1."""


def parse_args(argv):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", required=True, help="the documents, one JSON object with a 'text' string a line")
    p.add_argument("--vocab-size", type=int, required=True, help="the tokenizer's vocabulary size")
    p.add_argument("--out", required=True, help="the variant's folder (built in OUT.partial, renamed when done)")
    p.add_argument("--caseops", action="store_true", help="CaseOps-encode documents; write val byte sidecars")
    p.add_argument("--tokenizer", help="an existing SentencePiece model (default: train one)")
    p.add_argument("--val-docs", type=int, default=CHALLENGE_VAL_DOCS,
                   help=f"the first N documents are validation (default {CHALLENGE_VAL_DOCS}, the challenge's)")
    p.add_argument("--shard-tokens", type=int, default=None,
                   help=f"tokens a shard (default {SHARD_TOKENS}, with --caseops {CASEOPS_SHARD_TOKENS})")
    p.add_argument("--tokenizer-docs", type=int, default=TOKENIZER_DOCS,
                   help=f"documents the tokenizer trains on (default {TOKENIZER_DOCS})")
    p.add_argument("--tokenizer-sample", choices=("train", "first"), default="train",
                   help="train: the first train documents (default); first: the file's first documents, "
                        "validation included, as the challenge's script")
    p.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES,
                   help=f"a work item: the lines starting in this many bytes (default {CHUNK_BYTES}); any value "
                        f"gives the same shards")
    p.add_argument("--no-word-cache", action="store_true",
                   help="encode every document whole (default: words through a cache, the same tokens, checked)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: cores)")
    args = p.parse_args(argv)
    if not 256 + 8 < args.vocab_size <= 65536:
        raise UsageError(f"--vocab-size must be in 265..65536 (byte fallback needs 256 + specials; shards hold "
                         f"uint16), got {args.vocab_size}")
    if args.val_docs < 1:
        raise UsageError(f"--val-docs must be at least 1, got {args.val_docs}")
    if args.shard_tokens is None:
        args.shard_tokens = CASEOPS_SHARD_TOKENS if args.caseops else SHARD_TOKENS
    if not 1 <= args.shard_tokens < 2**31:
        raise UsageError(f"--shard-tokens must be in 1..{2**31 - 1}, got {args.shard_tokens}")
    if args.tokenizer_docs < 1:
        raise UsageError(f"--tokenizer-docs must be at least 1, got {args.tokenizer_docs}")
    if args.chunk_bytes < 1:
        raise UsageError(f"--chunk-bytes must be at least 1, got {args.chunk_bytes}")
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    if not os.path.isfile(args.docs):
        raise UsageError(f"--docs {args.docs}: no such file")
    if args.tokenizer is not None and not os.path.isfile(args.tokenizer):
        raise UsageError(f"--tokenizer {args.tokenizer}: no such file")
    if args.caseops and not has_module("google.protobuf"):
        raise UsageError("--caseops needs the protobuf package (SentencePiece gives token surfaces, which the val "
                         "byte sidecars count, as protobuf messages): pip install protobuf")
    return args


def has_module(name):
    """Whether `name` can be imported (a dotted name whose parent package is missing: no)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


# ------------------------------------------------------------------ documents

def parse_line(raw, line_no, path):
    """The text of one line of the documents file; BuildError naming the line when it is not one."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BuildError(f"{path} line {line_no}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise BuildError(f"{path} line {line_no}: not JSON ({e})") from None
    text = obj.get("text") if isinstance(obj, dict) else None
    if not isinstance(text, str):
        raise BuildError(f"{path} line {line_no}: no \"text\" string")
    if b"\\ud" in raw or b"\\uD" in raw:  # a JSON escape of a lone surrogate is no character of UTF-8 text
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BuildError(f"{path} line {line_no}: not UTF-8 text (a lone surrogate {text[e.start]!r})") from None
    return text


def scan_documents(path, chunk_bytes):
    """One pass over the documents file: (chunks [(start byte, end byte, first document index, documents)],
    documents, sha256). Chunks hold whole lines and depend only on the file."""
    chunks, digest, start, docs, pos = [], hashlib.sha256(), 0, 0, 0
    with open(path, "rb") as f:
        carry = b""
        while True:
            block = f.read(chunk_bytes)
            digest.update(block)
            if not block:
                break
            cut = block.rfind(b"\n")
            pos += len(block)
            if cut < 0:
                carry += block
                continue
            end = pos - (len(block) - cut - 1)
            n = block.count(b"\n", 0, cut + 1)  # carry holds none
            chunks.append((start, end, docs, n))
            docs, start, carry = docs + n, end, block[cut + 1:]
        if pos > start:  # a last line without its newline
            chunks.append((start, pos, docs, 1))
            docs += 1
    return chunks, docs, digest.hexdigest()


def iter_texts(path, first, limit):
    """Documents first, first+1, ... of the file (at most `limit`), parsed."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            if i < first:
                continue
            if i >= first + limit:
                break
            yield parse_line(raw, i + 1, path)


# ------------------------------------------------------------------ tokenizer

def train_tokenizer(args, val_docs):
    """The .model bytes of a tokenizer trained as the challenge's specs train theirs."""
    import sentencepiece as spm

    first = val_docs if args.tokenizer_sample == "train" else 0

    def sentences():
        for text in iter_texts(args.docs, first, args.tokenizer_docs):
            text = text.replace("\x00", " ").strip()
            if text:
                yield caseops.encode(text) if args.caseops else text

    extra = {"user_defined_symbols": list(caseops.OPERATORS)} if args.caseops else {}
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=sentences(), model_writer=model, vocab_size=args.vocab_size,
                                   **SP_TRAINER_OPTIONS, **extra)
    return model.getvalue()


def load_tokenizer(model_bytes, args):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    if sp.vocab_size() != args.vocab_size:
        raise BuildError(f"the tokenizer has {sp.vocab_size()} pieces, not --vocab-size {args.vocab_size}"
                         + ("" if args.tokenizer else " (too little text for so many pieces?)"))
    if sp.bos_id() != BOS_ID:
        raise BuildError(f"the tokenizer's <s> is id {sp.bos_id()}, not {BOS_ID} (the shards' document start)")
    if args.caseops and [sp.piece_to_id(c) for c in caseops.OPERATORS] != list(range(4, caseops.RESERVED_IDS)):
        raise BuildError("--caseops needs a tokenizer with the four CaseOps operators at ids 4-7")
    return sp


def byte_table(sp):
    """Per token id (base UTF-8 bytes, has a leading space, is a boundary): the evaluation's byte count."""
    n = sp.vocab_size()
    base, lead, boundary = np.zeros(n, np.int64), np.zeros(n, bool), np.ones(n, bool)
    for i in range(n):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            continue
        boundary[i] = False
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            base[i] = 1
            continue
        lead[i] = piece.startswith("\u2581")
        base[i] = len(piece[int(lead[i]):].encode("utf-8"))
    return base, lead, boundary


# --------------------------------------------------------------- tokenizing

class Encoder:
    """Tokenizes one chunk of the documents file (in a worker process)."""

    def __init__(self, model_bytes, docs, val_docs, use_caseops, word_cache=True):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        self.docs, self.val_docs, self.caseops = docs, val_docs, use_caseops
        self.table = byte_table(self.sp)
        # Word cache: SentencePiece segments each word (a run up to the next blank) on its own when no piece holds
        # a blank after its start, so a word's tokens can be looked up (in the normalised text) instead of found
        # again. Every WORD_CHECK_EVERY-th document is also encoded whole and must match.
        pieces = (self.sp.id_to_piece(i) for i in range(self.sp.vocab_size()) if not self.sp.is_byte(i))
        word_cache = word_cache and not any("\u2581" in p[1:] for p in pieces)
        self.words = {} if word_cache else None  # word -> its ids after a blank
        self.heads = {}  # a text's first word (no blank before it) -> its ids
        self.prefix = self.sp.encode("a", out_type=int)

    def _encode_train(self, texts, first):
        """<s> + the token ids of each text, as SentencePiece's encode gives them, as one uint16 array; through the
        word cache when on: the chunk's new words are encoded in one call, each after "a" and a blank (so that it
        starts a word), and a text is the join of its words' cached little-endian bytes."""
        sp, words, heads, prefix = self.sp, self.words, self.heads, self.prefix
        if words is None:
            return self._join(sp.encode(texts, out_type=int, num_threads=1))
        if len(words) + len(heads) >= WORD_CACHE_SIZE:
            words.clear()
            heads.clear()
        splits = [n.split("\u2581") for n in sp.normalize(texts)]
        new = set().union(*splits).difference(words)  # first words too: harmless, and one pass in C
        new.discard("")  # a blank no normalisation removed: such texts are encoded whole below
        new = sorted(new)
        for w, got in zip(new, sp.encode(["a\u2581" + w for w in new], out_type=int, num_threads=1)):
            if got[:len(prefix)] != prefix:
                raise BuildError(f"the tokenizer merges a word with the blank before it ({w!r})")
            words[w] = np.asarray(got[len(prefix):], "<u2").tobytes()
        new = sorted({ws[0] for ws in splits}.difference(heads))
        heads.update((w, np.asarray(got, "<u2").tobytes())
                     for w, got in zip(new, sp.encode(new, out_type=int, num_threads=1)))
        bos, parts = np.asarray([BOS_ID], "<u2").tobytes(), []
        for k, ws in enumerate(splits):
            if "" in ws and "" in ws[1:]:
                doc = np.asarray(sp.encode(texts[k], out_type=int), "<u2").tobytes()
            else:
                doc = heads[ws[0]] + b"".join(map(words.__getitem__, ws[1:]))
                if (first + k) % WORD_CHECK_EVERY == 0 and \
                        np.frombuffer(doc, "<u2").tolist() != sp.encode(texts[k], out_type=int):
                    raise BuildError(f"{self.docs} line {first + k + 1}: the word cache's tokens differ from "
                                     f"SentencePiece's; rerun with --no-word-cache")
            parts += (bos, doc)
        return np.frombuffer(b"".join(parts), "<u2")

    def __call__(self, chunk):
        """(val tokens, val byte sidecar or None, train tokens, train document fingerprints) of a chunk, as
        uint16 arrays (fingerprints uint64); BuildError when a val document fails a check."""
        start, end, first, n = chunk
        with open(self.docs, "rb") as f:
            f.seek(start)
            lines = f.read(end - start).split(b"\n")[:n]
        texts = [parse_line(raw, first + k + 1, self.docs) for k, raw in enumerate(lines)]
        n_val = min(max(self.val_docs - first, 0), n)
        self.edge_dropped = self.normalised = 0
        val, side = self._val(texts[:n_val], first) if n_val else ([], None)
        train = texts[n_val:]
        if self.caseops:
            train = [caseops.encode(t) for t in train]
        train = self._encode_train(train, first + n_val) if train else np.zeros(0, np.uint16)
        prints = document_fingerprints(np.append(train, np.uint16(BOS_ID)), BOS_ID)
        return (self._join(val) if n_val else np.zeros(0, np.uint16), side, train, prints, self.edge_dropped,
                self.normalised)

    @staticmethod
    def _join(docs):
        out = np.empty(sum(len(d) for d in docs) + len(docs), np.uint16)
        pos = 0
        for d in docs:
            out[pos] = BOS_ID
            out[pos + 1:pos + 1 + len(d)] = d
            pos += 1 + len(d)
        return out

    def _val(self, texts, first):
        """Val documents' ids, each checked: decoding gives the text back and the evaluation's byte count
        equals its UTF-8 bytes (the byte sidecar with CaseOps: from each token's surface, as the records)."""
        ids_out, side = [], []
        base, lead, boundary = self.table
        for k, original in enumerate(texts):
            where = f"{self.docs} line {first + k + 1} (a val document)"
            text = caseops.encode(original) if self.caseops else original
            if self.caseops:
                proto = self.sp.encode(text, out_type="proto")
                ids = [p.id for p in proto.pieces]
                surfaces = [p.surface for p in proto.pieces]
                counts = caseops.original_byte_counts(surfaces)
                spelled = caseops.decode("".join(surfaces))
                at = original.find(spelled)
                # What no surface spells may only be what the normaliser drops at the ends (blanks, controls).
                if at < 0 or self.sp.normalize(original[:at]) or self.sp.normalize(original[at + len(spelled):]):
                    raise BuildError(f"{where}: its tokens' surfaces do not spell the document back")
                if sum(counts) != len(spelled.encode("utf-8")):
                    raise BuildError(f"{where}: byte sidecar sums to {sum(counts)}, its text has "
                                     f"{len(spelled.encode('utf-8'))} bytes")
                side.append(np.asarray([0] + counts, np.int64))
                self.edge_dropped += spelled != original
                decoded = self.sp.decode(ids)
                normal = self.sp.normalize(text).replace("\u2581", " ")
            else:
                ids = self.sp.encode(text, out_type=int)
                decoded = self.sp.decode(ids)
                normal = self.sp.normalize(text).replace("\u2581", " ")
                arr = np.asarray(ids, np.int64)
                prev = np.concatenate([[BOS_ID], arr[:-1]]).astype(np.int64)
                counted = int(base[arr].sum() + (lead[arr] & ~boundary[prev]).sum()) if arr.size else 0
                if counted != len(decoded.encode("utf-8")):
                    raise BuildError(f"{where}: the evaluation counts {counted} bytes, its decoded text has "
                                     f"{len(decoded.encode('utf-8'))}")
            if decoded != normal:
                raise BuildError(f"{where}: decoding its tokens does not give its (normalised) text back")
            self.normalised += normal != text
            if max(ids, default=0) >= self.sp.vocab_size():
                raise BuildError(f"{where}: token id {max(ids)} outside the vocabulary")
            ids_out.append(ids)
        sidecar = None
        if self.caseops:
            sidecar = np.concatenate(side)
            if sidecar.size and int(sidecar.max()) > 65535:
                raise BuildError(f"{self.docs}: a val token stands for more than 65535 bytes")
            sidecar = sidecar.astype(np.uint16)
        return ids_out, sidecar

    # Per chunk: val documents with characters at their ends that no token stands for (blanks, controls, BOMs the
    # normaliser drops: no path counts them), and val documents
    # the tokenizer's normalisation changes (NFKC, blanks).
    edge_dropped = normalised = 0


_ENCODER = None


def _init_worker(*args):
    global _ENCODER
    _ENCODER = Encoder(*args)


def _encode_in_worker(chunk):
    return _ENCODER(chunk)


# ------------------------------------------------------------------- writing

class Split:
    """One split's shard stream: fills shards of `size` tokens in order, records where the next one starts
    (chunk index, tokens of that chunk's output of this split already written) for a resumed build."""

    def __init__(self, folder, name, size, state):
        self.folder, self.name, self.size = folder, name, size
        self.shards = state["shards"]  # [[file name, tokens, sha256], ...] (sidecars: [..., sidecar sha256])
        self.chunk, self.skip = state["chunk"], state["skip"]
        self.parts, self.side_parts, self.fill = [], [], 0

    def state(self):
        return {"shards": self.shards, "chunk": self.chunk, "skip": self.skip}

    def add(self, chunk_index, tokens, sidecar, on_shard):
        pos = self.skip if chunk_index == self.chunk else 0
        while pos < tokens.size:
            take = min(self.size - self.fill, tokens.size - pos)
            self.parts.append(tokens[pos:pos + take])
            if sidecar is not None:
                self.side_parts.append(sidecar[pos:pos + take])
            self.fill, pos = self.fill + take, pos + take
            if self.fill == self.size:
                self.chunk, self.skip = chunk_index, pos
                self.flush(on_shard)

    def flush(self, on_shard):
        if not self.fill:
            return
        name = f"fineweb_{self.name}_{len(self.shards):06d}.bin"
        entry = [name, self.fill, write_hashed(os.path.join(self.folder, name), np.concatenate(self.parts))]
        if self.side_parts:
            side_name = name.replace("fineweb_val_", "fineweb_val_bytes_", 1)
            entry.append(write_hashed(os.path.join(self.folder, side_name), np.concatenate(self.side_parts)))
        self.shards.append(entry)
        self.parts, self.side_parts, self.fill = [], [], 0
        on_shard()


def write_hashed(path, tokens):
    """write_shard, returning the file's sha256."""
    write_shard(path, tokens)
    digest = hashlib.sha256()
    header = np.zeros(HEADER_BYTES // 4, "<i4")
    header[:3] = (20240520, 1, tokens.size)
    digest.update(header.tobytes())
    digest.update(tokens.astype("<u2").tobytes())
    return digest.hexdigest()


def write_json_atomic(path, obj):
    write_file_atomic(path, (json.dumps(obj, indent=1) + "\n").encode("utf-8"))


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------- build

def settings_of(args, docs_sha256, n_docs):
    """What decides the output's bytes: a resumed build must have the same."""
    tok = None if args.tokenizer is None else sha256_file(args.tokenizer)
    return {"docs_sha256": docs_sha256, "docs": n_docs, "vocab_size": args.vocab_size, "caseops": args.caseops,
            "tokenizer": tok, "val_docs": args.val_docs, "shard_tokens": args.shard_tokens,
            "tokenizer_docs": None if tok else args.tokenizer_docs,
            "tokenizer_sample": None if tok else args.tokenizer_sample, "chunk_bytes": args.chunk_bytes}


def open_partial(out, settings):
    """OUT.partial and its state: continued when its settings match, else started afresh."""
    part = out + ".partial"
    state_path = os.path.join(part, STATE)
    if os.path.isfile(state_path):
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
        if state.get("settings") == settings:
            print(f"resuming the build in {part}: {len(state['val']['shards'])} val and "
                  f"{len(state['train']['shards'])} train shards already written")
            return part, state
        print(f"note: {part} holds a build with other settings; starting afresh")
    shutil.rmtree(part, ignore_errors=True)
    os.makedirs(part)
    return part, {"settings": settings, "val_done": False, "val": {"shards": [], "chunk": 0, "skip": 0},
                  "train": {"shards": [], "chunk": 0, "skip": 0},
                  "val_in_train": 0, "edge_dropped": 0, "normalised": 0}


def chunk_results(chunks, todo, model_bytes, args):
    """(index, result) of chunks[i] for i in todo, in order, from args.workers processes."""
    init = (model_bytes, args.docs, args.val_docs, args.caseops, not args.no_word_cache)
    if args.workers == 1:
        _init_worker(*init)
        for i in todo:
            yield i, _encode_in_worker(chunks[i])
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(args.workers, _init_worker, init) as pool:
        yield from zip(todo, pool.imap(_encode_in_worker, [chunks[i] for i in todo]))


def val_index(folder, val_shards):
    """The val shards' documents (data/shards.py's ValDocuments), the last one closed by a <s>: what a train
    document is compared with."""
    tokens = np.concatenate([read_shard(os.path.join(folder, s[0])) for s in val_shards] + [[BOS_ID]])
    return ValDocuments(tokens.astype(np.uint16), BOS_ID)


def build(args, argv):
    start_time = time.perf_counter()
    out = os.path.abspath(args.out.rstrip("/"))
    command = "python3 data/build_shards.py " + " ".join(shlex.quote(a) for a in argv)
    if os.path.exists(os.path.join(out, MANIFEST)):
        with open(os.path.join(out, MANIFEST), encoding="utf-8") as f:
            done = json.load(f)
        raise UsageError(f"--out {out} already holds a finished build ({done.get('command', '?')}); "
                         f"remove it or choose another --out")
    if os.path.exists(out):
        raise UsageError(f"--out {out} exists and is not a finished build; remove it or choose another --out")

    chunks, n_docs, docs_sha = scan_documents(args.docs, args.chunk_bytes)
    if n_docs <= args.val_docs:
        raise UsageError(f"--docs {args.docs} has {n_docs} documents, not more than --val-docs {args.val_docs}")
    split_note = ("the challenge's split: the first 50,000 documents are validation"
                  if args.val_docs == CHALLENGE_VAL_DOCS else
                  f"NOT the challenge's split: the first {args.val_docs} documents are validation "
                  f"(the challenge's: {CHALLENGE_VAL_DOCS})")
    print(f"documents: {n_docs} in {args.docs} (sha256 {docs_sha[:16]}...), {len(chunks)} chunks; {split_note}")
    settings = settings_of(args, docs_sha, n_docs)
    part, state = open_partial(out, settings)
    save = lambda: write_json_atomic(os.path.join(part, STATE), state)  # noqa: E731

    model_path = os.path.join(part, MODEL)
    if args.tokenizer is not None:
        with open(args.tokenizer, "rb") as f:
            model_bytes = f.read()
    elif os.path.isfile(model_path) and state.get("tokenizer_sha256"):
        with open(model_path, "rb") as f:
            model_bytes = f.read()
        if hashlib.sha256(model_bytes).hexdigest() != state["tokenizer_sha256"]:
            raise BuildError(f"{model_path} changed since it was trained; remove {part} to start afresh")
    else:
        t0 = time.perf_counter()
        first = "train" if args.tokenizer_sample == "train" else "first"
        print(f"training the tokenizer: {args.vocab_size} pieces on the {first} {args.tokenizer_docs} documents")
        model_bytes = train_tokenizer(args, args.val_docs)
        print(f"tokenizer trained in {time.perf_counter() - t0:.1f}s")
    sp = load_tokenizer(model_bytes, args)
    if not os.path.isfile(model_path):
        write_file_atomic(model_path, model_bytes)
        vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.vocab_size()))
        write_file_atomic(model_path[:-len(".model")] + ".vocab", vocab.encode("utf-8"))
    state["tokenizer_sha256"] = hashlib.sha256(model_bytes).hexdigest()
    save()

    val = Split(part, "val", args.shard_tokens, state["val"])
    train = Split(part, "train", args.shard_tokens, state["train"])

    def on_shard():
        state["val"], state["train"] = val.state(), train.state()
        save()

    for split in (val, train):  # shards past the recorded ones are leftovers of the killed build
        for name in os.listdir(part):
            if name.startswith(f"fineweb_{split.name}_") and name.endswith((".bin", ".tmp")):
                index = int(name.rsplit("_", 1)[1].split(".")[0])
                if index >= len(split.shards):
                    os.remove(os.path.join(part, name))
    index = None if not state["val_done"] else val_index(part, val.shards)
    first_chunk = train.chunk if state["val_done"] else val.chunk
    t0, tokens_done = time.perf_counter(), 0
    todo = range(len(chunks) if state.get("train_done") else first_chunk, len(chunks))
    # Counts are added after the chunk's shards are recorded: a build resumed at this chunk counts it again.
    for i, (val_toks, side, train_toks, prints, edge, normalised) in chunk_results(chunks, todo, model_bytes, args):
        begin, n = chunks[i][2], chunks[i][3]
        if not state["val_done"]:
            val.add(i, val_toks, side, on_shard)
            state["edge_dropped"] += edge
            state["normalised"] += normalised
            if begin + n >= args.val_docs:
                val.flush(on_shard)
                train.chunk, train.skip = i, 0
                state["val_done"] = True
                on_shard()
                index = val_index(part, val.shards)
        if train_toks.size:
            train.add(i, train_toks, None, on_shard)
            # train documents equal to a val document (a train document found twice counts twice)
            state["val_in_train"] += len({k for k, _ in index.found_in(np.append(train_toks, np.uint16(BOS_ID)),
                                                                        prints)})
        tokens_done += val_toks.size + train_toks.size
        if i % 256 == 255:
            rate = tokens_done / max(time.perf_counter() - t0, 1e-9)
            print(f"chunk {i + 1}/{len(chunks)}: {rate:,.0f} tokens/s")
    train.flush(on_shard)
    state["train_done"] = True  # the last, shorter shard is written: a resumed build only checks and finishes
    save()
    elapsed = time.perf_counter() - t0

    n_val = index.n
    if state["val_in_train"] > VAL_OVERLAP_TOLERANCE * n_val:
        raise BuildError(f"{state['val_in_train']} of the {n_val} val documents also occur in the train shards "
                         f"(more than {VAL_OVERLAP_TOLERANCE:.1%}); are there duplicate documents in {args.docs}?")
    for split in (val, train):  # every shard as written: complete header and size
        for entry in split.shards:
            if shard_num_tokens(os.path.join(part, entry[0])) != entry[1]:
                raise BuildError(f"{part}/{entry[0]}: not the {entry[1]} tokens written")
    manifest = {
        "command": command,
        "docs": {"path": os.path.abspath(args.docs), "sha256": docs_sha, "documents": n_docs},
        "split": {"val_docs": args.val_docs, "train_docs": n_docs - args.val_docs,
                  "challenge": args.val_docs == CHALLENGE_VAL_DOCS, "note": split_note},
        "tokenizer": {"file": MODEL, "sha256": state["tokenizer_sha256"], "vocab_size": args.vocab_size,
                      "trained": args.tokenizer is None,
                      "source": os.path.abspath(args.tokenizer) if args.tokenizer else None,
                      "training": None if args.tokenizer else {
                          "documents": args.tokenizer_docs, "sample": args.tokenizer_sample,
                          "options": SP_TRAINER_OPTIONS,
                          "user_defined_symbols": list(caseops.OPERATORS) if args.caseops else []}},
        "caseops": args.caseops,
        "shard_tokens": args.shard_tokens,
        "tokens": {"val": sum(e[1] for e in val.shards), "train": sum(e[1] for e in train.shards)},
        "shards": [{"file": e[0], "tokens": e[1], "sha256": e[2]} for e in val.shards + train.shards],
        "sidecars": [{"file": e[0].replace("fineweb_val_", "fineweb_val_bytes_", 1), "tokens": e[1],
                      "sha256": e[3]} for e in val.shards if len(e) > 3],
        "checks": {"val_documents_decoded_and_byte_counted": n_val,
                   "val_documents_changed_by_normalisation": state["normalised"],
                   "val_documents_with_uncounted_edges": state["edge_dropped"],
                   "val_documents_in_train": state["val_in_train"]},
    }
    write_json_atomic(os.path.join(part, MANIFEST), manifest)
    os.remove(os.path.join(part, STATE))
    os.replace(part, out)
    print(f"tokens: {manifest['tokens']['val']} val in {len(val.shards)} shards, {manifest['tokens']['train']} "
          f"train in {len(train.shards)} shards ({elapsed:.1f}s of tokenizing this run)")
    print(f"checks: {n_val} val documents decode back and count their bytes; {state['val_in_train']} found in "
          f"train; {state['normalised']} changed by the tokenizer's normalisation")
    print(f"done: {out} (manifest.json), {time.perf_counter() - start_time:.1f}s")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    return run_command(lambda: build(parse_args(argv), argv), (BuildError, OSError, RuntimeError, ValueError),
                       "interrupted; run the same command again to continue")


if __name__ == "__main__":
    sys.exit(main())
