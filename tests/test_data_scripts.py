"""Tests for data/: the shard helpers, the offline sample builder and the
FineWeb downloader (offline failure, argument errors, and its download logic
against a fake hub; the real hub is never contacted).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
sys.path.insert(0, str(DATA))

import cached_challenge_fineweb as dl  # noqa: E402
import shards  # noqa: E402

BUILDER = DATA / "build_sample_data.py"
DOWNLOADER = DATA / "cached_challenge_fineweb.py"
SAMPLE_SHARDS = ["fineweb_train_000000.bin", "fineweb_train_000001.bin",
                 "fineweb_train_000002.bin", "fineweb_train_000003.bin", "fineweb_val_000000.bin"]


def run(args, cwd=None, env=None, timeout=120):
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_error(proc, rc):
    assert proc.returncode == rc, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], proc.stderr


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------- shards.py

def test_write_shard_round_trip(tmp_path):
    tokens = np.concatenate([[0, 1, 65535], np.random.default_rng(0).integers(0, 65536, 5000)])
    path = tmp_path / "s.bin"
    shards.write_shard(path, tokens)
    assert path.stat().st_size == 1024 + 2 * tokens.size
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[:3].tolist() == [20240520, 1, tokens.size]
    assert not header[3:].any()
    raw = np.fromfile(path, dtype="<u2", offset=1024)
    assert np.array_equal(raw, tokens)
    assert np.array_equal(shards.read_shard(path), tokens)
    assert shards.shard_num_tokens(path) == tokens.size
    assert os.listdir(tmp_path) == ["s.bin"]  # no .tmp left behind


def test_write_shard_accepts_lists_and_empty(tmp_path):
    shards.write_shard(tmp_path / "a.bin", [5, 6, 7])
    assert shards.read_shard(tmp_path / "a.bin").tolist() == [5, 6, 7]
    shards.write_shard(tmp_path / "e.bin", np.zeros(0, dtype=np.int64))
    assert (tmp_path / "e.bin").stat().st_size == 1024
    assert shards.read_shard(tmp_path / "e.bin").size == 0


@pytest.mark.parametrize("bad", [[1, -1, 2], [65536], [0.5, 1.0]])
def test_write_shard_rejects_bad_tokens(tmp_path, bad):
    path = tmp_path / "bad.bin"
    with pytest.raises(ValueError, match="bad.bin"):
        shards.write_shard(path, np.asarray(bad))
    assert os.listdir(tmp_path) == []


def test_write_shard_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "s.bin"
    shards.write_shard(path, [1, 2, 3])
    before = path.read_bytes()
    # A bad call and a crash at the final rename both leave the old file intact.
    with pytest.raises(ValueError):
        shards.write_shard(path, [70000])

    def crash(src, dst):
        raise OSError("simulated crash")

    monkeypatch.setattr(shards.os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        shards.write_shard(path, list(range(100)))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["s.bin"]


def test_shard_validation_names_the_problem(tmp_path):
    path = tmp_path / "s.bin"
    shards.write_shard(path, list(range(10)))
    with open(path, "r+b") as f:
        f.truncate(1024 + 2 * 9)
    with pytest.raises(ValueError, match="does not match"):
        shards.read_shard(path)
    path.write_bytes(b"\0" * 1024)
    with pytest.raises(ValueError, match="bad shard header"):
        shards.shard_num_tokens(path)
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="shorter"):
        shards.shard_num_tokens(path)


# ------------------------------------------------------- build_sample_data.py

@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """One default build (it takes about a second), shared by the builder tests."""
    out = tmp_path_factory.mktemp("sample")
    proc = run([BUILDER, "--out-dir", out], env={**os.environ, "PYTHONHASHSEED": "1"})
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


def load_sample(out: Path):
    data_dir = out / "datasets" / "sample_sp1024"
    train = [shards.read_shard(data_dir / f"fineweb_train_{i:06d}.bin") for i in range(4)]
    val = shards.read_shard(data_dir / "fineweb_val_000000.bin")
    return train, val


def split_docs(tokens: np.ndarray, bos: int) -> list[tuple[int, ...]]:
    starts = np.flatnonzero(tokens == bos)
    return [tuple(tokens[a:b].tolist()) for a, b in zip(starts, [*starts[1:], tokens.size])]


def test_sample_build_layout_and_shards(sample):
    out, stdout = sample
    assert sorted(os.listdir(out / "datasets" / "sample_sp1024")) == SAMPLE_SHARDS
    assert sorted(os.listdir(out / "tokenizers")) == ["sample_1024_bpe.model", "sample_1024_bpe.vocab"]
    train, val = load_sample(out)
    sizes = [t.size for t in train]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) > 200_000  # an even split
    assert val.size == 32 * 1024 + 1
    for tokens in (*train, val):
        assert int(tokens.max()) < 1024
    assert train[0][0] == 1 and val[0] == 1  # every document starts with <s>
    assert f"{sum(sizes)} train" in stdout and "elapsed" in stdout


def test_sample_tokenizer(sample):
    import sentencepiece as spm

    out, _ = sample
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizers" / "sample_1024_bpe.model"))
    assert sp.vocab_size() == 1024
    assert sp.bos_id() == 1
    assert sum(sp.is_byte(i) for i in range(1024)) == 256  # byte fallback
    assert sp.encode("é☃", out_type=str)  # rare characters still encode
    text = sp.decode(load_sample(out)[1][:400].tolist())
    assert " the " in text


def test_sample_val_documents_are_held_out(sample):
    train, val = load_sample(sample[0])
    train_docs = set(split_docs(np.concatenate(train), bos=1))
    val_docs = split_docs(val, bos=1)[:-1]  # the last one is cut off at --val-tokens
    assert len(val_docs) >= 20
    assert not train_docs.intersection(val_docs)


def test_sample_build_is_deterministic_and_idempotent(sample, tmp_path):
    first, _ = sample
    out = tmp_path / "again"
    # A smaller build first: the full rebuild over it must drop the extra state
    # (its stale shard count) and come out byte-identical to the shared build,
    # here from another directory and with another hash seed.
    env = {**os.environ, "PYTHONHASHSEED": "2"}
    proc = run([BUILDER, "--out-dir", out, "--train-shards", "6", "--seed", "5"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert len(os.listdir(out / "datasets" / "sample_sp1024")) == 7
    proc = run([BUILDER, "--out-dir", out], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert tree_bytes(out) == tree_bytes(first)


@pytest.fixture(scope="module")
def sample_8192(tmp_path_factory):
    """A build at the sp8192 records' vocabulary size, 2 train shards (about a second)."""
    out = tmp_path_factory.mktemp("sample_8192")
    args = [BUILDER, "--out-dir", out, "--vocab-size", "8192", "--train-shards", "2"]
    proc = run(args, env={**os.environ, "PYTHONHASHSEED": "1"})
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout, args


