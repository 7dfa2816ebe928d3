"""torchrun that resumes by itself after a failure (issue 62).

    RUN_ID=r1 CHECKPOINT_EVERY=50 python3 scripts/run/torchrun_resume.py --standalone --nproc_per_node=8 train_gpt.py

runs `python3 -m torch.distributed.run ARGS` (torchrun) with the environment as given, and after a failed try
the same command again with RESUME=auto, which continues the newest complete checkpoint: the run ends with the
weights and *_exact lines of a run never stopped (docs/running.md, "Checkpoints and resuming"). At most --retries
reruns (3), each after --wait seconds (2); no rerun when a worker refused its input (exit 2: a bad setting or a
refused resume, which a rerun would repeat) or was interrupted (130), nor after this script gets Ctrl-C or SIGTERM
(passed on to torchrun). Each of its decisions is one line on stderr starting `torchrun_resume:`; torchrun's and
the workers' output pass through. Its exit status is the last try's.

Why not `torchrun --max-restarts`: its restarted rounds race with gloo (issue 62 measured `Gloo connectFullMesh
failed` and 300 s hangs on one node, and every restarted round failing on two nodes: PyTorch #108158, #167288);
a new torchrun is a new store and a new process group, which start as a first run does. RUN_ID must be set (every
try must find the same checkpoints) and CHECKPOINT_EVERY > 0 (without checkpoints a rerun starts over). On several
nodes, run it on every node with the same arguments (the rendezvous of each try meets the other nodes' reruns);
a node that is gone for good needs a person.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

NO_RERUN = {2: "a worker refused its input (exit 2): a rerun would repeat it",
            130: "a worker was interrupted (exit 130)"}


def say(line: str) -> None:
    print(f"torchrun_resume: {line}", file=sys.stderr, flush=True)


def check_environ(env: dict[str, str]) -> str | None:
    """Why this environment cannot resume, or None."""
    if not env.get("RUN_ID", "").strip():
        return "RUN_ID must be set: every try must find the same checkpoints (runs/$RUN_ID/checkpoints)"
    every = env.get("CHECKPOINT_EVERY", "").strip()
    if not (every.isdigit() and int(every) > 0):
        return f"CHECKPOINT_EVERY={every or '(unset)'} must be > 0: without checkpoints a rerun starts over"
    return None


def one_try(args: list[str], env: dict[str, str], stop: list) -> tuple[int, list[int]]:
    """torchrun once: its exit status and the worker exit codes its failure report names (stderr passed through)."""
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], env=env,
                            stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1)
    stop[:] = [proc]
    codes = []
    for line in proc.stderr:
        sys.stderr.write(line)
        found = re.match(r"\s*exitcode\s*:\s*(-?\d+)", line)
        if found:
            codes.append(int(found.group(1)))
    sys.stderr.flush()
    return proc.wait(), codes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     usage="RUN_ID=NAME CHECKPOINT_EVERY=N python3 scripts/run/torchrun_resume.py "
                                     "[--retries N] [--wait S] TORCHRUN_ARGS...")
    parser.add_argument("--retries", type=int, default=3, help="reruns at most (default 3)")
    parser.add_argument("--wait", type=float, default=2.0, help="seconds before each rerun (default 2)")
    ours, args = parser.parse_known_args(argv)
    args = args[1:] if args[:1] == ["--"] else args
    if not args:
        parser.error("give torchrun's arguments, ending with the script: --standalone --nproc_per_node=8 train_gpt.py")
    if ours.retries < 0 or ours.wait < 0:
        parser.error("--retries and --wait must be >= 0")
    env = dict(os.environ)
    problem = check_environ(env)
    if problem:
        say(f"error: {problem}")
        return 2
    stop: list = []
    stopped = []

    def on_signal(signum, _frame):
        stopped.append(signum)
        for p in stop:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    tries = ours.retries + 1
    for n in range(1, tries + 1):
        code, workers = one_try(args, env, stop)
        if code == 0:
            if n > 1:
                say(f"try {n} of {tries} finished (RESUME=auto)")
            return 0
        why = ("stopped by a signal" if stopped else next((NO_RERUN[c] for c in workers if c in NO_RERUN), None))
        failed = f"try {n} of {tries} failed (torchrun exit {code}; worker exit codes {workers or 'not reported'})"
        if why or n == tries:
            say(f"{failed}: {why or 'no tries left'}; not rerun")
            return code
        say(f"{failed}; rerunning with RESUME=auto in {ours.wait:g} s")
        time.sleep(ours.wait)
        env = {**env, "RESUME": "auto"}
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
