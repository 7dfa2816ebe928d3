"""Build a small offline sample dataset in the challenge's shard format.

The real challenge data (FineWeb, see cached_challenge_fineweb.py) needs the
Hugging Face hub. This script needs nothing but Python and sentencepiece: it
takes English text that ships with the interpreter (the pydoc help topics and
the docstrings of a fixed list of standard-library modules), trains a
SentencePiece BPE tokenizer on the training part and writes token shards:

    <out-dir>/tokenizers/sample_<V>_bpe.model   (+ .vocab)
    <out-dir>/datasets/sample_sp<V>/fineweb_train_000000.bin ...
    <out-dir>/datasets/sample_sp<V>/fineweb_val_000000.bin

That text (about 1.3 MB) serves vocabularies up to 4096 and is all they use.
Larger ones (up to 8192, the vocabulary of the sp8192 records) also take the
docstrings of a second fixed module list and the comment blocks of all listed
modules' source files (about 1.9 MB in all), so that fewer of their pieces are
left rare or unused in the train tokens.

With --caseops the documents go through the CaseOps case transform
(caseops.py, SPEC-FRONTIER 2) first, as in the CaseOps records' exports: the
tokenizer holds the four case operators as user-defined symbols (ids 0-7 are
reserved, so every document gets an explicit <s>), the files are named
..._caseops, and the val shard gets a byte sidecar
fineweb_val_bytes_000000.bin (same shard format, one uint16 per val token:
the UTF-8 bytes of original text that token stands for; 0 for <s> and the
operators), from which bits per byte are computed.

    <out-dir>/tokenizers/sample_<V>_bpe_caseops.model
    <out-dir>/datasets/sample_sp<V>_caseops/fineweb_{train,val,val_bytes}_XXXXXX.bin

Every build refuses (one line) to write train shards that contain a val
document, checked by a fingerprint of each document (data/shards.py).

The output is byte-identical across runs with the same arguments on the same
Python version (docstrings change between Python releases).

    python data/build_sample_data.py [--out-dir DIR] [--vocab-size 1024|...|8192]
        [--train-shards 4] [--val-tokens 32769] [--seed 0] [--caseops]
"""

import contextlib
import importlib
import inspect
import io
import math
import os
import random
import sys
import time
import tokenize
import warnings

import numpy as np

import caseops
from shards import OneLineParser, UsageError, val_documents_in_train, write_shard

DATA_DIR = os.path.dirname(os.path.abspath(__file__))