def test_sample_8192_build(sample_8192):
    import sentencepiece as spm

    out, stdout, _ = sample_8192
    assert "with the extra text of vocabularies above 4096" in stdout
    assert sorted(os.listdir(out / "tokenizers")) == ["sample_8192_bpe.model", "sample_8192_bpe.vocab"]
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizers" / "sample_8192_bpe.model"))
    assert sp.vocab_size() == 8192 and sp.bos_id() == 1
    assert sum(sp.is_byte(i) for i in range(8192)) == 256
    assert len((out / "tokenizers" / "sample_8192_bpe.vocab").read_text(encoding="utf-8").splitlines()) == 8192
    data_dir = out / "datasets" / "sample_sp8192"
    names = ["fineweb_train_000000.bin", "fineweb_train_000001.bin", "fineweb_val_000000.bin"]
    assert sorted(os.listdir(data_dir)) == names
    tokens = {}
    for name in names:
        header = np.fromfile(data_dir / name, dtype="<i4", count=256)
        assert header[:2].tolist() == [20240520, 1] and not header[3:].any()
        assert (data_dir / name).stat().st_size == 1024 + 2 * int(header[2])
        tokens[name] = shards.read_shard(data_dir / name)
        assert int(tokens[name].max()) < 8192
    train = np.concatenate([tokens[n] for n in names[:2]])
    val = tokens["fineweb_val_000000.bin"]
    assert train[0] == 1 and val[0] == 1  # every document starts with <s>
    assert val.size == 32 * 1024 + 1  # the val documents hold enough text at this vocabulary size
    assert train.size > 300_000
    # The upper half of the vocabulary is really used: most of its pieces occur
    # in train, and a good share of the val tokens are among them.
    assert np.unique(train[train > 4096]).size > 3000
    assert int((val > 4096).sum()) > val.size // 10
    train_docs = set(split_docs(train, bos=1))
    assert not train_docs.intersection(split_docs(val, bos=1)[:-1])


