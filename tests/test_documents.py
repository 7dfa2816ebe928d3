"""Documents (issue 17): the CaseOps transform, the CaseOps sample with its byte sidecar, sidecar BPB, varlen
attention on packed rows, the packed loader, BOS-split evaluation and progressive context."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import launcher
import train_gpt as tg
from conftest import (SAMPLE_VAL_TOKENS, TINY_ENV, build_sample, clean_environ, computed_once, config_error, read_log,
                      run_training, shared_folder, short_val_data)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "data"))

import caseops  # noqa: E402
import shards  # noqa: E402

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


# ------------------------------------------------------------ CaseOps sample data





@pytest.fixture(scope="module")
def caseops_sample(tmp_path_factory):
    """`build_sample_data.py --vocab-size 8192 --caseops` with 2 train shards (a couple of seconds), built once for
    the session (conftest.computed_once)."""
    return computed_once(shared_folder(tmp_path_factory) / "caseops",
                         lambda out: build_sample(out, "--vocab-size", "8192", "--caseops", "--train-shards", "2"))


def split_at_bos(tokens, bos=1):
    starts = np.flatnonzero(tokens == bos)
    return list(zip(starts.tolist(), [*starts[1:].tolist(), tokens.size]))


def test_caseops_sample_layout_tokenizer_and_sidecar(caseops_sample):
    import sentencepiece as spm

    data = caseops_sample / "datasets" / "sample_sp8192_caseops"
    assert sorted(os.listdir(data)) == ["fineweb_train_000000.bin", "fineweb_train_000001.bin",
                                        "fineweb_val_000000.bin", "fineweb_val_bytes_000000.bin"]
    sp = spm.SentencePieceProcessor(model_file=str(caseops_sample / "tokenizers" / "sample_8192_bpe_caseops.model"))
    assert sp.vocab_size() == 8192 and sp.bos_id() == 1
    assert [sp.piece_to_id(c) for c in caseops.OPERATORS] == [4, 5, 6, 7]
    val = shards.read_shard(data / "fineweb_val_000000.bin")
    sidecar = shards.read_shard(data / "fineweb_val_bytes_000000.bin")
    assert val.size == sidecar.size == 32 * 1024 + 1
    assert val[0] == 1 and np.all(sidecar[val == 1] == 0) and np.all(sidecar[(val >= 4) & (val <= 7)] == 0)
    assert int(((val >= 4) & (val <= 7)).sum()) > 100  # the operators are really used
    docs = split_at_bos(val)[:-1]  # the last one is cut at --val-tokens
    assert len(docs) > 20
    text_bytes = 0
    for a, b in docs:
        text = caseops.decode(sp.decode(val[a + 1:b].tolist()))
        assert any("A" <= c <= "Z" for c in text) or b - a < 50
        text_bytes += len(text.encode("utf-8"))
    # The sidecar's bytes over the complete documents are the UTF-8 length of their original text.
    assert int(sidecar[:docs[-1][1]].astype(np.int64).sum()) == text_bytes
    train = np.concatenate([shards.read_shard(data / f"fineweb_train_{i:06d}.bin") for i in range(2)])
    assert train[0] == 1 and shards.val_documents_in_train(val, [train], 1) == 0


def test_val_documents_in_train_counts_exact_copies_only():
    rng = np.random.default_rng(0)
    docs = [np.concatenate([[1], rng.integers(8, 500, size=n)]) for n in (5, 40, 80, 80, 300)]
    near = docs[3].copy()
    near[-1] += 1  # same length and first tokens as docs[3], one token differs at the end
    val = np.concatenate(docs + [docs[0][:3]])  # the last, cut-off document is not counted
    train = [np.concatenate([rng.integers(8, 500, size=7), docs[1], near, docs[4], [1, 9]]), docs[0][1:]]
    assert shards.val_documents_in_train(val, train, 1) == 2  # docs[1] and docs[4]
    assert shards.val_documents_in_train(val, [np.concatenate([near, [1]])], 1) == 0
    assert shards.val_documents_in_train(val, [np.concatenate([docs[3], [1]])], 1) == 1


def test_caseops_sample_refuses_train_val_overlap(monkeypatch, capsys):
    import build_sample_data as bsd

    real = bsd.split_documents

    def leaky(documents, val_tokens, seed, chars_per_token):
        train, val = real(documents, val_tokens, seed, chars_per_token)
        return val[:3] + train, val

    monkeypatch.setattr(bsd, "split_documents", leaky)
    assert bsd.main(["--out-dir", "/nonexistent/never-written", "--vocab-size", "1024", "--caseops"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3 validation documents also occur in the train shards" in err[0]


# ------------------------------------------------------------------ sidecar BPB



CPU = torch.device("cpu")


def cpu_runtime(h):
    return tg.Runtime(h, CPU, False, True, None, *tg.choose_precision(h, CPU))


def write_tokens(path, tokens):
    shards.write_shard(path, np.asarray(tokens, dtype=np.int64))


@pytest.fixture
def sidecar_data(tiny_env, tmp_path):
    """DATA_PATH with the sample's first 2049 val tokens in two val shards, and sidecars made from the
    tokenizer's own byte counts (the byte of a target given its predecessor; 0 at position 0)."""
    val = np.concatenate([tg.load_shard(f) for f in sorted(Path(tiny_env["DATA_PATH"]).glob("fineweb_val_*"))])
    val = val[:2049].astype(np.int64)
    luts = tg.build_byte_luts(tiny_env["TOKENIZER_PATH"], 1024)
    t = torch.from_numpy(val)
    side = np.concatenate([[0], luts.count(t[:-1], t[1:]).numpy().astype(np.int64)])
    for f in Path(tiny_env["DATA_PATH"]).glob("fineweb_train_*"):
        (tmp_path / f.name).symlink_to(f)
    for i, (a, b) in enumerate(((0, 1000), (1000, 2049))):
        write_tokens(tmp_path / f"fineweb_val_{i:06d}.bin", val[a:b])
        write_tokens(tmp_path / f"fineweb_val_bytes_{i:06d}.bin", side[a:b])
    return tmp_path


