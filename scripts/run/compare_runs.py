#!/usr/bin/env python3
"""Compare train_gpt.py runs in one table, read from their logs.

Each argument is a run's folder (runs/RUN_ID: its log is logs/RUN_ID.txt beside runs/) or a log file. One row a run:
its id, preset, the settings that differ between the runs given (the logs' `setting NAME=value [source]` lines;
PER_RUN's left out), the steps, the last step time, the final score (val_bpb), the scores before and after TTT, the
evaluation's time, the artifact's bytes and whether the run finished. A log cut mid-line, a run still going (no
evaluation_time line yet) and a failed run (its error line) never show as finished, and never pass a partial score
for a final one: their scores carry PARTIAL's mark (a footnote under the table says why), and sorted by a score they
come after every finished run.

Examples:
    python3 scripts/run/compare_runs.py runs/* --sort val_bpb
    python3 scripts/run/compare_runs.py runs/* --csv runs.csv --markdown runs.md --plot curves.png
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

# plot_logs beside this file; recordlib in scripts/record/
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "record")]
import plot_logs  # noqa: E402  (needs the paths above)
import recordlib as rl  # noqa: E402

# Settings that differ between runs by construction (a run's name and folder, a resumed part's RESUME): not a
# difference of recipe.
PER_RUN = ("RUN_ID", "CHECKPOINT_DIR", "RESUME", "TEST_KILL_AT_CHECKPOINT")
COLUMNS_BEFORE = ("run", "preset")
COLUMNS_AFTER = ("steps", "step_ms", "val_bpb", "pre_ttt_bpb", "post_ttt_bpb", "eval_s", "bytes", "status")
SCORES = ("val_bpb", "pre_ttt_bpb", "post_ttt_bpb")
PARTIAL = "*"  # after an unfinished run's score: not its final one
FOOTNOTE = f"{PARTIAL} a partial score: the run did not finish (see its status)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="runs/RUN_ID folders or log files (logs/RUN_ID.txt)")
    p.add_argument("--sort", metavar="COLUMN", help="sort by this column (numbers ascending; a missing value last), "
                                                   "e.g. val_bpb, step_ms, bytes or a setting's name")
    p.add_argument("--csv", type=Path, metavar="FILE", help="also write the table as CSV")
    p.add_argument("--markdown", type=Path, metavar="FILE", help="also write the table as Markdown")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="the runs' curves on one figure (scripts/run/plot_logs.py's)")
    return p


def log_path(arg: Path) -> Path:
    """A run's log: the file given, or for a folder runs/RUN_ID the log logs/RUN_ID.txt beside runs/."""
    return arg.resolve().parent.parent / "logs" / f"{arg.resolve().name}.txt" if arg.is_dir() else arg


status = plot_logs.status


def score(log: rl.RunLog, *names: str) -> float | None:
    """The first of the final evaluations `names` that the log has: its full-precision val_bpb."""
    return next((log.exact[n].val_bpb for n in names if n in log.exact), None)


def row(log: rl.RunLog, differing: list[str]) -> dict[str, object]:
    last = log.last_step
    final = score(log, *rl.METRIC_PREFERENCE)
    if final is None and log.val_steps:
        final = log.val_steps[-1].bpb
    out = {
        "run": log.path.stem, "preset": log.preset or "-",
        **{name: log.settings.get(name, "-") for name in differing},
        "steps": f"{log.final_step}/{last.total}" if last else "-",
        "step_ms": last.step_avg_ms if last else None,
        "val_bpb": final, "pre_ttt_bpb": score(log, "sliding", "roundtrip"), "post_ttt_bpb": score(log, "legal_ttt"),
        "eval_s": log.eval_total_s, "bytes": log.total_bytes, "status": status(log),
    }
    if out["status"] != "finished":  # never a final score: marked, as text
        out.update({k: cell(out[k]) + PARTIAL for k in SCORES if out[k] is not None})
    return out


def table(logs: list[rl.RunLog], sort: str | None = None) -> tuple[list[str], list[dict[str, object]]]:
    """(columns, rows): one row a log, the settings whose values differ between the logs as columns."""
    names = sorted({n for log in logs for n in log.settings} - set(PER_RUN))
    # a log without the setting (a log cut before its settings, an older script's) is no difference by itself
    differing = [n for n in names if len({log.settings[n] for log in logs if n in log.settings}) > 1]
    columns = [*COLUMNS_BEFORE, *differing, *COLUMNS_AFTER]
    rows = [row(log, differing) for log in logs]
    if sort:
        if sort not in columns:
            raise rl.RecordError(f"--sort {sort}: no such column (columns: {', '.join(columns)})")

        def key(r):
            v = r[sort]
            after = sort in SCORES and r["status"] != "finished"  # a partial score after every final one
            v = v.removesuffix(PARTIAL) if after and isinstance(v, str) else v
            try:
                return (after, v in (None, "-"), float(v), "")
            except (TypeError, ValueError):
                return (after, v in (None, "-"), 0.0, str(v))

        rows.sort(key=key)
    return columns, rows


def cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.8f}".rstrip("0").rstrip(".") if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def render_text(columns: list[str], rows: list[dict[str, object]]) -> str:
    cells = [columns] + [[cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in cells)


def render_markdown(columns: list[str], rows: list[dict[str, object]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]).replace("|", "\\|").replace(PARTIAL, "\\" + PARTIAL) for c in columns)
              + " |" for r in rows]
    return "\n".join(lines) + (f"\n\n\\{FOOTNOTE}" if any_partial(rows) else "") + "\n"


def any_partial(rows: list[dict[str, object]]) -> bool:
    return any(str(r[k]).endswith(PARTIAL) for r in rows for k in SCORES)


def write_csv(path: Path, columns: list[str], rows: list[dict[str, object]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows([["" if r[c] is None else r[c] for c in columns] for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs = []
    for arg in args.runs:
        path = log_path(arg)
        if not path.is_file():
            parser.error(f"{arg}: no log {path}" if arg.is_dir() else f"{arg}: no such file")
        logs.append(rl.parse_log(path))
    try:
        columns, rows = table(logs, args.sort)
    except rl.RecordError as e:
        parser.error(str(e))
    print(render_text(columns, rows) + (f"\n{FOOTNOTE}" if any_partial(rows) else ""))
    if args.csv:
        write_csv(args.csv, columns, rows)
    if args.markdown:
        args.markdown.write_text(render_markdown(columns, rows), encoding="utf-8")
    if args.plot:
        with_steps = [log for log in logs if log.steps]
        plot_logs.plot(with_steps, [log.path.stem for log in with_steps], args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
