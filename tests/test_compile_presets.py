"""The compiled path on 1 process (issue 34): the presets' tiny runs compiled (COMPILE_BACKEND=eager) to their last
line within their graph plan, nothing compiled inside a timed region, and the same scores as their eager twins
(check_preset_run in tests/test_compile.py); the LoRA presets' eager artifacts evaluated again with EVAL_ONLY. A
file of its own, apart from the graph plan's tests, so that pytest-xdist runs the suite's longest runs on both
workers."""
from __future__ import annotations

import pytest

from test_compile import EVAL_ONLY_PRESETS, PRESET_ENV, check_eval_only, check_preset_run, preset_data  # noqa: F401
from test_documents import caseops_sample  # noqa: F401 (fixture)
from test_presets import caseops_run_data  # noqa: F401 (fixture)

# Two presets do not run compiled on 1 process here (issue 69: 28 s of the suite's CPU, their runs' tracing):
# - record_0501: compiled on 1 process by its preflight rehearsal (tests/test_preflight.py: every compiled function
#   within its plan, no eager call, the four timed regions compiling nothing) and on 2 processes beside its eager
#   twin (tests/test_compile_ranks.py: its lines, the plan on every rank, the scores within REL_TOL);
# - record_0427: record_0430's code without record_0430's own paths. Its values are record_0430's but for record_0430's
#   own settings and the LoRA targets (q, k, v, o, mlp, head; record_0430's k, o, mlp, head): record_0430's run below
#   compiles its paths (QUANT_GATE=1, 2 TTT phases at these shapes, as record_0427's), and record_0501's runs above the
#   q and v adapters.
COMPILED_ON_ONE = [p for p in PRESET_ENV if p not in ("record_0427", "record_0501")]


@pytest.mark.parametrize("preset", COMPILED_ON_ONE)
def test_every_preset_runs_compiled_to_its_last_line_with_the_eager_scores(preset, preset_data, tmp_path,
                                                                           tmp_path_factory):
    check_preset_run(preset, 1, preset_data[preset], tmp_path, tmp_path_factory)


@pytest.mark.parametrize("preset", EVAL_ONLY_PRESETS)
def test_eval_only_of_a_lora_presets_artifact_gives_its_runs_scores(preset, preset_data, tmp_path, tmp_path_factory):
    check_eval_only(preset, preset_data[preset], tmp_path, tmp_path_factory)
