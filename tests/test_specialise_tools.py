"""A specialised file's tools (issue 60): each preset's refuses a changed fixed setting in one line; the record tools
know a specialised submission; each preset's specialised size is guarded and documented. The runs that check a
specialised file against the full script are tests/test_specialise.py's (a file of their own: pytest-xdist puts
each file on one worker)."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from conftest import PACK_TOOLS, REPO, SCRIPT, derived_once
from test_specialise import PRESETS

sys.path[:0] = [str(REPO / "scripts" / "record"), str(REPO / "scripts" / "pack")]  # check_record, make_record; the rest
import check_record  # noqa: E402
import pack_code  # noqa: E402
import specialise as sp  # noqa: E402
import make_record  # noqa: E402


def specialised_module(path: Path):
    """A specialised file's definitions, loaded in this process (nothing below `if __name__ == "__main__"` runs)."""
    return sp.load_module(path.read_text(encoding="utf-8"), path)


# Per preset, a setting its file fixes, given another value: one folded to its value outright (a mode, a switch), or
# one whose folded conditions are recorded (an int tested against 0)
REFUSED = {"record_0323": ("TTT_MODE", "lora", "TTT_MODE=lora: this file is specialised to TTT_MODE=sgd"),
           "record_0409": ("NUM_LOOPS", "0", "NUM_LOOPS=0: this file is specialised to NUM_LOOPS > 0 (its run's 2)"),
           "record_0427": ("PARALLEL_MODE", "gptj", "PARALLEL_MODE=gptj: this file is specialised to PARALLEL_MODE != "
                                                    "'gptj' (its run's lanes)"),
           "record_0430": ("AWQ_LITE", "0", "AWQ_LITE=0: this file is specialised to AWQ_LITE=1"),
           "record_0501": ("NGRAM_TILT", "0", "NGRAM_TILT=0: this file is specialised to NGRAM_TILT=1")}


def preset_files(tmp_path_factory) -> Path:
    """A folder of each preset's submission file, train_gpt.py specialised to PRESET=NAME alone (readable, as
    scripts/pack/update_packed_size.py makes them), made once for the session."""
    import update_packed_size as ups

    def build(out: Path) -> None:
        for preset, text in ups.specialise_presets().items():
            (out / f"{preset}.py").write_text(text, encoding="utf-8")

    return derived_once(tmp_path_factory, "specialised_presets", (SCRIPT, *PACK_TOOLS), build)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_changed_fixed_setting_is_refused_in_one_line(preset, tmp_path_factory, sample_data):
    """Each preset's submission file (specialised to PRESET=NAME alone) refuses a fixed setting given another value,
    in one line naming the setting, its fixed value and the run the file was made for, before any work; the run's
    own values and the values that select no code (sizes, paths, rates, the seed) are accepted."""
    module = specialised_module(preset_files(tmp_path_factory) / f"{preset}.py")
    name, value, message = REFUSED[preset]
    base = {"PRESET": preset, "DATA_PATH": sample_data["DATA_PATH"]}
    module.Hyperparameters(base)
    module.Hyperparameters({**base, "MATRIX_LR": "0.031", "SEED": "7", "NUM_LAYERS": "12"})
    with pytest.raises(module.ConfigError) as err:
        module.Hyperparameters({**base, name: value})
    text = str(err.value)
    assert "\n" not in text and text.startswith(message), text
    assert f"(made for PRESET={preset}); " in text and "the full train_gpt.py runs other values" in text
    with pytest.raises(module.ConfigError, match=f"^PRESET='?record_0501x'?(: this file is specialised to PRESET=| must "
                                                 f"be ){preset}"):  # the preset's name: its PRESETS holds no other
        module.Hyperparameters({**base, "PRESET": "record_0501x"})


