"""The tests' runs of train_gpt.py and of their helper programs without paying Python's and PyTorch's imports again
for each run (issue 42).

`python3 train_gpt.py` on the suite's 2-core CI machine spends 2.3 to 4 s of CPU importing torch before its first
line, and a 2-rank run under torchrun pays that three times (the launcher's agent, then each rank); the suite makes
a few hundred such runs. Here each pytest worker starts one server process (the "zygote") per process environment.
The zygote imports torch, numpy, sentencepiece, Dynamo, the compressors and train_gpt once, compiles the scripts it
is asked to run, and never computes anything; for each run it forks one child, which becomes what a new
`python3 SCRIPT ARGS` (or `python3 -c CODE ARGS`) process would be at its first line, and runs the script's code as
`__main__`:

- its environment is exactly the run's (os.environ replaced: C's getenv sees it too), its working folder the
  run's, stdin /dev/null, stdout and stderr files of its own (returned as text, as `capture_output=True` gives);
- sys.argv, sys.path[0] (the script's folder, symlinks resolved; '' for -c) and a new `__main__` module as the
  interpreter sets them for a script;
- its own seeds: Python's `random`, NumPy's global generator and torch's default CPU generator are seeded anew
  from the OS, as a new interpreter seeds them (the zygote never draws from them; a child that does not seed draws
  its own numbers);
- one thread at the fork: the zygote checks /proc/self/task before every fork and refuses to fork with more (the
  imports start none when OMP_NUM_THREADS is set as the tests set it: OpenBLAS starts its pool at NumPy's import
  otherwise), so no lock is held by a thread the child does not have, and the child's OpenMP pool is its own;
- no Dynamo cache, compiled graph or CUDA state: the zygote compiles nothing and initialises no device (it only
  makes Dynamo's line -> function-name table of the scripts it runs, as of their current bytes: _Compiled);
- its own process group, so that a timeout kills the run and anything it started;
- the interpreter's ending: SystemExit's code (or 1 and the traceback for an uncaught exception), non-daemon
  threads joined, atexit handlers run, streams flushed, and the status the zygote reports is the one
  `subprocess` would give (negative for a signal).

What a fork cannot give: the string-hash secret (PYTHONHASHSEED) is chosen when an interpreter starts, so the
children of one zygote share their zygote's (each zygote's is random unless PYTHONHASHSEED is set); and a variable
that a library reads at import (OMP_NUM_THREADS, TORCHINDUCTOR_*, TRITON_INTERPRET, PYTHONPATH, ...) must be what
the zygote started with. So a zygote serves only runs whose environment equals its own outside the names that
train_gpt.py reads as settings when it runs (RUN_ID, DATA_PATH, ...: read from its own source) and the launch
variables of a distributed rank; any other difference starts another zygote for that environment.

`run` replaces `subprocess.run([sys.executable, *argv], capture_output=True, text=True)`, `start` `Popen`, and
`run_ranks` `python3 -m torch.distributed.run --standalone --nproc_per_node=N SCRIPT`: N forked ranks that meet
through env:// as torchrun's workers do (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...), without its agent
process. tests/test_launcher.py checks each of these properties against real processes. A handful of tests keep
going through the real commands (`python3 train_gpt.py`, torchrun, the scripts); they say so."""
from __future__ import annotations

import atexit
import importlib.util
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "train_gpt.py"
# torchrun's per-worker variables (torch.distributed.elastic's agent sets these for each worker). PyTorch reads them
# when a process group or the elastic error handler starts (the TORCHELASTIC_* and TORCH_NCCL_* ones too), never at
# import: a rank is served by the zygote of the same environment's one-process runs.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
               "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
               "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE")
