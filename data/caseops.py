"""CaseOps: the bijective case transform of the CaseOps records (SPEC-FRONTIER 2).

Text is rewritten before SentencePiece so that "The", "THE" and "the" share the
lowercase pieces. The transform works on maximal runs of ASCII letters (A-Z,
a-z); everything else, non-ASCII letters included, passes through unchanged:

    lowercase run         unchanged                              "word" -> "word"
    TitleCase run         TITLE + lowercase                      "Word" -> T"word"
    ALLCAPS run (>= 2)    ALLCAPS + lowercase                    "WORD" -> A"word"
    any other mix         TITLE if the first letter is upper,    "iPhone" -> "i" C"phone"
                          then CAPNEXT before each later upper   "McDo" -> T"m" "c" C"d" "o"
    a literal operator    ESC + the character                    "\\ue001" -> E"\\ue001"

with the four private-use operators TITLE U+E001, ALLCAPS U+E002, CAPNEXT
U+E003 and ESC U+E004. decode(encode(t)) == t for every string t; decode
refuses (CaseOpsError) strings that encode cannot produce.

original_byte_counts(pieces) gives, for the pieces of an encoded text, the
UTF-8 bytes of the original text each one stands for (operators 0): the values
of the records' validation byte sidecar.
"""

import re

TITLE, ALLCAPS, CAPNEXT, ESC = "\ue001", "\ue002", "\ue003", "\ue004"
OPERATORS = (TITLE, ALLCAPS, CAPNEXT, ESC)
_OPERATOR_SET = frozenset(OPERATORS)
# ids 0-3 pad/BOS/EOS/UNK, 4-7 the operators as user-defined symbols: the first 8 ids are reserved.
RESERVED_IDS = 8


class CaseOpsError(ValueError):
    """A string that is not the output of encode()."""


def _ascii_letter(ch):
    return ("a" <= ch <= "z") or ("A" <= ch <= "Z")


def _ascii_upper(ch):
    return "A" <= ch <= "Z"


def _encode_run(word):
    """The encoding of one maximal ASCII letter run that holds a capital."""
    lower = word.lower()
    if len(word) >= 2 and word == word.upper():
        return ALLCAPS + lower
    if _ascii_upper(word[0]) and word[1:] == lower[1:]:
        return TITLE + lower  # also a lone capital letter
    out = [TITLE if _ascii_upper(word[0]) else "", lower[0]]
    out.extend(CAPNEXT + c if _ascii_upper(o) else c for o, c in zip(word[1:], lower[1:]))
    return "".join(out)


# From a capital to the end of its ASCII letter run. A match that starts a run is the run; one that follows
# lowercase letters is the rest of a mixed run, whose lowercase head the encoding leaves as it is.
_FROM_CAPITAL = re.compile(r"[A-Z][A-Za-z]*")
_LOWER = frozenset("abcdefghijklmnopqrstuvwxyz")
_ESCAPES = {ord(op): ESC + op for op in OPERATORS}


def encode(text):
    """The CaseOps encoding of `text` (see the module docstring)."""
    if not text.isascii() and any(op in text for op in OPERATORS):
        text = text.translate(_ESCAPES)  # operators are not letters: escaping them first changes no run
    return _FROM_CAPITAL.sub(_encoded_run, text)


_RUN_CACHE = {}  # capital runs repeat ("The", "I", "USA"): each is encoded once (up to _RUN_CACHE_SIZE of them)
_RUN_CACHE_SIZE = 1 << 16


def _encoded_run(match):
    start = match.start()
    key = (match.group(), start > 0 and match.string[start - 1] in _LOWER)
    out = _RUN_CACHE.get(key)
    if out is None:
        if len(_RUN_CACHE) >= _RUN_CACHE_SIZE:
            _RUN_CACHE.clear()
        word, tail = key
        # The tail of a mixed run: CAPNEXT before every capital (as _encode_run writes after the first letter).
        out = _RUN_CACHE[key] = ("".join(CAPNEXT + c.lower() if _ascii_upper(c) else c for c in word) if tail
                                 else _encode_run(word))
    return out