def test_the_record_tools_know_a_specialised_submission(tmp_path, tmp_path_factory):
    """make_record.py writes what a specialised packed file was made from into submission.json's code_specialised;
    check_record.py refuses a submission.json that says otherwise, and with --full-script derives the specialisation
    again from the full script (one line: SPECIALISED or FAIL), refusing a changed readable file or another script."""
    readable = preset_files(tmp_path_factory) / "record_0323.py"  # the default preset's submission file
    folder = tmp_path / "record"
    folder.mkdir()
    (folder / "train_gpt.py").write_text(pack_code.pack(readable.read_text(encoding="utf-8")), encoding="utf-8")
    shutil.copy(readable, folder / "train_gpt_readable.py")
    fields = make_record.code_source(folder)
    sha = hashlib.sha256(SCRIPT.read_bytes()).hexdigest()
    assert fields["code_specialised"] == {"source_sha256": sha, "run": {"PRESET": "record_0323"}}
    assert check_record.check_packed_code(folder) == []
    ok, line = check_record.check_specialisation(folder, SCRIPT)
    assert ok and line.startswith("SPECIALISED: train_gpt_readable.py is ") and line.endswith("specialised to PRESET=record_0323"), line
    other = tmp_path / "train_gpt.py"
    other.write_text(SCRIPT.read_text(encoding="utf-8") + "# changed\n", encoding="utf-8")
    ok, line = check_record.check_specialisation(folder, other)
    assert not ok and f"it was specialised from a script with sha256 {sha}, not {other}" in line
    text = readable.read_text(encoding="utf-8")
    (folder / "train_gpt_readable.py").write_text(text.replace("def rms_norm(x):", "def rms_norm(x):  # edited"),
                                                  encoding="utf-8")
    ok, line = check_record.check_specialisation(folder, SCRIPT)
    assert not ok and line.startswith("FAIL: ") and "it differs from " in line and "\n" not in line


SPECIALISED_PACKED_GUARD = {  # scripts/pack/update_packed_size.py
    "record_0323": 36_000,
    "record_0409": 37_200,
    "record_0427": 44_000,
    "record_0430": 44_700,
    "record_0501": 45_200,
}


def test_each_presets_specialised_size_is_guarded_and_documented(tmp_path_factory):
    """Each preset's file specialised to its own settings (PRESET=NAME alone): its packed size within its guard, and
    docs/submitting.md's table as scripts/pack/update_packed_size.py writes it from these measurements."""
    import update_packed_size as ups

    folder = preset_files(tmp_path_factory)

    def measure(out: Path) -> None:  # five packs: kept for the next session (conftest.derived_once)
        texts = {p: (folder / f"{p}.py").read_text(encoding="utf-8") for p in ups.PRESET_RECORDS}
        (out / "sizes.json").write_text(json.dumps(ups.specialised_sizes(texts)), encoding="utf-8")

    out = derived_once(tmp_path_factory, "specialised_sizes", (SCRIPT, *PACK_TOOLS), measure)
    sizes = {p: tuple(v) for p, v in json.loads((out / "sizes.json").read_text(encoding="utf-8")).items()}
    for preset, (lines, readable, minified, packed) in sizes.items():
        assert packed <= SPECIALISED_PACKED_GUARD[preset], (preset, packed)
    docs = (REPO / "docs" / "submitting.md").read_text(encoding="utf-8")
    table = docs[docs.index(ups.TABLE_BEGIN) + len(ups.TABLE_BEGIN):docs.index(ups.TABLE_END)]
    date = re.match(r"Measured (\S+) ", table).group(1)
    assert table == ups.sizes_table(sizes, date), "stale: python3 scripts/pack/update_packed_size.py"
    presets = (REPO / "docs" / "presets.md").read_text(encoding="utf-8")
    lines = presets[presets.index(ups.LINES_BEGIN) + len(ups.LINES_BEGIN):presets.index(ups.LINES_END)]
    assert lines == ups.lines_table(sizes, len(SCRIPT.read_text(encoding="utf-8").splitlines())), "stale: python3 scripts/pack/update_packed_size.py"

