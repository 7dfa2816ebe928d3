"""Shared code for the record tooling: log parsing, metric choice, statistics.

make_record.py, check_record.py and plot_logs.py all import this module so
that "what a log says" and "which number is the score" are decided in exactly
one place; a submission.json written by make_record therefore always passes
check_record's consistency checks.

Log format: train_gpt.py writes its own source code first, then a line of 100
'=' and the run's output. The source contains the f-string templates of the
lines we parse (e.g. ``step:{step}/{h.iterations}``), so every pattern below is
anchored at line start and demands real numbers where the template has braces;
template lines then never match and no separator detection is needed.

One file must hold exactly one run, written to the end. A rerun that appended
to an old log repeats the header (a line of 100 '=' then ``Running Python
<version>``), repeats the once-per-run lines (seed, device, sizes, final
results) and restarts the step count; a log cut off mid-write does not end
with a newline, and its last number may be cut short. ``integrity_problems``
reports both, since such a log's parsed values cannot be trusted.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

# Challenge limits (bytes of code + compressed model; wall-clock per phase).
SIZE_CAP_BYTES = 16_000_000
TIME_CAP_MS = 600_000

# The required improvement over the current record, in nats of val_loss.
SOTA_MARGIN_NATS = 0.005
SIGNIFICANCE_ALPHA = 0.01
# The audited leaderboard's rule since PR #1902 (SPEC-FRONTIER 19): a row is accepted when its seeds' mean is
# below the previous row's at one-sided Welch p < 0.25.
WELCH_ALPHA = 0.25
README_RULE = f"README rule: beat --sota-bpb by >= {SOTA_MARGIN_NATS} nats at p < {SIGNIFICANCE_ALPHA}"
WELCH_RULE = f"leaderboard rule (PR #1902): one-sided Welch t-test against the row's seeds at p < {WELCH_ALPHA}"
# A replay run (issue 40) reproduces a row when its seeds' mean is not told apart from the row's by a two-sided Welch
# t-test at p < 0.05, the usual level for "these two means differ".
REPRODUCTION_ALPHA = 0.05
REPRODUCTION_RULE = f"reproduction rule: two-sided Welch t-test at p < {REPRODUCTION_ALPHA}"

REQUIRED_SUBMISSION_KEYS = ("name", "val_bpb", "bytes_total", "blurb", "author", "github_id", "date")

# Final evaluations, best (most post-processing) first. The key is the
# --metric name; the value is the prefix of the log lines for that evaluation.
EVAL_PREFIXES = {
    "legal_ttt": "legal_ttt",
    "sliding": "final_int6_sliding_window",
    "roundtrip": "final_int6_roundtrip",
}
METRIC_PREFERENCE = ("legal_ttt", "sliding", "roundtrip")
# Evaluations that can be switched off; roundtrip always runs.
OPTIONAL_EVALS = ("sliding", "legal_ttt")

LOG_GLOB = "train_seed*.log"
# Shipped beside a packed train_gpt.py (scripts/pack/pack_code.py): the readable source it was packed from.
READABLE_CODE = "train_gpt_readable.py"
RESULTS_START = "<!-- results:start -->"
RESULTS_END = "<!-- results:end -->"

# A number as Python's format() prints it, including nan/inf after a divergence.
_NUM = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|[-+]?inf)"
# Documented fields may be followed by extra " key:value" fields.
_END = r"(?=\s|$)"


def _rx(body: str) -> re.Pattern[str]:
    return re.compile("^" + body + _END)


RX_SEED = _rx(r"seed:(\d+)")
RX_TRAIN_STEP = _rx(rf"step:(\d+)/(\d+) train_loss:{_NUM} train_time:{_NUM}ms step_avg:{_NUM}ms")
RX_VAL_STEP = _rx(rf"step:(\d+)/(\d+) val_loss:{_NUM} val_bpb:{_NUM} train_time:{_NUM}ms step_avg:{_NUM}ms")
# The records' own logs put a space after the colons (``train_time: 599672ms step: 5001/20000``).
RX_STOP_EARLY = _rx(rf"stopping_early: wallclock_cap train_time: ?{_NUM}ms step: ?(\d+)/(\d+)")
RX_PEAK_MEM = _rx(r"peak memory allocated: (\d+) MiB reserved: (\d+) MiB")
RX_POST_EMA = _rx(rf"DIAGNOSTIC post_ema val_loss:{_NUM} val_bpb:{_NUM} eval_time:{_NUM}ms")
RX_MODEL_BYTES = _rx(r"Serialized model: (\d+) bytes")
RX_CODE_BYTES = _rx(r"Code size: (\d+) bytes")
RX_QUANT_BYTES = _rx(r"Serialized model int6\+(?:lzma|brotli): (\d+) bytes")
RX_TOTAL_BYTES = _rx(r"Total submission size int6\+(?:lzma|brotli): (\d+) bytes")
RX_OVER_LIMIT = _rx(r"OVER_LIMIT total_bytes:(\d+) cap:(\d+)")
RX_TTT_FLAG = _rx(r"ttt_enabled:(0|1|True|False|true|false)")
# The diagnostic evaluations a run was set to make (DIAGNOSTIC_POST_EMA, DIAGNOSTIC_ROUNDTRIP; issue 46): a log
# saying roundtrip:0 has no final_int6_roundtrip lines, by its settings.
RX_DIAGNOSTICS = _rx(r"diagnostics: post_ema:(0|1) roundtrip:(0|1)")
RX_STRIDE_FLAG = _rx(r"eval_stride:(\d+)")
RX_DEVICE = _rx(r"device:(\S+) world_size:(\d+)")
# A run resumed from a checkpoint (RESUME) appends to its log: one more header and once-per-run lines per resume.
RX_RESUMED = _rx(r"resumed_from:(\S+) step:(\d+)")
# A replay run (issue 40: a replayed TRAIN_CLOCK and/or REPLAY_WORLD_SIZE virtual ranks) says so once, before its
# first step: the clock's text (ms:X, wall, record(...), log(PATH); it may hold spaces and parentheses), the replayed
# and the real world sizes, the micro-batches per rank, then maybe a note in parentheses. The clock is matched
# greedily, so it ends at the line's last "replay_world_size:" field (a path may hold that text; the note does not).
RX_REPLAYED = _rx(r"train_clock:(.+) replay_world_size:(\d+) world_size:(\d+) grad_accum:(\d+)")
# The first form, TRAIN_CLOCK=ms:X alone: ``train_clock:ms:50 (every time-based decision reads step x 50 ms; ...)``.
# train_gpt.py's settings dump, preset line, evaluation's end and one-line error (scripts/run/compare_runs.py, issue 63)
RX_SETTING = re.compile(r"^setting ([A-Z][A-Z0-9_]*)=(.*) \[(env|preset|default)\]$")
RX_PRESET = _rx(r"preset:(\S+)")
RX_EVAL_TOTAL = _rx(rf"evaluation_time: (?:ttt_loop:{_NUM}s )?total:{_NUM}s")
RX_ERROR = re.compile(r"^(?:error: |interrupted ).*")
RX_REPLAYED_SHORT = _rx(rf"train_clock:(ms:{_NUM})")
# The run header: train_gpt.py logs a separator line, then the interpreter's
# version (the source's template has "{sys.version}", never a digit).
RUN_SEPARATOR = "=" * 100
RX_RUN_HEADER = re.compile(r"^Running Python \d+\.\d+")
# Short final lines carry eval_time (and the stride for sliding window).
RX_EVAL_SHORT = {
    "roundtrip": _rx(rf"final_int6_roundtrip val_loss:{_NUM} val_bpb:{_NUM} eval_time:{_NUM}ms"),
    "sliding": _rx(rf"final_int6_sliding_window val_loss:{_NUM} val_bpb:{_NUM} stride:(\d+) eval_time:{_NUM}ms"),
    "legal_ttt": _rx(rf"legal_ttt val_loss:{_NUM} val_bpb:{_NUM} eval_time:{_NUM}ms"),
}
# The _exact lines carry the full-precision score.
RX_EVAL_EXACT = {
    name: _rx(rf"{prefix}_exact val_loss:{_NUM} val_bpb:{_NUM}") for name, prefix in EVAL_PREFIXES.items()
}


class RecordError(Exception):
    """A problem that stops a tool; the message is meant for the user."""


@dataclass
class Step:
    """One ``step:`` line; train lines have loss, val lines have loss and bpb."""

    kind: str  # "train" or "val"
    step: int
    total: int
    loss: float
    bpb: float | None
    train_time_ms: float
    step_avg_ms: float


@dataclass
class EvalLine:
    """A final evaluation line; eval_time/stride exist only on the short line."""

    val_loss: float
    val_bpb: float
    eval_time_ms: float | None = None
    stride: int | None = None


@dataclass
class RunLog:
    """Everything the tools need from one training log (last occurrence wins)."""

    path: Path
    seed: int | None = None
    steps: list[Step] = field(default_factory=list)
    stopped_early: bool = False
    peak_mem_mib: tuple[int, int] | None = None
    post_ema: EvalLine | None = None
    model_bytes: int | None = None
    code_bytes: int | None = None
    quant_model_bytes: int | None = None
    total_bytes: int | None = None
    over_limit: tuple[int, int] | None = None
    ttt_flag: bool | None = None
    roundtrip_flag: bool | None = None  # the diagnostics line's roundtrip (None: no such line, so required)
    eval_stride: int | None = None
    short: dict[str, EvalLine] = field(default_factory=dict)
    exact: dict[str, EvalLine] = field(default_factory=dict)
    device: str | None = None
    world_size: int | None = None
    # Integrity evidence (see integrity_problems).
    run_headers: int = 0
    once_counts: dict[str, int] = field(default_factory=dict)
    step_backwards: tuple[int, int] | None = None
    truncated: bool = False
    resumes: list[tuple[str, int]] = field(default_factory=list)  # (checkpoint, step) of each resumed_from line
    # A replay run's train_clock line (None for a run that is no replay): the clock's whole text (``ms:50``, ``wall``,
    # ``record(record_0427 seed 42)``, ``log(/a path/run.txt)``), the ranks it replays, the real ranks (its
    # world_size field; ``world_size`` above is the device line's) and the micro-batches per rank; the three ints are
    # None in the first form of the line, which names the clock only.
    train_clock: str | None = None
    replay_world_size: int | None = None
    real_world_size: int | None = None
    grad_accum: int | None = None
    stop_step: int | None = None  # the step of the stopping_early line (the records' own logs' form too)
    preset: str | None = None
    settings: dict[str, str] = field(default_factory=dict)  # NAME -> value of each `setting NAME=value [source]` line
    eval_total_s: float | None = None  # the evaluation_time line's total: the run's last line when it finished
    error: str | None = None  # the one-line error a failed run's log ends with

    @property
    def train_steps(self) -> list[Step]:
        return [s for s in self.steps if s.kind == "train"]

    @property
    def val_steps(self) -> list[Step]:
        return [s for s in self.steps if s.kind == "val"]

    @property
    def last_step(self) -> Step | None:
        return self.steps[-1] if self.steps else None

    @property
    def replayed(self) -> bool:
        """Whether the log is a replay run's (it has a train_clock line), whatever its clock."""
        return self.train_clock is not None

    @property
    def final_step(self) -> int | None:
        """The step training stopped at: the stopping_early line's, else the last step line's, else None."""
        if self.stop_step is not None:
            return self.stop_step
        return self.last_step.step if self.steps else None

    @property
    def train_time_ms(self) -> float | None:
        """Training time = train_time of the last step line (train or val)."""
        return self.last_step.train_time_ms if self.steps else None

    @property
    def eval_time_ms(self) -> float:
        """Sum of eval_time over the final evaluations present in the log."""
        return sum(e.eval_time_ms or 0.0 for e in self.short.values())

    def score(self, metric: str) -> EvalLine | None:
        """The full-precision result of one final evaluation, if logged."""
        return self.exact.get(metric)


