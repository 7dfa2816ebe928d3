"""Read and write token shards in the challenge's binary format.

A shard is 256 little-endian int32 header words followed by the tokens:

    word 0: SHARD_MAGIC (20240520)
    word 1: SHARD_VERSION (1)
    word 2: number of tokens n
    words 3..255: zero
    then n little-endian uint16 token ids

so a valid file is exactly HEADER_BYTES + 2 * n bytes long.
"""

import argparse
import os
import sys

import numpy as np

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = HEADER_WORDS * 4
MAX_TOKEN_ID = 2**16 - 1


def write_shard(path, tokens):
    """Write `tokens` (1-D ints in [0, 65535]) to `path` as a shard.

    The data goes to `path + '.tmp'` first and is renamed over `path` only once
    complete, so an interrupted write never leaves a file that looks valid.
    """
    path = os.fspath(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{path}: tokens must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{path}: tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise ValueError(
            f"{path}: token ids must lie in [0, {MAX_TOKEN_ID}], "
            f"got min {int(arr.min())} max {int(arr.max())}"
        )
    if arr.size >= 2**31:
        raise ValueError(f"{path}: {arr.size} tokens do not fit the int32 header count")

    header = np.zeros(HEADER_WORDS, dtype="<i4")
    header[0] = SHARD_MAGIC
    header[1] = SHARD_VERSION
    header[2] = arr.size
    write_file_atomic(path, header.tobytes(), arr.astype("<u2").tobytes())


def write_file_atomic(path, *parts):
    """Write the bytes `parts` to `path + '.tmp'`, flushed to disk, then rename it over `path`: a failed write
    (a full disk, a kill) never leaves a partial file under `path`, nor the temporary one after an error."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def shard_num_tokens(path):
    """Validate the header and size of the shard at `path`; return its token count.

    Raises ValueError naming the path when the file is not a complete shard.
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_WORDS)
    if int(header[0]) != SHARD_MAGIC or int(header[1]) != SHARD_VERSION:
        raise ValueError(
            f"{path}: bad shard header (magic {int(header[0])}, version {int(header[1])}; "
            f"expected {SHARD_MAGIC}, {SHARD_VERSION})"
        )
    num_tokens = int(header[2])
    expected = HEADER_BYTES + 2 * num_tokens
    if num_tokens < 0 or size != expected:
        raise ValueError(
            f"{path}: size {size} bytes does not match the header's {num_tokens} tokens "
            f"(expected {expected} bytes)"
        )
    return num_tokens


def read_shard(path):
    """Return the tokens of the shard at `path` as a uint16 array (header checked)."""
    num_tokens = shard_num_tokens(path)
    return np.fromfile(os.fspath(path), dtype="<u2", count=num_tokens, offset=HEADER_BYTES)


# Document fingerprints (pitfall 6 of SPEC-FRONTIER 17: train shards that hold validation documents).
FINGERPRINT_TOKENS = 32  # a document is known by its length and its first tokens


def _documents(tokens, bos, complete_only):
    """(starts, ends) of the documents of `tokens`, each starting at a `bos`; with complete_only the last one
    (maybe cut off) is left out."""
    starts = np.flatnonzero(tokens == bos)
    ends = np.append(starts[1:], tokens.size)
    return (starts[:-1], ends[:-1]) if complete_only else (starts, ends)


def document_fingerprints(tokens, bos, complete_only=True):
    """One uint64 per document of `tokens` (a document starts at each `bos`): a hash of its length and its
    first FINGERPRINT_TOKENS tokens, a cheap pre-filter before an exact comparison."""
    tokens = np.asarray(tokens)
    starts, ends = _documents(tokens, bos, complete_only)
    offsets = np.arange(FINGERPRINT_TOKENS)
    padded = np.concatenate([tokens.astype(np.uint64), np.zeros(FINGERPRINT_TOKENS, dtype=np.uint64)])
    window = padded[starts[:, None] + offsets]
    window[offsets[None, :] >= (ends - starts)[:, None]] = 0
    powers = np.full(FINGERPRINT_TOKENS, 1_000_003, dtype=np.uint64).cumprod()  # wraps mod 2^64
    with np.errstate(over="ignore"):
        return (window * powers).sum(axis=1, dtype=np.uint64) ^ ((ends - starts).astype(np.uint64)
                                                                  * np.uint64(0x9E3779B97F4A7C15))


# More val documents than this share found in train is an error: exact duplicates between FineWeb documents are
# rare but not impossible; the CaseOps overlap of pitfall 6 put 40,000 of the 50,000 val documents in train.
VAL_OVERLAP_TOLERANCE = 0.001


class ValDocuments:
    """The complete documents of val_tokens indexed by fingerprint, to find them among train documents
    (fingerprints first, then an exact comparison of the candidates). .n: how many there are."""

    def __init__(self, val_tokens, bos):
        self.tokens, self.bos = np.asarray(val_tokens), bos
        starts, ends = _documents(self.tokens, bos, True)
        self.by_print = {}
        for fp, a, b in zip(document_fingerprints(self.tokens, bos).tolist(), starts.tolist(), ends.tolist()):
            self.by_print.setdefault(fp, []).append((a, b))
        self.keys = np.fromiter(self.by_print, dtype=np.uint64)
        self.n = len(starts)

    def found_in(self, tokens, prints=None):
        """(k, a) for each complete document k of `tokens` (counted from 0) and each val document (its start
        offset a) equal to it (`prints`: the fingerprints of tokens' documents, where already computed)."""
        tokens = np.asarray(tokens)
        prints = document_fingerprints(tokens, self.bos) if prints is None else prints
        t_starts, t_ends = _documents(tokens, self.bos, True)
        found = []
        for k in np.flatnonzero(np.isin(prints, self.keys)).tolist():
            doc = tokens[t_starts[k]:t_ends[k]]
            found.extend((k, a) for a, b in self.by_print[int(prints[k])] if np.array_equal(doc, self.tokens[a:b]))
        return found


def val_documents_in_train(val_tokens, train_token_arrays, bos):
    """How many complete documents of val_tokens occur, token for token, among the complete documents of the
    train token arrays (ValDocuments)."""
    index = ValDocuments(val_tokens, bos)
    return len({a for tokens in train_token_arrays for _, a in index.found_in(tokens)})


class UsageError(Exception):
    """A bad command-line argument of a data script: reported on one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one stderr line (no usage dump) and exit 2 (via UsageError)."""

    def error(self, message):
        raise UsageError(message)


def fail(prog, err):
    """Report err as the one line on stderr."""
    print(f"{prog}: error: " + " ".join(str(err).splitlines()), file=sys.stderr)


def run_command(body, failures, interrupted):
    """A data script's main: body(); a UsageError is one stderr line and exit status 2, one of `failures` one
    line and 1, Ctrl-C the line `interrupted` and 130."""
    prog = os.path.basename(sys.argv[0])
    try:
        body()
    except UsageError as e:
        fail(prog, e)
        return 2
    except failures as e:
        fail(prog, e)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130
    return 0
