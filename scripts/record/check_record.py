#!/usr/bin/env python3
"""Check a record folder against the challenge's rules before opening a PR.

Usage: check_record.py FOLDER [--track 10min|non-record] [--sota-bpb X] [--against ROW] [--full-script TRAIN_GPT]

Every problem found is printed as one "FAIL: <file>: <problem>" line (never a
traceback) and the exit status is 1. Checked:

- at least one train_seed*.log; each log holds exactly one run (one
  "Running Python" header after the '=' separator, each once-per-run line
  such as seed, device, sizes and final results logged once, step numbers
  never going back) and ends with a newline (a log cut mid-line may hold a
  cut-short score, so it is refused as truncated);
- every log has all final lines (the sliding-window and TTT pairs only when
  that evaluation was enabled in any of the folder's logs) and a seed line
  that agrees with its file name;
- total submission size <= 16,000,000 bytes and no OVER_LIMIT line;
- train_gpt.py present, parseable as Python 3.10, and exactly as many bytes
  as every log's "Code size";
- if train_gpt.py is packed (scripts/pack/pack_code.py; run_seeds.sh with
  PACK_CODE=1): its payload decodes (nothing is executed) and parses as
  Python 3.10, train_gpt_readable.py is present, its sha256 is
  submission.json's code_source_sha256 (and code_packed is true), and
  minify(train_gpt_readable.py) (local renaming included, re-derived from
  that source) is exactly the payload, so the readable file is the code that
  ran; a file in the older LZMA2 + Base85 format is refused with one line
  (repack it); a readable source specialised to its run (scripts/pack/specialise.py,
  run_seeds.sh PACK_CODE=1) must be what submission.json's code_specialised says,
  and with --full-script TRAIN_GPT the specialisation is derived again from that
  full script for the run it records and compared (one SPECIALISED: or FAIL: line);
- submission.json is a JSON object whose fields have the types make_record.py
  writes (required: name, blurb, author, github_id non-empty strings; date
  YYYY-MM-DD; val_bpb a positive number; bytes_total a positive integer;
  optional: val_bpb_metric, val_bpb_std, seeds, per_seed, significance), and
  whose val_bpb, val_bpb_std, bytes_total, seeds and per_seed agree with the
  logs (same scoring rule as make_record.py); README.md present;
- 10-minute track only (8xH100): every log's "device:" line shows a CUDA
  device and world_size:8, and training and evaluation each took <= 600 s.

When nothing fails:

- non-record track: prints "OK: <summary>" and exits 0. With --sota-bpb it
  also prints the SOTA comparison, for information only.
- 10-minute track: a well-formed folder is not enough; a record must beat the
  current SOTA by at least 0.005 nats at p < 0.01 (the one-sided t-test of
  recordlib.significance_test, as in make_record.py). With --sota-bpb X it
  prints "OK: <summary>" and "RECORD: ..." and exits 0 when the folder beats
  X, else "WELL-FORMED: <summary>" and "NOT A RECORD: ..." and exits 1.
  Without --sota-bpb it prints "WELL-FORMED: <summary>" and a "NOT CHECKED"
  line asking for --sota-bpb or --against, and exits 1: exit 0 on this track
  always means "a valid record".
- --against ROW (the audited leaderboard's rule since PR #1902): the folder's
  per-seed scores against the previous row's (a record folder, its
  submission.json, or comma-separated numbers), one-sided Welch t-test at
  p < 0.25 (recordlib.welch_test). On the 10-minute track this rule then
  decides the verdict and the exit status; the README's rule, when
  --sota-bpb is also given, is printed as information. Every verdict line
  ends with the rule it applied, in square brackets.
- replay runs (issue 40: a "train_clock:" line, from TRAIN_CLOCK and/or
  REPLAY_WORLD_SIZE) reproduce a run: each such log is refused on the
  10-minute track, and a folder mixing replayed and wall-clock logs is one
  FAIL line. Elsewhere, with --against ROW, a folder of replayed logs is
  checked as a reproduction of ROW: a two-sided Welch t-test of the seeds'
  scores against the row's (recordlib.welch_two_sided) prints "REPRODUCES:"
  (p >= 0.05, exit 0) or "DOES NOT REPRODUCE:" (p < 0.05, exit 1), or one
  "NOT CHECKED:" line saying what the test lacks (exit 1); then, for
  information, the step each seed stopped at against the row's logs'.
  Without --against it is checked as any non-record folder.
"""
from __future__ import annotations