def _num(text: str) -> float:
    return float(text)


def _count_once(log: RunLog, kind: str) -> None:
    """Count a line that one run logs exactly once."""
    log.once_counts[kind] = log.once_counts.get(kind, 0) + 1


def _add_step(log: RunLog, step: Step) -> None:
    if log.steps and log.step_backwards is None and step.step < log.steps[-1].step:
        log.step_backwards = (log.steps[-1].step, step.step)
    log.steps.append(step)


def _parse_line(log: RunLog, line: str) -> None:
    """Update ``log`` from one line; lines matching no pattern are ignored."""
    if m := RX_TRAIN_STEP.match(line):
        s, n, loss, t, avg = m.groups()
        _add_step(log, Step("train", int(s), int(n), _num(loss), None, _num(t), _num(avg)))
    elif m := RX_VAL_STEP.match(line):
        s, n, loss, bpb, t, avg = m.groups()
        _add_step(log, Step("val", int(s), int(n), _num(loss), _num(bpb), _num(t), _num(avg)))
    elif m := RX_SEED.match(line):
        log.seed = int(m.group(1))
        _count_once(log, "seed")
    elif m := RX_DEVICE.match(line):
        log.device, log.world_size = m.group(1), int(m.group(2))
        _count_once(log, "device")
    elif m := RX_RESUMED.match(line):
        log.resumes.append((m.group(1), int(m.group(2))))
    elif m := RX_REPLAYED.match(line):
        log.train_clock = m.group(1)
        log.replay_world_size, log.real_world_size, log.grad_accum = (int(g) for g in m.group(2, 3, 4))
        _count_once(log, "train_clock")
    elif m := RX_REPLAYED_SHORT.match(line):
        log.train_clock = m.group(1)
        log.replay_world_size = log.real_world_size = log.grad_accum = None
        _count_once(log, "train_clock")
    elif m := RX_SETTING.match(line):
        log.settings[m.group(1)] = m.group(2)
    elif m := RX_PRESET.match(line):
        log.preset = m.group(1)
    elif m := RX_EVAL_TOTAL.match(line):
        log.eval_total_s = _num(m.group(2))
    elif m := RX_ERROR.match(line):
        log.error = m.group(0)
    elif m := RX_STOP_EARLY.match(line):
        log.stopped_early = True
        log.stop_step = int(m.group(2))
    elif m := RX_PEAK_MEM.match(line):
        log.peak_mem_mib = (int(m.group(1)), int(m.group(2)))
    elif m := RX_POST_EMA.match(line):
        log.post_ema = EvalLine(_num(m.group(1)), _num(m.group(2)), _num(m.group(3)))
    elif m := RX_MODEL_BYTES.match(line):
        log.model_bytes = int(m.group(1))
    elif m := RX_CODE_BYTES.match(line):
        log.code_bytes = int(m.group(1))
        _count_once(log, "Code size")
    elif m := RX_QUANT_BYTES.match(line):
        log.quant_model_bytes = int(m.group(1))
        _count_once(log, "Serialized model int6+lzma")
    elif m := RX_TOTAL_BYTES.match(line):
        log.total_bytes = int(m.group(1))
        _count_once(log, "Total submission size int6+lzma")
    elif m := RX_OVER_LIMIT.match(line):
        log.over_limit = (int(m.group(1)), int(m.group(2)))
    elif m := RX_TTT_FLAG.match(line):
        log.ttt_flag = m.group(1).lower() in ("1", "true")
    elif m := RX_DIAGNOSTICS.match(line):
        log.roundtrip_flag = m.group(2) == "1"
    elif m := RX_STRIDE_FLAG.match(line):
        log.eval_stride = int(m.group(1))
    else:
        _parse_eval_line(log, line)