def test_sample_8192_build_is_deterministic(sample_8192, tmp_path):
    first, _, args = sample_8192
    out = tmp_path / "again"
    proc = run([*args[:2], out, *args[3:]], cwd=tmp_path, env={**os.environ, "PYTHONHASHSEED": "2"})
    assert proc.returncode == 0, proc.stderr
    assert tree_bytes(out) == tree_bytes(first)


@pytest.mark.parametrize("args", [["--vocab-size", "100"], ["--vocab-size", "8193"], ["--vocab-size", "99999"],
                                  ["--train-shards", "0"], ["--val-tokens", "10"],
                                  ["--val-tokens", "10000000"], ["--vocab-size", "x"], ["--bogus"]])
def test_sample_builder_bad_args(tmp_path, args):
    out = tmp_path / "out"
    proc = run([BUILDER, "--out-dir", out, *args])
    assert_one_line_error(proc, 2)
    assert not out.exists()


# ------------------------------------------------- cached_challenge_fineweb.py

def closed_port_endpoint() -> str:
    """An http endpoint on localhost where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def isolated_downloader(tmp_path):
    """A copy of the downloader in its own folder (it writes next to itself) and
    an environment that cannot reach any hub."""
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("cached_challenge_fineweb.py", "shards.py"):
        shutil.copy(DATA / name, folder / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MATCHED_FINEWEB_"))}
    env.update(HF_ENDPOINT=closed_port_endpoint(), HF_HOME=str(tmp_path / "hf_home"))
    return folder, env


@pytest.mark.parametrize("variant, repo", [("sp1024", "willdepueoai/parameter-golf"),
                                           ("sp8192", "kevclark/parameter-golf")])
def test_downloader_offline_fails_fast_with_one_line(isolated_downloader, variant, repo):
    folder, env = isolated_downloader
    start = time.monotonic()
    proc = run([folder / "cached_challenge_fineweb.py", "--variant", variant, "--train-shards", "1"],
               cwd=folder.parent, env=env, timeout=60)
    assert time.monotonic() - start < 30
    assert_one_line_error(proc, 1)
    assert "could not reach the Hugging Face hub" in proc.stderr and f"from {repo} " in proc.stderr
    assert proc.stdout.startswith(f"source: dataset repo {repo} ")
    assert "build_sample_data.py" in proc.stderr
    assert sorted(os.listdir(folder)) == ["cached_challenge_fineweb.py", "shards.py"]


@pytest.mark.parametrize("args", [["--variant", "sp999"], ["--variant", "sp2048"],
                                  ["--variant", "sp1024", "--train-shards", "-1"],
                                  ["--variant", "sp1024", "--train-shards", "100000"],
                                  ["--variant", "sp1024", "--train-shards", "many"], []])
def test_downloader_bad_args(isolated_downloader, args):
    folder, env = isolated_downloader
    proc = run([folder / "cached_challenge_fineweb.py", *args], env=env, timeout=60)
    assert_one_line_error(proc, 2)


SP1024_REPO = "willdepueoai/parameter-golf"
KEVCLARK_REPO = "kevclark/parameter-golf"


class FakeHub:
    """Stands in for hub_download, serving each dataset repo from its own folder."""

    def __init__(self, repos: dict[str, Path]):
        self.repos = repos
        self.downloads: list[tuple[str, str]] = []  # (repo id, remote path)

    @property
    def root(self) -> Path:  # the sp1024 repo, which most tests use
        return self.repos[SP1024_REPO]

    def paths(self, repo_id=SP1024_REPO) -> list[str]:
        return sorted(path for repo, path in self.downloads if repo == repo_id)

    def download(self, repo_id, remote_path, staging_dir):
        if repo_id not in self.repos:
            raise dl.FetchError(f"dataset repo {repo_id} not found or not accessible (fake hub)")
        src = self.repos[repo_id] / remote_path
        if not src.is_file():
            raise dl.RemoteFileMissing(remote_path)
        self.downloads.append((repo_id, remote_path))
        dst = Path(staging_dir) / remote_path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)
        return str(dst)


def manifest_for(exports: dict[int, int]) -> dict:
    """A manifest in the challenge's schema for {vocab size: number of train shards}."""
    return {
        "datasets": [{"name": f"fineweb10B_sp{v}", "tokenizer_name": f"sp_bpe_{v}",
                      "stats": {"files_train": n, "files_val": 1}} for v, n in exports.items()],
        "tokenizers": [{"name": f"sp_bpe_{v}", "model_path": f"tokenizers/fineweb_{v}_bpe.model",
                        "vocab_path": f"tokenizers/fineweb_{v}_bpe.vocab"} for v in exports],
    }