import argparse
import ast
import datetime as dt
import hashlib
import math
import re
import sys
from pathlib import Path
from typing import Callable

# recordlib beside this file; pack_code and specialise in scripts/pack/
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "pack")]
import pack_code  # noqa: E402
import specialise  # noqa: E402
import recordlib as rl  # noqa: E402  (needs the paths above)

VAL_BPB_TOLERANCE = 1e-6
TRACK_10MIN_DIR = "track_10min_16mb"
# The 10-minute track runs on one node of 8 GPUs.
REQUIRED_WORLD_SIZE = 8

Problem = tuple[Path, str]


def sota_bpb_arg(text: str) -> float:
    """argparse type: a finite positive bpb."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="record folder, e.g. records/track_10min_16mb/2025-11-21_MyRun")
    p.add_argument(
        "--track",
        choices=("10min", "non-record"),
        help=f"rules to apply (default: 10min if the parent folder is {TRACK_10MIN_DIR}, else non-record;"
        " only the 10min track has time and hardware limits and needs a SOTA verdict)",
    )
    p.add_argument(
        "--sota-bpb",
        type=sota_bpb_arg,
        help="current record's val_bpb; the 10min track passes only if the folder beats it by"
        f" >= {rl.SOTA_MARGIN_NATS} nats at p < {rl.SIGNIFICANCE_ALPHA} (required there for exit 0)",
    )
    p.add_argument(
        "--against",
        metavar="ROW",
        help="the previous leaderboard row's per-seed val_bpb: a record folder (its submission.json's per-seed"
        " scores, else its logs), a submission.json, or comma-separated numbers; applies the leaderboard's rule"
        f" (one-sided Welch p < {rl.WELCH_ALPHA}, PR #1902) instead of the README's; for a folder of replay runs,"
        f" the reproduction check (two-sided Welch p < {rl.REPRODUCTION_ALPHA} means it does not reproduce ROW)",
    )
    p.add_argument(
        "--full-script",
        type=Path,
        metavar="TRAIN_GPT",
        help="the full train_gpt.py a specialised submission was made from: re-derives the specialisation to the"
        " run its readable source records and says in one line whether the folder's code is it",
    )
    return p


def infer_track(folder: Path) -> str:
    return "10min" if folder.resolve().parent.name == TRACK_10MIN_DIR else "non-record"


# ---------------------------------------------------------------------------
# Per-log checks


def check_log(log: rl.RunLog, folder_evals: set[str], track: str, code_size: int | None) -> list[Problem]:
    """Problems with one seed's log; code_size is train_gpt.py's size if readable.

    A log holding two runs or cut off mid-line gets only that verdict: its
    other values are unreliable and would add misleading lines.
    """
    p = log.path
    broken = rl.integrity_problems(log)
    if broken:
        return [(p, msg) for msg in broken]
    missing = rl.missing_final_lines(log, folder_evals)
    problems: list[Problem] = [(p, f"missing final line '{name}'") for name in missing]
    file_seed = rl.seed_from_filename(p)
    if file_seed is not None and log.seed is not None and file_seed != log.seed:
        problems.append((p, f"log says seed:{log.seed} but the file name says seed {file_seed}"))
    problems += check_size(log)
    if track == "10min":
        for note in (rl.resumed_note(log), rl.replayed_note(log)):
            if note:
                problems.append((p, note))
        problems += check_hardware(log)
        problems += check_times(log)
    if code_size is not None and log.code_bytes is not None and log.code_bytes != code_size:
        problems.append((p, f"Code size {log.code_bytes} bytes logged but train_gpt.py is {code_size} bytes"))
    return problems


def check_size(log: rl.RunLog) -> list[Problem]:
    problems = []
    if log.over_limit is not None:
        total, cap = log.over_limit
        problems.append((log.path, f"OVER_LIMIT line: total_bytes {total} over cap {cap}"))
    if log.total_bytes is not None and log.total_bytes > rl.SIZE_CAP_BYTES:
        problems.append((log.path, f"total submission size {log.total_bytes} bytes exceeds {rl.SIZE_CAP_BYTES}"))
    return problems


def check_hardware(log: rl.RunLog) -> list[Problem]:
    """10-minute track: the run must have used 8 CUDA GPUs (8xH100)."""
    need = f"the 10-minute track requires 8xH100 (device:cuda world_size:{REQUIRED_WORLD_SIZE})"
    if log.device is None or log.world_size is None:
        return [(log.path, f"no 'device:... world_size:N' line; cannot tell the hardware, and {need}")]
    on_cuda = re.fullmatch(r"cuda(:\d+)?", log.device) is not None
    if on_cuda and log.world_size == REQUIRED_WORLD_SIZE:
        return []
    return [(log.path, f"ran on device:{log.device} world_size:{log.world_size}, but {need}")]


def check_times(log: rl.RunLog) -> list[Problem]:
    """10-minute track: training and evaluation are each capped at 600 s."""
    problems = []
    if log.train_time_ms is None:
        problems.append((log.path, "no step lines; cannot tell the training time"))
    elif log.train_time_ms > rl.TIME_CAP_MS:
        problems.append((log.path, f"training time {log.train_time_ms:.0f} ms exceeds {rl.TIME_CAP_MS} ms"))
    if log.eval_time_ms > rl.TIME_CAP_MS:
        problems.append((log.path, f"evaluation time {log.eval_time_ms:.0f} ms exceeds {rl.TIME_CAP_MS} ms"))
    return problems


# ---------------------------------------------------------------------------
# Folder files


def check_code(path: Path) -> tuple[int | None, list[Problem]]:
    """Size of train_gpt.py in bytes (None if unreadable) and its problems."""
    if not path.is_file():
        return None, [(path, "file is missing")]
    try:
        src = path.read_bytes()
    except OSError as exc:
        return None, [(path, f"cannot read the file: {exc.strerror or exc}")]
    try:
        ast.parse(src, filename=str(path), feature_version=(3, 10))
    except SyntaxError as exc:
        return len(src), [(path, f"does not parse as Python 3.10: {exc.msg} (line {exc.lineno})")]
    except ValueError as exc:  # null bytes, on Pythons before 3.12
        return len(src), [(path, f"does not parse as Python 3.10: {exc}")]
    return len(src), []


def check_packed_code(folder: Path) -> list[Problem]:
    """Problems of a packed train_gpt.py and its readable source (none for a readable train_gpt.py)."""
    code, readable, sub = folder / "train_gpt.py", folder / rl.READABLE_CODE, folder / "submission.json"
    try:
        text = code.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):  # check_code reports what matters
        return []
    try:
        data = rl.load_submission(sub)
    except rl.RecordError:  # check_submission reports it
        data = None
    if not pack_code.is_packed(text):
        if text.startswith(pack_code.WRAPPER_HEAD.split("\n")[0] + "\n"):
            return [(code, "starts like a packed file but is not the exact wrapper scripts/pack/pack_code.py"
                           " writes; repack it")]
        if data is not None and data.get("code_packed") is True:
            return [(sub, "field 'code_packed' is true but train_gpt.py is not a packed file")]
        return []
    try:
        payload = pack_code.unpack(text)
    except pack_code.PackError as exc:
        return [(code, f"packed, but {exc}")]
    problems: list[Problem] = []
    try:
        ast.parse(payload, feature_version=(3, 10))
    except SyntaxError as exc:
        problems.append((code, f"packed code does not parse as Python 3.10: {exc.msg} (line {exc.lineno})"))
    except ValueError as exc:
        problems.append((code, f"packed code does not parse as Python 3.10: {exc}"))
    if not readable.is_file():
        problems.append((readable, "file is missing; a packed train_gpt.py must ship with the readable source it"
                                   " was packed from"))
        return problems
    source = readable.read_bytes()
    digest = hashlib.sha256(source).hexdigest()
    if data is not None:
        if data.get("code_packed") is not True:
            problems.append((sub, "field 'code_packed' must be true: train_gpt.py is packed"))
        recorded = data.get("code_source_sha256")
        if recorded is None:
            problems.append((sub, f"missing field 'code_source_sha256' (sha256 of {rl.READABLE_CODE}, which"
                                  " make_record.py writes for a packed train_gpt.py)"))
        elif isinstance(recorded, str) and recorded != digest:
            problems.append((sub, f"code_source_sha256 {recorded} is not the sha256 of {rl.READABLE_CODE}"
                                  f" ({digest})"))
    try:
        minified = pack_code.minify(source.decode("utf-8"))
    except UnicodeDecodeError:
        return problems + [(readable, "not UTF-8 text")]
    except pack_code.PackError as exc:
        return problems + [(readable, f"cannot be minified: {exc}")]
    if minified != payload:
        problems.append((code, f"its packed code is not minify({rl.READABLE_CODE}): it was not packed from that"
                               " source (or by another version of scripts/pack/pack_code.py)"))
    record = specialise.recorded(source.decode("utf-8"))
    if data is not None and record:
        claimed = data.get("code_specialised")
        if claimed != {"source_sha256": record.get("source_sha256"), "run": record.get("run")}:
            problems.append((sub, f"code_specialised must be what {rl.READABLE_CODE} records (its SPECIALISED: "
                                  f"source_sha256 {record.get('source_sha256')}, run {record.get('run')}): "
                                  "make_record.py writes it"))
    elif data is not None and data.get("code_specialised") is not None:
        problems.append((sub, f"code_specialised is set but {rl.READABLE_CODE} is not a specialised file"))
    return problems


def check_specialisation(folder: Path, full: Path) -> tuple[bool, str]:
    """--full-script: whether the folder's readable code is `full` specialised to the run it records."""
    readable = folder / rl.READABLE_CODE
    if not readable.is_file():
        return False, f"FAIL: {readable}: file is missing (a specialised submission ships its readable source)"
    try:
        full_text = full.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return False, f"FAIL: {full}: cannot be read ({exc})"
    ok, message = specialise.same_specialisation(full_text, readable.read_text(encoding="utf-8"), str(full))
    return ok, (f"SPECIALISED: {rl.READABLE_CODE} is {message}" if ok else f"FAIL: {readable}: {message}")