def _parse_eval_line(log: RunLog, line: str) -> None:
    for name, rx in RX_EVAL_EXACT.items():
        if m := rx.match(line):
            log.exact[name] = EvalLine(_num(m.group(1)), _num(m.group(2)))
            _count_once(log, EVAL_PREFIXES[name] + "_exact")
            return
    for name, rx in RX_EVAL_SHORT.items():
        if m := rx.match(line):
            g = m.groups()
            if name == "sliding":
                log.short[name] = EvalLine(_num(g[0]), _num(g[1]), _num(g[3]), int(g[2]))
            else:
                log.short[name] = EvalLine(_num(g[0]), _num(g[1]), _num(g[2]))
            _count_once(log, EVAL_PREFIXES[name])
            return


def parse_log_text(text: str, path: Path | str = "<text>") -> RunLog:
    """Parse the text of one training log."""
    log = RunLog(path=Path(path))
    log.truncated = bool(text) and not text.endswith("\n")
    previous = None
    for line in text.splitlines():
        line = line.rstrip()
        if previous == RUN_SEPARATOR and RX_RUN_HEADER.match(line):
            log.run_headers += 1
        _parse_line(log, line)
        previous = line
    return log


def parse_log(path: Path | str) -> RunLog:
    """Parse one training log file (undecodable bytes are replaced, not fatal)."""
    path = Path(path)
    return parse_log_text(path.read_text(encoding="utf-8", errors="replace"), path)


