"""The compiled path on 2 processes (issue 34): the presets' tiny runs compiled on 2 gloo ranks run to their last line,
with every rank's timed regions compiling nothing (the compile_region lines are all ranks' worst) and every compiled
function within its plan. record_0501, whose code is every other packed preset's and more (the tilt's broadcast,
LoRA TTT dealt to ranks), is also run eager on 2 ranks and compared (not with the 1-process eager run: Parallel Muon's
bf16 reduce-scatter puts 2 ranks 1.1e-5 apart from one process in record_0323's roundtrip loss, above the
compiled-vs-eager tolerance); that compilation leaves the scores as they are is otherwise the 1-process pairs' test
(tests/test_compile.py). record_0501's pair carries record_0430's own code paths (WITH_0430: progressive context, TTT
chunks by document length, AWQ-lite, the scored tail), so that one pair on 2 ranks stands for both (issue 53: a run
of its own for record_0430 cost the suite 41 s); record_0427 (record_0501's code with other values, no tilt) is left
to record_0501 on 2 ranks, and record_0409 (the layer loop's switch, which record_0501's runs make too, on the plain
loader that record_0323's run uses) to those two: the suite's time (issues 34, 36, 53). A file of its own, so that
pytest-xdist runs the two halves side by side."""
from __future__ import annotations

import pytest

from test_compile import PRESET_ENV, WITH_0430, check_preset_run, preset_data  # noqa: F401 (fixture)
from test_documents import caseops_sample  # noqa: F401 (fixture)
from test_presets import caseops_run_data  # noqa: F401 (fixture)


@pytest.mark.parametrize("preset", [p for p in PRESET_ENV if p not in ("record_0409", "record_0427", "record_0430")])
def test_every_preset_runs_compiled_on_two_processes(preset, preset_data, tmp_path, tmp_path_factory):
    check_preset_run(preset, 2, preset_data[preset], tmp_path, tmp_path_factory, eager=preset == "record_0501",
                     extra=WITH_0430 if preset == "record_0501" else None)