def test_sidecar_bpb_equals_tokenizer_bpb(sidecar_data, monkeypatch):
    monkeypatch.setenv("DATA_PATH", str(sidecar_data))
    h = tg.Hyperparameters()
    rt = cpu_runtime(h)
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    val = tg.load_validation_tokens(h.val_files, 128, h.vocab_size)
    assert val.numel() == 2049  # the sidecars are not read as val tokens
    side_luts, mode = tg.load_byte_sidecar(h.val_files, val, luts)
    assert mode == "sidecar" and side_luts.sidecar.numel() == 2049
    model = tg.build_model(h)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    logits_fn = model.forward_logits
    for evaluate in (lambda lt: tg.eval_val(rt, model, val, lt),
                     lambda lt: tg.eval_sliding(rt, model, logits_fn, val, lt)):
        assert evaluate(side_luts) == evaluate(luts)
    # The sidecar really is what is counted: doubling it halves the BPB.
    doubled = tg.replace(side_luts, sidecar=side_luts.sidecar * 2)
    loss, bpb = tg.eval_sliding(rt, model, logits_fn, val, luts)
    loss2, bpb2 = tg.eval_sliding(rt, model, logits_fn, val, doubled)
    assert loss2 == loss and bpb2 == pytest.approx(bpb / 2, rel=1e-12)


def test_no_sidecar_means_tokenizer_bytes(tiny_env):
    h = tg.Hyperparameters()
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    assert not luts.caseops
    val = tg.load_validation_tokens(h.val_files, 128, h.vocab_size)
    assert tg.load_byte_sidecar(h.val_files, val, luts) == (luts, "tokenizer")


@pytest.mark.parametrize("damage,words", [
    ("missing", "byte sidecar {d}/fineweb_val_bytes_000001.bin missing for val shard fineweb_val_000001.bin"),
    ("short", "fineweb_val_bytes_000000.bin is short: 999 entries for the 1000 tokens"),
    ("long", "fineweb_val_bytes_000000.bin is mismatched: 1001 entries for the 1000 tokens"),
    ("bos", "are mismatched: 5 bytes at val position 0, a BOS token"),
])
def test_bad_sidecars_are_one_line_errors(sidecar_data, monkeypatch, damage, words):
    monkeypatch.setenv("DATA_PATH", str(sidecar_data))
    side0 = sidecar_data / "fineweb_val_bytes_000000.bin"
    values = tg.load_shard(side0).astype(np.int64)
    if damage == "missing":
        (sidecar_data / "fineweb_val_bytes_000001.bin").unlink()
    elif damage == "short":
        write_tokens(side0, values[:-1])
    elif damage == "long":
        write_tokens(side0, np.append(values, 3))
    else:
        values[0] = 5
        write_tokens(side0, values)
    h = tg.Hyperparameters()
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    val = tg.load_validation_tokens(h.val_files, 128, h.vocab_size)
    with pytest.raises(tg.ConfigError) as err:
        tg.load_byte_sidecar(h.val_files, val, luts)
    assert "\n" not in str(err.value) and words.format(d=sidecar_data) in str(err.value)