def seed_from_filename(path: Path) -> int | None:
    m = re.fullmatch(r"train_seed(\d+)\.log", path.name)
    return int(m.group(1)) if m else None


def find_logs(folder: Path) -> list[Path]:
    """The per-seed logs of a record folder, ordered by seed number."""
    paths = [p for p in Path(folder).glob(LOG_GLOB) if p.is_file()]
    return sorted(paths, key=lambda p: (seed_from_filename(p) is None, seed_from_filename(p) or 0, p.name))


def load_logs(folder: Path) -> list[RunLog]:
    """Parse every per-seed log; a seed missing from the log body comes from its name."""
    logs = [parse_log(p) for p in find_logs(folder)]
    for log in logs:
        if log.seed is None:
            log.seed = seed_from_filename(log.path)
    return logs


# ---------------------------------------------------------------------------
# Integrity and completeness


def multiple_runs_evidence(log: RunLog) -> str | None:
    """Why ``log`` looks like two or more runs in one file, or None. A resumed run's log holds one part per
    start (the header and once-per-run lines again, steps past the checkpoint repeated): that is one run."""
    parts = 1 + len(log.resumes)
    if log.run_headers > parts:
        return f"{log.run_headers} run headers ('Running Python ...' after the '=' separator)"
    repeated = [(kind, n) for kind, n in log.once_counts.items() if n > parts]
    if repeated:
        kind, n = repeated[0]
        more = f" (and {len(repeated) - 1} other once-per-run line(s))" if len(repeated) > 1 else ""
        return f"'{kind}' line logged {n} times{more}"
    if log.step_backwards is not None and not log.resumes:
        before, after = log.step_backwards
        return f"step numbers go back from step:{before} to step:{after}"
    return None


