"""The specialiser's constant rules on a toy script (issue 60): each folds what the run fixes and nothing the file
cannot know, and the toy's specialised file prints what the full toy prints. The whole train_gpt.py is checked by
tests/test_specialise.py's runs; these say which rule does what, in milliseconds."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "pack"))
import specialise as sp  # noqa: E402

TOY = '''import os

MACHINE_SETTINGS = ("WORLD_SIZE",)
SPECIALISED = {}
PRESETS = {"base": {}}


class ConfigError(ValueError):
    pass


class Hyperparameters:
    def __init__(self, environ=None):
        self._environ, self._preset, self.effective = os.environ if environ is None else environ, {}, {}
        self.preset = self._env("PRESET", "base", str)
        self._preset = PRESETS[self.preset]
        self.stop_at = self._env("STOP_AT", -1)
        self.gate = self._env("GATE", "sparse", str)
        self.schedule = self._env("SCHEDULE", "", str)
        self.world_size = self._env("WORLD_SIZE", 1)
        prefix = self._env("PREFIX", "0", str)
        self.prefix_auto = prefix == "auto"

    def _env(self, name, default, kind=int):
        raw = self._environ.get(name, "") or self._preset.get(name, "")
        value = default if raw == "" else kind(raw)
        self.effective[name] = (value, "env")
        return value

    @property
    def phases(self):
        """SCHEDULE as a list."""
        return [int(x) for x in self.schedule.split(",")] if self.schedule else []


class Budget:
    def __init__(self, h):
        self.limit = h.stop_at

    def go(self, steps):
        if self.limit >= 0:
            return steps < self.limit
        return True


class Gate:
    def __init__(self, kind, width):
        self.kind, self.width = kind, width

    def apply(self, x):
        if self.kind == "sparse":
            return x * self.width
        return x + 1


def plan(h):
    if h.prefix_auto:
        return "planned"
    return "fixed"


def main():
    h = Hyperparameters()
    g = Gate(h.gate, h.world_size + 2)
    print(Budget(h).go(1), g.apply(2), plan(h), h.phases if h.phases else "none")
#EXTRA


if __name__ == "__main__":
    main()
'''


def specialised(text: str, run: dict[str, str]) -> sp.Specialised:
    return sp.specialise(text, run, "toy.py")


def output(text: str, tmp_path, env: dict[str, str]) -> str:
    path = tmp_path / "toy.py"
    path.write_text(text, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_each_rule_folds_what_the_run_fixes_and_the_file_prints_the_same(tmp_path):
    spec = specialised(TOY, {"PRESET": "base"})
    text = spec.text
    assert "< self.limit" not in text  # Budget's self.limit = h.stop_at reads as STOP_AT (-1)
    assert "x + 1" not in text and "x * self.width" in text  # Gate's kind: every construction passes h.gate
    assert "planned" not in text and "fixed" in text  # prefix = self._env("PREFIX", ...): a setting read into a local
    assert "int(x) for x" not in text and "'none')" in text  # phases returns [] once SCHEDULE is known unset
    assert ("==", "auto", False) in spec.conditions["PREFIX"] and ("truth", None, False) in spec.conditions["SCHEDULE"]
    assert ("<", 0, True) in spec.conditions["STOP_AT"] or (">=", 0, False) in spec.conditions["STOP_AT"]
    for env in ({}, {"WORLD_SIZE": "3", "STOP_AT": "-5"}):  # a machine setting and another negative stop: same code
        assert output(text, tmp_path, env) == output(TOY, tmp_path, env)


SUBCLASS = TOY.replace("\n\ndef plan(h):", "\n\nclass WideGate(Gate):\n    pass\n\n\ndef plan(h):").replace(
    "#EXTRA", "    WideGate('dense', 1)")  # a subclass reaches Gate.__init__ through its own construction
BY_TYPE = TOY.replace("#EXTRA", "    type(g)('dense', 1)")  # a construction that is no call of Gate's name


@pytest.mark.parametrize("text", [SUBCLASS, BY_TYPE], ids=["subclass", "type_call"])
def test_a_class_built_other_than_by_its_name_keeps_its_parameters(text):
    """Gate's parameters fold only while every construction is a call of its name: a subclass, or a type(obj)(...)
    call that may build it, keeps Gate.apply's other branch."""
    assert "x + 1" in specialised(text, {"PRESET": "base"}).text
    assert "x + 1" not in specialised(TOY, {"PRESET": "base"}).text


def test_an_attribute_stored_twice_is_no_alias_of_its_setting():
    """Budget's limit set from STOP_AT and, elsewhere, from the steps taken: a read of it is not the setting."""
    text = TOY.replace("        return True\n\n\nclass Gate:", "        return True\n\n    def reset(self, n):\n"
                       "        self.limit = n\n\n\nclass Gate:").replace("#EXTRA", "    Budget(h).reset(3)")
    assert "< self.limit" in specialised(text, {"PRESET": "base"}).text


def test_an_auto_prefix_is_planned(tmp_path):
    """PREFIX=auto specialises to the planning branch and records it."""
    spec = specialised(TOY, {"PRESET": "base", "PREFIX": "auto"})
    assert "planned" in spec.text and "fixed" not in spec.text
    assert ("==", "auto", True) in spec.conditions["PREFIX"]
    assert output(spec.text, tmp_path, {"PREFIX": "auto"}) == output(TOY, tmp_path, {"PREFIX": "auto"})


