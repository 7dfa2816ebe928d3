"""A submission carries only its run's code (issue 60): train_gpt.py specialised to one run (scripts/pack/specialise.py,
`scripts/pack/pack_code.py --for`) runs as the full script does with the same settings: the same loss and score lines
and the same artifact bytes, packed, for every preset; a changed fixed setting is refused in one line;
a specialisation that drops a branch the run takes is caught by the same comparison."""
from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import pytest

import launcher
import train_gpt as tg
from conftest import PACK_TOOLS, REPO, SCRIPT, clean_environ, derived_once, read_log, run_file
from test_compile import PRESET_ENV, compiled_run, eager_run, preset_data  # noqa: F401 (fixture)
from test_documents import caseops_sample  # noqa: F401 (fixture)
from test_kernels import KERNEL_RUN_ID, TINY_KERNEL_RUN, kernel_run, needs_interpreter
from test_presets import caseops_run_data  # noqa: F401 (fixture)

sys.path.insert(0, str(REPO / "scripts" / "pack"))
import pack_code as pc  # noqa: E402
from test_pack_code import _result_lines as result_lines  # noqa: E402
import specialise as sp  # noqa: E402

PRESETS = tuple(PRESET_ENV)
# what the file reads from the machine at run time, never given to the specialiser
RUNTIME_ONLY = set(tg.MACHINE_SETTINGS) | {"DATA_PATH", "TOKENIZER_PATH"}


def settings_of(env: dict[str, str]) -> dict[str, str]:
    """The settings of a run's environment that the specialiser is given (not the machine's, not data paths)."""
    return {k: v for k, v in env.items() if k not in RUNTIME_ONLY and k not in ("TRITON_INTERPRET", "RUN_ID")}


def run_settings(preset: str) -> dict[str, str]:
    """The tiny run's settings that the specialiser fixes code by (PRESET_ENV's, as its eager run has them)."""
    return settings_of({**PRESET_ENV[preset], "PRESET": preset})


def specialised_files(tmp_path_factory, name: str, run: dict[str, str]) -> tuple[Path, Path]:
    """(readable, packed) train_gpt.py specialised to `run`, made once for the session and kept for the next while
    the script, the run and the tools are unchanged (conftest.derived_once): the runs below test the files, and a
    specialisation is made afresh in test_a_specialisation_that_drops_a_taken_branch_is_caught and by check_record.py
    in tests/test_specialise_tools.py."""
    def build(out: Path) -> None:
        spec = sp.specialise(SCRIPT.read_text(encoding="utf-8"), run, str(SCRIPT))
        for kind, text in (("readable", spec.text), ("packed", pc.pack(spec.text))):
            (out / kind).mkdir()
            (out / kind / "train_gpt.py").write_text(text, encoding="utf-8")

    folder = derived_once(tmp_path_factory, f"specialised_{name}", (SCRIPT, *PACK_TOOLS, repr(sorted(run.items()))),
                          build)
    return folder / "readable" / "train_gpt.py", folder / "packed" / "train_gpt.py"


def run_file_in(path: Path, env: dict[str, str], cwd: Path, run_id: str):
    cwd.mkdir(parents=True, exist_ok=True)
    full = {**clean_environ(), "COMPILE": "0", **env, "RUN_ID": run_id, "OMP_NUM_THREADS": "1"}
    return launcher.run([path], full, cwd, timeout=600)


def assert_same_run(path: Path, env: dict[str, str], cwd: Path, full_dir: Path, full_id: str, full_log: str) -> str:
    """The file `path` run with `env` prints the full script's run's loss and score lines and writes its artifact's
    bytes; returns the log."""
    proc = run_file_in(path, env, cwd, "specialised")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(cwd, "specialised")
    want = result_lines(full_log)
    assert sum(" train_loss:" in line for line in want) >= 2 and any("_exact " in line for line in want)
    assert result_lines(log) == want, path
    assert run_file(cwd, "specialised").read_bytes() == run_file(full_dir, full_id).read_bytes(), path
    sha = hashlib.sha256(SCRIPT.read_bytes()).hexdigest()
    assert re.search(rf"^specialised: from train_gpt\.py sha256:{sha} for PRESET=", log, re.M)
    return log


