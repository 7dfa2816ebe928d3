"""Documents (issue 17): the CaseOps transform, the CaseOps sample with its byte sidecar, sidecar BPB, varlen
attention on packed rows, the packed loader, BOS-split evaluation and progressive context."""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "data"))

import caseops  # noqa: E402

RECORD_CAPS = REPO.parent / "shared" / "anchors" / "frontier" / "record_0427" / "lossless_caps.py"


def record_caps():
    """The 04-27 record's own lossless_caps module (imported, not copied); the test skips without it."""
    if not RECORD_CAPS.is_file():
        pytest.skip(f"{RECORD_CAPS} not present")
    spec = importlib.util.spec_from_file_location("record_lossless_caps", RECORD_CAPS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def corpus_text():
    import pydoc_data.topics

    return "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


# --------------------------------------------------------------------- CaseOps

ADVERSARIAL = ["", "a", "A", "the", "The", "THE", "tHE", "McDonald", "iPhone", "ABc", "aBC", "I", "I'm", "x1Y2Z",
               "HTTPServer", "\ue001", "\ue004\ue004", "A\ue002B", "Ünïcödé ÉTÉ été", "ǅemal", "ß STRASSE",
               "\ue003abc\ue001", "CamelCase_snake_CASE", "Z" * 50, "\n\tTab\r\nNEW", "😀Smile😀", "İstanbul"]


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_caseops_round_trip_adversarial(text):
    encoded = caseops.encode(text)
    assert caseops.decode(encoded) == text
    assert not any("A" <= c <= "Z" for c in encoded)  # every ASCII capital became an operator
    assert sum(caseops.original_byte_counts([encoded])) == len(text.encode("utf-8"))


def test_caseops_round_trip_random_strings():
    rng = random.Random(0)
    alphabet = "aAbByYzZ 0-_.'" + "".join(caseops.OPERATORS) + "éÉßΣ😀"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(16)))
        encoded = caseops.encode(text)
        assert caseops.decode(encoded) == text
        cut = rng.randrange(len(encoded) + 1)
        assert sum(caseops.original_byte_counts([encoded[:cut], encoded[cut:]])) == len(text.encode("utf-8"))


def test_caseops_examples():
    T, A, C, E = caseops.OPERATORS[0], caseops.OPERATORS[1], caseops.OPERATORS[2], caseops.OPERATORS[3]
    assert caseops.encode("The NASA iPhone McDo x") == f"{T}the {A}nasa i{C}phone {T}mc{C}do x"
    assert caseops.encode(T) == E + T
    assert caseops.original_byte_counts([f"{T}the", " é"]) == [3, 3]


@pytest.mark.parametrize("bad", ["\ue001", "\ue001 a", "\ue004a", "a\ue003", "\ue003a", "aB", "\ue002\ue001a",
                                 "\ue002ab\ue003c"])
def test_caseops_decode_refuses_what_encode_cannot_produce(bad):
    with pytest.raises(caseops.CaseOpsError):
        caseops.decode(bad)


def test_caseops_equals_the_records_transform():
    lc = record_caps()
    text = corpus_text()
    assert len(text) > 400_000
    assert caseops.encode(text) == lc.encode_lossless_caps_v2(text)
    assert caseops.decode(caseops.encode(text)) == lc.decode_lossless_caps_v2(lc.encode_lossless_caps_v2(text))
    rng = random.Random(1)
    alphabet = "aAbBzZ 1é" + "".join(caseops.OPERATORS)
    for _ in range(2000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
        assert caseops.encode(s) == lc.encode_lossless_caps_v2(s), repr(s)
        pieces = [caseops.encode(s)[:3], caseops.encode(s)[3:]]
        assert caseops.original_byte_counts(pieces) == lc.surface_piece_original_byte_counts(
            pieces, text_transform_name=lc.LOSSLESS_CAPS_CASEOPS_V1)
