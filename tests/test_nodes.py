"""Several nodes and restarts with torchrun itself (issue 62), in as few real runs as cover it (the file's cost):
two torchrun agents of one process each (`--nnodes 2 --nproc_per_node 1`, CPU, gloo) equal one node with two
processes (every *_exact line and the artifact's bytes): uninterrupted with static rendezvous, in two network
namespaces joined by a veth pair where this machine has root and `ip netns` (no loopback shared; one folder, as a
shared filesystem), on loopback elsewhere; a node lost after a checkpoint (its worker and its agent SIGKILLed,
static) stops the survivor at once with one line naming the lost peer and nothing that looks finished, and both
nodes rerun with RESUME=auto by c10d rendezvous end as the run never stopped (so c10d equals one node too);
scripts/run/torchrun_resume.py reruns a one-node run whose worker was killed and ends with the same exact lines, and
reruns no refused input. These are real processes (torchrun's agents and workers, not the zygote's forks), each run
bounded by a timeout, every process group killed at the end."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import pytest

import launcher
from conftest import (REPO, SCRIPT, clean_environ, computed_once, read_log, run_file, shared_folder, shared_run,
                      short_val_data)
from test_checkpoint import DEFAULT, EXACT

TIMEOUT = 120  # seconds for any one run here (a two-node tiny run takes ~12 s on 2 loaded cores)
LOST_TIMEOUT = 30  # DIST_TIMEOUT_SECONDS of the lost-node run: the survivor must stop well within it
RESUMER = REPO / "scripts" / "run" / "torchrun_resume.py"


@pytest.fixture(scope="module")
def env(sample_data, tmp_path_factory):
    """The tiny default model (tests/test_checkpoint.py's DEFAULT) on the sample's train shards and a val shard of
    two sequences, the data made once for the session."""
    folder = computed_once(shared_folder(tmp_path_factory) / "nodes_data",
                           lambda out: short_val_data(sample_data, out, 2 * 64 + 1))
    return {**DEFAULT, "DATA_PATH": str(folder), "TOKENIZER_PATH": sample_data["TOKENIZER_PATH"],
            "DIST_TIMEOUT_SECONDS": "60"}


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    """One node, two processes, never stopped: its *_exact lines and its artifact's bytes."""
    folder = shared_run(tmp_path_factory, "ref", env, nproc=2)
    return exact_lines(folder, "ref"), run_file(folder, "ref").read_bytes()


def exact_lines(cwd: Path, run_id: str) -> list:
    lines = re.findall(EXACT, read_log(cwd, run_id), re.M)
    assert lines
    return lines


def start(args: list, cwd: Path, env: dict, prefix: tuple = ()) -> subprocess.Popen:
    """One torchrun agent (a node) in a session of its own, stderr kept in a file beside its folder."""
    cwd.mkdir(parents=True, exist_ok=True)
    full = {**clean_environ(), **env}
    err = open(cwd.parent / f"{cwd.name}.{uuid.uuid4().hex[:6]}.stderr", "w+")
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "torch.distributed.run", *args, str(SCRIPT)], cwd=cwd,
                            env=full, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    proc.err_file = err
    return proc


def finish(procs: list, timeout: float = TIMEOUT) -> list:
    """Waits for every process (each process group killed past the timeout): each one's (returncode, stderr)."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a node ran past {timeout} s")
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the agent's session: its workers too
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    out = []
    for p in procs:
        p.err_file.seek(0)
        out.append((p.returncode, p.err_file.read()))
        p.err_file.close()
    return out


def static(rank: int, port: int, addr: str = "127.0.0.1") -> list:
    return ["--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank), "--master_addr", addr,
            "--master_port", str(port)]


def c10d(port: int) -> list:
    return ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "nodes"]


def same_as_reference(cwd: Path, run_id: str, reference) -> None:
    assert exact_lines(cwd, run_id) == reference[0]
    assert run_file(cwd, run_id).read_bytes() == reference[1]


def test_two_nodes_equal_one_node_with_two_processes(env, reference, tmp_path):
    """Static rendezvous on loopback, both nodes in one folder (a shared filesystem): rank 0 writes the log and the
    artifact there. Where network namespaces can be made, the same run across them (below) stands for this one;
    c10d rendezvous is the lost-node test's rerun."""
    if netns_problem() is None:
        pytest.skip("the same two-node run in two network namespaces (test_two_nodes_in_two_network_namespaces) "
                    "covers it on this machine")
    port = launcher.free_port()
    for code, err in finish([start(static(r, port), tmp_path / "shared", {**env, "RUN_ID": "two"}) for r in (0, 1)]):
        assert code == 0, err[-3000:]
    same_as_reference(tmp_path / "shared", "two", reference)