class _Decoder:
    """Reads an encoded string one character at a time. emit(ch) returns the original text of that character
    ('' for an operator); the state says what the operators pending before it ask for."""

    def __init__(self):
        self.escaped = False  # the previous character was ESC
        self.word_mode = None  # TITLE or ALLCAPS, waiting for a word's first letter
        self.capnext = False  # CAPNEXT waiting for a letter
        self.in_word = False  # inside an ASCII letter run
        self.allcaps = False  # the current run is ALLCAPS

    def emit(self, ch):
        if self.escaped:
            if ch not in OPERATORS:
                raise CaseOpsError(f"ESC followed by {ch!r}, not an operator")
            if self.word_mode or self.capnext:
                raise CaseOpsError("case operator not followed by a letter")
            self.escaped, self.in_word, self.allcaps = False, False, False
            return ch
        if ch == ESC:
            self.escaped = True
            return ""
        if ch in (TITLE, ALLCAPS):
            if self.word_mode or self.capnext or self.in_word:
                raise CaseOpsError("TITLE/ALLCAPS operator inside a word or after another operator")
            self.word_mode = ch
            return ""
        if ch == CAPNEXT:
            if self.capnext or self.word_mode or not self.in_word:
                raise CaseOpsError("CAPNEXT operator outside a word or after another operator")
            self.capnext = True
            return ""
        if not _ascii_letter(ch):
            if self.word_mode or self.capnext:
                raise CaseOpsError(f"case operator followed by {ch!r}, not an ASCII letter")
            self.in_word, self.allcaps = False, False
            return ch
        if _ascii_upper(ch):
            raise CaseOpsError(f"upper-case letter {ch!r} in encoded text")
        if not self.in_word:
            self.in_word, self.allcaps = True, self.word_mode == ALLCAPS
            upper, self.word_mode = self.word_mode is not None, None
        else:
            upper = self.allcaps or self.capnext
            if self.capnext and self.allcaps:
                raise CaseOpsError("CAPNEXT inside an ALLCAPS word")
        self.capnext = False
        return ch.upper() if upper else ch

    def finish(self):
        if self.escaped or self.word_mode or self.capnext:
            raise CaseOpsError("encoded text ends with a dangling operator")


def decode_slowly(text):
    """decode(text), one character at a time (its errors say what is wrong)."""
    d = _Decoder()
    out = [d.emit(ch) for ch in text]
    d.finish()
    return "".join(out)


# Each operator's effect, without checking that it is allowed there: ESC x -> x, ALLCAPS run -> upper run,
# TITLE or CAPNEXT letter -> upper letter.
_OPERATOR_USE = re.compile("\ue004([\\s\\S])|\ue002([a-z]+)|[\ue001\ue003]([a-z])")


def _undo(match):
    escaped, run, letter = match.groups()
    return escaped if escaped is not None else (run or letter).upper()


def decode(text):
    """The original text of an encoded string; CaseOpsError if encode() cannot have produced it.

    Fast path: the operators are undone by one regex pass and the result encoded again; when that gives `text`
    back, `text` is an encoding and the result is what decode_slowly(text) gives (decode(encode(t)) == t).
    Otherwise decode_slowly decides (it raises, or accepts a redundant spelling such as ALLCAPS before one
    letter)."""
    original = _OPERATOR_USE.sub(_undo, text) if not text.isascii() else text
    return original if encode(original) == text else decode_slowly(text)


def original_byte_counts(pieces):
    """For consecutive fragments `pieces` of an encoded text, the UTF-8 byte count of the original text each
    one decodes to (operators count 0, case changes none). Their sum is len(decode("".join(pieces)) in UTF-8).
    A fragment may be `bytes` (a tokenizer's byte-fallback piece): part of a non-ASCII character, it counts
    its length.

    When every operator is a fragment of its own (the tokenizers hold them as user-defined symbols), a fragment
    counts its UTF-8 bytes, an operator 0 (3 when escaped, a literal); the text is then checked as decode
    checks it."""
    if all(type(p) is str for p in pieces):
        joined = "".join(pieces)
        counts = [0 if p in _OPERATOR_SET else len(p.encode("utf-8")) for p in pieces]
        if sum(joined.count(op) for op in OPERATORS) == counts.count(0) - pieces.count(""):
            if ESC in joined:  # an escaped operator is a literal character of the original: 3 bytes
                escaped = False
                for i, p in enumerate(pieces):
                    if p in _OPERATOR_SET:
                        counts[i] = 3 if escaped else 0
                        escaped = p == ESC and not escaped
                    else:
                        escaped = False
            if encode(_OPERATOR_USE.sub(_undo, joined)) == joined:  # an encoding: nothing else to check
                return counts
    return byte_counts_slowly(pieces)


def byte_counts_slowly(pieces):
    """original_byte_counts(pieces), one character at a time through the decoder (its errors say what is wrong)."""
    d = _Decoder()
    counts = []
    for piece in pieces:
        if isinstance(piece, bytes):
            if piece.isascii():
                piece = piece.decode("ascii")
            else:
                d.emit("\x80")  # a non-ASCII character: ends a word, refuses a pending operator
                counts.append(len(piece))
                continue
        counts.append(sum(len(d.emit(ch).encode("utf-8")) for ch in piece))
    d.finish()
    return counts