# Pure-Python (or always-built-in) standard-library modules whose docstrings
# form the corpus. A fixed list keeps the text independent of which optional
# extension modules (ssl, sqlite3, ctypes, curses, lzma, tkinter, _decimal...)
# a given interpreter was built with, and of anything with import side effects.
DOC_MODULES = (
    "abc", "argparse", "ast", "asyncio.base_events", "asyncio.events",
    "asyncio.futures", "asyncio.locks", "asyncio.queues", "asyncio.streams",
    "asyncio.subprocess", "asyncio.tasks", "base64", "bdb", "binascii",
    "bisect", "builtins", "calendar", "cmd", "code", "codecs", "codeop",
    "collections", "collections.abc", "colorsys", "compileall",
    "concurrent.futures._base", "configparser", "contextlib", "contextvars",
    "copy", "copyreg", "csv", "dataclasses", "datetime", "difflib", "dis",
    "doctest", "email.charset", "email.feedparser", "email.generator",
    "email.header", "email.headerregistry", "email.message", "email.parser",
    "email.policy", "email.utils", "enum", "errno", "filecmp", "fileinput",
    "fnmatch", "fractions", "ftplib", "functools", "gc", "getopt", "getpass",
    "gettext", "glob", "graphlib", "heapq", "hmac", "html", "html.parser",
    "http", "http.client", "http.cookiejar", "http.cookies", "http.server",
    "imaplib", "importlib", "importlib.abc", "importlib.machinery",
    "importlib.metadata", "importlib.resources", "importlib.util", "inspect",
    "io", "ipaddress", "itertools", "json", "json.decoder", "json.encoder",
    "keyword", "linecache", "locale", "logging", "logging.config",
    "logging.handlers", "mailbox", "marshal", "math", "mimetypes",
    "modulefinder", "multiprocessing.connection", "multiprocessing.managers",
    "multiprocessing.pool", "multiprocessing.process", "multiprocessing.queues",
    "multiprocessing.shared_memory", "multiprocessing.synchronize", "netrc",
    "numbers", "opcode", "operator", "optparse", "os", "pathlib",
    "pdb", "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib",
    "posixpath", "pprint", "profile", "pstats", "py_compile", "pyclbr", "queue",
    "quopri", "random", "re", "reprlib", "runpy", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "signal", "smtplib", "socket",
    "socketserver", "stat", "statistics", "string", "stringprep", "struct",
    "subprocess", "symtable", "sys", "sysconfig", "tabnanny", "tarfile",
    "tempfile", "textwrap", "threading", "time", "timeit", "token", "tokenize",
    "tomllib", "trace", "traceback", "tracemalloc", "types", "typing",
    "unicodedata", "unittest.case", "unittest.loader", "unittest.main",
    "unittest.mock", "unittest.result", "unittest.runner", "unittest.suite",
    "urllib.error", "urllib.parse", "urllib.request", "urllib.response",
    "urllib.robotparser", "uuid", "warnings", "wave", "weakref",
    "wsgiref.handlers", "wsgiref.headers", "wsgiref.simple_server",
    "wsgiref.util", "wsgiref.validate", "xml.dom", "xml.dom.minidom",
    "xml.dom.pulldom", "xml.etree.ElementPath", "xml.etree.ElementTree",
    "xml.parsers.expat", "xml.sax", "xml.sax.handler", "xml.sax.saxutils",
    "xml.sax.xmlreader", "xmlrpc.client", "xmlrpc.server", "zipapp", "zipfile",
    "zipimport", "zoneinfo",
)
# More pure-Python modules present from Python 3.10 on, and always built: used
# only for vocabularies above LARGE_VOCAB (see collect_documents).
EXTRA_DOC_MODULES = (
    "_collections_abc", "_compat_pickle", "_markupbase", "_pydecimal", "_pyio",
    "_sitebuiltins", "_strptime", "_threading_local", "_weakrefset",
    "asyncio.base_subprocess", "asyncio.exceptions", "asyncio.format_helpers",
    "asyncio.protocols", "asyncio.runners", "asyncio.selector_events",
    "asyncio.sslproto", "asyncio.staggered", "asyncio.threads",
    "asyncio.transports", "asyncio.trsock", "concurrent.futures.process",
    "concurrent.futures.thread", "dbm", "dbm.dumb", "email._encoded_words",
    "email._header_value_parser", "email._parseaddr", "email._policybase",
    "email.base64mime", "email.iterators", "email.quoprimime", "encodings",
    "encodings.idna", "encodings.punycode", "genericpath", "html.entities",
    "importlib.readers", "json.scanner", "multiprocessing.context",
    "multiprocessing.dummy", "multiprocessing.forkserver", "multiprocessing.heap",
    "multiprocessing.reduction", "multiprocessing.resource_tracker",
    "multiprocessing.spawn", "multiprocessing.util", "ntpath", "pydoc",
    "rlcompleter", "unittest.async_case", "unittest.signals", "unittest.util",
    "venv", "webbrowser", "xml.dom.expatbuilder", "xml.dom.minicompat",
    "xml.dom.xmlbuilder", "xml.etree.ElementInclude", "xml.sax._exceptions",
    "xml.sax.expatreader",
)
# Vocabularies above this size also get the extra text: the docstrings of
# EXTRA_DOC_MODULES and the comment blocks of every listed module's source.
LARGE_VOCAB = 4096
# One-liners ("Return self+value.") carry little text and mostly repeat.
MIN_DOC_CHARS = 120

# 32 sequences of 1024 tokens plus the one extra token that the shifted
# next-token targets need: big enough for a stable loss, small enough that a
# tiny model evaluates it in seconds on a CPU.
DEFAULT_VAL_TOKENS = 32 * 1024 + 1
MIN_VAL_TOKENS = 4 * 1024 + 1
# Documents are moved to val until they hold val_chars_per_token(vocab size)
# characters per wanted val token: VAL_CHARS_PER_TOKEN up to 1024 pieces, plus
# VAL_CHARS_PER_TOKEN_STEP per doubling above. The val text averages about 2.8
# characters per token with 1024 pieces, 4.0 with 4096 and 4.3 with 8192; the
# margin makes a short val split unlikely, and any surplus is cut off after
# encoding.
VAL_CHARS_PER_TOKEN = 3.5
VAL_CHARS_PER_TOKEN_STEP = 0.6
# At most this fraction of the text may be held out for val.
MAX_VAL_TEXT_FRACTION = 0.5