# How a forked child becomes a new process, and the variables libraries read at import (never a run-time setting, even
# where train_gpt reads one too): scripts/run/new_process.py, loaded from its file (the children's sys.path stays a new
# process's), shared with the tiny bench's row server.
_SPEC = importlib.util.spec_from_file_location("new_process", REPO / "scripts" / "run" / "new_process.py")
NEW_PROCESS = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(NEW_PROCESS)
IMPORT_TIME_PREFIXES = NEW_PROCESS.IMPORT_TIME_PREFIXES
# Passed to the runs, never a reason for another zygote: set by pytest for each test and read by no library; and the
# address Inductor writes into this process's environment before it loads a compiled graph (an in-process Inductor
# test), which every process loading one writes for itself first (it had cost a worker two more zygotes, issue 69).
HARMLESS_PREFIXES = ("PYTEST_", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
# What the zygote imports before it serves (each if installed): what train_gpt.py's runs import, then train_gpt.
# torch._dynamo.backends.common: what Dynamo imports at a process's first compilation (AOT autograd, functorch's
# compile, networkx; 0.1 to 0.4 s of each compiled run).
PRELOAD = ("numpy", "numpy.random", "torch", "torch.nn.functional", "torch.distributed", "torch._dynamo",
           "torch._dynamo.backends.common", "sentencepiece", "brotli", "zpaq", "triton", "triton.language", "train_gpt")


def runtime_names() -> frozenset[str]:
    """The names train_gpt.py reads as settings (its `_env("NAME"` calls) that no library reads at import, and the
    launch variables: a run may set them to anything and still be served by a zygote started without them."""
    names = set(re.findall(r"""_env\w*\(\s*["']([A-Z][A-Z0-9_]*)["']""", SCRIPT.read_text(encoding="utf-8")))
    return frozenset(n for n in names if not n.startswith(IMPORT_TIME_PREFIXES)) | frozenset(LAUNCH_VARS)


def zygote_env(env: dict[str, str], runtime: frozenset[str]) -> dict[str, str]:
    """The part of a run's environment that its zygote must have started with."""
    return {k: v for k, v in env.items() if k not in runtime and not k.startswith(HARMLESS_PREFIXES)}


# ---------------------------------------------------------------------------------------------- the zygote

def _threads() -> list[str]:
    tasks = os.listdir("/proc/self/task")
    return [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in tasks]


def _send(msg: dict) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


class _Compiled:
    """Code objects of the scripts run so far, compiled again when a file changes (size or modification time).

    Beside each, Dynamo's table of the file's function names by line (torch._dynamo.funcname_cache, which a process
    tokenizes at its first compilation of code from that file: 0.29 s for train_gpt.py's 390 KB on a 2-core EPYC)
    is made when the script is compiled, and again when the file changes, so a compiled run does not tokenize the
    script itself; the table only names lines in Dynamo's messages, never what a graph computes."""

    def __init__(self):
        self.cache = {}

    def script(self, path: str):
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in self.cache:
            with open(path, "rb") as f:
                self.cache[key] = compile(f.read(), path, "exec", dont_inherit=True)
            names = sys.modules.get("torch._dynamo.funcname_cache")
            if names is not None:
                names.cache.pop(path, None)
                names.get_funcname(path, 1)  # tokenizes the file as it is now (a later change makes both anew)
        return self.cache[key]


def serve() -> None:
    """The zygote: preloads, says it is ready, then forks a child for each spawn request and reports each child's
    end, until its stdin closes (its pytest worker ended): then it kills what it still runs and exits."""
    import gc

    sys.path[0] = str(REPO)  # train_gpt importable; each child sets its own sys.path[0]
    loaded = []
    for name in PRELOAD:
        try:
            if importlib.util.find_spec(name.split(".")[0]) is not None:
                importlib.import_module(name)
                loaded.append(name)
        except Exception:  # a broken optional package: the run that needs it imports it itself and fails there
            pass
    compiled = _Compiled()
    compiled.script(str(SCRIPT))
    # The preloaded modules' objects (torch's, Dynamo's, ...) live as long as the zygote: frozen out of the garbage
    # collector's generations, a child's collections no longer walk them (nor write their headers, each write a page
    # copied after the fork). A run's own objects are collected as in a new process.
    gc.collect()
    gc.freeze()
    _send({"ready": os.getpid(), "threads": _threads(), "preloaded": loaded})
    children, buf = set(), b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.02 if children else None)
        if ready:
            chunk = os.read(0, 1 << 20)
            if not chunk:
                for pid in children:
                    _kill_group(pid, signal.SIGKILL)
                os._exit(0)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                threads = _threads()
                if len(threads) != 1:
                    _send({"id": req["id"], "error": f"the zygote has {len(threads)} threads ({threads}): not forking"})
                    continue
                try:
                    code = _code_for(req["argv"], compiled)
                except (OSError, SyntaxError, ValueError) as e:
                    _send({"id": req["id"], "error": f"{type(e).__name__}: {e}"})
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req, code)  # never returns
                children.add(pid)
                _send({"id": req["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _send({"pid": pid, "status": status})


def _code_for(argv: list[str], compiled: _Compiled):
    if argv[0] == "-c":
        if len(argv) < 2:
            raise ValueError("-c needs its code")
        return compile(argv[1], "<string>", "exec", dont_inherit=True)
    return compiled.script(os.path.abspath(argv[0]))


def _child(req: dict, code) -> None:
    """In the forked child: the run's process (scripts/run/new_process.py's become), its stdout and stderr into the
    run's files; never returns."""
    try:
        fds = (os.open(os.devnull, os.O_RDONLY),
               *(os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for name in ("stdout", "stderr")))
    except BaseException:
        os._exit(1)
    NEW_PROCESS.become(req["argv"], req["env"], req["cwd"], fds, code)


def _kill_group(pid: int, sig: int) -> None:
    for target in (lambda: os.killpg(pid, sig), lambda: os.kill(pid, sig)):
        try:
            target()
            return
        except (ProcessLookupError, PermissionError):
            continue


# ---------------------------------------------------------------------------------------------- the pytest side

class LaunchError(RuntimeError):
    """The zygote could not start or fork."""


class Zygote:
    """One zygote process and the messages it sends (read on demand: the pytest worker is single-threaded)."""

    def __init__(self, env: dict[str, str], folder: Path):
        self.log = folder / f"zygote{len(list(folder.glob('zygote*')))}.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"], env=env,
                                         cwd=folder, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        self.buf, self.exits, self.replies, self.next_id = b"", {}, {}, 0
        hello = self._until(lambda: self.replies.get("ready"), 300)
        if len(hello["threads"]) != 1:
            self.close()
            raise LaunchError(f"the zygote has {len(hello['threads'])} threads after its imports ({hello['threads']})"
                              ": a fork of it would not be a clean process (set OMP_NUM_THREADS)")
        self.preloaded = hello["preloaded"]

    def _pump(self, timeout: float | None) -> None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return
        chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
        if not chunk:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise LaunchError(f"the zygote (pid {self.proc.pid}) ended: {tail}")
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            msg = json.loads(line)
            if "ready" in msg:
                self.replies["ready"] = msg
            elif "status" in msg:
                self.exits[msg["pid"]] = msg["status"]
            else:
                self.replies[msg["id"]] = msg

    def _until(self, got, timeout: float):
        deadline = time.monotonic() + timeout
        while (value := got()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"the zygote (pid {self.proc.pid}) did not answer in {timeout:.0f} s")
            self._pump(left)
        return value

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, out: Path, err: Path) -> int:
        self.next_id += 1
        rid = self.next_id
        req = {"id": rid, "argv": [str(a) for a in argv], "env": env, "cwd": str(cwd), "stdout": str(out),
               "stderr": str(err)}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._until(lambda: self.replies.pop(rid, None), 60)
        if "error" in reply:
            raise LaunchError(reply["error"])
        return reply["pid"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _Run:
    """A run started by `start`, as much of subprocess.Popen's interface as the tests use; its stdout and stderr go
    to files of its own (`output` reads them)."""

    forked = False

    def __init__(self, argv: list[str]):
        self.args = [sys.executable, *argv]
        fd, out = tempfile.mkstemp(prefix="out", dir=_state.folder)
        os.close(fd)
        self.out, self.err = Path(out), Path(out + ".err")
        self.returncode = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._block(0.5 if left is None else min(left, 0.5))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            if sig == signal.SIGKILL:
                _kill_group(self.pid, sig)
            else:
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) as text; the files are removed."""
        texts = tuple(p.read_text(encoding="utf-8", errors="replace") if p.exists() else "" for p in (self.out, self.err))
        for p in (self.out, self.err):
            p.unlink(missing_ok=True)
        return texts

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            out, err = self.output()
            raise subprocess.TimeoutExpired(self.args, timeout, out, err) from None
        return self.output()


class Child(_Run):
    """A run forked from a zygote."""

    forked = True

    def __init__(self, zygote: Zygote, argv: list[str], env: dict[str, str], cwd: Path):
        super().__init__(argv)
        self.zygote = zygote
        self.pid = zygote.spawn(list(argv), env, Path(cwd), self.out, self.err)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote._pump(0)
            if self.pid in self.zygote.exits:
                self.returncode = os.waitstatus_to_exitcode(self.zygote.exits.pop(self.pid))
        return self.returncode

    def _block(self, timeout: float) -> None:
        self.zygote._pump(timeout)


class RealProcess(_Run):
    """A run as a new `python3` process: where no zygote may serve its environment, or TEST_LAUNCHER=real."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, why: str):
        super().__init__(argv)
        self.why = why
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.popen = subprocess.Popen(self.args, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=err, start_new_session=True)
        self.pid = self.popen.pid

    def poll(self) -> int | None:
        self.returncode = self.popen.poll()
        return self.returncode

    def _block(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


class _State:
    """The zygotes of this pytest worker, one per process environment, and their scratch folder."""

    def __init__(self):
        self.zygotes, self._folder = {}, None
        self.runtime = runtime_names()

    @property
    def folder(self) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="launcher-"))
            atexit.register(self.close)
        return self._folder

    def zygote(self, env: dict[str, str]) -> Zygote | str:
        """The zygote for `env`'s process environment, or why there is none (a new process runs instead)."""
        if os.environ.get("TEST_LAUNCHER") == "real":
            return "TEST_LAUNCHER=real"
        base = zygote_env(env, self.runtime)
        key = tuple(sorted(base.items()))
        if key not in self.zygotes:
            try:
                self.zygotes[key] = Zygote(base, self.folder)
            except LaunchError as e:
                self.zygotes[key] = str(e)
        return self.zygotes[key]

    def close(self) -> None:
        for z in self.zygotes.values():
            if isinstance(z, Zygote):
                z.close()
        self.zygotes.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


