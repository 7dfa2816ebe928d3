#!/usr/bin/env python3
"""Summarise a record folder's seed logs into submission.json and README.md.

Reads every train_seed*.log in FOLDER, scores each run with one final metric
(the same rule check_record.py applies), writes submission.json, and keeps a
results table in README.md between the results markers so hand-written text
around it survives re-runs. With --sota-bpb it also runs the challenge's
significance test (beat the record by 0.005 nats at p < 0.01).

When FOLDER/train_gpt.py is the packed form written by scripts/pack/pack_code.py
(run_seeds.sh with PACK_CODE=1), submission.json also records code_packed: true
and code_source_sha256, the sha256 of the readable FOLDER/train_gpt_readable.py; when that source is
specialised to its run (PACK_CODE=1 does it: scripts/pack/specialise.py), code_specialised records what from
(the full train_gpt.py's sha256) and for which settings.

Example:
    python scripts/record/make_record.py records/track_10min_16mb/2025-11-21_MyRun \\
        --author "Jane Doe" --github-id janedoe --blurb "..." --sota-bpb 1.1194
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import re
import sys
from pathlib import Path

# recordlib beside this file; pack_code and specialise in scripts/pack/
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "pack")]
import pack_code  # noqa: E402
import specialise  # noqa: E402
import recordlib as rl  # noqa: E402  (needs the paths above)

DASH = "–"
TRACK_10MIN_DIR = "track_10min_16mb"  # as check_record.py infers the track: a folder directly inside it
COLUMNS = (
    "seed",
    "step_avg (ms)",
    "steps",
    "pre-TTT bpb",
    "post-TTT bpb",
    "TTT gain",
    "TTT time (s)",
    "artifact bytes",
)
# Number format per numeric column (the seed column holds labels).
FORMATS = ("{:.2f}", "{:.0f}", "{:.4f}", "{:.4f}", "{:.4f}", "{:.1f}", "{:.0f}")


def parse_date(text: str) -> str:
    """argparse type: an ISO calendar date written as YYYY-MM-DD."""
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
        raise argparse.ArgumentTypeError(f"date must be YYYY-MM-DD, got {text!r}")
    try:
        dt.date.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="record folder holding train_seed*.log files")
    p.add_argument(
        "--name", help="submission name (default: kept from submission.json, else the folder name after the date)"
    )
    p.add_argument("--author", help="author's name (default: kept from submission.json)")
    p.add_argument("--github-id", help="author's GitHub user name (default: kept from submission.json)")
    p.add_argument("--blurb", help="one-paragraph description of the submission (default: kept)")
    p.add_argument(
        "--date", type=parse_date, help="YYYY-MM-DD (default: kept, else the folder's date prefix, else today)"
    )
    p.add_argument("--sota-bpb", type=float, help="current record's val_bpb; runs the significance test against it")
    p.add_argument(
        "--metric",
        choices=list(rl.EVAL_PREFIXES),
        help="final evaluation to score (default: legal_ttt if every log has it, else sliding, else roundtrip)",
    )
    return p


# ---------------------------------------------------------------------------
# Table


def pre_ttt(log: rl.RunLog) -> rl.EvalLine | None:
    """Score before test-time training: sliding window if run, else roundtrip."""
    return log.score("sliding") or log.score("roundtrip")


def row_values(log: rl.RunLog) -> list[float | None]:
    """Numeric cells of one seed's row (None where the column doesn't apply)."""
    last = log.last_step
    pre, post = pre_ttt(log), log.score("legal_ttt")
    ttt_short = log.short.get("legal_ttt")
    return [
        last.step_avg_ms if last else None,
        float(last.step) if last else None,
        pre.val_bpb if pre else None,
        post.val_bpb if post else None,
        pre.val_bpb - post.val_bpb if pre and post else None,
        ttt_short.eval_time_ms / 1000.0 if ttt_short and ttt_short.eval_time_ms is not None else None,
        float(log.total_bytes) if log.total_bytes is not None else None,
    ]


def column_stats(rows: list[list[float | None]]) -> tuple[list[float | None], list[float | None]]:
    """Per-column mean and sample std; a column with any gap gets none."""
    means, stds = [], []
    for column in zip(*rows):
        if any(v is None for v in column):
            means.append(None)
            stds.append(None)
        else:
            means.append(rl.mean(list(column)))
            stds.append(rl.sample_std(list(column)))
    return means, stds


def format_row(label: str, values: list[float | None]) -> list[str]:
    cells = [label]
    for fmt, v in zip(FORMATS, values):
        cells.append(DASH if v is None or math.isnan(v) else fmt.format(v))
    return cells


def results_table(logs: list[rl.RunLog]) -> str:
    """Markdown table: one row per seed, then mean and sample std (n-1)."""
    rows = [row_values(log) for log in logs]
    means, stds = column_stats(rows)
    body = [format_row(str(log.seed), r) for log, r in zip(logs, rows)]
    body.append(format_row("mean", means))
    body.append(format_row("std", stds))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Significance


def significance_lines(sig: rl.Significance) -> list[str]:
    lines = [
        f"Significance test: {sig.test} (H0: mean >= SOTA - margin, H1: mean < SOTA - margin)",
        f"  n={sig.n} mean={sig.mean:.8f} std={_fmt(sig.std, '.8f')}",
        f"  SOTA={sig.sota_bpb} margin={sig.margin_nats} nats = {sig.margin_bpb:.8f} bpb"
        f" -> threshold {sig.threshold_bpb:.8f}",
    ]
    if sig.t is not None:
        lines.append(f"  t={sig.t:.4f} df={sig.df} p={sig.p:.6f} (alpha={sig.alpha})")
    lines.append(f"  verdict: {sig.verdict}")
    return lines


def _fmt(value: float | None, spec: str) -> str:
    return DASH if value is None else format(value, spec)


# ---------------------------------------------------------------------------
# Output files


def code_source(folder: Path) -> dict:
    """submission.json's code fields: for a packed train_gpt.py, the readable source's sha256; else none."""
    code = folder / "train_gpt.py"
    if not code.is_file() or not pack_code.is_packed(code.read_text(encoding="utf-8", errors="replace")):
        return {}
    readable = folder / rl.READABLE_CODE
    if not readable.is_file():
        raise rl.RecordError(f"{code} is packed but {readable} (its readable source) is missing")
    fields = {"code_packed": True, "code_source_sha256": hashlib.sha256(readable.read_bytes()).hexdigest()}
    record = specialise.recorded(readable.read_text(encoding="utf-8", errors="replace"))
    if record:  # specialised to its run (run_seeds.sh PACK_CODE=1): from which full script, for which settings
        fields["code_specialised"] = {"source_sha256": record["source_sha256"], "run": record["run"]}
    return fields


def build_submission(args: argparse.Namespace, existing: dict, logs: list[rl.RunLog], metric: str,
                     sig: rl.Significance | None) -> dict:
    """submission.json contents: CLI values beat existing values beat defaults."""
    folder_date, folder_name = rl.folder_date_and_name(args.folder)
    scores = [log.score(metric).val_bpb for log in logs]
    std = rl.sample_std(scores)
    data = dict(existing)
    data.pop("significance", None)  # a result for other seeds would be stale
    for key in ("code_packed", "code_source_sha256", "code_specialised"):  # re-derived from the folder below
        data.pop(key, None)
    data.update(
        name=args.name or existing.get("name") or folder_name,
        val_bpb=round(rl.mean(scores), 8),
        bytes_total=max(log.total_bytes for log in logs),
        blurb=args.blurb if args.blurb is not None else existing.get("blurb", ""),
        author=args.author or existing.get("author", ""),
        github_id=args.github_id or existing.get("github_id", ""),
        date=args.date or existing.get("date") or folder_date or dt.date.today().isoformat(),
        val_bpb_metric=metric,
        val_bpb_std=round(std, 8) if std is not None else None,
        seeds=[log.seed for log in logs],
        per_seed=[per_seed_entry(log, metric) for log in logs],
    )
    if sig is not None:
        data["significance"] = sig.as_dict()
    data.update(code_source(args.folder))
    return data


def per_seed_entry(log: rl.RunLog, metric: str) -> dict:
    score = log.score(metric)
    return {
        "seed": log.seed,
        "val_bpb": score.val_bpb,
        "val_loss": score.val_loss,
        "bytes_total": log.total_bytes,
        "steps": log.last_step.step if log.last_step else None,
        "train_time_ms": log.train_time_ms,
        "eval_time_ms": log.eval_time_ms,
    }


def results_block(logs: list[rl.RunLog], metric: str, table: str, sig: rl.Significance | None,
                  packed: bool = False) -> str:
    scores = [log.score(metric).val_bpb for log in logs]
    std = rl.sample_std(scores)
    summary = (
        f"Score: `val_bpb` = mean of `{rl.EVAL_PREFIXES[metric]}_exact` over {len(logs)} seed(s)"
        f" = {rl.mean(scores):.8f} (sample std {_fmt(std, '.8f')})."
    )
    parts = [rl.RESULTS_START, summary, "", table]
    if packed:
        parts += ["", f"Code: `train_gpt.py` (the file that ran; its bytes are the logged Code size) is the packed"
                  f" form of `{rl.READABLE_CODE}`: `python3 scripts/pack/pack_code.py {rl.READABLE_CODE} --check"
                  " train_gpt.py` verifies it without running it."]
    if sig is not None:
        parts += ["", "```", *significance_lines(sig), "```"]
    parts.append(rl.RESULTS_END)
    return "\n".join(parts)


def read_readme(path: Path) -> str | None:
    """The folder's README.md text (None when there is none), read before anything is written: a README.md that
    is a directory, unreadable or not UTF-8 is a one-line RecordError."""
    if not path.exists():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except IsADirectoryError:
        raise rl.RecordError(f"{path} is a directory, not a file; move it away") from None
    except UnicodeDecodeError as exc:
        raise rl.RecordError(f"{path} is not UTF-8 text (byte {exc.start}); re-save it as UTF-8") from None
    except OSError as exc:
        raise rl.RecordError(f"{path}: cannot read ({exc.strerror or exc})") from None


def readme_with_results(text: str | None, path: Path, title: str, blurb: str, block: str) -> str:
    """README.md with the marked results block replaced (or added), all other text kept as written."""
    if text is None:
        intro = f"{blurb}\n\n" if blurb else ""
        return f"# {title}\n\n{intro}## Results\n\n{block}\n"
    start, end = text.find(rl.RESULTS_START), text.find(rl.RESULTS_END)
    if start == -1 and end == -1:
        sep = "" if text.endswith("\n") else "\n"
        return f"{text}{sep}\n## Results\n\n{block}\n"
    if start == -1 or end == -1 or end < start:
        raise rl.RecordError(f"{path}: results markers are unbalanced; fix them by hand")
    return text[:start] + block + text[end + len(rl.RESULTS_END):]


# ---------------------------------------------------------------------------


def warn_incomplete(logs: list[rl.RunLog]) -> None:
    """Incomplete, resumed or replayed logs may still be scorable; say so, check_record will fail them (a resumed one
    on the 10-minute track; a replayed one is refused there here too, in run())."""
    for log in logs:
        missing = rl.missing_final_lines(log)
        if missing:
            print(f"warning: {log.path}: missing {', '.join(missing)}", file=sys.stderr)
        for note in (rl.resumed_note(log), rl.replayed_note(log)):
            if note:
                print(f"warning: {log.path}: {note}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    folder: Path = args.folder
    logs = rl.load_logs(folder)
    if not logs:
        raise rl.RecordError(f"{folder}: no {rl.LOG_GLOB} files")
    warn_incomplete(logs)
    replayed = [log for log in logs if rl.replayed_note(log)]
    if replayed and (folder.resolve().parent.name == TRACK_10MIN_DIR or args.sota_bpb is not None):
        where = "--sota-bpb" if args.sota_bpb is not None else f"a folder under {TRACK_10MIN_DIR}"
        raise rl.RecordError(f"{replayed[0].path}: {rl.replayed_note(replayed[0])}; {where} claims a record: put "
                             f"a reproduction under track_non_record_16mb and compare it with check_record.py --against")
    lacking_size = [log.path.name for log in logs if log.total_bytes is None]
    if lacking_size:
        raise rl.RecordError(f"no 'Total submission size int6+lzma' line in {', '.join(lacking_size)}")
    metric = rl.choose_metric(logs, args.metric)
    sig = None
    if args.sota_bpb is not None:
        values = [log.score(metric).val_bpb for log in logs]
        sig = rl.significance_test(values, args.sota_bpb, rl.bpb_per_nat(logs, metric))

    sub_path, readme_path = folder / "submission.json", folder / "README.md"
    existing = rl.load_submission(sub_path) if sub_path.exists() else {}
    readme = read_readme(readme_path)
    submission = build_submission(args, existing, logs, metric, sig)
    table = results_table(logs)
    block = results_block(logs, metric, table, sig, packed=bool(submission.get("code_packed")))
    readme = readme_with_results(readme, readme_path, submission["name"], submission["blurb"], block)
    # both files written only once both are composed: a bad README.md leaves submission.json as it was
    sub_path.write_text(json.dumps(submission, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    readme_path.write_text(readme, encoding="utf-8")

    print(f"metric: {rl.EVAL_PREFIXES[metric]}_exact  val_bpb={submission['val_bpb']:.8f}"
          f"  bytes_total={submission['bytes_total']}")
    print(table)
    if sig is not None:
        print("\n".join(significance_lines(sig)))
    for key in ("author", "github_id"):
        if not submission[key]:
            print(f"warning: submission.json: {key} is empty; pass --{key.replace('_', '-')}", file=sys.stderr)
    print(f"wrote {sub_path} and {folder / 'README.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except rl.RecordError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
