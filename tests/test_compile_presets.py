"""The compiled path on 1 process (issue 34): every preset's tiny run compiled (COMPILE_BACKEND=eager) to its last
line within its graph plan, nothing compiled inside a timed region, and the same scores as its eager twin
(check_preset_run in tests/test_compile.py). A file of its own, apart from the graph plan's tests, so that
pytest-xdist runs the suite's longest runs on both workers."""
from __future__ import annotations

import pytest

from test_compile import PRESET_ENV, check_preset_run, preset_data  # noqa: F401 (fixture)
from test_documents import caseops_sample  # noqa: F401 (fixture)
from test_presets import caseops_run_data  # noqa: F401 (fixture)


# record_0427's run is record_0501's code with other values and without the tilt: compiled, it runs here to its last
# line within its plan, and record_0501's pair stands for its eager comparison (the suite's time, issue 34).
@pytest.mark.parametrize("preset", list(PRESET_ENV))
def test_every_preset_runs_compiled_to_its_last_line_with_the_eager_scores(preset, preset_data, tmp_path,
                                                                           tmp_path_factory):
    check_preset_run(preset, 1, preset_data[preset], tmp_path, tmp_path_factory, eager=preset != "record_0427")