OFF = TOY.replace('''        self.world_size = self._env("WORLD_SIZE", 1)''', '''        self.world_size = self._env("WORLD_SIZE", 1)
        self.weight = self._env("WEIGHT", 0.0, float)
        self.rate = self._env("RATE", 0.5, float)
        assert 0 <= self.weight < 1''').replace('''

def plan(h):''', '''

class Extra:
    def __init__(self, w):
        self.w = w


class Log:
    def __init__(self):
        self.seen = []

    def note(self, x):
        self.seen.append(x)


LOG = Log()


class Model:
    def __init__(self, h):
        self.extra = Extra(h.weight) if h.weight > 0 else None
        self.scale = h.weight or h.rate

    def out(self):
        return self.scale if self.extra is None else self.extra.w


def plan(h):''').replace("#EXTRA", "    LOG.note(3)\n    print(Model(h).out())")


def test_a_float_at_zero_folds_like_a_bool_and_what_it_switched_off_goes(tmp_path):
    """WEIGHT=0.0 (a float switching a piece off): its tests fold, the piece's class, the attribute set to None, the
    chained check and the write-only LOG's call go, `h.weight or h.rate` keeps the rate's read, and `== 0.0` is the
    condition; RATE (0.5) is a value: never tested. WEIGHT=0.25 keeps everything."""
    spec = specialised(OFF, {"PRESET": "base"})
    text = spec.text
    for gone in ("class Extra", "self.extra = None", "0 <= ", "LOG", "class Log"):
        assert gone not in text, gone
    assert "self.scale = h.rate" in text
    assert spec.conditions["WEIGHT"] == [("==", 0.0, True)] and "RATE" not in spec.conditions
    assert "\n\n\n\n" not in text
    assert output(text, tmp_path, {}) == output(OFF, tmp_path, {})
    on = specialised(OFF, {"PRESET": "base", "WEIGHT": "0.25"}).text
    assert "class Extra" in on and "LOG" not in on and "WEIGHT" not in specialised(OFF, {"PRESET": "base",
                                                                                       "WEIGHT": "0.25"}).conditions


def test_a_piece_named_as_its_setting_keeps_its_test_the_naming_rule():
    """docs/frontier.md's naming rule: the attribute holding a piece named as the setting's attribute (self.weight)
    is no constant to the specialiser, so its `is None` test and the code behind it stay; named apart, they go."""
    same = specialised(OFF.replace("self.extra", "self.weight"), {"PRESET": "base"}).text
    assert "self.weight is None" in same and "self.extra" not in specialised(OFF, {"PRESET": "base"}).text


PIECES = TOY.replace('''

def plan(h):''', '''

class Part:
    def __init__(self):
        self.w = 2

    def __call__(self, x):
        return x * self.w


class Net:
    def __init__(self):
        self.parts = {"a": Part(), "b": Part()}

    def modules(self):
        return iter(self.parts.values())

    def terms(self):
        return tuple(p for p in self.modules() if hasattr(p, "term_weight"))

    def run(self, x, taps=()):
        reads = tuple(n for p in self.modules() for n in getattr(p, "reads", ()))
        for p in tuple(p for p in self.modules() if hasattr(p, "hook")):
            x = p.hook(x)
        if taps or reads:
            return x, sorted({*taps, *reads})
        return x

    def loss(self, x):
        terms = self.terms()
        return self.run(x, tuple(n for t in terms for n in t.taps))


def plan(h):''').replace("#EXTRA", "    net = Net()\n    print(net.loss(3), net.run(4), getattr(os, 'no_such_probe', None))\n#EXTRA")
PIECES_GONE = ('getattr(p, "reads"', 'hasattr(p, "hook")', "p.hook(x)", "taps or reads", "def terms", "t.taps")


def test_what_no_piece_declares_folds_away_and_the_file_prints_the_same(tmp_path):
    """Issue 71's "off is free" for layer states: an attribute nothing in the file binds (`reads`, `hook`,
    `term_weight`) is no object's, so getattr gives its default and hasattr False; tuple() of a generator that yields
    nothing is (), a loop over () goes, a method returning a known literal (Net.terms) is that literal, and a method
    parameter every call of its name gives the same literal (Net.run's taps: (), its default, from both calls) is
    that literal. Only a module of a walk (`for p in self.modules()`) is asked: a library object's probe stays."""
    text = specialised(PIECES, {"PRESET": "base"}).text
    for gone in PIECES_GONE:
        assert gone not in text, gone
    assert "getattr(os, 'no_such_probe', None)" in text
    assert output(text, tmp_path, {}) == output(PIECES, tmp_path, {})


@pytest.mark.parametrize("change, kept", [
    (("        self.w = 2\n", "        self.w, self.reads = 2, ('r',)\n"), 'getattr(p, "reads"'),  # a store of it
    (("#EXTRA", "    setattr(Part, 'hook', lambda self, x: x + 1)\n    print(net.run(5))"), "p.hook(x)"),  # a string
    (("#EXTRA", "    print(net.run(5, ('t',)))"), "sorted({*taps"),  # a call giving another value
    (("#EXTRA", "    run = net.run\n    print(run(5, ('t',)))"), "sorted({*taps"),  # a read not as a call
    (("#EXTRA", "    print(Net.run(net, 5, ('t',)))"), "sorted({*taps"),  # a call through the class
], ids=["stored", "named_in_a_string", "another_value", "read", "through_the_class"])
def test_what_the_file_may_bind_or_give_stays(tmp_path, change, kept):
    """Each way the file may give an object the attribute, or a method another value, keeps the code it decides,
    and the specialised file prints what the full one prints."""
    text = PIECES.replace(*change)
    spec = specialised(text, {"PRESET": "base"}).text
    assert kept in spec
    assert output(spec, tmp_path, {}) == output(text, tmp_path, {})
