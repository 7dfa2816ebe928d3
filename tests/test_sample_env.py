"""scripts/run/sample_env.sh derives the CPU sample run's schedule from ITERATIONS: the default 200 steps give
exactly the values the sample record was trained with, shorter runs keep the same proportions, explicit
settings win, and a malformed ITERATIONS stops with one line on stderr."""
from __future__ import annotations

import os
import subprocess

import pytest

from conftest import REPO, config_error

DERIVED = ("ITERATIONS", "WARMDOWN_ITERS", "MUON_MOMENTUM_WARMUP_STEPS", "VAL_LOSS_EVERY", "TRAIN_LOG_EVERY",
           "EMA_DECAY")
# Everything sample_env.sh sets; cleared so the developer's shell cannot leak into a case.
SET_BY_SCRIPT = DERIVED + (
    "DATA_PATH", "TOKENIZER_PATH", "DEVICE", "NUM_LAYERS", "MODEL_DIM", "NUM_HEADS", "NUM_KV_HEADS",
    "VE_LAYERS", "XSA_LAST_N", "TRAIN_SEQ_LEN", "EVAL_SEQ_LEN", "TRAIN_BATCH_TOKENS", "VAL_BATCH_SIZE",
    "WARMUP_STEPS", "MAX_WALLCLOCK_SECONDS", "TTT_CHUNK_TOKENS", "TTT_BATCH_SEQS", "GRAD_ACCUM_STEPS")


def source_env(names=DERIVED, **env: str) -> subprocess.CompletedProcess:
    """Sources the script in bash, as sample_run.sh does (set -euo pipefail), and prints the derived values."""
    base = {k: v for k, v in os.environ.items() if k not in SET_BY_SCRIPT}
    echo = " ".join(f'"${name}"' for name in names)
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source scripts/run/sample_env.sh; echo {echo}"],
                          cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=10)


def derived(**env: str) -> dict[str, str]:
    proc = source_env(**env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return dict(zip(DERIVED, proc.stdout.split()))


@pytest.mark.parametrize("env, expected", [
    # The default run: the values the sample record (records/track_non_record_16mb/...6L128) was trained with.
    ({}, ("200", "80", "100", "50", "25", "0.98")),
    ({"ITERATIONS": "200"}, ("200", "80", "100", "50", "25", "0.98")),
    # 40% warmdown, 50% momentum warmup, validation every 25%, a log line every 12.5%, EMA horizon 25%.
    ({"ITERATIONS": "50"}, ("50", "20", "25", "12", "6", "0.92")),
    # 1 - 4/10 = 0.6 is clamped up to 0.9; the integers stay >= 1.
    ({"ITERATIONS": "10"}, ("10", "4", "5", "2", "1", "0.9")),
    ({"ITERATIONS": "1"}, ("1", "1", "1", "1", "1", "0.9")),
    # Long runs: the decay stops at the record's 0.997.
    ({"ITERATIONS": "2000"}, ("2000", "800", "1000", "500", "250", "0.997")),
    ({"ITERATIONS": "300"}, ("300", "120", "150", "75", "37", "0.986667")),
    # A leading zero is decimal, not octal.
    ({"ITERATIONS": "050"}, ("50", "20", "25", "12", "6", "0.92")),
], ids=["unset", "200", "50", "10", "1", "2000", "300", "050"])
def test_schedule_follows_iterations(env, expected):
    assert derived(**env) == dict(zip(DERIVED, expected))


def test_explicit_settings_win():
    got = derived(ITERATIONS="50", WARMDOWN_ITERS="7", MUON_MOMENTUM_WARMUP_STEPS="0", VAL_LOSS_EVERY="0",
                  TRAIN_LOG_EVERY="3", EMA_DECAY="0.5")
    assert got == {"ITERATIONS": "50", "WARMDOWN_ITERS": "7", "MUON_MOMENTUM_WARMUP_STEPS": "0",
                   "VAL_LOSS_EVERY": "0", "TRAIN_LOG_EVERY": "3", "EMA_DECAY": "0.5"}
    # One explicit value leaves the others derived.
    assert derived(ITERATIONS="50", EMA_DECAY="0.99")["WARMDOWN_ITERS"] == "20"


@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5", "2e2", " 200", "1234567890"])
def test_bad_iterations_is_refused(value):
    proc = source_env(ITERATIONS=value)
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"ITERATIONS={value}" in lines[0] and "must be a whole number" in lines[0]


def test_helper_variables_do_not_leak():
    proc = subprocess.run(["bash", "-c", "source scripts/run/sample_env.sh; compgen -v _sample_ || true"],
                          cwd=REPO, env={k: v for k, v in os.environ.items() if k not in SET_BY_SCRIPT},
                          capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def sample_settings(**env: str) -> dict[str, str]:
    """Every variable the script sets, as a shell sourcing it sees them."""
    proc = source_env(SET_BY_SCRIPT, **env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return dict(zip(SET_BY_SCRIPT, proc.stdout.split()))


def test_the_sample_takes_one_micro_step_a_step():
    """Issue 53: the sample's whole batch in one micro-step (the fewest: TRAIN_BATCH_TOKENS need only split into
    sequences), where the record's split is 8 over the ranks; an explicit GRAD_ACCUM_STEPS wins. That a run's start
    says so (a `grad_accum:` line), and a run at the record's split says nothing: tests/test_compile.py's
    check_preset_run, on runs with and without GRAD_ACCUM_STEPS."""
    import train_gpt as tg

    sample = sample_settings()
    assert sample["GRAD_ACCUM_STEPS"] == "1" and sample_settings(GRAD_ACCUM_STEPS="8")["GRAD_ACCUM_STEPS"] == "8"
    h = tg.Hyperparameters(sample)
    assert (h.grad_accum_steps, h.record_grad_accum_steps, h.micro_steps) == (1, 8, 1)
    assert h.local_tokens == h.train_batch_tokens == 8192
    assert tg.Hyperparameters({**sample, "GRAD_ACCUM_STEPS": "0"}).grad_accum_steps == 8  # 0: the record's split
    assert tg.Hyperparameters({**sample, "GRAD_ACCUM_STEPS": "0", "WORLD_SIZE": "2"}).grad_accum_steps == 4
    assert tg.Hyperparameters({}).grad_accum_steps == 8  # the default run keeps the record's


@pytest.mark.parametrize("value, fragment", [
    ("-1", "GRAD_ACCUM_STEPS=-1 must be >= 0"),
    ("x", "GRAD_ACCUM_STEPS='x' is not a valid int"),
    ("1.5", "GRAD_ACCUM_STEPS='1.5' is not a valid int"),
    ("3", "TRAIN_BATCH_TOKENS=8192 must split into whole sequences of TRAIN_SEQ_LEN=256 per rank and micro-step"),
])
def test_a_bad_grad_accum_steps_is_one_line(value, fragment):
    assert fragment in config_error({**sample_settings(), "GRAD_ACCUM_STEPS": value})
