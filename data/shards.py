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
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(arr.astype("<u2").tobytes())
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


class UsageError(Exception):
    """A bad command-line argument of a data script: reported on one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one stderr line (no usage dump) and exit 2 (via UsageError)."""

    def error(self, message):
        raise UsageError(message)
