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


# ------------------------------------------------------------ CaseOps sample data

import os  # noqa: E402
import subprocess  # noqa: E402

import numpy as np  # noqa: E402

import shards  # noqa: E402


@pytest.fixture(scope="module")
def caseops_sample(tmp_path_factory):
    """`build_sample_data.py --vocab-size 8192 --caseops` with 2 train shards (a couple of seconds)."""
    out = tmp_path_factory.mktemp("caseops")
    proc = subprocess.run([sys.executable, str(REPO / "data" / "build_sample_data.py"), "--out-dir", str(out),
                           "--vocab-size", "8192", "--caseops", "--train-shards", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


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

import torch  # noqa: E402

import train_gpt as tg  # noqa: E402
from conftest import config_error  # noqa: E402

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
LAYOUTS = [([[40, 25, 63]], 64, 0), ([[1, 127]], 128, 0), ([[128]], 128, 1), ([[64, 64, 64, 64, 1]], 64, 0),
           ([[10, 64, 64, 30], [3, 64, 33, 64, 4]], 64, 1), ([[100, 100, 57]], 100, 0), ([[17] * 9], 32, 1)]


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
