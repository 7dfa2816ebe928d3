"""The last bad inputs (issue 22, item 5): each ends in one line and an exit code before any work, and leaves
nothing behind. Absurd model sizes (refused from a parameter-count formula checked here against the built model
and a real optimizer step), an over-long RUN_ID, an EVAL_ONLY artifact with wrongly typed entries, a record
folder's unreadable README.md, a bad downloader variant (refused before the hub is touched), and a zpaq that is
installed but does not import (issue 42, item 4)."""
from __future__ import annotations

import importlib.util
import io
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_gpt as tg
from conftest import REPO, TINY_ENV, clean_environ, config_error, read_log, run_training
from test_records import META, make_folder
from test_trust import assert_one_line_error

sys.path.insert(0, str(REPO / "scripts" / "record"))
import make_record  # noqa: E402  (needs the path above)

# ---------------------------------------------------------------------------------------------- absurd sizes

FEATURE_MIXES = [
    pytest.param({}, id="tiny"),
    pytest.param({"TIE_EMBEDDINGS": "0", "MLP_MULT": "2.5", "NUM_KV_HEADS": "4", "VOCAB_SIZE": "512",
                  "BIGRAM_DIM": "32", "VE_DIM": "16"}, id="untied-other-widths"),
    pytest.param({"BIGRAM_VOCAB_SIZE": "0", "VE_ENABLED": "0", "SMEAR_GATE": "2", "ATTN_GATE": "sparse"}, id="0427"),
    pytest.param({"ATTN_GATE": "dense", "SKIP_GATES": "1", "NUM_LOOPS": "2", "LOOP_START": "1", "LOOP_END": "2",
                  "PARALLEL_RESIDUAL_START": "2", "PARALLEL_MODE": "lanes", "SMEAR_GATE": "0"}, id="loops-lanes"),
]


def built_counts(model) -> dict[str, int]:
    """The counts of the model built for real (model_param_counts reads the one built on the meta device)."""
    counts = {"banks": 0, "embeddings": 0, "other": 0, "training_only": 0}
    groups, only = tg.param_groups(model), tg.marked(model, "training_only")
    for name, p in model.named_parameters():
        kind = "training_only" if only.get(name) else "banks" if groups[name] == "matrix" else \
            "embeddings" if p.dtype == torch.bfloat16 else "other"
        counts[kind] += p.numel()
    return counts


@pytest.mark.parametrize("over", FEATURE_MIXES)
def test_param_count_formula_equals_the_built_model(over):
    h = tg.Hyperparameters({**TINY_ENV, **over})
    assert tg.model_param_counts(h) == built_counts(tg.build_model(h))


def test_param_count_formula_at_the_defaults():
    h = tg.Hyperparameters({})
    assert tg.model_param_counts(h) == built_counts(tg.build_model(h))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("over", [{}, {"MUON_MOMENTUM_FP32": "1", "SWA_ENABLED": "1"}, {"EMA_ENABLED": "0"}])
def test_memory_formula_equals_a_real_training_step(over):
    """model_memory_bytes == the bytes of weights + gradients + every optimizer state tensor (less AdamW's step
    counters) + the EMA/SWA copies after one real step of the tiny model."""
    h = tg.Hyperparameters({**TINY_ENV, "TIE_EMBEDDINGS": "0", **over})
    model = tg.build_model(h)
    muon, adams = tg.build_optimizers(h, model)
    averager = tg.WeightAverager(h, model)
    ids = torch.randint(0, h.vocab_size, (2, 33))
    model(ids[:, :-1], ids[:, 1:]).backward()
    for opt in (muon, *adams):
        opt.step()
    averager.update(0, 0.1)
    if h.swa_enabled:  # SWA's copy, allocated at the first snapshot of the warmdown
        averager.update(h.swa_every, 0.1)
        assert averager.swa is not None
    states = [v for opt in (muon, *adams) for s in opt.state.values() for k, v in s.items() if k != "step"]
    params = list(model.parameters())
    copies = [*(averager.ema or {}).values(), *(averager.swa or {}).values()]
    measured = tensor_bytes(params) + tensor_bytes(p.grad for p in params) + tensor_bytes(states + copies)
    assert all(p.grad is not None for p in params)
    assert tg.model_memory_bytes(h) == measured
    assert tg.model_memory_bytes(tg.Hyperparameters({**TINY_ENV, **over, "TIE_EMBEDDINGS": "0",
                                                     "EVAL_ONLY": __file__})) == tensor_bytes(params)