MANIFEST = manifest_for({1024: 3})


def publish(root: Path, exports: dict[int, int], mark: int = 0) -> Path:
    """Lay out a dataset repo like the real ones: datasets/manifest.json, shards and
    tokenizers under datasets/. Train shard i of vocab v holds v + mark + i + arange(100)."""
    for v, n_train in exports.items():
        shard_dir = root / "datasets" / "datasets" / f"fineweb10B_sp{v}"
        shard_dir.mkdir(parents=True)
        for i in range(n_train):
            shards.write_shard(shard_dir / f"fineweb_train_{i:06d}.bin", np.arange(100) + v + mark + i)
        shards.write_shard(shard_dir / "fineweb_val_000000.bin", np.arange(50) + v + mark)
        (root / "datasets" / "tokenizers").mkdir(exist_ok=True)
        for ext in ("model", "vocab"):
            (root / "datasets" / "tokenizers" / f"fineweb_{v}_bpe.{ext}").write_bytes(f"{ext} {v} {mark}".encode())
    (root / "datasets" / "manifest.json").write_text(json.dumps(manifest_for(exports)))
    return root


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """The sp1024 repo (3 train shards) and Kevin Clark's repo (sp4096 and sp8192, 3 each)."""
    hub = FakeHub({SP1024_REPO: publish(tmp_path / "repo", {1024: 3}),
                   KEVCLARK_REPO: publish(tmp_path / "kevclark", {4096: 3, 8192: 3})})
    local = tmp_path / "data"
    monkeypatch.delenv("MATCHED_FINEWEB_REPO_ID", raising=False)
    monkeypatch.setattr(dl, "DATA_DIR", str(local))
    monkeypatch.setattr(dl, "check_hub_reachable", lambda repo_id, remote_path: None)
    monkeypatch.setattr(dl, "hub_download", hub.download)
    return hub, local


def test_download_places_files_and_skips_existing(fake_hub, capsys):
    hub, local = fake_hub
    assert dl.main(["--variant", "sp1024", "--train-shards", "2"]) == 0
    shard_dir = local / "datasets" / "fineweb10B_sp1024"
    assert sorted(os.listdir(shard_dir)) == ["fineweb_train_000000.bin", "fineweb_train_000001.bin",
                                             "fineweb_val_000000.bin"]
    assert (local / "tokenizers" / "fineweb_1024_bpe.model").read_bytes() == b"model 1024 0"
    assert (local / "tokenizers" / "fineweb_1024_bpe.vocab").read_bytes() == b"vocab 1024 0"
    assert not (local / "datasets" / ".hf_staging").exists()
    assert shards.read_shard(shard_dir / "fineweb_train_000001.bin").tolist() == list(range(1025, 1125))
    assert {repo for repo, _ in hub.downloads} == {SP1024_REPO}
    assert capsys.readouterr().out.startswith(f"source: dataset repo {SP1024_REPO} (the default for sp1024;")

    # Second run, default shard count (80) is more than the 3 published: all of
    # them, and only the missing shard and a corrupted one are downloaded again.
    with open(shard_dir / "fineweb_train_000000.bin", "r+b") as f:
        f.truncate(1500)
    hub.downloads.clear()
    assert dl.main(["--variant", "sp1024"]) == 0
    assert hub.paths() == ["datasets/datasets/fineweb10B_sp1024/fineweb_train_000000.bin",
                           "datasets/datasets/fineweb10B_sp1024/fineweb_train_000002.bin",
                           "datasets/manifest.json"]
    assert shards.shard_num_tokens(shard_dir / "fineweb_train_000000.bin") == 100
    assert "fetching all" in capsys.readouterr().out