def integrity_problems(log: RunLog) -> list[str]:
    """Reasons the parsed values of ``log`` cannot be trusted at all."""
    problems = []
    evidence = multiple_runs_evidence(log)
    if evidence is not None:
        problems.append(
            f"holds more than one run: {evidence}; a rerun appended to an old log?"
            " Keep exactly one run per log"
        )
    if log.truncated:
        problems.append("does not end with a newline: the log looks truncated (cut off mid-line)")
    return problems


def resumed_note(log: RunLog) -> str | None:
    """One line for a log that resumed from a checkpoint, or None: its training was not one uninterrupted run."""
    if not log.resumes:
        return None
    where, step = log.resumes[-1]
    more = f" ({len(log.resumes)} resumes)" if len(log.resumes) > 1 else ""
    return (f"resumed from a checkpoint (resumed_from:{where} step:{step}){more}: the 10-minute track measures one "
            "uninterrupted run, so this log is not a valid 10-minute-track record run")


def replay_text(log: RunLog) -> str:
    """The clock and the worlds of a replay run's log in words, e.g. ``trained on a replay clock
    (train_clock:ms:50)`` or ``trained on the wall clock, replaying 8 ranks on 1 (replay_world_size:8 world_size:1
    grad_accum:8)``."""
    if log.train_clock == "wall":
        text = "trained on the wall clock"
    else:
        text = f"trained on a replay clock (train_clock:{log.train_clock})"
    if log.replay_world_size is not None:
        text += (f", replaying {log.replay_world_size} ranks on {log.real_world_size} (replay_world_size:"
                 f"{log.replay_world_size} world_size:{log.real_world_size} grad_accum:{log.grad_accum})")
    return text


def replayed_note(log: RunLog) -> str | None:
    """One line for a replay run's log (a train_clock line: TRAIN_CLOCK and/or REPLAY_WORLD_SIZE), or None: its
    schedule followed replayed time or its ranks were simulated, so it reproduces a run rather than being a 600 s one
    on 8 GPUs."""
    if not log.replayed:
        return None
    return (f"{replay_text(log)}: a reproduction, not a run timed by the wall clock on its own ranks, so this log is "
            "not a valid 10-minute-track record run")


def enabled_evals(log: RunLog) -> set[str]:
    """Optional evaluations this log shows were switched on.

    Evidence is either of its result lines or the config line logged at start
    (``ttt_enabled:1`` / ``eval_stride:N`` with N > 0). A run that crashed
    before its final evaluations thus still counts as needing them.
    """
    on = {name for name in OPTIONAL_EVALS if name in log.short or name in log.exact}
    if log.ttt_flag:
        on.add("legal_ttt")
    if log.eval_stride:
        on.add("sliding")
    return on