def test_caseops_tokenizer_without_sidecar_is_an_error(caseops_sample, tmp_path):
    data = caseops_sample / "datasets" / "sample_sp8192_caseops"
    (tmp_path / "fineweb_val_000000.bin").symlink_to(data / "fineweb_val_000000.bin")
    luts = tg.build_byte_luts(str(caseops_sample / "tokenizers" / "sample_8192_bpe_caseops.model"), 8192)
    assert luts.caseops
    pattern = str(data / "fineweb_val_*.bin")
    val = tg.load_validation_tokens(pattern, 128, 8192)
    with_side, mode = tg.load_byte_sidecar(pattern, val, luts)
    assert mode == "sidecar" and int(with_side.sidecar.sum()) > 0
    with pytest.raises(tg.ConfigError, match="sidecar .* missing: a CaseOps tokenizer needs"):
        tg.load_byte_sidecar(str(tmp_path / "fineweb_val_*.bin"), val, luts)


# ------------------------------------------------------------- varlen attention

def packed_model(monkeypatch, **env):
    """A tiny fp32 model with perturbed weights, without the token-mixing BigramHash and SmearGate v1."""
    for k, v in {"BIGRAM_VOCAB_SIZE": "0", "SMEAR_GATE": "0", **env}.items():
        monkeypatch.setenv(k, v)
    h = tg.Hyperparameters()
    model = tg.build_model(h)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.float() + 0.05 * torch.randn(p.shape, generator=g))
    model.set_compute_dtype(torch.float32)
    for p in model.parameters():
        p.data = p.data.float()
    return h, model.eval()


def cu_from_lengths(lengths, pad_to=None):
    cu = np.concatenate([[0], np.cumsum(lengths)])
    if pad_to is not None:
        cu = np.concatenate([cu, np.full(pad_to - cu.size, cu[-1])])
    return torch.tensor(cu, dtype=torch.int32)


# (segment lengths per row, cut length S): several boundary layouts; a row starting mid-document is just a
# first segment without BOS; a document longer than S arrives cut into segments of at most S.
LAYOUTS = [([[1, 40, 25, 62]], 64, 0), ([[128]], 128, 1), ([[64, 64, 64, 64, 1]], 64, 0),
           ([[10, 64, 64, 30], [3, 64, 33, 64, 4]], 64, 1), ([[17] * 9], 32, 1)]