@pytest.mark.parametrize("over,culprit", [
    ({"NUM_LAYERS": "1000", "MODEL_DIM": "4096"}, "NUM_LAYERS=1000"),
    ({"MODEL_DIM": "100000", "VOCAB_SIZE": "8192", "MLP_MULT": "4"}, "MODEL_DIM=100000"),
    ({"BIGRAM_VOCAB_SIZE": "100000000000", "NUM_LAYERS": "12"}, "BIGRAM_VOCAB_SIZE=100000000000"),
    ({"VOCAB_SIZE": "1000000000", "MODEL_DIM": "768"}, "VOCAB_SIZE=1000000000"),
])
def test_absurd_size_is_refused_naming_the_setting_that_grew_it(over, culprit):
    h = tg.Hyperparameters(over)
    with pytest.raises(tg.ConfigError) as err:
        tg.check_model_memory(h, torch.device("cpu"))
    message = str(err.value)
    need = tg.model_memory_bytes(h)
    assert "\n" not in message and message.startswith(f"{culprit}: the model would need at least ")
    assert f"{need / 1e9:,.1f} GB of CPU memory ({sum(tg.model_param_counts(h).values()):,} parameters" in message


def test_memory_check_compares_the_need_with_what_is_available(monkeypatch):
    """The defaults pass with exactly their need available and are refused one byte below it; on CPU each local
    rank counts."""
    h = tg.Hyperparameters({})
    need = tg.model_memory_bytes(h)
    monkeypatch.setattr(tg, "available_memory", lambda device: (need, "available (test)"))
    tg.check_model_memory(h, torch.device("cpu"))
    monkeypatch.setattr(tg, "available_memory", lambda device: (need - 1, "available (test)"))
    with pytest.raises(tg.ConfigError, match=r"^the model's sizes: the model would need at least"):
        tg.check_model_memory(h, torch.device("cpu"))
    monkeypatch.setattr(tg, "available_memory", lambda device: (2 * need - 1, "available (test)"))
    two = tg.Hyperparameters({"LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(tg.ConfigError, match="x 2 local ranks"):
        tg.check_model_memory(two, torch.device("cpu"))


def test_this_machine_reports_its_memory():
    avail = tg.available_memory(torch.device("cpu"))
    assert avail is not None and avail[0] > 0


@pytest.mark.parametrize("over,name", [({"NUM_LAYERS": "1000", "MODEL_DIM": "4096"}, "NUM_LAYERS"),
                                       ({"MODEL_DIM": "100000"}, "MODEL_DIM"),
                                       ({"BIGRAM_VOCAB_SIZE": "100000000000"}, "BIGRAM_VOCAB_SIZE")])
def test_absurd_size_stops_the_script_at_start(tmp_path, over, name):
    """Before data (DATA_PATH does not exist), before the log, nothing written."""
    env = {**TINY_ENV, "DATA_PATH": str(tmp_path / "no_data"), "TOKENIZER_PATH": str(tmp_path / "no.model"),
           "RUN_ID": "absurd", **over}
    proc = run_training(env, tmp_path, timeout=60)
    assert_one_line_error(proc, 2, f"error: {name}=", "GB of CPU memory", "parameters")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- RUN_ID

def test_run_id_longer_than_a_file_name_is_refused(tmp_path):
    limit = tg.file_name_max(str(tmp_path))
    ok = "r" * (limit - len(".txt"))
    assert tg.Hyperparameters({"RUN_ID": ok}).run_id == ok
    assert "_profile_rank0.json" in config_error({"RUN_ID": ok, "PROFILE": "1"})
    assert "'.preflight.txt'" in config_error({"RUN_ID": ok, "PREFLIGHT": "1"})  # PREFLIGHT=1's log, refused at start
    proc = run_training({**TINY_ENV, "RUN_ID": ok + "r", "DATA_PATH": str(tmp_path / "no_data")}, tmp_path,
                        timeout=60)
    assert_one_line_error(proc, 2, "error: RUN_ID=", "too long", f"{limit}-byte limit")
    assert list(tmp_path.iterdir()) == []


def test_a_finished_run_id_is_refused_at_start(tmp_path, monkeypatch):
    """runs/RUN_ID/final_model.int6.ptz exists (issue 47): a training run, a resume and EVAL_ONLY under that name are
    refused in one line naming RUN_ID, the file and both ways out, before the data is read or the log opened; with
    OVERWRITE_RUN=1 the settings pass. A folder runs/RUN_ID that cannot be made is refused too."""
    done = tmp_path / "runs" / "r1" / "final_model.int6.ptz"
    done.parent.mkdir(parents=True)
    done.write_bytes(b"a finished run's artifact")
    monkeypatch.chdir(tmp_path)
    line = ("RUN_ID=r1 is a finished run (runs/r1/final_model.int6.ptz exists): choose a new RUN_ID, or set "
            "OVERWRITE_RUN=1 to replace its outputs")
    for over in ({}, {"RESUME": "auto"}, {"EVAL_ONLY": str(done)}):
        assert config_error({"RUN_ID": "r1", **over}) == line
        assert tg.Hyperparameters({"RUN_ID": "r1", "OVERWRITE_RUN": "1", **over}).overwrite_run
    assert "OVERWRITE_RUN='yes' must be 0 or 1" in config_error({"OVERWRITE_RUN": "yes"})
    proc = run_training({**TINY_ENV, "RUN_ID": "r1", "DATA_PATH": str(tmp_path / "no_data")}, tmp_path, timeout=60)
    assert_one_line_error(proc, 2, f"error: {line}")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["runs", "runs/r1",
                                                                                "runs/r1/final_model.int6.ptz"]
    assert done.read_bytes() == b"a finished run's artifact"
    (tmp_path / "runs" / "r2").write_text("a file where the run's folder should be\n")
    proc = run_training({**TINY_ENV, "RUN_ID": "r2", "DATA_PATH": str(tmp_path / "no_data")}, tmp_path, timeout=60)
    assert_one_line_error(proc, 2, "error: RUN_ID=r2: cannot make its folder runs/r2 (")
    assert not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------------------------------- CHECKPOINT_DIR

def test_checkpoint_dir_that_is_a_file_or_not_writable_is_refused_at_start(tmp_path, sample_data, monkeypatch):
    """Refused before the log and the data (issue 34: it trained until its first checkpoint, then stopped)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    env = {**TINY_ENV, **sample_data, "CHECKPOINT_EVERY": "1", "RUN_ID": "ckpt"}
    for folder, words in ((blocker, "is a file, not a folder"), (blocker / "sub", "is a file, not a folder")):
        proc = run_training({**env, "CHECKPOINT_DIR": str(folder)}, tmp_path, timeout=60)
        assert_one_line_error(proc, 2, f"error: CHECKPOINT_DIR={folder}: {blocker} ", words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # no log, no checkpoints folder
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    access = os.access  # root may write anywhere: the permission answer is simulated for this folder
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else access(p, mode))
    with pytest.raises(tg.ConfigError, match=f"CHECKPOINT_DIR={locked}/ckpt: {locked} is not writable by this user"):
        tg.check_checkpoint_dir(str(locked / "ckpt"))
    tg.check_checkpoint_dir(str(tmp_path / "new" / "deeper"))  # folders still to create are fine


# ---------------------------------------------------------------------------------------------- EVAL_ONLY

@pytest.fixture(scope="module")
def artifact_obj(tmp_path_factory):
    """The unpacked dict of a real tiny artifact, and the tiny settings it was made with."""
    h = tg.Hyperparameters({**TINY_ENV, "TTT_ENABLED": "0"})
    path = tmp_path_factory.mktemp("art") / "a.ptz"
    tg.save_artifact(str(path), tg.build_model(h), True, h)
    return torch.load(io.BytesIO(lzma.decompress(path.read_bytes())), map_location="cpu"), h


def write_artifact(path: Path, obj: dict) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    path.write_bytes(lzma.compress(buf.getvalue()))
    return str(path)


WRONG_TYPES = [
    pytest.param(lambda o: {**o, "w": list(o["w"].values())}, "'w' and 'm' must be dicts", id="w-list"),
    pytest.param(lambda o: {**o, "m": "passthrough"}, "'w' and 'm' must be dicts", id="m-str"),
    pytest.param(lambda o: {**o, "w": {**o["w"], "tok_emb.weight.q": [1, 2]}}, "w['tok_emb.weight.q'] has type list",
                 id="w-value-list"),
    pytest.param(lambda o: {**o, "m": {**o["m"], "tok_emb.weight": 8}}, "m['tok_emb.weight'] has type int",
                 id="meta-value-int"),
    pytest.param(lambda o: {**o, "late_qat": "0"}, "'late_qat' has type str, not bool", id="late-qat-str"),
    pytest.param(lambda o: {**o, "late_qat": 0}, "'late_qat' has type int, not bool", id="late-qat-int"),
]


@pytest.mark.parametrize("mutate,fragment", WRONG_TYPES)
def test_artifact_with_wrong_types_is_one_line(tmp_path, artifact_obj, mutate, fragment):
    obj, h = artifact_obj
    good = write_artifact(tmp_path / "good.ptz", obj)
    assert tg.load_artifact(good, h).qat_on()  # the unmutated artifact loads
    path = write_artifact(tmp_path / "bad.ptz", mutate(obj))
    with pytest.raises(tg.ConfigError) as err:
        tg.load_artifact(path, h)
    assert str(err.value).startswith(f"{path}: artifact ") and fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_eval_only_artifact_with_wrong_types_stops_the_script(tmp_path, sample_data, artifact_obj):
    obj, _ = artifact_obj
    path = write_artifact(tmp_path / "bad.ptz", {**obj, "late_qat": "yes"})
    proc = run_training({**TINY_ENV, **sample_data, "TTT_ENABLED": "0", "EVAL_ONLY": path, "RUN_ID": "types"},
                        tmp_path, timeout=120)
    line = assert_one_line_error(proc, 2, f"error: {path}: artifact entry 'late_qat' has type str, not bool")
    assert "final_int6_roundtrip val_loss" not in proc.stdout  # (the start line names it: scored_evaluations)
    assert read_log(tmp_path, "types").rstrip("\n").endswith(line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.ptz", "logs"]


# ---------------------------------------------------------------------------------------------- make_record.py

@pytest.mark.parametrize("bad,fragment", [("dir", "is a directory"), ("latin1", "is not UTF-8")])
def test_make_record_with_an_unreadable_readme_is_one_line(tmp_path, capsys, bad, fragment):
    folder = make_folder(tmp_path)
    readme = folder / "README.md"
    if bad == "dir":
        readme.mkdir()
    else:
        readme.write_bytes("# R\u00e9sultats\n".encode("latin-1"))
    before = sorted(p.name for p in folder.iterdir())
    capsys.readouterr()
    assert make_record.main([str(folder), *META]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {readme} {fragment}"), err
    assert sorted(p.name for p in folder.iterdir()) == before  # no submission.json either


# ---------------------------------------------------------------------------------------------- downloader

@pytest.mark.parametrize("variant,touched", [("sp999", False), ("SP1024", False), ("", False), ("sp1024", True)])
def test_downloader_checks_the_variant_before_the_hub(tmp_path, variant, touched):
    """huggingface_hub and sockets are replaced by tripwires that record any use: a bad variant is one line and
    exit 2 without touching either (the good variant shows the tripwires work)."""
    folder, fakes, trip = tmp_path / "data", tmp_path / "fakes", tmp_path / "touched"
    folder.mkdir()
    (fakes / "huggingface_hub").mkdir(parents=True)
    for name in ("cached_challenge_fineweb.py", "shards.py"):
        shutil.copy(REPO / "data" / name, folder / name)
    tripwire = f"open({str(trip)!r}, 'a').write('{{}}\\n'.format(%s))\n"
    (fakes / "huggingface_hub" / "__init__.py").write_text(tripwire % "'import'" + "raise ImportError('tripwire')\n")
    (fakes / "sitecustomize.py").write_text(
        "import socket\n\ndef _connect(self, *a):\n    " + tripwire % "'connect'"
        + "    raise OSError('tripwire')\n\nsocket.socket.connect = _connect\n")
    env = {**{k: v for k, v in clean_environ().items() if not k.startswith(("HF_", "MATCHED_FINEWEB_"))},
           "PYTHONPATH": str(fakes)}
    proc = subprocess.run([sys.executable, str(folder / "cached_challenge_fineweb.py"), "--variant", variant,
                           "--train-shards", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    if touched:
        assert trip.exists() and proc.returncode != 0
        return
    assert_one_line_error(proc, 2, "--variant")
    assert not trip.exists(), trip.read_text()
    assert sorted(os.listdir(folder)) == ["cached_challenge_fineweb.py", "shards.py"]


# ---------------------------------------------------------------------------------------------- a broken zpaq

GLIBC_ERROR = "/lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.34' not found (required by zpaq/_zpaq.so)"


def test_a_zpaq_that_does_not_import_is_refused_at_start_in_one_line(monkeypatch, tmp_path):
    """COMPRESSOR=pergroup with a zpaq that find_spec finds but whose import fails (a stand-in failing as a wheel
    built for a newer glibc does): one line naming the package, the import's error, the fix and the glibc the
    wheels need, from the settings (before any work) and from reading a per-group artifact; lzma never looks."""
    (tmp_path / "zpaq").mkdir()
    (tmp_path / "zpaq" / "__init__.py").write_text(f"raise ImportError({GLIBC_ERROR!r})\n", encoding="utf-8")
    monkeypatch.delitem(sys.modules, "zpaq", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("zpaq") is not None and tg.import_error("zpaq") == f"ImportError: {GLIBC_ERROR}"
    assert tg.missing_modules("pergroup") == [("zpaq", "zpaq")] and tg.missing_modules("lzma") == []
    fix = (f"pip install --force-reinstall zpaq (it is installed, but its import fails: ImportError: {GLIBC_ERROR}; "
           "zpaq's wheels need glibc 2.34 or newer; on older Linux pip builds it from source with a C++ compiler)")
    assert config_error({"COMPRESSOR": "pergroup"}) == f"COMPRESSOR=pergroup needs the zpaq package: {fix}"
    with pytest.raises(tg.ConfigError) as err:
        tg.pergroup_deserialize(b"", "x.ptz")
    assert str(err.value) == f"x.ptz: per-group artifacts need the zpaq module: {fix}"
    tg.Hyperparameters({"COMPRESSOR": "lzma"})
    assert tg.import_error("brotli") is None and tg.import_error("no_such_module_here") == ""


# ---------------------------------------------------------------------------------------------- the auto prefix's cap

def test_a_negative_prefix_cap_is_named_as_the_cap():
    """PHASED_TTT_PREFIX_DOCS=auto takes its prefix from the cap, so a negative cap named the prefix (issue 62)."""
    line = config_error({"PHASED_TTT_PREFIX_DOCS": "auto", "PHASED_TTT_PREFIX_DOCS_MAX": "-1"})
    assert line == "PHASED_TTT_PREFIX_DOCS_MAX=-1 must be >= 0 (0: every val document)", line
    assert config_error({"PHASED_TTT_PREFIX_DOCS": "-3"}) == "PHASED_TTT_PREFIX_DOCS=-3 must be a number of documents >= 0, or auto"