# submission.json fields: one predicate and the words for what it accepts.


def is_number(v: object) -> bool:
    """A JSON number within float range; bool is an int subclass in Python, so
    excluded, and an integer too long for a float would overflow arithmetic."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def valid_date(text: str) -> bool:
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
        return False
    try:
        dt.date.fromisoformat(text)
    except ValueError:
        return False
    return True


Rule = tuple[Callable[[object], bool], str]
NONEMPTY_STRING: Rule = (lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string")
POSITIVE_NUMBER: Rule = (lambda v: is_number(v) and v > 0, "a positive number")
POSITIVE_INT: Rule = (lambda v: is_int(v) and v > 0, "a positive integer")
SEED_INT: Rule = (lambda v: is_int(v) and v >= 0, "a non-negative integer")
NONNEG_NUMBER_OR_NULL: Rule = (lambda v: v is None or (is_number(v) and v >= 0), "a non-negative number or null")
NONNEG_INT_OR_NULL: Rule = (lambda v: v is None or (is_int(v) and v >= 0), "a non-negative integer or null")
PROBABILITY_OR_NULL: Rule = (lambda v: v is None or (is_number(v) and 0 <= v <= 1), "a number in [0, 1] or null")
BOOLEAN: Rule = (lambda v: isinstance(v, bool), "true or false")
DATE: Rule = (lambda v: isinstance(v, str) and valid_date(v), "YYYY-MM-DD")
SHA256: Rule = (lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None,
                "64 lowercase hex digits")
SPECIALISATION: Rule = (lambda v: isinstance(v, dict) and set(v) == {"source_sha256", "run"} and SHA256[0](
    v["source_sha256"]) and isinstance(v["run"], dict) and all(isinstance(k, str) and isinstance(x, str)
                                                              for k, x in v["run"].items()),
                        "an object {source_sha256: the full train_gpt.py's sha256, run: {setting: value}}")
METRIC: Rule = (lambda v: isinstance(v, str) and v in rl.EVAL_PREFIXES, "one of " + ", ".join(rl.EVAL_PREFIXES))

# (field, required, rule) in the order make_record.py writes them.
TOP_FIELDS: tuple[tuple[str, bool, Rule], ...] = (
    ("name", True, NONEMPTY_STRING),
    ("val_bpb", True, POSITIVE_NUMBER),
    ("bytes_total", True, POSITIVE_INT),
    ("blurb", True, NONEMPTY_STRING),
    ("author", True, NONEMPTY_STRING),
    ("github_id", True, NONEMPTY_STRING),
    ("date", True, DATE),
    ("val_bpb_metric", False, METRIC),
    ("val_bpb_std", False, NONNEG_NUMBER_OR_NULL),
    ("code_packed", False, BOOLEAN),
    ("code_source_sha256", False, SHA256),
    ("code_specialised", False, SPECIALISATION),
)
PER_SEED_FIELDS: tuple[tuple[str, bool, Rule], ...] = (
    ("seed", True, SEED_INT),
    ("val_bpb", True, POSITIVE_NUMBER),
    ("val_loss", False, POSITIVE_NUMBER),
    ("bytes_total", False, POSITIVE_INT),
    ("steps", False, NONNEG_INT_OR_NULL),
    ("train_time_ms", False, NONNEG_NUMBER_OR_NULL),
    ("eval_time_ms", False, NONNEG_NUMBER_OR_NULL),
)
SIGNIFICANCE_FIELDS: tuple[tuple[str, bool, Rule], ...] = (
    ("sota_bpb", True, POSITIVE_NUMBER),
    ("significant", True, BOOLEAN),
    ("p", False, PROBABILITY_OR_NULL),
)
assert {k for k, required, _ in TOP_FIELDS if required} == set(rl.REQUIRED_SUBMISSION_KEYS)


def field_problems(obj: dict, fields: tuple[tuple[str, bool, Rule], ...], prefix: str = "") -> list[str]:
    problems = []
    for key, required, (ok, expected) in fields:
        if key not in obj:
            if required:
                problems.append(f"missing field '{prefix}{key}'")
        elif not ok(obj[key]):
            problems.append(f"field '{prefix}{key}' must be {expected}, got {rl.describe_json(obj[key])}")
    return problems


def submission_type_problems(data: dict) -> list[str]:
    """Every field make_record.py writes has its type (extra fields are free)."""
    problems = field_problems(data, TOP_FIELDS)
    if "seeds" in data:
        seeds = data["seeds"]
        if not isinstance(seeds, list):
            problems.append(f"field 'seeds' must be an array of integers, got {rl.describe_json(seeds)}")
        else:
            ok, expected = SEED_INT
            problems += [
                f"field 'seeds[{i}]' must be {expected}, got {rl.describe_json(s)}"
                for i, s in enumerate(seeds) if not ok(s)
            ]
    if "per_seed" in data:
        entries = data["per_seed"]
        if not isinstance(entries, list):
            problems.append(f"field 'per_seed' must be an array of objects, got {rl.describe_json(entries)}")
        else:
            for i, entry in enumerate(entries):
                if isinstance(entry, dict):
                    problems += field_problems(entry, PER_SEED_FIELDS, f"per_seed[{i}].")
                else:
                    problems.append(f"field 'per_seed[{i}]' must be an object, got {rl.describe_json(entry)}")
    if "significance" in data:
        sig = data["significance"]
        if isinstance(sig, dict):
            problems += field_problems(sig, SIGNIFICANCE_FIELDS, "significance.")
        else:
            problems.append(f"field 'significance' must be an object, got {rl.describe_json(sig)}")
    return problems


def check_submission(path: Path, logs: list[rl.RunLog], logs_usable: bool) -> list[Problem]:
    try:
        data = rl.load_submission(path)
    except rl.RecordError as exc:
        return [(path, str(exc))]
    type_problems = submission_type_problems(data)
    problems = [(path, msg) for msg in type_problems]
    if logs_usable:
        problems += [(path, msg) for msg in submission_value_problems(data, logs)]
    return problems


def submission_value_problems(data: dict, logs: list[rl.RunLog]) -> list[str]:
    """Fields that have the right type must agree with the logs."""
    problems = []
    try:
        metric = submission_metric(data, logs)
    except rl.RecordError as exc:
        return [f"cannot check val_bpb: {exc}"]
    scores = [log.score(metric).val_bpb for log in logs]
    expected = rl.mean(scores)
    line = rl.EVAL_PREFIXES[metric] + "_exact"
    v = data.get("val_bpb")
    if POSITIVE_NUMBER[0](v) and not abs(v - expected) <= VAL_BPB_TOLERANCE:
        problems.append(f"val_bpb {v} != mean {line} of the logs {expected:.8f}")
    if "val_bpb_std" in data and NONNEG_NUMBER_OR_NULL[0](data["val_bpb_std"]):
        problems += std_problems(data["val_bpb_std"], rl.sample_std(scores), line)
    totals = [log.total_bytes for log in logs if log.total_bytes is not None]
    b = data.get("bytes_total")
    if totals and POSITIVE_INT[0](b) and b != max(totals):
        problems.append(f"bytes_total {b} != max logged total submission size {max(totals)}")
    log_seeds = sorted(log.seed for log in logs if log.seed is not None)
    seeds = data.get("seeds")
    if isinstance(seeds, list) and all(SEED_INT[0](s) for s in seeds) and sorted(seeds) != log_seeds:
        problems.append(f"seeds {seeds} do not match the logs' seeds {log_seeds}")
    entries = data.get("per_seed")
    if isinstance(entries, list) and all(isinstance(e, dict) and not field_problems(e, PER_SEED_FIELDS)
                                         for e in entries):
        problems += per_seed_problems(entries, logs, metric)
    return problems


def std_problems(std: float | None, expected: float | None, line: str) -> list[str]:
    if expected is None:
        return [] if std is None else [f"val_bpb_std {std} given but one seed has no sample std (expected null)"]
    if std is None or not abs(std - expected) <= VAL_BPB_TOLERANCE:
        return [f"val_bpb_std {std} != sample std of {line} over the logs {expected:.8f}"]
    return []


def per_seed_problems(entries: list[dict], logs: list[rl.RunLog], metric: str) -> list[str]:
    by_seed = {log.seed: log for log in logs}
    listed = sorted(e["seed"] for e in entries)
    if listed != sorted(s for s in by_seed if s is not None):
        return [f"per_seed lists seeds {listed} but the logs have seeds {sorted(s for s in by_seed if s is not None)}"]
    problems = []
    for i, entry in enumerate(entries):
        score = by_seed[entry["seed"]].score(metric).val_bpb
        if not abs(entry["val_bpb"] - score) <= VAL_BPB_TOLERANCE:
            problems.append(f"per_seed[{i}].val_bpb {entry['val_bpb']} != {rl.EVAL_PREFIXES[metric]}_exact"
                            f" {score:.8f} of seed {entry['seed']}'s log")
    return problems


def submission_metric(data: dict, logs: list[rl.RunLog]) -> str:
    """The metric submission.json names (as make_record writes it), else the default rule."""
    named = data.get("val_bpb_metric")
    return rl.choose_metric(logs, named if METRIC[0](named) else None)


# ---------------------------------------------------------------------------


def find_problems(folder: Path, track: str) -> tuple[list[rl.RunLog], list[Problem]]:
    if not folder.is_dir():
        return [], [(folder, "not a directory")]
    logs = rl.load_logs(folder)
    code_size, problems = check_code(folder / "train_gpt.py")
    problems += check_packed_code(folder)
    if not logs:
        problems.insert(0, (folder, f"no {rl.LOG_GLOB} files"))
    folder_evals = set().union(*(rl.enabled_evals(log) for log in logs)) if logs else set()
    for log in logs:
        problems += check_log(log, folder_evals, track, code_size)
    problems += check_replay_mix(folder, logs)
    if logs:
        usable = not any(rl.integrity_problems(log) for log in logs)
        problems += check_submission(folder / "submission.json", logs, usable)
    elif not (folder / "submission.json").is_file():
        problems.append((folder / "submission.json", "file is missing"))
    if not (folder / "README.md").is_file():
        problems.append((folder / "README.md", "file is missing"))
    return logs, problems


def check_replay_mix(folder: Path, logs: list[rl.RunLog]) -> list[Problem]:
    """One problem when some logs are replay runs and others are not: a folder is a reproduction or a run."""
    replayed = [log.path.name for log in logs if log.replayed]
    plain = [log.path.name for log in logs if not log.replayed]
    if not replayed or not plain:
        return []
    return [(folder, f"mixes replay runs ({', '.join(replayed)}: a train_clock line) with runs on the wall clock"
                     f" ({', '.join(plain)}); the seeds of a folder are all a reproduction or all a run")]


def summary(folder: Path, track: str, logs: list[rl.RunLog], metric: str) -> str:
    scores = [log.score(metric).val_bpb for log in logs]
    train_s = max(log.train_time_ms or 0.0 for log in logs) / 1000
    eval_s = max(log.eval_time_ms for log in logs) / 1000
    return (
        f"{folder} ({track} track): {len(logs)} seed(s) {[log.seed for log in logs]}, "
        f"val_bpb {rl.mean(scores):.8f} ({rl.EVAL_PREFIXES[metric]}_exact), "
        f"max total {max(log.total_bytes for log in logs)} bytes, "
        f"max train {train_s:.1f} s, max eval {eval_s:.1f} s"
    )


def sota_verdict(logs: list[rl.RunLog], metric: str, sota_bpb: float) -> tuple[bool, str]:
    """(is a record, one line) from the challenge's one-sided t-test."""
    scores = [log.score(metric).val_bpb for log in logs]
    sig = rl.significance_test(scores, sota_bpb, rl.bpb_per_nat(logs, metric))
    rule = f"by >= {sig.margin_nats} nats ({sig.margin_bpb:.5f} bpb) at p < {sig.alpha}"
    head = f"mean val_bpb {sig.mean:.8f} over {sig.n} seed(s)"
    if sig.t is None:
        return False, f"NOT A RECORD: {head}: {sig.verdict}, so it cannot be shown to beat SOTA {sota_bpb} {rule}"
    stats = f"(t={sig.t:.4g}, df={sig.df}, p={sig.p:.4g}; threshold {sig.threshold_bpb:.8f})"
    if sig.significant:
        return True, f"RECORD: {head} beats SOTA {sota_bpb} {rule} {stats} [{rl.README_RULE}]"
    return False, f"NOT A RECORD: {head} does not beat SOTA {sota_bpb} {rule} {stats} [{rl.README_RULE}]"


