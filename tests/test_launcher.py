"""tests/launcher.py (issue 42): a run forked from a pytest worker's zygote is the process `python3 SCRIPT` or torchrun
would have started: the same program state at its first line (argv, sys.path, __main__, environment as C sees it,
working folder, one thread, torch's thread count, no Dynamo cache, no CUDA), seeds of its own, nothing left over from
the run before it, the interpreter's exit statuses and streams, a timeout that ends it and what it started, and ranks
that meet as torchrun's workers do; and train_gpt.py run both ways writes the same log and the same artifact bytes.
The real commands here are the references (each test runs both)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

import launcher
from conftest import TINY_ENV, clean_environ, read_log, run_file, run_training, short_val_data

ENV = {**clean_environ(), "OMP_NUM_THREADS": "1"}

PROBE = r'''
import ctypes, json, os, random, sys, threading
import numpy as np
import torch
import torch._dynamo.utils
getenv = ctypes.CDLL(None).getenv
getenv.restype = ctypes.c_char_p
state = {
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__, "file": globals().get("__file__"),
    "main_is_this": sys.modules["__main__"].__dict__ is globals(), "threads": len(os.listdir("/proc/self/task")),
    "py_threads": threading.active_count(), "torch_threads": torch.get_num_threads(),
    "env": os.environ.get("PROBE_VALUE"), "c_env": (getenv(b"PROBE_VALUE") or b"").decode(),
    "no_env": "PROBE_ONLY_IN_THE_FIRST" in os.environ, "dynamo_counters": sum(len(v) for v in torch._dynamo.utils.counters.values()),
    "cuda_initialized": torch.cuda.is_initialized(), "stdin": sys.stdin.read(),
    "fds": sorted(int(f) for f in os.listdir("/proc/self/fd") if int(f) < 3),
}
if "train_gpt" in sys.modules:
    state["tg_stage"] = sys.modules["train_gpt"]._STAGE[0]
draws = {"random": random.random(), "numpy": float(np.random.rand()), "torch": float(torch.rand(1))}
print(json.dumps({"state": state, "draws": draws}))
if len(sys.argv) > 1 and sys.argv[1] == "dirty":  # leave every kind of state behind, for the next run to not see
    os.environ["PROBE_ONLY_IN_THE_FIRST"] = "1"
    sys.path.insert(0, sys.argv[2])
    import train_gpt
    train_gpt._STAGE[0] = "left by the first run"
    torch.manual_seed(5)
    torch.set_num_threads(2)
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(3))
    random.seed(1)
    np.random.seed(1)
'''


def probe(tmp_path, real: bool, *args: str, **env: str) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    full = {**ENV, "PROBE_VALUE": "forty-two", **env}
    if real:
        proc = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=full, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
    else:
        proc = launcher.run([script, *args], full, tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.real_command
def test_a_forked_run_starts_as_a_new_python_process_would_and_keeps_nothing_of_the_run_before(tmp_path):
    real = probe(tmp_path, True)
    first = probe(tmp_path, False, "dirty", str(launcher.REPO))
    second = probe(tmp_path, False)
    assert real["state"]["threads"] == 1 and real["state"]["env"] == real["state"]["c_env"] == "forty-two"
    assert first["state"] == {**real["state"], "argv": first["state"]["argv"], "tg_stage": "start-up"}
    assert second["state"] == {**real["state"], "tg_stage": "start-up"}  # train_gpt preloaded, never run
    # seeds of its own, as a new interpreter draws them from the OS: no two runs draw the same numbers
    for source in ("random", "numpy", "torch"):
        assert len({run["draws"][source] for run in (real, first, second)}) == 3, source


def test_dynamos_table_of_a_scripts_function_names_is_the_scripts_as_it_is_now(tmp_path):
    """The zygote makes Dynamo's line -> function-name table of each script it compiles (so that compiled runs do not
    tokenize train_gpt.py again): the run finds it made, and a script edited between runs gets its new names, as a
    new process would."""
    script = tmp_path / "named.py"
    ask = ("import torch._dynamo.funcname_cache as names\n"
           "print(__file__ in names.cache, names.get_funcname(__file__, 5), names.get_funcname(__file__, 7))\n")
    for first, second in (("alpha", "beta"), ("gamma_longer", "delta")):
        script.write_text(f"{ask}\n\ndef {first}():\n    return 1\ndef {second}():\n    return 2\n")
        proc = launcher.run([script], ENV, tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout == f"True {first} {second}\n"  # made by the zygote, before the run's first line


def test_a_zygote_serves_only_runs_of_its_own_process_environment(tmp_path):
    """Settings that train_gpt reads when it runs (and the address an in-process Inductor test leaves in the
    environment) share a zygote; a variable that a library reads at start gets a zygote started with it
    (TORCHINDUCTOR_CACHE_DIR here), or a new process where no fork of one would be clean: with OMP_NUM_THREADS=2
    OpenBLAS starts a thread at NumPy's import."""
    before = len(launcher._state.zygotes)
    probe(tmp_path, False, RUN_ID="a", SEED="1", RANK="0", PYTEST_SOMETHING="x", TORCHELASTIC_RUN_ID="none",
          TORCHELASTIC_RESTART_COUNT="0")  # a torchrun worker's variables: the same zygote
    after_settings = len(launcher._state.zygotes)
    probe(tmp_path, False, RUN_ID="b", SEED="2", _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR="1")  # Inductor's address
    assert after_settings <= before + 1 and len(launcher._state.zygotes) == after_settings
    child = launcher.start(["-c", "pass"], {**ENV, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}, tmp_path)
    assert child.forked and child.communicate(60) == ("", "") and child.returncode == 0
    assert len(launcher._state.zygotes) == after_settings + 1
    two = launcher.start(["-c", "import torch; print(torch.get_num_threads())"], {**ENV, "OMP_NUM_THREADS": "2"},
                         tmp_path)
    assert not two.forked and "threads" in two.why and two.communicate(60)[0] == "2\n"
    assert {"RUN_ID", "SEED", "DATA_PATH", "RANK", "MASTER_PORT", *launcher.LAUNCH_VARS} <= launcher.runtime_names()
    os.environ["TEST_LAUNCHER"] = "real"  # every run a new process, as before the launcher
    try:
        real = launcher.start(["-c", "print('hi')"], ENV, tmp_path)
    finally:
        del os.environ["TEST_LAUNCHER"]
    assert not real.forked and real.why == "TEST_LAUNCHER=real" and real.communicate(60) == ("hi\n", "")
    assert not {"OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR", "PYTHONPATH"} & launcher.runtime_names()


