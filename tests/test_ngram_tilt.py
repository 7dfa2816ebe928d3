"""ngram_tilt_hints (SPEC-FRONTIER 20(a)): #2135's token n-gram hints as tensor ops, equal element for element
(tokens exactly, probabilities bit for bit) to the record's own C (../shared/anchors/frontier/record_0501), compiled
in a temporary folder and driven through its own Python wrapper, on streams built to break an implementation."""
from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
import torch

import train_gpt as tg
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "bench"))
import bench_ngram  # noqa: E402  (needs the path above)

HAVE_RECORD = (bench_ngram.record_dir() / "online_ngram_state.c").is_file()


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """The record's online_ngram_tilt.py, imported from a temporary copy with its C compiled there (cc -O2)."""
    if not HAVE_RECORD:
        pytest.skip("../shared/anchors/frontier/record_0501 (the record's files) is not here")
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to build the record's online_ngram_state.c")
    pytest.importorskip("sentencepiece")  # the record's online_ngram_tilt.py imports it
    return bench_ngram.record_helpers(tmp_path_factory.mktemp("record_0501"))


def ours(stream, order):
    tok, prob = tg.ngram_tilt_hints(torch.tensor(np.asarray(stream, dtype=np.int64)), order)
    assert tok.dtype == torch.int64 and prob.dtype == torch.float32 and tok.numel() == len(stream)
    return tok.numpy(), prob.numpy()


def assert_same_as_record(record, stream, order):
    """Ours equal to the record's C: tokens exactly, probabilities bit for bit. Returns ours."""
    tok, prob = ours(stream, order)
    ref_tok, ref_prob = bench_ngram.record_token_hints(record, np.asarray(stream), order)
    np.testing.assert_array_equal(tok, ref_tok)
    np.testing.assert_array_equal(prob.view(np.int32), ref_prob.view(np.int32))
    return tok, prob


def keys(context, order, tok=0):
    """Our (context key, pair key) for one context of order-1 tokens followed by `tok`."""
    stream = torch.tensor([context[0], *context, tok][1:])  # the seed is stream[0] itself
    key, pair, _ = tg.ngram_tilt_keys(stream, order)
    return int(key[-1]), int(pair[-1])


# Two order-4 contexts with one key (found by search over tokens < 256), and two (context, token) pairs with one
# pair key (contexts whose keys are close, then tokens < 8192 solving key1*M ^ t1*C3 == key2*M ^ t2*C3).
SAME_KEY = ((108, 56, 57), (139, 16, 96))
SAME_PAIR = (((184, 73, 157), 3712), ((255, 62, 189), 4046))


def test_keys_match_spec_check_values_and_the_collisions_are_real():
    ctx = tuple(range(1, 16))
    assert keys(ctx, 16, 16) == (19_987_444, 19_987_527_030_860)  # SPEC-FRONTIER 20(a)'s values from the C
    assert keys(tuple(range(2, 17)), 16)[0] == 12_303_571
    assert tg.NGRAM_ORDERS == range(2, 34)  # ROLLING_COEFFS has 32 entries: contexts of up to 32 tokens
    assert keys(SAME_KEY[0], 4)[0] == keys(SAME_KEY[1], 4)[0] and SAME_KEY[0] != SAME_KEY[1]
    (c1, t1), (c2, t2) = SAME_PAIR
    assert keys(c1, 4, t1)[1] == keys(c2, 4, t2)[1] and keys(c1, 4)[0] != keys(c2, 4)[0]


def test_spec_worked_example():
    tok, prob = ours([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8], 4)
    assert tok.tolist() == [0] * 7 + [8, 5, 6, 7, 8, 0, 0, 0, 8]
    assert prob[7:12].tolist() == [1.0] * 5 and prob[15] == np.float32(2) / np.float32(3)
    assert not prob[:7].any() and not prob[12:15].any()


@pytest.mark.parametrize("order", [2, 4, 16, 33])
def test_equal_to_record_c_on_streams_built_to_break_it(record, order):
    rng = np.random.default_rng(order)
    L = order - 1
    span = rng.integers(0, 50, 40)
    streams = {
        "ties": [0] + [3, 1, 3, 2, 3, 2, 3, 1, 3, 4, 3] * 3 + [3],  # order 2: 3->1 and 3->2 tie at position 6
        "once": list(rng.permutation(400)),  # every context appears once
        "spans": np.concatenate([span, rng.integers(0, 50, 7), span, span[:25], rng.integers(0, 3, 60), span]),
        "extreme ids": rng.choice([0, 8191], 300),
        "uint16 ids": rng.choice([0, 1, 65535], 200),
        "shorter than order": rng.integers(0, 5, max(order - 1, 1)),
        "one token": [7],
        "exactly order-1": rng.integers(0, 3, L),
        "exactly order": rng.integers(0, 3, order),
        "small vocab": rng.integers(0, 3, 500),
        "seed repeats": [9] * (3 * order),
    }
    for name, stream in streams.items():
        tok, prob = assert_same_as_record(record, stream, order)
        assert not prob[:max(L - 1, 0)].any() and not tok[:max(L - 1, 0)].any(), name  # no full context yet
    if order == 2:  # the tie: after 3 -> 1, 3 -> 2 the count is 1:1 and the older top (1) stays
        tok, prob = ours(streams["ties"], 2)
        assert (tok[6], prob[6]) == (1, np.float32(0.5))