def welch_verdict(logs: list[rl.RunLog], metric: str, row: str) -> tuple[bool, str]:
    """(accepted, one line) from the leaderboard's one-sided Welch t-test against the row's per-seed scores."""
    w = rl.welch_test([log.score(metric).val_bpb for log in logs], rl.row_scores(row))
    head = f"mean val_bpb {w.mean:.8f} over {w.n} seed(s) against the row's {w.row_mean:.8f} over {w.row_n} ({row})"
    if w.p is None:
        return False, (f"NOT A RECORD: {head}: the Welch t-test needs at least 2 seeds on each side"
                       f" [{rl.WELCH_RULE}]")
    df = "n/a" if w.df is None else f"{w.df:.4g}"
    stats = f"(t={w.t:.4g}, df={df}, p={w.p:.4g})"
    if w.significant:
        return True, f"RECORD: {head} is lower at p < {w.alpha} {stats} [{rl.WELCH_RULE}]"
    return False, f"NOT A RECORD: {head} is not lower at p < {w.alpha} {stats} [{rl.WELCH_RULE}]"


def reproduction_verdict(logs: list[rl.RunLog], metric: str, row: str) -> tuple[bool, str]:
    """(reproduces, one line) from the two-sided Welch t-test of a reproduction's seeds against the row's."""
    w = rl.welch_two_sided([log.score(metric).val_bpb for log in logs], rl.row_scores(row))
    head = (f"mean {w.mean:.8f} over {w.n} seed(s) vs the row's {w.row_mean:.8f} over {w.row_n} seed(s) ({row}),"
            f" difference {w.difference:+.8f}")
    if w.missing is not None:
        return False, f"NOT CHECKED: whether it reproduces the row: {head}: {w.missing} [{rl.REPRODUCTION_RULE}]"
    stats = f"t={w.t:.4g}, df={w.df:.4g}, two-sided p={w.p:.4g}"
    if w.reproduces:
        return True, f"REPRODUCES: {head} ({stats} >= {w.alpha}) [{rl.REPRODUCTION_RULE}]"
    return False, f"DOES NOT REPRODUCE: {head} ({stats} < {w.alpha}) [{rl.REPRODUCTION_RULE}]"