# Lower bound: room for the 256 byte-fallback pieces, 4 special pieces and the
# base characters. Upper bound: the ~1.9 MB of the extended text supports no
# meaningfully larger vocabulary.
MIN_VOCAB, MAX_VOCAB = 512, 8192
MAX_TRAIN_SHARDS = 64

# Trainer settings mirror the challenge's fineweb_*_bpe tokenizers (same special
# ids: pad 0, <s> 1, </s> 2, <unk> 3). num_threads is pinned because its value
# is stored in the .model file; the learned pieces do not depend on it.
SP_TRAINER_OPTIONS = dict(
    model_type="bpe",
    character_coverage=0.999,
    byte_fallback=True,
    split_digits=True,
    normalization_rule_name="nmt_nfkc",
    add_dummy_prefix=False,
    pad_id=0,
    bos_id=1,
    eos_id=2,
    unk_id=3,
    num_threads=1,
    minloglevel=2,
)


def parse_args(argv):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=DATA_DIR,
                   help="root for tokenizers/ and datasets/ (default: the folder holding this script)")
    p.add_argument("--vocab-size", type=int, default=1024,
                   help=f"tokenizer vocabulary size, {MIN_VOCAB}..{MAX_VOCAB} (default 1024; above "
                        f"{LARGE_VOCAB} more stdlib text is used)")
    p.add_argument("--train-shards", type=int, default=4,
                   help=f"number of train shards, 1..{MAX_TRAIN_SHARDS} (default 4)")
    p.add_argument("--val-tokens", type=int, default=DEFAULT_VAL_TOKENS,
                   help=f"tokens in the val shard, at least {MIN_VAL_TOKENS} (default {DEFAULT_VAL_TOKENS})")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the document shuffle that picks val documents (default 0)")
    p.add_argument("--caseops", action="store_true",
                   help="apply the CaseOps case transform and write a val byte sidecar (default off)")
    args = p.parse_args(argv)
    if not MIN_VOCAB <= args.vocab_size <= MAX_VOCAB:
        raise UsageError(f"--vocab-size must be in {MIN_VOCAB}..{MAX_VOCAB}, got {args.vocab_size}")
    if not 1 <= args.train_shards <= MAX_TRAIN_SHARDS:
        raise UsageError(f"--train-shards must be in 1..{MAX_TRAIN_SHARDS}, got {args.train_shards}")
    if args.val_tokens < MIN_VAL_TOKENS:
        raise UsageError(f"--val-tokens must be at least {MIN_VAL_TOKENS}, got {args.val_tokens}")
    if args.seed < 0:
        raise UsageError(f"--seed must be non-negative, got {args.seed}")
    return args


def _docstring(obj):
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _module_docstrings(name):
    """Docstrings of module `name` and of the classes, functions and methods it defines."""
    # Quiet: some imports and attribute lookups warn (deprecations, e.g. the
    # typing.io pseudo-module) and none may print into the build's output.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return _collect_module_docstrings(importlib.import_module(name))


def _collect_module_docstrings(module):
    name = module.__name__
    docs = [_docstring(module)]
    for attr, obj in sorted(vars(module).items()):
        # Objects re-exported from elsewhere are documented by their own module.
        if attr.startswith("_") or getattr(obj, "__module__", None) != name:
            continue
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        docs.append(_docstring(obj))
        if inspect.isclass(obj):
            for member_name, member in sorted(vars(obj).items()):
                if member_name.startswith("_") and member_name != "__init__":
                    continue
                if inspect.isroutine(member) or isinstance(member, (property, classmethod, staticmethod)):
                    docs.append(_docstring(member))
    return docs


def _comment_blocks(path):
    """Runs of consecutive whole-line comments in the Python source at `path`,
    one string per run, with the '#' marks and surrounding blanks removed."""
    blocks, block = [], []
    with tokenize.open(path) as f:  # decodes as the file's coding cookie says
        for line in f:
            stripped = line.strip()
            if stripped.startswith("#"):
                block.append(stripped.lstrip("#").strip())
                continue
            if block:
                blocks.append("\n".join(block).strip())
                block = []
    if block:
        blocks.append("\n".join(block).strip())
    return blocks