def missing_final_lines(log: RunLog, also_enabled: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Names of the required final lines absent from ``log``.

    ``also_enabled`` lets a caller demand optional evaluations that other seeds
    of the same record ran: seeds of one record share one configuration.
    """
    missing = []
    for label, value in (
        ("Serialized model int6+lzma", log.quant_model_bytes),
        ("Code size", log.code_bytes),
        ("Total submission size int6+lzma", log.total_bytes),
    ):
        if value is None:
            missing.append(label)
    required = () if log.roundtrip_flag is False else ("roundtrip",)
    for name in (*required, *sorted(enabled_evals(log) | set(also_enabled) - set(required))):
        prefix = EVAL_PREFIXES[name]
        if name not in log.short:
            missing.append(prefix)
        if name not in log.exact:
            missing.append(prefix + "_exact")
    return missing


# ---------------------------------------------------------------------------
# Scores and statistics


def choose_metric(logs: list[RunLog], requested: str | None = None) -> str:
    """The evaluation whose exact bpb is the record's score.

    Default: the most post-processed evaluation that every log has (TTT, then
    sliding window, then plain roundtrip), so that one seed lacking TTT can't
    silently mix metrics.
    """
    if not logs:
        raise RecordError("no logs to score")
    if requested is not None:
        if requested not in EVAL_PREFIXES:
            raise RecordError(f"unknown metric {requested!r}; choose from {', '.join(EVAL_PREFIXES)}")
        lacking = [log.path.name for log in logs if log.score(requested) is None]
        if lacking:
            line = EVAL_PREFIXES[requested] + "_exact"
            raise RecordError(f"metric {requested!r}: no {line} line in {', '.join(lacking)}")
        return requested
    for name in METRIC_PREFERENCE:
        if all(log.score(name) is not None for log in logs):
            return name
    raise RecordError("some logs have no final_int6_roundtrip_exact line; nothing to score")


def mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def sample_std(values: list[float]) -> float | None:
    """Sample standard deviation (n-1 denominator); None when n < 2."""
    return statistics.stdev(values) if len(values) >= 2 else None


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """Continued fraction for the incomplete beta, by the modified Lentz method.

    The fraction's terms alternate between d_{2m} = m(b-m)x / ((a+2m-1)(a+2m))
    and d_{2m+1} = -(a+m)(a+b+m)x / ((a+2m)(a+2m+1)); it converges fast for
    x < (a+1)/(a+b+2), which the caller guarantees via the symmetry
    I_x(a, b) = 1 - I_{1-x}(b, a).
    """
    tiny, eps = 1e-300, 1e-15

    def guard(v: float) -> float:
        return v if abs(v) > tiny else tiny

    c = 1.0
    d = 1.0 / guard(1.0 - (a + b) * x / (a + 1.0))
    result = d
    for m in range(1, 1000):
        even = m * (b - m) * x / ((a + 2 * m - 1.0) * (a + 2 * m))
        d = 1.0 / guard(1.0 + even * d)
        c = guard(1.0 + even / c)
        result *= d * c
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1.0))
        d = 1.0 / guard(1.0 + odd * d)
        c = guard(1.0 + odd / c)
        delta = d * c
        result *= delta
        if abs(delta - 1.0) < eps:
            return result
    raise ArithmeticError(f"incomplete beta did not converge (a={a}, b={b}, x={x})")


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) = B(x; a, b) / B(a, b) for 0 <= x <= 1 and a, b > 0."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must lie in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom.

    Uses P(|T| >= |t|) = I_{df/(df+t^2)}(df/2, 1/2), halved for one tail.
    """
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0 if t < 0 else 1.0
    tail = 0.5 * regularized_incomplete_beta(df / (df + t * t), df / 2.0, 0.5)
    return tail if t < 0 else 1.0 - tail


@dataclass
class Significance:
    """One-sided one-sample t-test that the mean beats the record by the margin."""

    test: str
    n: int
    mean: float
    std: float | None
    sota_bpb: float
    margin_nats: float
    margin_bpb: float
    threshold_bpb: float
    t: float | None
    df: int | None
    p: float | None
    alpha: float
    significant: bool
    verdict: str

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        # JSON has no inf/nan; a zero-variance sample gives an infinite t.
        if d["t"] is not None and not math.isfinite(d["t"]):
            d["t"] = str(d["t"])
        return d


def bpb_per_nat(logs: list[RunLog], metric: str) -> float:
    """Mean of bpb/val_loss over the runs: bpb = loss/ln2 * tokens/bytes is
    linear in the loss, so this ratio converts a margin in nats to bpb."""
    ratios = []
    for log in logs:
        e = log.score(metric)
        if e is None or e.val_loss == 0:
            raise RecordError(f"{log.path.name}: no usable {EVAL_PREFIXES[metric]}_exact line")
        ratios.append(e.val_bpb / e.val_loss)
    return mean(ratios)


def significance_test(
    values: list[float],
    sota_bpb: float,
    bpb_per_nat_ratio: float,
    margin_nats: float = SOTA_MARGIN_NATS,
    alpha: float = SIGNIFICANCE_ALPHA,
) -> Significance:
    """Test H0: mean >= sota - margin against H1: mean < sota - margin.

    t = (mean - (sota - margin)) / (s / sqrt(n)) with df = n - 1, and the
    p-value is the lower tail P(T <= t).
    """
    n = len(values)
    m = mean(values) if values else math.nan
    s = sample_std(values)
    margin_bpb = margin_nats * bpb_per_nat_ratio
    threshold = sota_bpb - margin_bpb
    name = "one-sample one-sided Student t-test"
    base = dict(test=name, n=n, mean=m, std=s, sota_bpb=sota_bpb, margin_nats=margin_nats,
                margin_bpb=margin_bpb, threshold_bpb=threshold, alpha=alpha)
    if n < 2:
        verdict = f"cannot run the t-test with n={n} seed(s); at least 2 are needed"
        return Significance(**base, t=None, df=None, p=None, significant=False, verdict=verdict)
    t = _t_statistic(m, s, n, threshold)
    p = student_t_cdf(t, n - 1) if not math.isnan(t) else 1.0
    significant = p < alpha
    if significant:
        verdict = f"SIGNIFICANT: mean beats {sota_bpb} by >= {margin_nats} nats ({margin_bpb:.5f} bpb) at p < {alpha}"
    else:
        verdict = f"NOT SIGNIFICANT: cannot claim mean beats {sota_bpb} by {margin_nats} nats at p < {alpha}"
    return Significance(**base, t=t, df=n - 1, p=p, significant=significant, verdict=verdict)


@dataclass
class Welch:
    """One-sided Welch t-test that a folder's mean val_bpb is below a leaderboard row's (PR #1902's rule)."""

    n: int
    mean: float
    row_n: int
    row_mean: float
    t: float | None
    df: float | None
    p: float | None
    alpha: float
    significant: bool


def _welch_t_df(values: list[float], row_values: list[float]) -> tuple[float, float] | None:
    """Welch's t = (m - m_row) / sqrt(v + v_row), v = s^2/n, and the Welch-Satterthwaite
    df = (v + v_row)^2 / (v^2/(n-1) + v_row^2/(n_row-1)); None when a side has under 2 values or neither has spread."""
    n, row_n = len(values), len(row_values)
    if n < 2 or row_n < 2:
        return None
    v, row_v = statistics.variance(values) / n, statistics.variance(row_values) / row_n
    if v + row_v == 0:
        return None
    t = (mean(values) - mean(row_values)) / math.sqrt(v + row_v)
    df = (v + row_v) ** 2 / (v * v / (n - 1) + row_v * row_v / (row_n - 1))
    return t, df


def welch_test(values: list[float], row_values: list[float], alpha: float = WELCH_ALPHA) -> Welch:
    """Test H0: mean(values) >= mean(row_values) against H1: it is lower, without assuming equal variances.

    With v = s^2/n per sample (s the n-1 sample std): t = (m - m_row) / sqrt(v + v_row), the
    Welch-Satterthwaite df = (v + v_row)^2 / (v^2/(n-1) + v_row^2/(n_row-1)) (not an integer in general), and
    p = P(T_df <= t) from student_t_cdf. Both samples need 2 values; with no spread in either the sign of the
    difference decides (p 0 or 1) and a tie is not significant.
    """
    n, row_n = len(values), len(row_values)
    m = mean(values) if values else math.nan
    row_m = mean(row_values) if row_values else math.nan
    base = dict(n=n, mean=m, row_n=row_n, row_mean=row_m, alpha=alpha)
    if n < 2 or row_n < 2:
        return Welch(**base, t=None, df=None, p=None, significant=False)
    t_df = _welch_t_df(values, row_values)
    if t_df is None:  # no spread on either side
        p = 0.0 if m < row_m else 1.0
        return Welch(**base, t=math.copysign(math.inf, m - row_m) if m != row_m else math.nan, df=None, p=p,
                     significant=p < alpha)
    t, df = t_df
    p = student_t_cdf(t, df)
    return Welch(**base, t=t, df=df, p=p, significant=p < alpha)


@dataclass
class WelchTwoSided:
    """Two-sided Welch t-test of a reproduction's seeds against a row's: H0, the two means are equal. ``missing``
    says why there is no test (then t, df and p are None)."""

    n: int
    mean: float
    row_n: int
    row_mean: float
    difference: float
    t: float | None
    df: float | None
    p: float | None
    alpha: float
    missing: str | None

    @property
    def reproduces(self) -> bool:
        """The means are not told apart: p >= alpha (False without a test)."""
        return self.p is not None and self.p >= self.alpha


def welch_two_sided(values: list[float], row_values: list[float],
                    alpha: float = REPRODUCTION_ALPHA) -> WelchTwoSided:
    """Test H0: mean(values) = mean(row_values) against H1: they differ, without assuming equal variances.

    t and df as in welch_test; p = P(|T_df| >= |t|) = 2 P(T_df <= -|t|) from student_t_cdf. No test (``missing``
    set) when a side has under 2 values, a value is not finite, or neither side has any spread: Welch's t then has
    no variance to divide by, and equal means with none would prove nothing either.
    """
    n, row_n = len(values), len(row_values)
    m = mean(values) if values else math.nan
    row_m = mean(row_values) if row_values else math.nan
    base = dict(n=n, mean=m, row_n=row_n, row_mean=row_m, difference=m - row_m, alpha=alpha)
    missing = None
    if n < 2 or row_n < 2:
        sides = [f"{what} has {k}" for what, k in (("the reproduction", n), ("the row", row_n)) if k < 2]
        missing = f"the Welch t-test needs at least 2 seeds on each side, and {' and '.join(sides)}"
    elif not all(math.isfinite(v) for v in (*values, *row_values)):
        missing = "a score is not a finite number"
    t_df = None if missing else _welch_t_df(values, row_values)
    if t_df is None:
        missing = missing or ("every seed on each side has the same score, so the Welch t-test has no variance to"
                              " work with")
        return WelchTwoSided(**base, t=None, df=None, p=None, missing=missing)
    t, df = t_df
    p = min(1.0, 2.0 * student_t_cdf(-abs(t), df))
    return WelchTwoSided(**base, t=t, df=df, p=p, missing=None)


def row_scores(row: str) -> list[float]:
    """A leaderboard row's per-seed val_bpb, from comma-separated numbers, a submission.json, or a record folder
    (its submission.json when that lists per-seed scores, as the leaderboard read them, else its
    train_seed*.log scored like make_record.py). submission.json: make_record.py's `per_seed` list or the
    records' `seed_results` object (seed -> {val_bpb}). Raises RecordError with a one-line message."""
    if re.fullmatch(r"\s*[-+.\deE]+(\s*,\s*[-+.\deE]+)*\s*,?\s*", row):
        try:
            values = [float(x) for x in row.split(",") if x.strip()]
        except ValueError:
            raise RecordError(f"{row!r}: not a list of numbers") from None
        if not all(math.isfinite(v) and v > 0 for v in values):
            raise RecordError(f"{row!r}: every score must be a positive number")
        return values
    path = Path(row)
    if path.is_dir():
        if (path / "submission.json").is_file():
            values = _submission_scores(path / "submission.json")
            if values:
                return values
        logs = load_logs(path)
        if not logs:
            raise RecordError(f"{path}: no per-seed scores (no submission.json with per_seed or seed_results,"
                              f" no {LOG_GLOB})")
        broken = [log.path.name for log in logs if integrity_problems(log)]
        if broken:
            raise RecordError(f"{path}: cannot score {', '.join(broken)} (not one complete run)")
        try:
            metric = choose_metric(logs)
        except RecordError as exc:  # name the row: the message is about its logs, not the folder checked
            raise RecordError(f"{path}: cannot score its logs: {exc}") from None
        return [log.score(metric).val_bpb for log in logs]
    if path.is_file():
        values = _submission_scores(path)
        if not values:
            raise RecordError(f"{path}: no per-seed scores (per_seed or seed_results)")
        return values
    raise RecordError(f"{row!r} is not a folder, a submission.json or comma-separated numbers")


def row_stop_steps(row: str) -> list[tuple[int | None, int]]:
    """(seed, step training stopped at) of each train_seed*.log of a row given as a record folder; [] when the row
    is not a folder, or for a log that is not one complete run or tells no step."""
    path = Path(row)
    if not path.is_dir():
        return []
    return [(log.seed, log.final_step) for log in load_logs(path)
            if log.final_step is not None and not integrity_problems(log)]


def _submission_scores(path: Path) -> list[float]:
    """Per-seed val_bpb of a submission.json ([] when it lists none)."""
    try:
        data = load_submission(path)
    except RecordError as exc:
        raise RecordError(f"{path}: {exc}") from None
    entries = data.get("per_seed")
    if not isinstance(entries, list):
        results = data.get("seed_results")
        entries = list(results.values()) if isinstance(results, dict) else []
    values = [e.get("val_bpb") if isinstance(e, dict) else None for e in entries]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
               for v in values):
        raise RecordError(f"{path}: a per-seed val_bpb is not a positive number")
    return [float(v) for v in values]