def stop_step_lines(logs: list[rl.RunLog], row: str) -> list[str]:
    """For information: the step each reproduction stopped at against the row's logs' (none when ROW has no logs);
    a faithful replay stops at the record's step."""
    row_steps = rl.row_stop_steps(row)
    if not row_steps:
        return []
    lines = []
    for log in logs:
        step = log.final_step
        stopped = "told no step" if step is None else f"stopped at step {step}"
        same_seed = [s for seed, s in row_steps if seed == log.seed]
        if same_seed and step is not None:
            gap = step - same_seed[0]
            how = "the same step" if gap == 0 else f"{abs(gap)} step(s) {'later' if gap > 0 else 'earlier'}"
            lines.append(f"INFO: seed {log.seed} {stopped} (the row's seed {log.seed}: {same_seed[0]}, {how})")
        else:
            listed = ", ".join(f"{s} (seed {seed})" for seed, s in row_steps)
            lines.append(f"INFO: seed {log.seed} {stopped} (the row's logs: {listed})")
    return lines


def verdict_lines(folder: Path, track: str, logs: list[rl.RunLog], sota_bpb: float | None,
                  against: str | None = None) -> tuple[int, list[str]]:
    """Exit status and output for a folder with no problems (see the module docstring)."""
    metric = submission_metric(rl.load_submission(folder / "submission.json"), logs)
    about = summary(folder, track, logs, metric)
    if track != "10min" and against is not None and logs and all(log.replayed for log in logs):
        reproduces, line = reproduction_verdict(logs, metric, against)
        lines = [f"OK: {about}" if reproduces else f"WELL-FORMED: {about}", line]
        lines += stop_step_lines(logs, against)
        if sota_bpb is not None:
            lines.append("INFO (non-record track, not required): " + sota_verdict(logs, metric, sota_bpb)[1])
        return (0 if reproduces else 1), lines
    if track != "10min":
        lines = [f"OK: {about}"]
        if against is not None:
            lines.append("INFO (non-record track, not required): " + welch_verdict(logs, metric, against)[1])
        if sota_bpb is not None:
            lines.append("INFO (non-record track, not required): " + sota_verdict(logs, metric, sota_bpb)[1])
        return 0, lines
    if sota_bpb is None and against is None:
        return 1, [
            f"WELL-FORMED: {about}",
            "NOT CHECKED: whether it beats the current SOTA; a 10-minute record must beat it by"
            f" >= {rl.SOTA_MARGIN_NATS} nats at p < {rl.SIGNIFICANCE_ALPHA}: pass --sota-bpb X"
            " (the current record's val_bpb), or --against ROW for the leaderboard's rule"
            f" (one-sided Welch p < {rl.WELCH_ALPHA} against that row's seeds)",
        ]
    is_record, line = welch_verdict(logs, metric, against) if against is not None else sota_verdict(
        logs, metric, sota_bpb)
    lines = [f"OK: {about}" if is_record else f"WELL-FORMED: {about}", line]
    if against is not None and sota_bpb is not None:
        lines.append("INFO (not deciding: --against applies the leaderboard's rule): "
                     + sota_verdict(logs, metric, sota_bpb)[1])
    return (0 if is_record else 1), lines


def one_line(text: str) -> str:
    """A message on one output line, whatever it quotes."""
    return " ".join(text.splitlines())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    folder: Path = args.folder
    track = args.track or infer_track(folder)
    logs, problems = find_problems(folder, track)
    for path, message in problems:
        print(f"FAIL: {path}: {one_line(message)}")
    if args.full_script is not None:
        ok, line = check_specialisation(folder, args.full_script)
        print(one_line(line))
        if not ok:
            return 1
    if problems:
        return 1
    try:
        status, lines = verdict_lines(folder, track, logs, args.sota_bpb, args.against)
    except rl.RecordError as exc:
        print(f"FAIL: {folder}: {one_line(str(exc))}")
        return 1
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