def collect_documents(extended=False):
    """Return (documents, modules that failed to import), in a fixed order.

    One document per pydoc help topic and per docstring of DOC_MODULES; with
    `extended`, then also one per docstring of EXTRA_DOC_MODULES and per comment
    block of the source files of both lists' modules. Documents that differ only
    in whitespace are kept once (the tokenizer's normalization would make them
    identical), so no val document also appears in train.
    """
    import pydoc_data.topics

    candidates = [pydoc_data.topics.topics[key].strip() for key in sorted(pydoc_data.topics.topics)]
    failed, imported = [], []
    for name in DOC_MODULES + (EXTRA_DOC_MODULES if extended else ()):
        try:
            candidates.extend(_module_docstrings(name))
            imported.append(sys.modules[name])
        except Exception:  # an interpreter built without this module: leave it out
            failed.append(name)
    if extended:
        sources = []
        for module in imported:
            path = getattr(module, "__file__", None)  # None for built-in modules
            if isinstance(path, str) and path.endswith(".py") and path not in sources:
                sources.append(path)
        for path in sources:
            try:
                candidates.extend(_comment_blocks(path))
            except (OSError, SyntaxError, UnicodeDecodeError):  # unreadable here: leave it out
                pass
    documents, seen = [], set()
    for doc in candidates:
        key = " ".join(doc.split())
        if len(doc) >= MIN_DOC_CHARS and key not in seen:
            seen.add(key)
            documents.append(doc)
    return documents, failed


def val_chars_per_token(vocab_size):
    """Characters of val text to set aside per wanted val token (see VAL_CHARS_PER_TOKEN)."""
    if vocab_size <= 1024:
        return VAL_CHARS_PER_TOKEN
    return VAL_CHARS_PER_TOKEN + VAL_CHARS_PER_TOKEN_STEP * math.log2(vocab_size / 1024)


def split_documents(documents, val_tokens, seed, chars_per_token=VAL_CHARS_PER_TOKEN):
    """Seeded shuffle, then the first documents (enough for val_tokens) go to val."""
    order = list(documents)
    random.Random(seed).shuffle(order)
    total_chars = sum(len(d) for d in order)
    budget = val_tokens * chars_per_token
    if budget > MAX_VAL_TEXT_FRACTION * total_chars:
        most = int(MAX_VAL_TEXT_FRACTION * total_chars / chars_per_token)
        raise UsageError(f"--val-tokens {val_tokens} would hold out more than "
                         f"{MAX_VAL_TEXT_FRACTION:.0%} of the {total_chars}-character sample text; "
                         f"use at most {most}")
    n_val, chars = 0, 0
    while chars < budget:
        chars += len(order[n_val])
        n_val += 1
    return order[n_val:], order[:n_val]


def train_tokenizer(train_docs, vocab_size, **options):
    """Train the BPE tokenizer on the train documents; return the .model bytes."""
    import sentencepiece as spm

    # The trainer reads sentences; lines keep them far below its length limit.
    lines = [line.strip() for doc in train_docs for line in doc.splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                   vocab_size=vocab_size, **SP_TRAINER_OPTIONS, **options)
    return model.getvalue()


def encode_documents(sp, documents):
    """Token ids of all documents, each one preceded by <s>, as one int32 array."""
    bos = sp.bos_id()
    return np.concatenate([np.asarray([bos] + ids, dtype=np.int32)
                           for ids in sp.encode(documents, out_type=int)])


def piece_fragments(sp):
    """Per token id, the text it stands for in the (encoded) input: str, or bytes for byte-fallback pieces;
    '' for control and unknown ids."""
    out = []
    for i in range(sp.vocab_size()):
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            out.append(bytes([int(piece[3:5], 16)]))
        elif sp.is_control(i) or sp.is_unknown(i):
            out.append("")
        else:
            out.append(piece.replace("\u2581", " "))
    return out


def encode_caseops_documents(sp, documents):
    """CaseOps documents: (token ids with an explicit <s> per document, each token's original UTF-8 byte
    count). A document is first normalised as the tokenizer normalises (NFKC, collapsed blanks), so that its
    pieces spell exactly its CaseOps encoding; that normalised text is the text the byte counts add up to."""
    fragments = piece_fragments(sp)
    ids_out, bytes_out = [], []
    for doc in documents:
        text = caseops.encode(sp.normalize(doc).replace("\u2581", " "))
        ids = sp.encode(text, out_type=int)
        pieces = [fragments[i] for i in ids]
        spelled = b"".join(p if isinstance(p, bytes) else p.encode("utf-8") for p in pieces)
        if spelled != text.encode("utf-8"):
            raise RuntimeError(f"the tokenizer does not spell CaseOps text back exactly: {text[:60]!r}")
        ids_out.append(np.asarray([sp.bos_id()] + ids, dtype=np.int32))
        bytes_out.append(np.asarray([0] + caseops.original_byte_counts(pieces), dtype=np.int32))
    return np.concatenate(ids_out), np.concatenate(bytes_out)