@pytest.mark.parametrize("layout,S,loops", LAYOUTS)
def test_packed_forward_equals_documents_alone(tiny_env, monkeypatch, layout, S, loops):
    h, model = packed_model(monkeypatch, NUM_LOOPS=str(loops), LOOP_START="1", LOOP_END="2")
    model.looping = loops > 0
    T = sum(layout[0])
    assert all(sum(r) == T for r in layout)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(8, h.vocab_size, (len(layout), T), generator=g)
    lengths = [n for row in layout for n in row]
    for row, lens in enumerate(layout):  # segments start with BOS, except a row's first (mid-document)
        for start in np.cumsum([0, *lens[:-1]])[1:]:
            ids[row, start] = 1
    docs = tg.DocBounds(cu_from_lengths(lengths, pad_to=len(lengths) + 5), S)
    with torch.no_grad():
        packed = model.forward_logits(ids, docs)
        dense = model.forward_logits(ids)
        flat_ids, flat = ids.reshape(-1), packed.reshape(-1, packed.size(-1))
        a = 0
        for n in lengths:
            alone = model.forward_logits(flat_ids[a:a + n][None])[0]
            torch.testing.assert_close(flat[a:a + n], alone, rtol=1e-4, atol=1e-4)
            a += n
    if len(lengths) > len(layout):  # crossing a boundary would give other logits: the test can fail
        assert not torch.allclose(packed, dense, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- packed loader



def brute_cu(row, S, bucket=64):
    """cu_seqlens by the words of SPEC-FRONTIER 3, one position at a time."""
    cu, seg_start = [0], 0
    for i in range(1, len(row)):
        if row[i] == 1 or i - seg_start == S:
            cu.append(i)
            seg_start = i
    cu.append(len(row))
    while len(cu) % bucket:
        cu.append(len(row))
    return cu


@pytest.mark.parametrize("seed", range(6))
def test_packed_cu_seqlens(seed):
    rng = np.random.default_rng(seed)
    row = rng.integers(0, [3, 30, 300, 3000][seed % 4], size=int(rng.integers(1, 700)))
    if seed == 5:
        row[:] = 1  # every token a BOS: more than one bucket
    cu = tg.packed_cu_seqlens(row, 64)
    assert cu.dtype == np.int32 and cu.tolist() == brute_cu(row.tolist(), 64)


def make_doc_shards(dirpath, sizes, seed=0):
    """Shards of random documents (BOS=1 then ids 2..999); shard 0 starts mid-document."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(sizes):
        t = rng.integers(2, 1000, size=n)
        t[rng.random(n) < 0.02] = 1
        out.append(t)
        shards.write_shard(dirpath / f"fineweb_train_{i:06d}.bin", t)
    return out


def packed_runtime(monkeypatch, data, world=1, rank=0, **env):
    base = {"DATA_PATH": str(data), "TRAIN_LOADER": "packed", "BIGRAM_VOCAB_SIZE": "0", "SMEAR_GATE": "0",
            "TRAIN_SEQ_LEN": "64", "TRAIN_BATCH_TOKENS": str(8 * 256), "VOCAB_SIZE": "1024",
            "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    for k in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {**base, **env}.items():
        monkeypatch.setenv(k, str(v))
    return tg.Runtime(tg.Hyperparameters(), CPU, world > 1, rank == 0, None)


def expected_spans(shard_tokens, world, local, steps):
    """SPEC-FRONTIER 3 by hand: from each shard's first BOS, spans of world*(local+1) while they fit."""
    span, out = world * (local + 1), []
    k = 0
    while len(out) < steps:
        t = shard_tokens[k % len(shard_tokens)]
        pos = int(np.flatnonzero(t == 1)[0])
        while pos + span <= t.size and len(out) < steps:
            out.append(t[pos:pos + span])
            pos += span
        k += 1
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_packed_loader_spans_rank_split_and_wrap(tmp_path, monkeypatch, world, prefetch):
    toks = make_doc_shards(tmp_path, (5000, 1000, 3000))
    steps = 30  # several passes over the shards: wrap-around
    for rank in range(world):
        rt = packed_runtime(monkeypatch, tmp_path, world, rank, TRAIN_PREFETCH=prefetch)
        local = rt.h.train_batch_tokens // (world * rt.h.grad_accum_steps)
        loader = tg.make_train_loader(rt)
        try:
            for span in expected_spans(toks, world, local, steps):
                x, y, docs = loader.next_batch()
                mine = span[rank * (local + 1):(rank + 1) * (local + 1)]
                assert x.shape == (1, local)
                assert x[0].tolist() == mine[:-1].tolist() and y[0].tolist() == mine[1:].tolist()
                assert docs.max_len == 64 and docs.cu_seqlens.tolist() == brute_cu(mine[:-1].tolist(), 64)
        finally:
            loader.shutdown()


SMALL_STEP = {"TRAIN_BATCH_TOKENS": 512, "GRAD_ACCUM_STEPS": 2, "TRAIN_SEQ_LEN": 128}  # 2 rows of 256 a step


def test_packed_loader_prefetch_on_off_identical_and_restore_after_warmup(tiny_env, monkeypatch):
    batches = {}
    for prefetch in (0, 1):
        rt = packed_runtime(monkeypatch, tiny_env["DATA_PATH"], TRAIN_PREFETCH=prefetch, TRAIN_COPY_STREAM=0,
                            **SMALL_STEP)
        loader = tg.make_train_loader(rt)
        assert isinstance(loader, tg.PrefetchingPackedLoader) == bool(prefetch)
        try:
            batches[prefetch] = [loader.next_batch() for _ in range(12)]
        finally:
            loader.shutdown()
    for (x0, y0, d0), (x1, y1, d1) in zip(*batches.values()):
        assert torch.equal(x0, x1) and torch.equal(y0, y1) and torch.equal(d0.cu_seqlens, d1.cu_seqlens)
    # Warmup runs real steps on the packed batches, then a fresh loader starts from the beginning again.
    rt = packed_runtime(monkeypatch, tiny_env["DATA_PATH"], TRAIN_PREFETCH=1, WARMUP_STEPS=1, NUM_LAYERS=2,
                        VE_LAYERS="1", XSA_LAST_N=1, **SMALL_STEP)
    trainer = tg.Trainer(rt, tg.build_model(rt.h))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    loader = tg.warmup_and_restore(rt, trainer)
    try:
        again = [loader.next_batch() for _ in range(12)]
    finally:
        loader.shutdown()
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in before.items())
    for (x0, _, d0), (x1, _, d1) in zip(batches[0], again):
        assert torch.equal(x0, x1) and torch.equal(d0.cu_seqlens, d1.cu_seqlens)
    assert threading.active_count() < 50