def test_equal_to_record_c_where_keys_and_pair_keys_collide(record):
    (a, b) = SAME_KEY
    # context a then 7; context b has never been seen, yet its key has a's counts
    stream = [1, 2, *a, 7, 3, *b, 5, 4, *b, 5, 6, *a, 0]
    tok, prob = assert_same_as_record(record, stream, 4)
    assert (tok[10], prob[10]) == (7, 1.0)
    assert (tok[15], prob[15]) == (7, np.float32(0.5))  # merged: a->7, b->5 tie at 1, a's 7 came first
    assert (tok[20], prob[20]) == (5, np.float32(2) / np.float32(3))  # b->5 twice: 5 took the top
    (c1, t1), (c2, t2) = SAME_PAIR
    # (c1, t1) counted, then c2 (new context) gets pair count 2 from the shared pair key: top_count 2 of total 1
    stream = [0, *c1, t1, 1, *c2, t2, 2, *c2, 3]
    tok, prob = assert_same_as_record(record, stream, 4)
    assert (tok[14], prob[14]) == (t2, 2.0)


def test_equal_to_record_c_on_a_zipf_stream_with_spans(record):
    stream = bench_ngram.zipf_stream(60_000, seed=3)
    for order in (3, 16):
        _, prob = assert_same_as_record(record, stream, order)
        assert (prob >= np.float32(0.8)).sum() > 100  # gated positions exist: the comparison means something


def test_causal_changing_target_p_changes_no_hint_at_or_before_p():
    rng = np.random.default_rng(0)
    for order in (2, 5, 16):
        base = np.resize(rng.integers(0, 4, 30), 400)  # a repeated pattern with noise: hints everywhere
        base[rng.random(400) < 0.05] = 3
        tok, prob = ours(base, order)
        for p in [0, 1, order - 2, order - 1, order, 57, 200, 399]:
            changed = base.copy()
            changed[p] = (changed[p] + 1 + rng.integers(0, 3)) % 4
            tok2, prob2 = ours(changed, order)
            np.testing.assert_array_equal(tok2[:p + 1], tok[:p + 1])
            np.testing.assert_array_equal(prob2[:p + 1], prob[:p + 1])
            assert p + 1 >= len(base) or (tok2 != tok).any() or (prob2 != prob).any()


def test_running_max_in_rows_equals_cummax():
    rng = np.random.default_rng(1)
    for n in (1, 3, 4, 5, 12, 13, 50):
        x = torch.from_numpy(rng.integers(0, 20, n))
        for width in (1, 4, 1024):
            out, spare = torch.empty_like(x), torch.empty_like(x)
            assert torch.equal(tg._running_max(x, out, spare, width), x.cummax(0).values), (n, width)


def test_empty_and_bad_inputs():
    tok, prob = tg.ngram_tilt_hints(torch.zeros(0, dtype=torch.int64), 16)
    assert tok.numel() == 0 and prob.numel() == 0
    with pytest.raises(ValueError, match="order 34 outside 2..33"):
        tg.ngram_tilt_hints(torch.arange(10), 34)
    with pytest.raises(ValueError, match="order 1 outside"):
        tg.ngram_tilt_hints(torch.arange(10), 1)
    with pytest.raises(ValueError, match="0..65535"):
        tg.ngram_tilt_hints(torch.tensor([1, 65536, 2]), 2)
    with pytest.raises(ValueError, match="1-D"):
        tg.ngram_tilt_hints(torch.zeros(2, 3, dtype=torch.int64), 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu():
    stream = torch.from_numpy(bench_ngram.zipf_stream(200_000, seed=5).astype(np.int64))
    tok, prob = tg.ngram_tilt_hints(stream, 16)
    tok_c, prob_c = tg.ngram_tilt_hints(stream.cuda(), 16)
    assert tok_c.is_cuda and prob_c.is_cuda
    assert torch.equal(tok_c.cpu(), tok) and torch.equal(prob_c.cpu().view(torch.int32), prob.view(torch.int32))
