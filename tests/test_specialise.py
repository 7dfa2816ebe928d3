"""A submission carries only its run's code (issue 60): train_gpt.py specialised to one run (scripts/specialise.py,
`scripts/pack_code.py --for`) runs as the full script does with the same settings: the same loss and score lines
and the same artifact bytes, readable and packed, for every preset; a changed fixed setting is refused in one line;
a specialisation that drops a branch the run takes is caught by the same comparison."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

import launcher
import train_gpt as tg
from conftest import REPO, SCRIPT, clean_environ, computed_once, read_log, run_file, shared_folder
from test_compile import PRESET_ENV, eager_run, preset_data  # noqa: F401 (fixture)
from test_documents import caseops_sample  # noqa: F401 (fixture)
from test_presets import caseops_run_data  # noqa: F401 (fixture)

sys.path.insert(0, str(REPO / "scripts"))
import pack_code as pc  # noqa: E402
import specialise as sp  # noqa: E402

PRESETS = tuple(PRESET_ENV)
# what the file reads from the machine at run time, never given to the specialiser
RUNTIME_ONLY = set(tg.MACHINE_SETTINGS) | {"DATA_PATH", "TOKENIZER_PATH"}


def result_lines(log: str) -> list[str]:
    """The run's loss and score lines without their timings, and its artifact's size lines."""
    out = []
    for line in log.splitlines():
        if re.match(r"^step:\d+/\d+ (train|val)_loss:", line):
            out.append(" ".join(f for f in line.split() if not f.startswith(("train_time:", "step_avg:",
                                                                              "data_wait_ms:"))))
        elif re.match(r"^(\w+_exact|DIAGNOSTIC post_ema|Serialized model)", line):
            out.append(re.sub(r" eval_time:\S+", "", line))
    return out


def run_settings(preset: str) -> dict[str, str]:
    """The tiny run's settings that the specialiser fixes code by (PRESET_ENV's, as its eager run has them)."""
    env = {**PRESET_ENV[preset], "PRESET": preset}
    return {k: v for k, v in env.items() if k not in RUNTIME_ONLY}


def specialised_files(tmp_path_factory, preset: str) -> tuple[Path, Path]:
    """(readable, packed) train_gpt.py of the preset's tiny run, made once for the session."""
    def build(out: Path) -> None:
        spec = sp.specialise(SCRIPT.read_text(encoding="utf-8"), run_settings(preset), str(SCRIPT))
        (out / "readable").mkdir()
        (out / "packed").mkdir()
        (out / "readable" / "train_gpt.py").write_text(spec.text, encoding="utf-8")
        (out / "packed" / "train_gpt.py").write_text(pc.pack(spec.text), encoding="utf-8")

    key = __import__("hashlib").sha256(SCRIPT.read_bytes() + repr(run_settings(preset)).encode()).hexdigest()[:12]
    folder = computed_once(shared_folder(tmp_path_factory) / f"specialised_{preset}_{key}", build)
    return folder / "readable" / "train_gpt.py", folder / "packed" / "train_gpt.py"


def run_file_in(path: Path, env: dict[str, str], cwd: Path, run_id: str):
    cwd.mkdir(parents=True, exist_ok=True)
    full = {**clean_environ(), **env, "RUN_ID": run_id, "OMP_NUM_THREADS": "1", "COMPILE": "0"}
    return launcher.run([path], full, cwd, timeout=600)


@pytest.mark.parametrize("preset", PRESETS)
def test_specialised_file_runs_as_the_full_script(preset, preset_data, tmp_path, tmp_path_factory):
    """The preset's tiny run (tests/test_compile.py's eager run, shared) and its specialised file, readable and
    packed, with the same settings: the same loss and score lines, the same artifact bytes; the specialised log says
    it is one and from which source."""
    full_dir, full_log = eager_run(tmp_path_factory, preset, preset_data[preset], 1)
    readable, packed = specialised_files(tmp_path_factory, preset)
    env = {**preset_data[preset], **PRESET_ENV[preset], "PRESET": preset}
    want = result_lines(full_log)
    assert sum(" train_loss:" in line for line in want) >= 2 and any("_exact " in line for line in want)
    for kind, path in (("readable", readable), ("packed", packed)):
        proc = run_file_in(path, env, tmp_path / kind, kind)
        assert proc.returncode == 0, proc.stderr[-3000:]
        log = read_log(tmp_path / kind, kind)
        assert result_lines(log) == want, kind
        assert run_file(tmp_path / kind, kind).read_bytes() == run_file(full_dir, f"{preset}_1").read_bytes(), kind
        sha = __import__("hashlib").sha256(SCRIPT.read_bytes()).hexdigest()
        assert re.search(rf"^specialised: from train_gpt\.py sha256:{sha} for PRESET={preset} ", log, re.M), kind