def test_download_rejects_more_shards_than_published(fake_hub, capsys):
    assert dl.main(["--variant", "sp1024", "--train-shards", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3 train shards" in err[0]


def test_download_rejects_corrupt_remote_shard(fake_hub, capsys):
    hub, local = fake_hub
    remote = hub.root / "datasets" / "datasets" / "fineweb10B_sp1024" / "fineweb_train_000000.bin"
    with open(remote, "r+b") as f:
        f.truncate(1100)
    assert dl.main(["--variant", "sp1024", "--train-shards", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a valid shard" in err[0]
    assert not (local / "datasets" / "fineweb10B_sp1024" / "fineweb_train_000000.bin").exists()
    assert not list((local / "datasets").rglob("fineweb_train_000000.bin"))


def test_download_without_manifest_uses_conventional_names(fake_hub, capsys):
    hub, local = fake_hub
    (hub.root / "datasets" / "manifest.json").unlink()
    assert dl.main(["--variant", "sp1024", "--train-shards", "3"]) == 0
    assert len(os.listdir(local / "datasets" / "fineweb10B_sp1024")) == 4
    assert "conventional file names" in capsys.readouterr().out
    # Past the end of the export the missing file is named.
    assert dl.main(["--variant", "sp1024", "--train-shards", "4"]) == 1
    assert "fineweb_train_000003.bin" in capsys.readouterr().err


@pytest.mark.parametrize("vocab", [4096, 8192])
def test_download_large_vocab_variants_from_their_repo(fake_hub, capsys, vocab):
    hub, local = fake_hub
    assert dl.main(["--variant", f"sp{vocab}", "--train-shards", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"source: dataset repo {KEVCLARK_REPO} (the default for sp{vocab}; "
                          "MATCHED_FINEWEB_REPO_ID overrides it)\n")
    assert {repo for repo, _ in hub.downloads} == {KEVCLARK_REPO}
    remote = f"datasets/datasets/fineweb10B_sp{vocab}"
    assert hub.paths(KEVCLARK_REPO) == [f"{remote}/fineweb_train_000000.bin", f"{remote}/fineweb_train_000001.bin",
                                        f"{remote}/fineweb_val_000000.bin", "datasets/manifest.json",
                                        f"datasets/tokenizers/fineweb_{vocab}_bpe.model",
                                        f"datasets/tokenizers/fineweb_{vocab}_bpe.vocab"]
    shard_dir = local / "datasets" / f"fineweb10B_sp{vocab}"
    assert sorted(os.listdir(local / "datasets")) == [f"fineweb10B_sp{vocab}", "manifest.json"]
    assert sorted(os.listdir(shard_dir)) == ["fineweb_train_000000.bin", "fineweb_train_000001.bin",
                                             "fineweb_val_000000.bin"]
    assert shards.read_shard(shard_dir / "fineweb_train_000001.bin").tolist() == list(range(vocab + 1, vocab + 101))
    assert sorted(os.listdir(local / "tokenizers")) == [f"fineweb_{vocab}_bpe.model", f"fineweb_{vocab}_bpe.vocab"]
    assert (local / "tokenizers" / f"fineweb_{vocab}_bpe.model").read_bytes() == f"model {vocab} 0".encode()
    assert json.loads((local / "datasets" / "manifest.json").read_text()) == manifest_for({4096: 3, 8192: 3})
    assert f"2 train shards from {KEVCLARK_REPO} in {shard_dir}" in out


def test_download_default_train_shards_per_variant(fake_hub, tmp_path, capsys):
    hub, local = fake_hub
    # Published: one shard more than sp8192's default of 128, and fewer than sp4096's 143.
    hub.repos[KEVCLARK_REPO] = publish(tmp_path / "kevclark_full", {4096: 2, 8192: 129})
    assert dl.main(["--variant", "sp8192"]) == 0
    names = os.listdir(local / "datasets" / "fineweb10B_sp8192")
    assert len(names) == 129 and "fineweb_train_000127.bin" in names and "fineweb_train_000128.bin" not in names
    assert dl.main(["--variant", "sp4096"]) == 0
    assert len(os.listdir(local / "datasets" / "fineweb10B_sp4096")) == 3
    assert f"{KEVCLARK_REPO} publishes 2 train shards for sp4096; fetching all" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        dl.parse_args(["--help"])
    assert "sp1024 80, sp4096 143, sp8192 128" in " ".join(capsys.readouterr().out.split())


def test_download_repo_override_applies_to_every_variant(fake_hub, tmp_path, monkeypatch, capsys):
    hub, local = fake_hub
    hub.repos["someone/mirror"] = publish(tmp_path / "mirror", {1024: 2, 8192: 2}, mark=7)
    monkeypatch.setenv("MATCHED_FINEWEB_REPO_ID", "someone/mirror")
    assert dl.main(["--variant", "sp8192", "--train-shards", "1"]) == 0
    assert dl.main(["--variant", "sp1024", "--train-shards", "2"]) == 0
    out = capsys.readouterr().out
    assert ("source: dataset repo someone/mirror (from MATCHED_FINEWEB_REPO_ID; the default for sp8192 is "
            f"{KEVCLARK_REPO})") in out
    assert f"source: dataset repo someone/mirror (from MATCHED_FINEWEB_REPO_ID; the default for sp1024 is " \
           f"{SP1024_REPO})" in out
    assert {repo for repo, _ in hub.downloads} == {"someone/mirror"}
    tokens = shards.read_shard(local / "datasets" / "fineweb10B_sp8192" / "fineweb_train_000000.bin")
    assert tokens.tolist() == list(range(8192 + 7, 8192 + 107))
    assert (local / "tokenizers" / "fineweb_8192_bpe.model").read_bytes() == b"model 8192 7"
    assert len(os.listdir(local / "datasets" / "fineweb10B_sp1024")) == 3
    # The mirror has no sp4096 export: one line naming the mirror, not the default repo.
    assert dl.main(["--variant", "sp4096"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "someone/mirror does not list dataset fineweb10B_sp4096" in err[0]


@pytest.mark.parametrize("value", ["", "not a repo", "a/b/c"])
def test_download_rejects_bad_repo_override(fake_hub, monkeypatch, capsys, value):
    hub, local = fake_hub
    monkeypatch.setenv("MATCHED_FINEWEB_REPO_ID", value)
    assert dl.main(["--variant", "sp8192", "--train-shards", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"MATCHED_FINEWEB_REPO_ID={value!r} is not a Hugging Face repo id" in err[0]
    assert hub.downloads == [] and not local.exists()


def test_download_unknown_variant_names_the_known_ones(fake_hub, capsys):
    hub, _ = fake_hub
    assert dl.main(["--variant", "sp2048"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown --variant 'sp2048'; choose from sp1024, sp4096, sp8192" in err[0]
    assert hub.downloads == []


def test_manifest_schemas():
    val, train, tok = dl.plan_from_manifest(MANIFEST, "sp1024", SP1024_REPO)
    assert val == ["fineweb_val_000000.bin"]
    assert train == [f"fineweb_train_{i:06d}.bin" for i in range(3)]
    assert tok == ["tokenizers/fineweb_1024_bpe.model", "tokenizers/fineweb_1024_bpe.vocab"]
    # Datasets keyed by name with explicit file lists, no tokenizer section.
    listed = {"datasets": {"fineweb10B_sp1024": {
        "val_files": ["datasets/fineweb10B_sp1024/fineweb_val_000000.bin"],
        "train_files": ["fineweb_train_000000.bin", "fineweb_train_000001.bin"]}}}
    val, train, tok = dl.plan_from_manifest(listed, "sp1024", SP1024_REPO)
    assert val == ["fineweb_val_000000.bin"] and len(train) == 2
    assert tok == ["tokenizers/fineweb_1024_bpe.model", "tokenizers/fineweb_1024_bpe.vocab"]
    for bad, reason in [([], "JSON object"), ({"datasets": []}, "does not list"),
                        ({"datasets": [{"name": "fineweb10B_sp1024", "stats": {}}]}, "cannot tell")]:
        with pytest.raises(dl.FetchError, match=reason) as info:
            dl.plan_from_manifest(bad, "sp1024", SP1024_REPO)
        assert "\n" not in str(info.value)


CASEOPS_REPO = "romeerp/parameter-golf-caseops-v1"
CASEOPS_DATASET = "fineweb10B_sp8192_lossless_caps_caseops_v1_reserved"
CASEOPS_TOKENIZER = "fineweb_8192_bpe_lossless_caps_caseops_v1_reserved"


def publish_caseops(root: Path, val_docs: list[np.ndarray], train_docs: list[np.ndarray]) -> Path:
    """The CaseOps export's layout: val shard + byte sidecar, 2 train shards, its tokenizer, a manifest."""
    shard_dir = root / "datasets" / "datasets" / CASEOPS_DATASET
    shard_dir.mkdir(parents=True)
    val = np.concatenate(val_docs)
    shards.write_shard(shard_dir / "fineweb_val_000000.bin", val)
    shards.write_shard(shard_dir / "fineweb_val_bytes_000000.bin", (val != 1).astype(np.int64) * 3)
    half = len(train_docs) // 2
    for i, part in enumerate((train_docs[:half], train_docs[half:])):
        shards.write_shard(shard_dir / f"fineweb_train_{i:06d}.bin", np.concatenate(part))
    (root / "datasets" / "tokenizers").mkdir()
    (root / "datasets" / "tokenizers" / f"{CASEOPS_TOKENIZER}.model").write_bytes(b"caseops model")
    manifest = {"datasets": [{"name": CASEOPS_DATASET, "tokenizer_name": "caseops",
                              "stats": {"files_train": 2, "files_val": 1}}],
                "tokenizers": [{"name": "caseops", "model_path": f"tokenizers/{CASEOPS_TOKENIZER}.model"}]}
    (root / "datasets" / "manifest.json").write_text(json.dumps(manifest))
    return root


def caseops_docs(seed, n):
    rng = np.random.default_rng(seed)
    return [np.concatenate([[1], rng.integers(8, 8192, size=int(rng.integers(10, 60)))]) for _ in range(n)]


def test_download_caseops_variant_with_sidecars_and_overlap_check(fake_hub, tmp_path, capsys):
    hub, local = fake_hub
    val, train = caseops_docs(0, 20), caseops_docs(1, 40)
    hub.repos[CASEOPS_REPO] = publish_caseops(tmp_path / "caseops", val, train)
    assert dl.main(["--variant", "sp8192_caseops"]) == 0
    out = capsys.readouterr().out
    assert f"source: dataset repo {CASEOPS_REPO} (the default for sp8192_caseops" in out
    assert "val/train overlap: 0 of 19 validation documents" in out
    shard_dir = local / "datasets" / CASEOPS_DATASET
    assert sorted(os.listdir(shard_dir)) == ["fineweb_train_000000.bin", "fineweb_train_000001.bin",
                                             "fineweb_val_000000.bin", "fineweb_val_bytes_000000.bin"]
    assert (shards.read_shard(shard_dir / "fineweb_val_bytes_000000.bin")
            == (shards.read_shard(shard_dir / "fineweb_val_000000.bin") != 1) * 3).all()
    assert os.listdir(local / "tokenizers") == [f"{CASEOPS_TOKENIZER}.model"]

    # Pitfall 6: an export whose train shards hold val documents is refused in one line.
    hub.repos[CASEOPS_REPO] = publish_caseops(tmp_path / "leaky", val, train[:10] + val[:5] + train[10:])
    shutil.rmtree(shard_dir)
    assert dl.main(["--variant", "sp8192_caseops"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "5 of the 19 validation documents also occur in the 2 train shards" in err[0]


def test_download_docs_checked_against_their_manifest(fake_hub, capsys):
    """--with-docs: docs_selected.jsonl and its source manifest from the challenge's repo, checked (count, sha256,
    size) before they are moved into place; a good copy is kept, a damaged one fetched again, a download that does
    not match is refused in one line and leaves no documents file."""
    import hashlib

    hub, local = fake_hub
    body = b"".join(json.dumps({"text": f"document {i}"}).encode() + b"\n" for i in range(5))
    meta = {"num_docs": 5, "docs_sha256": hashlib.sha256(body).hexdigest(), "docs_bytes": len(body), "docs_val": 2}
    (hub.root / "datasets" / "docs_selected.jsonl").write_bytes(body)
    (hub.root / "datasets" / "docs_selected.source_manifest.json").write_text(json.dumps(meta))
    docs = local / "datasets" / "docs_selected.jsonl"
    assert dl.main(["--with-docs"]) == 0
    assert docs.read_bytes() == body and not (local / "datasets" / ".hf_staging").exists()
    assert hub.paths() == ["datasets/docs_selected.jsonl", "datasets/docs_selected.source_manifest.json"]
    hub.downloads.clear()
    assert dl.main(["--with-docs"]) == 0 and hub.paths() == []  # a good copy is kept
    assert "matches docs_selected.source_manifest.json" in capsys.readouterr().out
    docs.write_bytes(body[:-7])  # cut short, as by an interrupted copy
    assert dl.main(["--with-docs"]) == 0 and docs.read_bytes() == body
    assert hub.paths() == ["datasets/docs_selected.jsonl"]
    docs.unlink()
    (hub.root / "datasets" / "docs_selected.jsonl").write_bytes(body.replace(b"document 3", b"document 8"))
    assert dl.main(["--with-docs"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match" in err[0] and "sha256" in err[0], err
    assert not docs.exists()
