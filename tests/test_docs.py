"""The README is what users read: every setting documented with the real default, and the test command CI
runs is the one the README gives."""
from __future__ import annotations

import re

import train_gpt as tg
from conftest import REPO, SCRIPT, TINY_ENV

README = (REPO / "README.md").read_text(encoding="utf-8")


def env_vars_read_by_script() -> set[str]:
    src = SCRIPT.read_text(encoding="utf-8")
    return set(re.findall(r'_env(?:_int_list)?\("([A-Z0-9_]+)"', src)) - TORCHRUN_VARS


# Set by torchrun, not by users.
TORCHRUN_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def readme_table() -> dict[str, str]:
    rows = {}
    for line in README.splitlines():
        m = re.match(r"^\| ([A-Z0-9_ /]+?) \| ([^|]+?) \|", line)
        if m and m.group(1) != "env":
            for name in m.group(1).split(" / "):
                rows[name.strip()] = m.group(2).strip()
    return rows


def test_every_setting_is_documented():
    missing = env_vars_read_by_script() - set(readme_table())
    assert not missing, f"README settings table lacks {sorted(missing)}"


def test_documented_numeric_defaults_are_the_real_ones(monkeypatch):
    for k in list(TINY_ENV) + ["RANK", "WORLD_SIZE", "LOCAL_RANK"]:
        monkeypatch.delenv(k, raising=False)
    for k in env_vars_read_by_script():
        monkeypatch.delenv(k, raising=False)
    h = tg.Hyperparameters()
    table = readme_table()
    split_defaults = {"BETA1": "0.9", "BETA2": "0.95", "ADAM_EPS": "1e-8"}
    checked = 0
    for name in env_vars_read_by_script():
        doc = split_defaults.get(name, table.get(name, ""))
        try:
            documented = float(doc)
        except ValueError:
            continue  # prose defaults ("random uuid4", "cuda if available, else cpu")
        actual = getattr(h, tg.Hyperparameters._attr(name))
        assert float(actual) == documented, (name, doc, actual)
        checked += 1
    assert checked > 50


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"^(python3 -m pip install -r requirements\.txt && .+)$", README, re.M)
    assert len(commands) == 2, commands
    test_command = commands[1]
    assert "pytest" in test_command
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command in ci.splitlines()