def test_packed_loader_errors(tmp_path, monkeypatch):
    shards.write_shard(tmp_path / "fineweb_train_000000.bin", np.full(5000, 7))
    rt = packed_runtime(monkeypatch, tmp_path, TRAIN_PREFETCH=0)
    with pytest.raises(tg.ConfigError, match="TRAIN_LOADER=packed: no train shard .* holds a BOS token"):
        tg.make_train_loader(rt)
    toks = make_doc_shards(tmp_path, (5000,))
    toks[0][3000] = 1500
    shards.write_shard(tmp_path / "fineweb_train_000000.bin", toks[0])
    for prefetch in (0, 1):
        loader = tg.make_train_loader(packed_runtime(monkeypatch, tmp_path, TRAIN_PREFETCH=prefetch))
        with pytest.raises(tg.ConfigError) as err:
            try:
                for _ in range(20):
                    loader.next_batch()
            finally:
                loader.shutdown()
        assert str(err.value) == f"shard {tmp_path / 'fineweb_train_000000.bin'}: token id 1500 >= VOCAB_SIZE=1024"
    msg = config_error({"TRAIN_LOADER": "packed"})
    assert "TRAIN_LOADER=packed needs BIGRAM_VOCAB_SIZE=0 and SMEAR_GATE=0 or 2" in msg
    assert "SMEAR_GATE=0 or 2" in config_error({"TRAIN_LOADER": "packed", "BIGRAM_VOCAB_SIZE": "0"})
    # SmearGate v2 is masked at BOS, so it never mixes documents: accepted with the packed loader
    assert tg.Hyperparameters({"TRAIN_LOADER": "packed", "BIGRAM_VOCAB_SIZE": "0", "SMEAR_GATE": "2"}).smear_gate == 2


# ------------------------------------------------------------ BOS-split evaluation

def fp32_runtime(h):
    return tg.Runtime(h, CPU, False, True, None)


