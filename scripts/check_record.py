#!/usr/bin/env python3
"""Check a record folder against the challenge's rules before opening a PR.

Exits 0 and prints an OK summary when the folder is complete and consistent;
otherwise prints one "FAIL: <file>: <problem>" line per problem and exits 1.

Checked: at least one train_seed*.log; every log has all final lines (the
sliding-window and TTT pairs only when that evaluation was enabled in any of
the folder's logs); total submission size <= 16,000,000 bytes and no
OVER_LIMIT line; on the 10-minute track, training and evaluation each
<= 600 s; train_gpt.py present, parseable as Python 3.10, and exactly as many
bytes as every log's "Code size"; submission.json has the required keys with
sane values, and its val_bpb / bytes_total match the logs (same scoring rule
as make_record.py); README.md present.
"""
from __future__ import annotations

import argparse
import ast
import datetime as dt
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recordlib as rl  # noqa: E402  (needs the path above)

VAL_BPB_TOLERANCE = 1e-6
TRACK_10MIN_DIR = "track_10min_16mb"

Problem = tuple[Path, str]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="record folder, e.g. records/track_10min_16mb/2025-11-21_MyRun")
    p.add_argument(
        "--track",
        choices=("10min", "non-record"),
        help=f"rules to apply (default: 10min if the parent folder is {TRACK_10MIN_DIR}, else non-record;"
        " only the 10min track has time limits)",
    )
    return p


def infer_track(folder: Path) -> str:
    return "10min" if folder.resolve().parent.name == TRACK_10MIN_DIR else "non-record"


# ---------------------------------------------------------------------------
# Per-log checks


def check_log(log: rl.RunLog, folder_evals: set[str], track: str, code_size: int | None) -> list[Problem]:
    """Problems with one seed's log; code_size is train_gpt.py's size if readable."""
    p = log.path
    missing = rl.missing_final_lines(log, folder_evals)
    problems: list[Problem] = [(p, f"missing final line '{name}'") for name in missing]
    file_seed = rl.seed_from_filename(p)
    if file_seed is not None and log.seed is not None and file_seed != log.seed:
        problems.append((p, f"log says seed:{log.seed} but the file name says seed {file_seed}"))
    problems += check_size(log)
    if track == "10min":
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
    src = path.read_bytes()
    try:
        ast.parse(src, filename=str(path), feature_version=(3, 10))
    except SyntaxError as exc:
        return len(src), [(path, f"does not parse as Python 3.10: {exc.msg} (line {exc.lineno})")]
    return len(src), []


def check_submission(path: Path, logs: list[rl.RunLog]) -> list[Problem]:
    try:
        data = rl.load_submission(path)
    except rl.RecordError as exc:
        return [(path, str(exc))]
    problems = [(path, msg) for msg in submission_type_problems(data)]
    problems += [(path, msg) for msg in submission_value_problems(data, logs)]
    return problems


def submission_type_problems(data: dict) -> list[str]:
    """Required keys present with usable types; bool is excluded from numbers."""
    problems = [f"missing key '{k}'" for k in rl.REQUIRED_SUBMISSION_KEYS if k not in data]
    for key in ("name", "blurb", "author", "github_id", "date"):
        if key in data and (not isinstance(data[key], str) or not data[key].strip()):
            problems.append(f"'{key}' must be a non-empty string")
    v = data.get("val_bpb")
    if "val_bpb" in data and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
        problems.append(f"'val_bpb' must be a positive number, got {v!r}")
    b = data.get("bytes_total")
    if "bytes_total" in data and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
        problems.append(f"'bytes_total' must be a positive integer, got {b!r}")
    metric = data.get("val_bpb_metric")
    if metric is not None and metric not in rl.EVAL_PREFIXES:
        problems.append(f"'val_bpb_metric' must be one of {', '.join(rl.EVAL_PREFIXES)}, got {metric!r}")
    if isinstance(data.get("date"), str) and data["date"].strip() and not valid_date(data["date"]):
        problems.append(f"'date' must be YYYY-MM-DD, got {data['date']!r}")
    return problems


def valid_date(text: str) -> bool:
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
        return False
    try:
        dt.date.fromisoformat(text)
    except ValueError:
        return False
    return True


def submission_value_problems(data: dict, logs: list[rl.RunLog]) -> list[str]:
    """val_bpb, bytes_total and seeds must agree with the logs."""
    problems = []
    try:
        metric = submission_metric(data, logs)
    except rl.RecordError as exc:
        return [f"cannot check val_bpb: {exc}"]
    expected = rl.mean([log.score(metric).val_bpb for log in logs])
    v = data.get("val_bpb")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and not abs(v - expected) <= VAL_BPB_TOLERANCE:
        line = rl.EVAL_PREFIXES[metric] + "_exact"
        problems.append(f"val_bpb {v} != mean {line} of the logs {expected:.8f}")
    totals = [log.total_bytes for log in logs if log.total_bytes is not None]
    b = data.get("bytes_total")
    if totals and isinstance(b, int) and not isinstance(b, bool) and b != max(totals):
        problems.append(f"bytes_total {b} != max logged total submission size {max(totals)}")
    seeds = data.get("seeds")
    if seeds is not None and sorted(map(str, seeds)) != sorted(str(log.seed) for log in logs):
        problems.append(f"seeds {seeds} do not match the logs' seeds {[log.seed for log in logs]}")
    return problems


# ---------------------------------------------------------------------------


def find_problems(folder: Path, track: str) -> tuple[list[rl.RunLog], list[Problem]]:
    if not folder.is_dir():
        return [], [(folder, "not a directory")]
    logs = rl.load_logs(folder)
    code_size, problems = check_code(folder / "train_gpt.py")
    if not logs:
        problems.insert(0, (folder, f"no {rl.LOG_GLOB} files"))
    folder_evals = set().union(*(rl.enabled_evals(log) for log in logs)) if logs else set()
    for log in logs:
        problems += check_log(log, folder_evals, track, code_size)
    if logs:
        problems += check_submission(folder / "submission.json", logs)
    elif not (folder / "submission.json").is_file():
        problems.append((folder / "submission.json", "file is missing"))
    if not (folder / "README.md").is_file():
        problems.append((folder / "README.md", "file is missing"))
    return logs, problems


def submission_metric(data: dict, logs: list[rl.RunLog]) -> str:
    """The metric submission.json names (as make_record writes it), else the default rule."""
    named = data.get("val_bpb_metric")
    return rl.choose_metric(logs, named if named in rl.EVAL_PREFIXES else None)


def summary(folder: Path, track: str, logs: list[rl.RunLog]) -> str:
    metric = submission_metric(rl.load_submission(folder / "submission.json"), logs)
    scores = [log.score(metric).val_bpb for log in logs]
    train_s = max(log.train_time_ms or 0.0 for log in logs) / 1000
    eval_s = max(log.eval_time_ms for log in logs) / 1000
    return (
        f"OK: {folder} ({track} track): {len(logs)} seed(s) {[log.seed for log in logs]}, "
        f"val_bpb {rl.mean(scores):.8f} ({rl.EVAL_PREFIXES[metric]}_exact), "
        f"max total {max(log.total_bytes for log in logs)} bytes, "
        f"max train {train_s:.1f} s, max eval {eval_s:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    folder: Path = args.folder
    track = args.track or infer_track(folder)
    logs, problems = find_problems(folder, track)
    for path, message in problems:
        print(f"FAIL: {path}: {message}")
    if problems:
        return 1
    print(summary(folder, track, logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