def _t_statistic(m: float, s: float, n: int, threshold: float) -> float:
    """t statistic; with zero spread the sign of the difference decides (+-inf),
    and an exact tie (0/0) is reported as nan and treated as not significant."""
    diff = m - threshold
    if s > 0:
        return diff / (s / math.sqrt(n))
    if diff == 0:
        return math.nan
    return math.copysign(math.inf, diff)


# ---------------------------------------------------------------------------
# Submission file


def describe_json(value: object) -> str:
    """A value as the JSON type and (short) value, for one-line messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (int, float)):
        text = repr(value)
        return f"number {text if len(text) <= 40 else text[:37] + '...'}"
    if isinstance(value, str):
        text = json.dumps(value if len(value) <= 40 else value[:37] + "...", ensure_ascii=False)
        return f"string {text}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def load_submission(path: Path) -> dict:
    """Read submission.json; raises RecordError with a one-line message."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecordError("file is missing") from None
    except RecursionError:
        raise RecordError("not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise RecordError(f"not valid JSON: {' '.join(str(exc).split())}") from None
    except OSError as exc:
        raise RecordError(f"cannot read the file: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise RecordError(f"top level must be a JSON object, got {describe_json(data)}")
    return data


def folder_date_and_name(folder: Path) -> tuple[str | None, str]:
    """Split a record folder name 'YYYY-MM-DD_Name' into (date, name)."""
    m = re.fullmatch(r"(\d{4}-\d{2}-\d{2})_(.+)", Path(folder).name)
    if m:
        return m.group(1), m.group(2)
    return None, Path(folder).name