ENDINGS = {
    "exit 3": "import sys; print('out'); sys.exit(3)",
    "exit message": "import sys; sys.exit('bad thing')",
    "exception": "def f():\n    raise ValueError('no')\nf()",
    "ctrl-c": "raise KeyboardInterrupt",
    "killed": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "threads and atexit": ("import atexit, threading, time\natexit.register(print, 'atexit ran')\n"
                           "threading.Thread(target=lambda: (time.sleep(0.3), print('thread joined'))).start()\n"
                           "print('main done')"),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.real_command
def test_exit_status_and_streams_are_the_interpreters(ending, tmp_path):
    code = ENDINGS[ending]
    real = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=60)
    forked = launcher.run(["-c", code], ENV, tmp_path, timeout=60)
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)


def test_a_timeout_ends_the_run_and_what_it_started(tmp_path):
    code = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '300']); print(p.pid, flush=True); "
            "time.sleep(300)")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as err:
        launcher.run(["-c", code], ENV, tmp_path, timeout=3)
    assert time.monotonic() - t0 < 30
    grandchild = int(err.value.output.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{grandchild}") and \
            open(f"/proc/{grandchild}/stat").read().split(")")[-1].split()[0] != "Z":
        time.sleep(0.1)
    alive = os.path.exists(f"/proc/{grandchild}") and \
        open(f"/proc/{grandchild}/stat").read().split(")")[-1].split()[0] != "Z"
    assert not alive


RANKS = r'''
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS")
line = f"rank:{rank} sum:{x.item()} " + " ".join(f"{n}={os.environ.get(n)}" for n in names)
os.write(1, (line + "\n").encode())  # one write: torchrun's ranks share a pipe, and print's newline is a write of its own
dist.destroy_process_group()
if os.environ.get("FAIL_RANK") == str(rank):
    sys.exit(7)
if os.environ.get("FAIL_RANK"):
    time.sleep(120)
'''


@pytest.mark.real_command
def test_ranks_meet_and_fail_as_torchruns_workers(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}  # torchrun sets it to 1 where unset
    real = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    forked = launcher.run_ranks([script], env, tmp_path, 2, timeout=300)
    assert real.returncode == forked.returncode == 0, (real.stderr[-2000:], forked.stderr[-2000:])
    lines = sorted(re.findall(r"^rank:.*$", real.stdout, re.M))
    assert lines and lines == forked.stdout.splitlines() and "sum:3.0" in lines[0]
    t0 = time.monotonic()
    failed = launcher.run_ranks([script], {**env, "FAIL_RANK": "1"}, tmp_path, 2, timeout=300)
    assert failed.returncode == 7 and failed.rank_codes[1] == 7 and failed.rank_codes[0] == -15
    assert time.monotonic() - t0 < 60  # the sleeping peer was ended, as torchrun ends it


@pytest.mark.real_command
def test_train_gpt_forked_writes_what_the_real_commands_write(tmp_path, sample_data):
    """A tiny 2-rank run under torchrun and forked: the same log lines (times aside) and artifact bytes; a
    1-process run through `python3 train_gpt.py` and forked, likewise."""
    data = short_val_data(sample_data, tmp_path, 2 * 128 + 1)
    env = {**TINY_ENV, **data, "ITERATIONS": "2", "TTT_ENABLED": "0", "EVAL_STRIDE": "0", "RUN_ID": "r"}

    def results(log):  # what the run computed: losses, scores (times and host aside)
        return re.findall(r"^step:\d+/\d+ train_loss:\S+|^\S+_exact .*$|^Serialized model.*$", log, re.M)

    for nproc in (2, 0):
        runs = {}
        for real in (True, False):
            cwd = tmp_path / f"n{nproc}_{'real' if real else 'forked'}"
            cwd.mkdir()
            proc = run_training(env, cwd, nproc=nproc, real=real)
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[real] = (results(read_log(cwd, "r")), run_file(cwd, "r").read_bytes())
        assert len(runs[True][0]) >= 3 and runs[True] == runs[False]
