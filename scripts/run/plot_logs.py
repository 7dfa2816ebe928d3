#!/usr/bin/env python3
"""Plot training curves of one or more train_gpt.py logs into one PNG.

The 2x2 grid shows train loss and val bpb, each against step and against
training time (s), with one line per log, so runs of different speed can be
compared both per step and per second of the 10-minute budget. A run's status
sets its line style (finished solid, unfinished dashed, cut mid-line
dash-dotted, failed dotted; the legend says which), each run has its own marker (identical runs' curves
stay visible), and a finished run's final score (its exact val_bpb) is a star
with its value on the val bpb panels, at its last step.

Example:
    python scripts/run/plot_logs.py logs/a.txt logs/b.txt --labels base,new -o curves.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "record"))  # recordlib in scripts/record/
import recordlib as rl  # noqa: E402  (needs the path above)

# (row, column) -> (step kind, y attribute, y label, x attribute, x label)
PANELS = {
    (0, 0): ("train", "loss", "train loss", "step", "step"),
    (0, 1): ("train", "loss", "train loss", "seconds", "train time (s)"),
    (1, 0): ("val", "bpb", "val bpb", "step", "step"),
    (1, 1): ("val", "bpb", "val bpb", "seconds", "train time (s)"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path, help="training logs (logs/*.txt or train_seed*.log)")
    p.add_argument(
        "-o", "--output", type=Path, default=Path("train_curves.png"), help="PNG to write (default: %(default)s)"
    )
    p.add_argument("--labels", help="comma-separated legend labels, one per log (default: file stems)")
    return p


STYLES = {"finished": "-", "unfinished": "--", "cut": "-.", "failed": ":"}  # status_kind(status) -> line style
MARKERS = "osD^vP<>Xph*"


def status(log: rl.RunLog) -> str:
    """finished, failed (its error line), cut mid-line, or unfinished (running, or stopped without a line)."""
    if log.error:
        return "failed: " + log.error.removeprefix("error: ")
    if log.truncated:
        return "unfinished (cut mid-line)"
    return "finished" if log.eval_total_s is not None else "unfinished"


def status_kind(state: str) -> str:
    """status's kind: finished, unfinished, cut or failed."""
    return "cut" if state == "unfinished (cut mid-line)" else state.split(":")[0]


def final_score(log: rl.RunLog) -> float | None:
    """A finished run's final score: its first exact val_bpb in recordlib's preference; None for any other run."""
    if status(log) != "finished":
        return None
    return next((log.exact[n].val_bpb for n in rl.METRIC_PREFERENCE if n in log.exact), None)


def series(log: rl.RunLog, kind: str, y_attr: str, x_attr: str) -> tuple[list[float], list[float]]:
    steps = [s for s in log.steps if s.kind == kind]
    xs = [s.train_time_ms / 1000.0 if x_attr == "seconds" else s.step for s in steps]
    return xs, [getattr(s, y_attr) for s in steps]


def plot(logs: list[rl.RunLog], labels: list[str], output: Path) -> None:
    # Imported here so the other tools and tests run without matplotlib; Agg
    # renders to files and needs no display (headless training boxes).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for (row, col), (kind, y_attr, y_label, x_attr, x_label) in PANELS.items():
        ax = axes[row][col]
        for i, (log, label) in enumerate(zip(logs, labels)):
            xs, ys = series(log, kind, y_attr, x_attr)
            state = status(log)
            if not xs:
                continue
            # markers of decreasing size on every few points: two identical runs show both
            shown = status_kind(state).replace("cut", "cut mid-line")
            line, = ax.plot(xs, ys, STYLES[status_kind(state)], label=label if state == "finished" else
                            f"{label} ({shown})", marker=MARKERS[i % len(MARKERS)],
                            markersize=7 - 4 * i / max(len(logs), 1), markevery=max(len(xs) // 12, 1),
                            fillstyle="none", alpha=0.9)
            final = final_score(log)
            if kind == "val" and final is not None:
                x = xs[-1]
                ax.plot([x], [final], "*", color=line.get_color(), markersize=14 - 6 * i / max(len(logs), 1))
                ax.annotate(f"{final:.5f}", (x, final), textcoords="offset points", xytext=(4, 4), fontsize="small",
                            color=line.get_color())
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.set_title(f"{y_label} vs {x_label}")
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [p.stem for p in args.logs]
    if len(labels) != len(args.logs):
        parser.error(f"--labels has {len(labels)} labels for {len(args.logs)} logs")
    logs = []
    for path in args.logs:
        if not path.is_file():
            parser.error(f"{path}: no such file")
        log = rl.parse_log(path)
        if not log.steps:
            parser.error(f"{path}: no 'step:N/M train_loss:...' or 'step:N/M val_loss:...' lines to plot")
        logs.append(log)
    plot(logs, labels, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