_state = _State()


def start(argv: list, env: dict[str, str], cwd: Path) -> _Run:
    """`python3 ARGV...` (a script path or `-c CODE`, then its arguments) with exactly `env` in `cwd`: forked from
    the zygote of its process environment (a Child), or, where none may serve it, a new process (RealProcess, whose
    `why` says why)."""
    argv = [str(a) for a in argv]
    zygote = _state.zygote(env)
    if isinstance(zygote, str):
        return RealProcess(argv, env, Path(cwd), zygote)
    return Child(zygote, argv, env, Path(cwd))


def run(argv: list, env: dict[str, str], cwd: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout),
    forked from a zygote."""
    child = start(argv, env, cwd)
    out, err = child.communicate(timeout)
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun --standalone --nproc_per_node=nproc gives worker `rank` on one node (no restarts)."""
    return {"OMP_NUM_THREADS": "1", **env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False"}


def run_ranks(argv: list, env: dict[str, str], cwd: Path, nproc: int, timeout: float | None = None,
              stop_peers: bool = True) -> subprocess.CompletedProcess:
    """`nproc` ranks of `python3 ARGV...` that meet through env:// as torchrun's workers: a CompletedProcess whose
    returncode is the status of the first rank seen to fail (the lowest rank among those seen together) or 0, whose stdout and stderr are every rank's in rank order, and
    whose `rank_codes` lists each rank's. With `stop_peers` (torchrun's behaviour), once a rank fails the others are
    ended (SIGTERM, SIGKILL 5 s later) instead of waiting for their collectives to time out."""
    port = free_port()
    children = [start(argv, rank_env(env, r, nproc, port), cwd) for r in range(nproc)]
    deadline = None if timeout is None else time.monotonic() + timeout
    killed_at, first_failed = None, None
    try:
        while None in [c.poll() for c in children]:  # every child polled: its end recorded
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise subprocess.TimeoutExpired(children[0].args, timeout)
            if first_failed is None:
                first_failed = next((c.returncode for c in children if c.returncode not in (None, 0)), None)
            if stop_peers and first_failed is not None and killed_at is None:
                killed_at = now
                for c in children:
                    c.send_signal(signal.SIGTERM)
            if killed_at is not None and now - killed_at > 5:
                for c in children:
                    c.kill()
            children[0]._block(0.05)
    except subprocess.TimeoutExpired:
        for c in children:
            c.kill()
            c.wait()
        outs = [c.output() for c in children]
        raise subprocess.TimeoutExpired(children[0].args, timeout, "".join(o for o, _ in outs),
                                        "".join(e for _, e in outs)) from None
    outs = [c.output() for c in children]
    codes = [c.returncode for c in children]
    if first_failed is None:
        first_failed = next((c for c in codes if c), 0)
    proc = subprocess.CompletedProcess(children[0].args, first_failed, "".join(o for o, _ in outs),
                                       "".join(e for _, e in outs))
    proc.rank_codes = codes
    return proc


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