def test_a_lost_node_stops_the_survivor_and_both_resume_exactly(env, reference, tmp_path):
    """Static rendezvous; after the step-2 checkpoint the rank-1 worker kills its agent and itself (SIGKILL: the node
    is gone). The survivor exits 1 at once with one line naming the lost peer, no final model written; both nodes
    rerun with RESUME=auto end as the run never stopped. The rerun meets by c10d rendezvous (as a user may restart
    with either), so its end equal to one node's also shows c10d's two nodes equal one node with two processes:
    steps 1-2 by static, the rest, the artifact and every evaluation by c10d."""
    cwd, port = tmp_path / "shared", launcher.free_port()
    ck = {**env, "RUN_ID": "lost", "CHECKPOINT_EVERY": "2", "DIST_TIMEOUT_SECONDS": str(LOST_TIMEOUT)}
    began = time.monotonic()
    runs = finish([start(static(r, port), cwd, {**ck, "TEST_KILL_AT_CHECKPOINT": "2:node:1"}) for r in (0, 1)])
    took = time.monotonic() - began
    assert sorted(code for code, _ in runs) == [-9, 1], [(c, e[-2000:]) for c, e in runs]
    survivor = next(err for code, err in runs if code == 1)
    errors = [ln for ln in survivor.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "lost a peer of the 2 ranks" in errors[0], survivor[-3000:]
    assert re.search(r"Connection (closed|reset) by peer \(peer \[127\.0\.0\.1\]:\d+\)", errors[0]), errors[0]
    assert took < LOST_TIMEOUT, took
    assert not run_file(cwd, "lost").exists() and not run_file(cwd, "lost", "final_model.pt").exists()
    assert [p.name for p in (cwd / "runs" / "lost" / "checkpoints").iterdir()] == ["step_00000002"]
    port = launcher.free_port()
    runs = finish([start(c10d(port), cwd, {**ck, "RESUME": "auto"}) for r in (0, 1)])
    for code, err in runs:
        assert code == 0, err[-3000:]
    assert "resumed_from:runs/lost/checkpoints/step_00000002 step:2" in read_log(cwd, "lost")
    same_as_reference(cwd, "lost", reference)


def netns_problem() -> str | None:
    """Why two network namespaces cannot be made here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    name = f"t62probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


@pytest.fixture
def two_namespaces():
    """Two network namespaces joined by a veth pair, 10.62.0.1 and 10.62.0.2 (their loopbacks up too): each one's
    (namespace, device). Each node sets GLOO_SOCKET_IFNAME to its device: gloo otherwise takes the address its
    hostname resolves to, here 127.0.0.1 in both, and the nodes cannot connect."""
    problem = netns_problem()
    if problem:
        pytest.skip(problem)
    tag = f"{os.getpid() % 100000}"
    names = [f"t62a{tag}", f"t62b{tag}"]
    cmds = [["ip", "netns", "add", names[0]], ["ip", "netns", "add", names[1]],
            ["ip", "link", "add", f"t62va{tag}", "type", "veth", "peer", "name", f"t62vb{tag}"],
            ["ip", "link", "set", f"t62va{tag}", "netns", names[0]], ["ip", "link", "set", f"t62vb{tag}", "netns",
                                                                        names[1]]]
    for i, (ns, dev) in enumerate(zip(names, (f"t62va{tag}", f"t62vb{tag}"))):
        cmds += [["ip", "-n", ns, "addr", "add", f"10.62.0.{i + 1}/24", "dev", dev],
                 ["ip", "-n", ns, "link", "set", dev, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]]
    try:
        for cmd in cmds:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                pytest.skip(f"`{' '.join(cmd)}` fails here: {done.stderr.strip()[:200]}")
        yield list(zip(names, (f"t62va{tag}", f"t62vb{tag}")))
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_two_nodes_in_two_network_namespaces(env, reference, tmp_path, two_namespaces):
    """Static rendezvous over the veth pair (GLOO_SOCKET_IFNAME set), both nodes in one folder: every rank reads the
    artifact back for its evaluation, so the run's folder must be shared (a node of its own folder fails with
    `error: runs/ns/final_model.int6.ptz: artifact does not exist [rank 1]`)."""
    port = launcher.free_port()
    procs = [start(static(r, port, "10.62.0.1"), tmp_path / "shared", {**env, "RUN_ID": "ns",
                                                                         "GLOO_SOCKET_IFNAME": dev},
                   ("ip", "netns", "exec", ns)) for r, (ns, dev) in enumerate(two_namespaces)]
    for code, err in finish(procs):
        assert code == 0, err[-3000:]
    same_as_reference(tmp_path / "shared", "ns", reference)


def resumer(args: list, cwd: Path, env: dict, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(RESUMER), *args], cwd=cwd, env={**clean_environ(), **env},
                          capture_output=True, text=True, timeout=timeout)


def test_torchrun_resume_reruns_a_killed_worker_to_the_same_end(env, reference, tmp_path):
    """Rank 1's worker alone SIGKILLed after the step-2 checkpoint (torchrun's agent then ends rank 0): the script
    reruns torchrun with RESUME=auto, which ends with the uninterrupted run's exact lines and artifact."""
    cwd = tmp_path / "run"
    proc = resumer(["--wait", "0", "--standalone", "--nproc_per_node", "2", str(SCRIPT)], cwd,
                   {**env, "RUN_ID": "cut", "CHECKPOINT_EVERY": "2", "TEST_KILL_AT_CHECKPOINT": "2:after:1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("torchrun_resume:")]
    failed = re.match(r"torchrun_resume: try 1 of 4 failed \(torchrun exit 1; worker exit codes \[(.*)\]\); rerunning "
                      r"with RESUME=auto in 0 s$", ours[0])
    assert len(ours) == 2 and failed and "-9" in failed.group(1).split(", "), ours  # the order is torchrun's
    assert ours[1] == "torchrun_resume: try 2 of 4 finished (RESUME=auto)"
    assert read_log(cwd, "cut").count("resumed_from:runs/cut/checkpoints/step_00000002 step:2") == 1
    same_as_reference(cwd, "cut", reference)


# torchrun's failure report for a worker that exited 2 (its format as torch 2.13 prints it; the killed-worker test
# above reads a real one)
REFUSED_REPORT = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train_gpt.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_18:01:50
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 16175)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_torchrun_resume_reruns_no_refused_input(env, tmp_path, monkeypatch, capsys):
    """A worker that refused its input (exit 2, as train_gpt.py's for a bad setting: tests/test_bad_inputs.py) is
    not rerun: torchrun_resume.py's main() in this process, its torchrun a stand-in that prints torchrun's report
    of that worker and exits 1 (a real torchrun costs seconds of imports for nothing the decision reads); nor is a
    run that cannot resume (no RUN_ID, no checkpoints), refused before torchrun starts (the script itself)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("torchrun_resume", RESUMER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    started = []

    class Torchrun:
        def __init__(self, cmd, **kwargs):
            started.append(cmd)
            self.stderr = iter(REFUSED_REPORT.splitlines(keepends=True))

        def wait(self):
            return 1

        def poll(self):
            return 1

    monkeypatch.setattr(mod, "subprocess", types.SimpleNamespace(Popen=Torchrun, PIPE=subprocess.PIPE))
    monkeypatch.setattr(mod, "signal", types.SimpleNamespace(signal=lambda *a: None, SIGINT=signal.SIGINT,
                                                             SIGTERM=signal.SIGTERM))  # pytest's handlers kept
    monkeypatch.setenv("RUN_ID", "bad")
    monkeypatch.setenv("CHECKPOINT_EVERY", "2")
    code = mod.main(["--wait", "0", "--standalone", "--nproc_per_node", "1", str(SCRIPT)])
    ours = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("torchrun_resume:")]
    assert code == 1 and len(started) == 1 and started[0][1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert ours == ["torchrun_resume: try 1 of 4 failed (torchrun exit 1; worker exit codes [2]): a worker refused "
                    "its input (exit 2): a rerun would repeat it; not rerun"]
    for over, fragment in (({"RUN_ID": ""}, "RUN_ID must be set"), ({"CHECKPOINT_EVERY": "0"}, "CHECKPOINT_EVERY=0")):
        proc = resumer(["--standalone", "--nproc_per_node", "1", str(SCRIPT)], tmp_path / "none",
                       {**env, "RUN_ID": "x", "CHECKPOINT_EVERY": "2", **over})
        assert proc.returncode == 2 and proc.stderr.startswith("torchrun_resume: error: ") and fragment in \
            proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