# The packed file runs for every preset. The readable one is not run (issue 69: it was, for the default preset): it is
# the same program, as pack_code verifies on every pack (the minified text parses to the readable one's AST less
# docstrings and annotations, and compiles to the same instructions), and tests/test_pack_code.py runs packed and
# readable train_gpt.py side by side.
@pytest.mark.parametrize("preset", PRESETS)
def test_specialised_file_runs_as_the_full_script(preset, preset_data, tmp_path, tmp_path_factory):
    """The preset's tiny run (tests/test_compile.py's eager run, shared) and its specialised packed file with the same
    settings: the same loss and score lines, the same artifact bytes; the specialised log says it is one and from
    which source."""
    full_dir, full_log = eager_run(tmp_path_factory, preset, preset_data[preset], 1)
    _, packed = specialised_files(tmp_path_factory, preset, run_settings(preset))
    env = {**preset_data[preset], **PRESET_ENV[preset], "PRESET": preset}
    assert_same_run(packed, env, tmp_path, full_dir, f"{preset}_1", full_log)


def test_specialised_file_runs_compiled_as_the_full_script(preset_data, tmp_path, tmp_path_factory):
    """record_0323's tiny run compiled (COMPILE_BACKEND=eager: Dynamo's tracing, guards and graph breaks;
    tests/test_compile.py's compiled run, shared) and its specialised packed file compiled: the same lines, the same
    artifact bytes."""
    full_dir, full_log, env = compiled_run(tmp_path_factory, "record_0323", preset_data["record_0323"], 1)
    _, packed = specialised_files(tmp_path_factory, "record_0323", run_settings("record_0323"))
    assert_same_run(packed, env, tmp_path, full_dir, "record_0323_1_c", full_log)


def test_specialised_packed_file_runs_the_fused_kernels_as_the_full_script(sample_data, tmp_path, tmp_path_factory):
    """With FUSED_MLP=1 FUSED_CE=1 under Triton's interpreter (tests/test_kernels.py's kernel run, shared): the
    specialised packed file's kernels run (not the eager fallback; Triton reads their minified source from the
    packed file's linecache entry) and give the same lines and artifact bytes."""
    needs_interpreter()
    env = {**TINY_KERNEL_RUN, **sample_data, "FUSED_MLP": "1", "FUSED_CE": "1", "TRITON_INTERPRET": "1"}
    _, packed = specialised_files(tmp_path_factory, "kernels", settings_of(env))
    full_dir = kernel_run(tmp_path_factory, sample_data)
    log = assert_same_run(packed, env, tmp_path, full_dir, KERNEL_RUN_ID, read_log(full_dir, KERNEL_RUN_ID))
    for kernel in ("mlp", "ce"):
        assert f"fused_{kernel}: triton kernel (Triton interpreter on CPU, TRITON_INTERPRET=1, float32)" in log


def test_a_specialisation_that_drops_a_taken_branch_is_caught(monkeypatch, preset_data, tmp_path, tmp_path_factory):
    """The comparison above catches a wrong specialisation: an analysis that folds EMA_ENABLED to 0 while the run has
    it on (and records it as on, so the file does not refuse to start) drops the branch the run takes, and the tiny
    run's lines differ from the full script's."""
    full_dir, full_log = eager_run(tmp_path_factory, "record_0323", preset_data["record_0323"], 1)
    honest = specialised_files(tmp_path_factory, "record_0323", run_settings("record_0323"))[0].read_text(encoding="utf-8")
    init = sp.Analysis.__init__

    def wrong(self, *args):
        init(self, *args)
        self.known_settings["ema_enabled"] = False  # the run's value is True

    monkeypatch.setattr(sp.Analysis, "__init__", wrong)
    spec = sp.specialise(SCRIPT.read_text(encoding="utf-8"), run_settings("record_0323"), str(SCRIPT))
    assert ("truth", None, True) in spec.conditions["EMA_ENABLED"] and spec.text != honest
    path = tmp_path / "train_gpt.py"
    path.write_text(spec.text, encoding="utf-8")
    env = {**preset_data["record_0323"], **PRESET_ENV["record_0323"], "PRESET": "record_0323"}
    with pytest.raises(AssertionError, match="assert \\[.*\\] == \\["):
        assert_same_run(path, env, tmp_path / "run", full_dir, "record_0323_1", full_log)
