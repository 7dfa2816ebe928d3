#!/usr/bin/env python3
"""Plot training curves of one or more train_gpt.py logs into one PNG.

The 2x2 grid shows train loss and val bpb, each against step and against
training time (s), with one line per log, so runs of different speed can be
compared both per step and per second of the 10-minute budget.

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
        for log, label in zip(logs, labels):
            xs, ys = series(log, kind, y_attr, x_attr)
            if xs:
                ax.plot(xs, ys, label=label, marker="o" if kind == "val" else None, markersize=3)
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