def segment_nll_sum(model, tokens, L):
    """Reference: rows of L targets, each split at its BOS tokens, every segment run on its own."""
    total = 0.0
    for r in range((tokens.numel() - 1) // L):
        row = tokens[r * L:(r + 1) * L + 1].long()
        cu = tg.packed_cu_seqlens(row[:-1].numpy(), L, bucket=1).tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            logits = model.forward_logits(row[a:b][None])[0]
            total += float(torch.nn.functional.cross_entropy(logits, row[a + 1:b + 1], reduction="sum"))
    return total


def test_bos_split_eval_scores_each_document_alone(tiny_env, monkeypatch):
    h, model = packed_model(monkeypatch, EVAL_SPLIT_AT_BOS="1", VAL_BATCH_SIZE=str(8 * 256), EVAL_STRIDE="128")
    rt = fp32_runtime(h)
    val = tg.load_validation_tokens(h.val_files, 128, h.vocab_size)[:4 * 128 + 1]
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    assert int((val == 1).sum()) >= 1  # the rows do hold document starts
    with torch.no_grad():
        want = segment_nll_sum(model, val, 128) / (val.numel() - 1)
    loss, _ = tg.eval_val(rt, model, val, luts)
    assert loss == pytest.approx(want, rel=1e-5)
    # Sliding windows with stride = EVAL_SEQ_LEN are the same rows: the same split and score.
    sliding, _ = tg.eval_sliding(rt, model, model.forward_logits, val, luts)
    assert sliding == pytest.approx(want, rel=1e-5)
    monkeypatch.setenv("EVAL_SPLIT_AT_BOS", "0")
    dense, _ = tg.eval_val(fp32_runtime(tg.Hyperparameters()), model, val, luts)
    assert abs(dense - want) > 1e-4  # attention across documents scores differently: the test can fail


def test_eval_include_tail_scores_every_target(tiny_env, monkeypatch):
    h, model = packed_model(monkeypatch, EVAL_INCLUDE_TAIL="1", EVAL_SPLIT_AT_BOS="1",
                            VAL_BATCH_SIZE=str(8 * 256))
    assert h.eval_include_tail and tg.Hyperparameters({}).eval_include_tail is False
    rt = fp32_runtime(h)
    full = tg.load_validation_tokens(h.val_files, 100, h.vocab_size, include_tail=True)
    cut = tg.load_validation_tokens(h.val_files, 100, h.vocab_size)
    assert full.numel() == SAMPLE_VAL_TOKENS == 16 * 1024 + 1 and cut.numel() == 16300 + 1  # 84 targets cut
    val = full[:3 * 128 + 58]  # 3 rows and a tail of 57 targets
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    loss, bpb = tg.eval_val(rt, model, val, luts)
    with torch.no_grad():
        rows = segment_nll_sum(model, val[:3 * 128 + 1], 128)
        tail = val[3 * 128:].long()
        cu = tg.packed_cu_seqlens(tail[:-1].numpy(), 1000, bucket=1).tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            logits = model.forward_logits(tail[a:b][None])[0]
            rows += float(torch.nn.functional.cross_entropy(logits, tail[a + 1:b + 1], reduction="sum"))
    assert loss == pytest.approx(rows / (val.numel() - 1), rel=1e-5)
    nbytes = float(luts.count(val[:-1], val[1:]).sum())
    assert bpb == pytest.approx(loss / np.log(2) * (val.numel() - 1) / nbytes, rel=1e-9)


def test_packed_training_run_end_to_end(sample_data, tmp_path):
    """A tiny run on documents: packed loader, BOS-split validation / sliding / TTT, the tail scored, GPTQ
    calibrated on packed batches; the log names what ran."""
    data = tmp_path / "data"
    data.mkdir()
    env = {**TINY_ENV, **short_val_data(sample_data, data, 1024 + 40), "RUN_ID": "packed", "ITERATIONS": "2",
           "TRAIN_LOADER": "packed", "BIGRAM_VOCAB_SIZE": "0", "SMEAR_GATE": "0", "EVAL_INCLUDE_TAIL": "1",
           "QUANT": "gptq", "GPTQ_CALIBRATION_BATCHES": "2", "GPTQ_RESERVE_SECONDS": "0", "TTT_EPOCHS": "1",
           "TTT_CHUNK_TOKENS": "512", "EVAL_STRIDE": "64", "TRAIN_SEQ_LEN_SCHEDULE": "64@0,128@0.5"}
    proc = run_training(env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(tmp_path, "packed")
    for line in ("attention_backend_packed:torch_doc_blocks", "bpb_bytes:tokenizer", "val_tokens:1063",
                 "documents: eval_split_at_bos:1 eval_include_tail:1", "setting EVAL_SPLIT_AT_BOS=1 [default]",
                 "data_path: loader:packed", "legal_ttt_exact val_loss:", "warmup_step:1/1 seq_len:64",
                 "warmup_step:1/1 seq_len:128", "seq_len:128 step:1 frac:0.5000"):
        assert line in log, line


# ------------------------------------------------------------ progressive context

def test_seq_len_schedule_phases_and_rewarmup_values(monkeypatch):
    h = tg.Hyperparameters({"TRAIN_LOADER": "packed", "BIGRAM_VOCAB_SIZE": "0", "SMEAR_GATE": "0",
                            "TRAIN_SEQ_LEN_SCHEDULE": "1024@0,2048@0.1,3072@0.7", "SEQ_LEN_REWARMUP_STEPS": "4",
                            "MAX_WALLCLOCK_SECONDS": "0", "ITERATIONS": "100"})
    assert h.seq_len_phases == [(1024, 0.0), (2048, 0.1), (3072, 0.7)]
    assert [tg.seq_len_phase(h, s, 0.0) for s in (0, 9, 10, 69, 70, 99)] == [0, 0, 1, 1, 2, 2]
    assert [tg.seq_len_rewarmup(h, k) for k in (None, 0, 1, 2, 3, 4, 50)] == [1, 0.25, 0.5, 0.75, 1, 1, 1]
    assert tg.seq_len_rewarmup(tg.Hyperparameters({}), None) == 1.0
    assert tg.Hyperparameters({}).seq_len_phases == []


@pytest.mark.parametrize("value,words", [
    ("1024@0.1,2048@0.5", "fractions must start at 0"), ("1024@0,2048@0.5,3072@0.4", "fractions must start at 0"),
    ("1024@0,2048@1", "below 1"), ("0@0", "lengths must be > 0"), ("1024", "must look like"),
    ("a@0", "must look like")])
def test_bad_seq_len_schedule_is_a_one_line_error(value, words):
    msg = config_error({"TRAIN_LOADER": "packed", "BIGRAM_VOCAB_SIZE": "0", "SMEAR_GATE": "0",
                        "TRAIN_SEQ_LEN_SCHEDULE": value})
    assert msg.startswith(f"TRAIN_SEQ_LEN_SCHEDULE={value!r}") and words in msg
    assert "needs TRAIN_LOADER=packed" in config_error({"TRAIN_SEQ_LEN_SCHEDULE": "64@0,128@0.5"})


SCHEDULE_RECORDER = """
import json
phase_fn = tg.seq_len_phase
seen = []
def recorded(h, step, elapsed_ms):
    p = phase_fn(h, step, elapsed_ms)
    if not seen or seen[-1][1] != p:
        seen.append((step, p))
        json.dump(seen, open(f"phases{rank}.json", "w"))
    return p
tg.seq_len_phase = recorded
tg.main()
"""


def test_two_ranks_with_skewed_clocks_switch_context_at_one_step(tmp_path, sample_data):
    """Rank 1's clock runs twice as fast (a step counts 100 ms on rank 0, 200 ms on rank 1: TRAIN_CLOCK=ms, a clock
    the test controls, so the steps are the same on a fast, slow or busy machine): the context switches (and the LR
    re-warmup after them) must happen at the same step on both ranks, the agreed elapsed time's (the slower clock's)
    against the 2 s cap: to 64 once 0.25 has passed (after step 3, 600 ms), to 128 at 0.5 (after step 5, 1000 ms),
    where rank 0's own clock would switch after steps 5 and 10; the weights then agree."""
    from test_frontier import CLOCK_WRAPPER

    wrapper = tmp_path / "clock_run.py"
    source = CLOCK_WRAPPER.format(repo=str(REPO))
    assert source.rstrip().endswith("tg.main()")
    wrapper.write_text(source.rstrip()[:-len("tg.main()")] + SCHEDULE_RECORDER)
    env = {**clean_environ(), **TINY_ENV, **sample_data, "RUN_ID": "ctx", "OMP_NUM_THREADS": "1",
           "ITERATIONS": "100000", "MAX_WALLCLOCK_SECONDS": "2", "TRAIN_CLOCK": "ms:100", "WARMDOWN_ITERS": "0",
           "TRAIN_LOG_EVERY": "0", "TTT_ENABLED": "0", "EVAL_STRIDE": "0", "WARMUP_STEPS": "0", "TRAIN_LOADER": "packed",
           "BIGRAM_VOCAB_SIZE": "0", "SMEAR_GATE": "0", "TRAIN_SEQ_LEN_SCHEDULE": "32@0,64@0.25,128@0.5",
           "SEQ_LEN_REWARMUP_STEPS": "3", "TRAIN_BATCH_TOKENS": "2048"}
    proc = launcher.run_ranks([wrapper], env, tmp_path, 2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    p0, p1 = (json.loads((tmp_path / f"phases{r}.json").read_text()) for r in (0, 1))
    assert p0 == p1 == [[0, 0], [3, 1], [5, 2]], (p0, p1)
    log = read_log(tmp_path, "ctx")
    for (step, p), length in zip(p0[1:], (64, 128)):
        assert re.search(rf"^seq_len:{length} step:{step} frac:", log, re.M), log[-2000:]
    a, b = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_bench_varlen_prints_the_table():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_varlen.py"), "--sizes", "256,512",
                           "--seg", "64", "--dense-max", "256"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 256 |") or line.startswith("| 512 |")]
    assert len(rows) == 2 and rows[1].endswith("| - |"), proc.stdout