def check_no_val_in_train(train_tokens, val_tokens, bos):
    """Pitfall 6 (SPEC-FRONTIER 17): refuse train tokens holding a complete val document."""
    found = val_documents_in_train(val_tokens, [train_tokens], bos)
    if found:
        raise RuntimeError(f"{found} validation documents also occur in the train shards; refusing to write them")


def write_bytes_atomic(path, data):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def build(args):
    import sentencepiece as spm

    start = time.perf_counter()
    extended = args.vocab_size > LARGE_VOCAB
    documents, failed = collect_documents(extended)
    train_docs, val_docs = split_documents(documents, args.val_tokens, args.seed,
                                           val_chars_per_token(args.vocab_size))

    suffix, val_bytes = ("_caseops" if args.caseops else ""), None
    if args.caseops:
        model_bytes = train_tokenizer([caseops.encode(d) for d in train_docs], args.vocab_size,
                                      user_defined_symbols=list(caseops.OPERATORS))
    else:
        model_bytes = train_tokenizer(train_docs, args.vocab_size)
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    if sp.vocab_size() != args.vocab_size:
        raise RuntimeError(f"tokenizer came out with {sp.vocab_size()} pieces, wanted {args.vocab_size}")

    if args.caseops:
        if [sp.piece_to_id(c) for c in caseops.OPERATORS] != list(range(4, caseops.RESERVED_IDS)):
            raise RuntimeError("the CaseOps operators did not get ids 4..7")
        train_tokens, _ = encode_caseops_documents(sp, train_docs)
        val_all, val_bytes_all = encode_caseops_documents(sp, val_docs)
        val_bytes = val_bytes_all[: args.val_tokens]
    else:
        train_tokens = encode_documents(sp, train_docs)
        val_all = encode_documents(sp, val_docs)
    val_tokens = val_all[: args.val_tokens]
    if len(val_tokens) < MIN_VAL_TOKENS:
        raise RuntimeError(f"val split has only {len(val_tokens)} tokens, need {MIN_VAL_TOKENS}")
    check_no_val_in_train(train_tokens, val_tokens, sp.bos_id())

    tok_dir = os.path.join(args.out_dir, "tokenizers")
    data_dir = os.path.join(args.out_dir, "datasets", f"sample_sp{args.vocab_size}{suffix}")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    model_path = os.path.join(tok_dir, f"sample_{args.vocab_size}_bpe{suffix}.model")
    write_bytes_atomic(model_path, model_bytes)
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.vocab_size()))
    write_bytes_atomic(model_path[: -len(".model")] + ".vocab", vocab.encode("utf-8"))

    # Shards left over from an earlier run (say with more --train-shards)
    # would otherwise be picked up by the training script's globs.
    for name in sorted(os.listdir(data_dir)):
        if name.startswith("fineweb_") and name.endswith((".bin", ".bin.tmp")):
            os.remove(os.path.join(data_dir, name))
    shard_paths = []
    for i, chunk in enumerate(np.array_split(train_tokens, args.train_shards)):
        shard_paths.append(os.path.join(data_dir, f"fineweb_train_{i:06d}.bin"))
        write_shard(shard_paths[-1], chunk)
    shard_paths.append(os.path.join(data_dir, "fineweb_val_000000.bin"))
    write_shard(shard_paths[-1], val_tokens)
    if val_bytes is not None:
        shard_paths.append(os.path.join(data_dir, "fineweb_val_bytes_000000.bin"))
        write_shard(shard_paths[-1], val_bytes)

    print(f"documents: {len(train_docs)} train, {len(val_docs)} val"
          + (", CaseOps" if args.caseops else "")
          + (f", with the extra text of vocabularies above {LARGE_VOCAB}" if extended else "")
          + (f" (modules not importable here, skipped: {' '.join(failed)})" if failed else ""))
    print(f"tokens: {len(train_tokens)} train in {args.train_shards} shards, "
          f"{len(val_tokens)} val (of {len(val_all)} in the val documents)")
    print(f"tokenizer: {model_path} (vocab {sp.vocab_size()})")
    for path in shard_paths:
        print(f"shard: {path}")
    print(f"elapsed: {time.perf_counter() - start:.1f}s")


def fail(prog, err):
    """Report err as the one line on stderr."""
    print(f"{prog}: error: " + " ".join(str(err).splitlines()), file=sys.stderr)


def main(argv=None):
    prog = os.path.basename(sys.argv[0])
    try:
        build(parse_args(argv))
    except UsageError as e:
        fail(prog, e)
        return 2
    except (OSError, RuntimeError, ValueError) as e:
        fail(prog, e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
