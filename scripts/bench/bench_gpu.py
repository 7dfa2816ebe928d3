"""One-command GPU benchmark (issue 23): every row from one run, printed as one markdown table.

On one CUDA GPU it builds the offline sample data, then times, each in its own process under a time limit:
train_gpt.py at the record's shapes (11L d512, seq 2048, 786,432 tokens per step as 8 micro-batches) with
TRAIN_PREFETCH 0/1 x TRAIN_COPY_STREAM 0/1, PRESET=record_0409 with its layer loop off and on, optional rows for
settings and presets that exist in this checkout, the 2026-03-23 record's own script on the same GPU and
attention backend, the races of the presets record_0427, record_0430 (each context phase) and record_0501 against
their records' own scripts (scripts/bench/bench_record.py drives them through scripts/record/record_shim, so both
sides run the same attention kernels; loop off and on), and the sliding-window and TTT evaluations of ours against
the record's functions on one model. Without CUDA, or with BENCH_TINY=1, the same pipeline runs at tiny shapes
(the CI test of this script).

    bash scripts/bench/bench_gpu.sh                 # docs/gpu.md, "GPU benchmark"
    BENCH_TINY=1 bash scripts/bench/bench_gpu.sh    # the same on CPU in under a minute

Needs nothing beyond PyTorch, NumPy, SentencePiece (and Triton for torch.compile on CUDA).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import bench_record

REPO = Path(__file__).resolve().parents[2]


def find_anchors():
    """The records' files: BENCH_ANCHORS, else shared/anchors inside the checkout (the copy that travels to a
    device machine; git-ignored), else ../shared/anchors beside it (the developers' layout)."""
    candidates = [os.environ.get("BENCH_ANCHORS", ""), REPO / "shared" / "anchors", REPO.parent / "shared" / "anchors"]
    return next((Path(c).resolve() for c in candidates if c and (Path(c) / "record_2026-03-23").is_dir()),
                REPO.parent / "shared" / "anchors")


ANCHORS = find_anchors()
RECORD_SCRIPT = ANCHORS / "record_2026-03-23" / "train_gpt.py"
RECORD_ROW = "record 2026-03-23 (its script)"
RACES = ("record_0427", "record_0430", "record_0501")  # presets raced against their records' scripts (race_rows)
TINY_RACE = "race record_0430 seq32 loop on"  # the one race tiny mode (CPU) runs
# tiny mode: the first losses of a race's two rows (same weights, same batch) agree to the record's 4 logged decimals
# at step 1 and to this much at steps 2-3, where the two sides' optimizer precision on CPU differs (docs/gpu.md)
RACE_LOSS_TOL = {1: 1e-4, 2: 3e-3, 3: 3e-3}
COLUMNS = ("row", "settings", "status", "ms_per_step", "tokens_per_s", "data_wait_ms", "peak_mib", "compile_s",
           "mfu", "ours_vs_record", "bpb", "note")
EVAL_TAG = "BENCH_EVAL "
MATMUL_TAG = "BENCH_MATMUL "

# ---------------------------------------------------------------------------------------------- configuration


def bench_config(environ):
    """Shapes, step counts and limits: the record's shapes on CUDA, tiny ones on CPU or with BENCH_TINY=1."""
    tiny = environ.get("BENCH_TINY", "") == "1" or not cuda_available()
    if tiny:
        model = {"DEVICE": "cpu", "NUM_LAYERS": "4", "MODEL_DIM": "64", "NUM_HEADS": "4", "NUM_KV_HEADS": "2",
                 "VE_LAYERS": "2,3", "XSA_LAST_N": "2", "TRAIN_SEQ_LEN": "64", "EVAL_SEQ_LEN": "64",
                 "TRAIN_BATCH_TOKENS": "512", "VAL_BATCH_SIZE": "4096", "TTT_CHUNK_TOKENS": "512",
                 "EVAL_BATCH_SEQS": "16", "TTT_BATCH_SEQS": "4", "EVAL_STRIDE": "16", "OMP_NUM_THREADS": "1"}
        # the presets' layer indices on 4 layers, and record_0430's progressive context (1024 -> 3072 tokens) scaled
        # to the tiny 64 (at full length one tiny step took 5-12 s on 2 CPU cores, and its loop-on row timed out),
        # in lengths that divide the 64-token micro-batch, as the record's script requires of its schedule
        layers = {"LOOP_START": "1", "LOOP_END": "2", "PARALLEL_RESIDUAL_START": "2", "XSA_LAST_N": "4",
                  "TRAIN_SEQ_LEN_SCHEDULE": "16@0,32@0.1,64@0.7"}
        defaults = {"steps": 6, "warmup": 1, "row_timeout": 60, "budget": 300, "val_tokens": 32 * 64 + 1}
    else:
        model, layers = {}, {}  # train_gpt.py's defaults are the record's shapes
        defaults = {"steps": 30, "warmup": 5, "row_timeout": 240, "budget": 540, "val_tokens": 256 * 2048 + 1}
    cfg = {"tiny": tiny, "model": model, "preset_layers": layers}
    for key, default in defaults.items():
        raw = environ.get(f"BENCH_{key.upper()}", "")
        try:
            cfg[key] = int(raw) if raw else default
        except ValueError:
            raise SystemExit(f"error: BENCH_{key.upper()}={raw!r} is not an integer") from None
        if cfg[key] <= 0:
            raise SystemExit(f"error: BENCH_{key.upper()}={raw!r} must be > 0")
    if cfg["steps"] < 3:
        raise SystemExit(f"error: BENCH_STEPS={cfg['steps']} must be >= 3 (the step time is taken after step 1)")
    cfg["dir"] = Path(environ.get("BENCH_DIR", "") or REPO / "logs" / "bench_gpu").resolve()
    cfg["only"] = [r for r in environ.get("BENCH_ROWS", "").split(",") if r.strip()]
    return cfg


def cuda_available():
    import torch

    return torch.cuda.is_available()


def flops_per_token(h, looping):
    """Training FLOPs per token, the formula in docs/gpu.md ("GPU benchmark"): 6 x (matmul weights a token meets) plus
    causal attention 6 x layers run x seq_len x model_dim; embeddings lookups, norms and small projections
    (bigram, value embedding: under 0.5%) are left out."""
    import train_gpt as tg

    d, kv, hidden = h.model_dim, h.num_kv_heads * h.head_dim, h.mlp_hidden
    enc, dec = tg.virtual_layers(h.num_layers, h.num_loops if looping else 0, h.loop_start, h.loop_end)
    layers_run = len(enc) + len(dec)
    per_block = 2 * d * d + 2 * d * kv + 2 * d * hidden  # q, o; k, v; MLP up, down
    return 6 * (layers_run * per_block + h.vocab_size * d) + 6 * layers_run * h.train_seq_len * d


# ---------------------------------------------------------------------------------------------- running a row


def run_logged(cmd, env, cwd, timeout, stop_when=None):
    """Runs cmd with its own process group, reading stdout+stderr line by line with arrival times. Kills the
    group on timeout, or once a line matches stop_when (the rest of the run is not measured). In tiny mode a row
    that ROWS.serves is forked from the row server instead of started anew (RowServer).
    Returns (status, returncode, [(seconds since start, line)])."""
    lines, t0 = [], time.monotonic()
    proc = ROWS.start(cmd, env, cwd) if ROWS.serves(cmd, env) else None
    if proc is None:
        ROWS.new += 1
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    stopped = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic() - t0, line.rstrip("\n")))
            if stop_when is not None and re.search(stop_when, line):
                stopped.set()
                kill_group(proc)
                break

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
        status = "stopped" if stopped.is_set() else "exited"
    except subprocess.TimeoutExpired:
        kill_group(proc)
        status = "stopped" if stopped.is_set() else "timeout"
    reader.join(timeout=5)
    proc.wait()
    kill_group(proc)  # compile workers or other children left behind
    return status, proc.returncode, lines


def kill_group(proc):
    """SIGKILL to the process group this script started for the row (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------------- tiny mode: forked rows

# What a tiny row imports before its first line and at its first optimizer step (torch._dynamo: about 1 s of each
# row), imported once by the row server.
ROW_SERVER_PRELOAD = ("numpy", "torch", "torch._dynamo", "sentencepiece", "train_gpt")
# How a forked row becomes a new process, and the variables libraries read at import: scripts/run/new_process.py
# (tests/launcher.py's zygote uses it too), loaded from its file so that the rows' sys.path stays a new process's. A
# row whose value of such a variable differs from the server's (the eval and record rows' TORCHDYNAMO_DISABLE, the
# matmul row's OMP_NUM_THREADS) starts anew; the others are the rows' own settings, read when they run.
_SPEC = importlib.util.spec_from_file_location("new_process", REPO / "scripts" / "run" / "new_process.py")
NEW_PROCESS = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(NEW_PROCESS)


class RowServer:
    """Tiny mode (CPU shapes): one process (`--row-server`) that has imported ROW_SERVER_PRELOAD and computes nothing
    forks each row's run, which becomes what `python3 SCRIPT` would be at its first line (serve_rows: the row's
    environment, folder, argv, sys.path[0] and __main__, its own process group, seeds and exit status) without
    paying the imports again: about 2 s of CPU a row, 17 s of the tiny bench's 44 s on a 2-core EPYC. Rows whose
    environment differs from the server's in an import-time variable, and all rows at the record's shapes (one
    fresh process each, as the GPU numbers need), start anew. Off (None) until start_server; a server that cannot
    start, or whose imports left more than one thread (a fork would not be clean), serves nothing and says why."""

    def __init__(self):
        self.proc = self.sock = self.env = None
        self.why_not = "not tiny mode"
        self.forked = self.new = 0

    def start_server(self, env):
        import socket

        try:  # fork, descriptors passed over a socket and its message boundaries: Linux has them, not every system
            if not (hasattr(os, "fork") and hasattr(socket, "send_fds")):
                raise OSError("no os.fork or socket.send_fds here")
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except (OSError, AttributeError) as e:
            self.why_not = f"this system cannot fork rows: {e}"
            return
        try:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--row-server",
                                          str(theirs.fileno())], env=env, pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        finally:
            theirs.close()
        ours.settimeout(120)
        try:
            hello = json.loads(ours.recv(1 << 16) or b'{"error": "it exited"}')
        except (OSError, ValueError) as e:
            hello = {"error": f"{type(e).__name__}: {e}"}
        if "error" in hello:
            ours.close()
            self.stop()
            self.why_not = f"the row server did not start: {hello['error']}"
            return
        self.sock, self.env = ours, dict(env)

    def serves(self, cmd, env):
        """Whether the row `cmd` (python3 SCRIPT ...) with `env` is forked: only its own settings differ."""
        ok = self.sock is not None and len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1].endswith(".py")
        if ok:
            names = set(env) ^ set(self.env) | {k for k in env if env[k] != self.env.get(k)}
            ok = not any(k.startswith(NEW_PROCESS.IMPORT_TIME_PREFIXES) for k in names)
        return ok

    def summary(self):
        """The table's line on how its processes started."""
        if self.forked == 0:
            return f"processes: each new ({self.why_not})"
        return (f"processes: {self.forked} forked from one that imported {', '.join(ROW_SERVER_PRELOAD)} (tiny mode: "
                f"--help and the rows), {self.new} new (their import-time variables differ from its)")

    def start(self, cmd, env, cwd):
        """A forked row's process as run_logged uses a Popen (pid, stdout, wait, returncode), or None where the
        server failed (the row then starts anew)."""
        import socket

        try:
            self.sock.settimeout(60)
            self.sock.send(json.dumps({"argv": cmd[1:], "env": env, "cwd": str(cwd)}).encode())
            msg, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
            reply = json.loads(msg)
        except (OSError, ValueError) as e:
            self.stop()
            self.why_not = f"the row server failed: {type(e).__name__}: {e}"
            return None
        if "pid" not in reply or not fds:
            for fd in fds:
                os.close(fd)
            return None
        self.forked += 1
        return ForkedRow(reply["pid"], fds[0], self.sock)

    def stop(self):
        """Closes the socket (the server then exits) and reaps the server."""
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = self.sock = None


class ForkedRow:
    """A row forked by the row server, as run_logged reads a Popen: its output (stdout and stderr) as text lines
    from a pipe, its exit status from the server (negative for a signal, as subprocess gives it)."""

    def __init__(self, pid, fd, sock):
        self.pid, self.sock, self.returncode = pid, sock, None
        self.stdout = open(fd, encoding="utf-8", errors="replace")

    def wait(self, timeout=None):
        import socket

        if self.returncode is None:
            self.sock.settimeout(timeout)
            try:
                self.returncode = json.loads(self.sock.recv(1 << 16))["status"]
            except socket.timeout:
                raise subprocess.TimeoutExpired(f"row {self.pid}", timeout) from None
            finally:
                self.sock.settimeout(60)
        return self.returncode


ROWS = RowServer()


def serve_rows(fd):
    """`--row-server FD`: imports ROW_SERVER_PRELOAD, then for each request on the socket FD forks a child that runs
    the row, sends the child's pid with the read end of its output pipe, waits for it and sends its exit status;
    exits when the socket closes. Refuses (one message) if the imports left more than one thread."""
    import socket

    sock = socket.socket(fileno=fd)
    sys.path[0] = str(REPO)  # train_gpt importable (bench_record is imported already); each row sets its own [0]
    try:
        for name in ROW_SERVER_PRELOAD:
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 (a broken install: the rows start anew and fail or not on their own)
        sock.send(json.dumps({"error": f"importing {name}: {type(e).__name__}: {e}"}).encode())
        return
    threads = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["?"]
    if len(threads) != 1:
        sock.send(json.dumps({"error": f"its imports left {len(threads)} threads, and a fork keeps one"}).encode())
        return
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        msg = sock.recv(1 << 20)
        if not msg:
            return
        req = json.loads(msg)
        script = os.path.abspath(req["argv"][0])
        try:
            code = compile(Path(script).read_text(encoding="utf-8"), script, "exec", dont_inherit=True)
        except (OSError, SyntaxError, ValueError) as e:  # the row then starts anew and reports it as python3 would
            sock.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            continue
        r, w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the row's process: stdout and stderr into the pipe (unbuffered: PYTHONUNBUFFERED=1, child_env)
            os.close(r)
            sock.close()
            NEW_PROCESS.become(req["argv"], req["env"], req["cwd"], (os.open(os.devnull, os.O_RDONLY), w, os.dup(w)),
                               code)
        os.close(w)
        socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [r])
        os.close(r)
        _, status = os.waitpid(pid, 0)
        sock.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())


STEP_LINE = re.compile(r"^step:(\d+)/(\d+) train_loss:(\S+) train_time:(\d+)ms step_avg:")
WAIT_LINE = re.compile(r"^data_wait: total_ms:([\d.]+) mean_ms_per_step:([\d.]+)")
PEAK_LINE = re.compile(r"^peak memory allocated: (\d+) MiB reserved: (\d+) MiB")
WARMUP_TIME_LINE = re.compile(r"^warmup_time: steps:(\d+) ms:(\d+)")
WARMUP_STEP_LINE = re.compile(r"^warmup_step:(\d+)/(\d+)")
BACKEND_LINE = re.compile(r"attention_backend:(\S+)")
PACKED_LINE = re.compile(r"attention_backend_packed:(\S+(?: gqa:\S+)?)")  # torch_varlen with its GQA mode
ERROR_LINE = re.compile(r"^(error|Traceback|RuntimeError|\w+Error)\b")


def parse_training(lines):
    """Numbers of one training run from its timed console lines; raises ValueError naming what is missing.
    ms/step: (train_time at the last step - at step 1) / (steps - 1), so compile and first-step work are out."""
    steps, losses = {}, {}
    for _, line in lines:
        m = STEP_LINE.match(line)
        if m:
            steps[int(m.group(1))] = float(m.group(4))
            losses[int(m.group(1))] = float(m.group(3))
    if 1 not in steps or len(steps) < 2:
        raise ValueError(f"train step lines missing (found steps {sorted(steps)})")
    last = max(steps)
    out = {"steps": last, "ms_per_step": (steps[last] - steps[1]) / (last - 1), "losses": losses}
    for _, line in lines:
        if m := WAIT_LINE.match(line):
            out["data_wait_ms"] = float(m.group(2))
        elif m := PEAK_LINE.match(line):
            out["peak_mib"] = int(m.group(1))
        elif m := WARMUP_TIME_LINE.match(line):
            out["warmup_steps"], out["warmup_s"] = int(m.group(1)), int(m.group(2)) / 1000.0
        elif m := BACKEND_LINE.search(line):
            out.setdefault("backend", m.group(1))
        elif m := PACKED_LINE.search(line):
            out.setdefault("packed_backend", m.group(1))
    if "warmup_s" not in out:  # the record logs no warmup time: from its lines' arrival times, after 'seed:'
        idx = [i for i, (_, line) in enumerate(lines) if WARMUP_STEP_LINE.match(line)]
        before = [i for i in range(idx[0]) if lines[i][1].startswith("seed:")] if idx else []
        if idx and idx[0] > 0:
            out["warmup_steps"] = len(idx)
            out["warmup_s"] = lines[idx[-1]][0] - lines[before[-1] if before else idx[0] - 1][0]
    if "warmup_s" in out:
        out["compile_s"] = max(out["warmup_s"] - out["warmup_steps"] * out["ms_per_step"] / 1000.0, 0.0)
    return out


def failure_note(status, code, lines, timeout):
    """One line for a row without a result: the time limit, or the run's own error line (the exception line
    that ends a traceback, else the last 'error...' line, else the last line)."""
    if status == "timeout":
        return f"timeout: no result within {timeout:.0f} s (killed)"
    text = [line for _, line in lines if line.strip()]
    tb = [i for i, line in enumerate(text) if line.startswith("Traceback")]
    after = [line for line in text[tb[-1] + 1:] if not line[:1].isspace()] if tb else []
    errors = [line for line in text if ERROR_LINE.match(line)]
    last = after[-1] if after else errors[-1] if errors else text[-1] if text else "no output"
    return f"failed (exit {code}): {last[:200]}"


# ---------------------------------------------------------------------------------------------- data


def build_data(cfg, vocab):
    """Sample data for `vocab` (data/build_sample_data.py, offline) and two data folders linking its train shards:
    train/ with a short val shard (the rows' end-of-training validation), eval/ with cfg val_tokens tokens
    (the sample's val text repeated) for the evaluation comparison. Returns (train dir, eval dir, tokenizer)."""
    import numpy as np

    sys.path.insert(0, str(REPO / "data"))
    import shards

    root = cfg["dir"] / "data"
    sample = root / "datasets" / f"sample_sp{vocab}"
    tokenizer = root / "tokenizers" / f"sample_{vocab}_bpe.model"
    if not tokenizer.is_file():
        proc = subprocess.run([sys.executable, str(REPO / "data" / "build_sample_data.py"), "--out-dir", str(root),
                               "--vocab-size", str(vocab)], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"building the vocab-{vocab} sample data failed: "
                               f"{(proc.stderr.strip() or '?').splitlines()[-1]}")
    val = np.concatenate([np.fromfile(f, dtype="<u2", offset=shards.HEADER_BYTES)
                          for f in sorted(sample.glob("fineweb_val_*.bin"))])
    seq = int(cfg["model"].get("EVAL_SEQ_LEN", "2048"))
    dirs = []
    for name, n in (("train", 4 * seq + 1), ("eval", cfg["val_tokens"])):
        d = root / f"{name}_sp{vocab}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for f in sorted(sample.glob("fineweb_train_*.bin")):
            (d / f.name).symlink_to(f)
        shards.write_shard(d / "fineweb_val_000000.bin", np.resize(val, n))
        dirs.append(d)
    return dirs[0], dirs[1], tokenizer


# ---------------------------------------------------------------------------------------------- rows


def child_env(cfg, extra):
    """The environment of a row's process: ours without BENCH_* and torchrun variables, unbuffered output, and
    one Inductor cache for all rows (under BENCH_DIR, so a warm device machine keeps it between calls)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cfg["dir"] / "inductor_cache"))
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def training_env(cfg, data, run_id):
    """What every training row shares: N timed steps without a time cap or warmdown (so no late QAT: the steady
    steps of most of a real run), no validation before the end, train-loss lines at steps 1-10 and the last."""
    train_dir, _, tokenizer = data
    return {**cfg["model"], "ITERATIONS": str(cfg["steps"]), "WARMUP_STEPS": str(cfg["warmup"]),
            "MAX_WALLCLOCK_SECONDS": "0", "WARMDOWN_ITERS": "0", "VAL_LOSS_EVERY": "0",
            "TRAIN_LOG_EVERY": str(cfg["steps"]), "TTT_ENABLED": "0", "EVAL_STRIDE": "0",
            "DATA_PATH": str(train_dir), "TOKENIZER_PATH": str(tokenizer), "RUN_ID": run_id, "SEED": "1337"}


def plan_rows(cfg, help_text, presets, backends):
    """The rows of this run in the order they run (the comparison with the record first, so that a run cut short by
    BENCH_BUDGET still has it): dicts with name, env, kind (ours | record | record_script | eval | skip), note, and
    vs (the row whose step time ours_vs_record divides by). Optional rows run only when train_gpt.py --help lists
    their setting (presets: train_gpt.PRESETS); else 'skipped' says why."""
    loader = {f"ours p{p}c{c}": {"TRAIN_PREFETCH": p, "TRAIN_COPY_STREAM": c} for p in "01" for c in "01"}
    rows = [{"name": "ours p1c1 (default)", "kind": "ours", "env": loader.pop("ours p1c1"),
             "vs": RECORD_ROW if backends["ours"] == backends["record"] else None}]
    if backends["ours"] != backends["record"]:  # e.g. FA2 installed, FA3 not: compare on the record's backend
        rows.append({"name": "ours default, record's backend", "kind": "ours", "vs": RECORD_ROW,
                     "env": {"ATTENTION_BACKEND": backends["record"]}})
    record = {"name": RECORD_ROW, "kind": "record",
              "env": {"BIGRAM_VOCAB_SIZE": "1536", "TTT_FREEZE_BLOCKS": "0"}}  # its README command's values
    if cfg["tiny"]:
        record.update(kind="skip", note="skipped: needs CUDA (its main() requires it)")
    elif not RECORD_SCRIPT.is_file():
        record.update(kind="skip", note=f"skipped: {RECORD_SCRIPT} is not here (BENCH_ANCHORS)")
    rows += [record, {"name": "eval", "kind": "eval", "env": {}}]
    for name, env in loader.items():
        rows.append({"name": name, "kind": "ours", "env": env})
        if cfg["tiny"] and name != "ours p0c0":  # copy streams are CUDA only: p0c1 = p0c0, p1c0 = p1c1 on CPU
            rows[-1].update(kind="skip", note="skipped: tiny mode on CPU, where copy streams are off (CUDA only) and "
                                              "this row would repeat " + ("ours p0c0" if name == "ours p0c1" else
                                                                         "the default row"))
    if backends["fa4"]:
        rows.append({"name": "ours default, FA4", "kind": "ours", "env": {"ATTENTION_BACKEND": "flash_attn_4"}})
    for setting in ("FUSED_MLP", "FUSED_CE"):
        row = {"name": f"ours {setting}=1", "kind": "ours", "env": {setting: "1"}}
        if not re.search(rf"^\s*{setting}\s", help_text, re.M):
            row.update(kind="skip", note=f"skipped: {setting} is not a setting of this train_gpt.py (--help)")
        elif cfg["tiny"]:
            row.update(kind="skip", note="skipped: tiny mode on CPU, where the kernels fall back to eager (CUDA only; "
                                         "tests/test_kernels.py runs them in Triton's interpreter)")
        rows.append(row)
    for preset in ("record_0409", "record_0427", "record_0430", "record_0501"):
        if preset not in presets:
            rows.append({"name": f"PRESET={preset}", "kind": "skip", "env": {"PRESET": preset},
                         "note": f"skipped: PRESET={preset} does not exist in this train_gpt.py"})
            continue
        base = preset_base(cfg, presets, preset)
        if int(presets[preset].get("NUM_LOOPS", "0")) > 0:
            rows.append({"name": f"PRESET={preset} loop off", "kind": "ours", "env": {**base, "NUM_LOOPS": "0"}})
            rows.append({"name": f"PRESET={preset} loop on", "kind": "ours", "looping": True,
                         "env": {**base, "ENABLE_LOOPING_AT": "0"}})
            if cfg["tiny"] and preset != "record_0409":
                rows[-1].update(kind="skip", note="skipped: tiny mode runs record_0409's loop-on row only (the "
                                                  "same looping code; on CPU only the script is tested)")
        else:
            rows.append({"name": f"PRESET={preset}", "kind": "ours", "env": base})
        if presets[preset].get("TRAIN_LOADER") == "packed":
            rows += packed_attention_rows(cfg, preset, {**base, "NUM_LOOPS": "0"}, backends)
    rows += race_rows(cfg, presets, backends)
    if cfg["only"]:
        names = [r["name"] for r in rows]
        rows = [r for r in rows if any(o.strip() in r["name"] for o in cfg["only"])]
        if not rows:
            raise SystemExit(f"error: BENCH_ROWS={','.join(cfg['only'])!r} matches no row of: {', '.join(names)}")
    return rows


def preset_base(cfg, presets, preset):
    """A preset row's settings: the preset, its layer indices at tiny shapes, and what only the training steps need:
    COMPRESSOR=lzma where its compressor's package is missing, no n-gram tilt (nothing is scored to tilt)."""
    import train_gpt as tg

    layers = {k: v for k, v in cfg["preset_layers"].items() if k in presets[preset] or k == "XSA_LAST_N"}
    base = {"PRESET": preset, **layers}
    if tg.missing_modules(presets[preset].get("COMPRESSOR", "lzma")):
        base["COMPRESSOR"] = "lzma"  # only the training steps are measured; brotli/zpaq may be missing offline
    if presets[preset].get("NGRAM_TILT") == "1":
        base["NGRAM_TILT"] = "0"  # the training rows score nothing, so there is no final score to tilt
    return base


def race_rows(cfg, presets, backends):
    """The presets against their records' own scripts (issue 41): for record_0427, record_0501 and each context phase
    of record_0430 (its schedule's lengths, one per row pair: TRAIN_SEQ_LEN_SCHEDULE=L@0), loop off (NUM_LOOPS=0) and
    on (ENABLE_LOOPING_AT=0), a row of ours and a row of the record's script (kind record_script, run by
    scripts/bench/bench_record.py from our initial weights) with the same settings. Both sides attend with the same
    kernels: ours with ATTENTION_BACKEND=torch_varlen (dense rows SDPA, packed rows PyTorch's varlen_attn; sdpa, the
    masked path, where varlen_attn is missing), the record through scripts/record/record_shim, which calls those. Tiny
    mode runs TINY_RACE only (AUTOCAST_DTYPE=fp32: its first losses are compared with the record's)."""
    rows = []
    attention = "torch_varlen" if backends["torch_varlen"] else "sdpa"
    for preset in RACES:
        if preset not in presets:
            continue  # plan_rows already says the preset is missing
        base = {**preset_base(cfg, presets, preset), "ATTENTION_BACKEND": attention}
        schedule = base.pop("TRAIN_SEQ_LEN_SCHEDULE", presets[preset].get("TRAIN_SEQ_LEN_SCHEDULE", ""))
        if cfg["tiny"]:
            base["AUTOCAST_DTYPE"] = "fp32"
        phases = [(f" seq{n}", {"TRAIN_SEQ_LEN_SCHEDULE": f"{n}@0"}) for n in
                  (item.split("@")[0] for item in schedule.split(",") if item)] or [("", {})]
        for phase, phase_env in phases:
            for looping, loop_env in ((False, {"NUM_LOOPS": "0"}), (True, {"ENABLE_LOOPING_AT": "0"})):
                pair = f"race {preset}{phase} loop {'on' if looping else 'off'}"
                env = {**base, **phase_env, **loop_env}
                ours = {"name": f"{pair}: ours", "kind": "ours", "env": env, "looping": looping,
                        "vs": f"{pair}: its script"}
                record = {"name": f"{pair}: its script", "kind": "record_script", "record": preset, "env": env,
                          "looping": looping, "pair": ours["name"]}
                if not bench_record.record_script(ANCHORS, preset).is_file():
                    record.update(kind="skip", note=f"skipped: {bench_record.record_script(ANCHORS, preset)} is not "
                                                    "here (BENCH_ANCHORS)")
                if cfg["tiny"] and pair != TINY_RACE:
                    for row in (ours, record):
                        row.update(kind="skip", note=f"skipped: tiny mode runs the pair {TINY_RACE!r} only (the same "
                                                     "driver and mapping; CPU time)")
                rows += [ours, record]
    return rows


def packed_attention_rows(cfg, preset, base, backends):
    """A preset that packs documents (loops off): its packed rows through PyTorch's varlen_attn
    (ATTENTION_BACKEND=torch_varlen) against the exact masked SDPA fallback (ATTENTION_BACKEND=sdpa); both
    need CUDA (on CPU the masked path is what every row runs)."""
    rows = [{"name": f"PRESET={preset} packed torch_varlen", "kind": "ours",
             "env": {**base, "ATTENTION_BACKEND": "torch_varlen"}},
            {"name": f"PRESET={preset} packed masked (sdpa)", "kind": "ours",
             "env": {**base, "ATTENTION_BACKEND": "sdpa"}}]
    if cfg["tiny"]:
        for row in rows:
            row.update(kind="skip", note="skipped: needs CUDA (the pair compares CUDA kernels)")
    elif not backends["torch_varlen"]:
        rows[0].update(kind="skip", note="skipped: this PyTorch's varlen_attn lacks window_size (2.11 on)")
    return rows


def run_training_row(cfg, row, data_for, deadline, hparams_for):
    """One training row: its process under min(BENCH_ROW_TIMEOUT, time left), stopped after the training lines."""
    left = deadline - time.monotonic()
    if left < 10:
        return {"status": "skipped: BENCH_BUDGET used up", "note": "run it alone with BENCH_ROWS"}
    timeout = min(cfg["row_timeout"], left)
    run_id = "bench_" + re.sub(r"[^A-Za-z0-9]+", "_", row["name"]).strip("_")
    try:
        env = {**training_env(cfg, data_for(row), run_id), **row["env"]}
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return {"status": f"failed: {e}"}
    hparams_env = env  # our settings of the row (a record_script row's process gets them in the record's names)
    if row["kind"] == "record":
        cmd, stop = [sys.executable, str(RECORD_SCRIPT)], r"^peak memory allocated"
        if importlib.util.find_spec("flash_attn_interface") is None:  # FA3 missing: the SDPA stand-in
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ANCHORS), os.environ.get("PYTHONPATH", "")]))
            row["backend"] = "sdpa (anchors stand-in)"
    elif row["kind"] == "record_script":  # a frontier record's own script, driven from our initial weights
        try:
            inits = cfg.setdefault("inits", {})  # one model per settings that shape it (NUM_LOOPS: skip weights)
            key = json.dumps({k: v for k, v in env.items() if k not in ("RUN_ID", "TRAIN_SEQ_LEN_SCHEDULE",
                                                                        "ENABLE_LOOPING_AT")}, sort_keys=True)
            if key not in inits:
                inits[key] = bench_record.write_initial_weights(hparams_for(env), cfg["dir"] / f"{run_id}.init.pt")
            env = {**bench_record.record_env(ANCHORS, row["record"], env, cfg["tiny"]),
                   "BENCH_RECORD_INIT": str(inits[key])}
        except Exception as e:  # noqa: BLE001 (building our model or mapping the settings: this row fails, not the run)
            return {"status": f"failed: {type(e).__name__}: {e}"}
        cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_record.py"), row["record"]]
        stop = r"^bench_record: done"
    else:
        cmd, stop = [sys.executable, str(REPO / "train_gpt.py")], r"^final_weights:"
    status, code, lines = run_logged(cmd, child_env(cfg, env), cfg["dir"], timeout, stop)
    (cfg["dir"] / f"{run_id}.console.txt").write_text("".join(f"{t:9.3f} {ln}\n" for t, ln in lines))
    result = {"log": f"{run_id}.console.txt"}
    if status != "stopped" and not (status == "exited" and code == 0):
        return {**result, "status": failure_note(status, code, lines, timeout)}
    try:
        result.update(parse_training(lines), status="ok")
    except ValueError as e:
        return {**result, "status": f"parse error: {e}"}
    result.setdefault("backend", row.get("backend", "flash_attn_3" if row["kind"] == "record" else None))
    h = hparams_for(hparams_env)
    tokens = h.train_batch_tokens
    result["tokens_per_s"] = tokens / (result["ms_per_step"] / 1000.0)
    result["flops_per_token"] = flops_per_token(h, row.get("looping", False))
    return result


def internal(mode, cfg, env, timeout):
    """Runs this script in `mode` (matmul | eval) as a child under a time limit; returns (dict or None, note)."""
    status, code, lines = run_logged([sys.executable, str(Path(__file__).resolve()), f"--{mode}"],
                                     child_env(cfg, env), cfg["dir"], timeout)
    (cfg["dir"] / f"bench_{mode}.console.txt").write_text("".join(f"{t:9.3f} {ln}\n" for t, ln in lines))
    tag = EVAL_TAG if mode == "eval" else MATMUL_TAG
    for _, line in lines:
        if line.startswith(tag):
            try:
                return json.loads(line[len(tag):]), ""
            except json.JSONDecodeError as e:
                return None, f"parse error: {e}"
    return None, failure_note(status, code, lines, timeout)


# ---------------------------------------------------------------------------------------------- child: matmul peak


def matmul_peak():
    """The device's measured matmul rate (TFLOP/s): bf16 8192^3 on CUDA, fp32 256^3 on CPU (tiny)."""
    import torch

    cuda = torch.cuda.is_available() and os.environ.get("DEVICE", "") != "cpu"
    n, dtype, dev = (8192, torch.bfloat16, "cuda") if cuda else (512, torch.float32, "cpu")
    a, b = torch.randn(n, n, dtype=dtype, device=dev), torch.randn(n, n, dtype=dtype, device=dev)
    reps = 20
    for _ in range(3):
        a @ b
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    rate = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12
    print(MATMUL_TAG + json.dumps({"tflops": rate, "what": f"{str(dtype).replace('torch.', '')} {n}^3 on {dev}"}),
          flush=True)


# ---------------------------------------------------------------------------------------------- child: evaluations


def record_tail_sums(rt, model, val_tokens, luts, min_len):
    """[nll, tokens, bytes] of the windows the record's evaluation adds at the end of the stream: its windows
    start every stride up to the end, so the truncated ones (length < EVAL_SEQ_LEN, at least min_len) each score
    their last stride targets again (docs/evaluation.md, "Every target scored once"). Ours scores every target once; these sums make
    our result comparable with the record's. Needs (targets - EVAL_SEQ_LEN) % stride == 0."""
    import torch
    import torch.nn.functional as F

    h, total = rt.h, val_tokens.numel() - 1
    L, S = h.eval_seq_len, h.eval_stride
    sums = torch.zeros(3, dtype=torch.float64)
    model.eval()
    with torch.inference_mode():
        for ws in range(total - L + S, total, S):
            wlen = total - ws
            if wlen < min_len:
                continue
            span = val_tokens[ws:total + 1].to(rt.device).long()
            with rt.autocast():
                logits = model.forward_logits(span[None, :-1])
            first = max(wlen - S, 0)
            nll = F.cross_entropy(logits.float()[0, first:], span[1:][first:], reduction="sum")
            sums += torch.tensor([nll.item(), wlen - first,
                                  float(luts.count(span[:-1][first:].cpu(), span[1:][first:].cpu()).sum())],
                                 dtype=torch.float64)
    return sums


def with_tail(loss, bpb, total, tail):
    """Our (val_loss, val_bpb) over `total` targets plus the record's extra tail scorings -> its bpb."""
    nll, nbytes = loss * total, loss * total / (math.log(2.0) * bpb)
    loss2 = (nll + float(tail[0])) / (total + float(tail[1]))
    return loss2 / math.log(2.0) * (total + float(tail[1])) / (nbytes + float(tail[2]))


def eval_compare():
    """Ours vs the record's sliding-window and TTT evaluation functions on one model (ours at SEED's initial
    weights, restored before each call), same val tokens and device; prints one EVAL_TAG json line."""
    import types

    import sentencepiece as spm
    import torch

    sys.path.insert(0, str(REPO))
    import train_gpt as tg

    if importlib.util.find_spec("flash_attn_interface") is None:
        sys.path.insert(0, str(ANCHORS))  # the record's module imports FA3; the SDPA stand-in where it is missing
    spec = importlib.util.spec_from_file_location("record_0323", RECORD_SCRIPT)
    rec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rec)

    h = tg.Hyperparameters()
    rt = tg.setup_runtime(h)
    backend = tg.select_attention_backend(rt.device, h.attention_backend)
    model = rt.prepare_model(tg.build_model(h))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    luts = tg.build_byte_luts(h.tokenizer_path, h.vocab_size)
    rec_luts = rec.build_sentencepiece_luts(spm.SentencePieceProcessor(model_file=h.tokenizer_path), h.vocab_size,
                                           rt.device)
    val = tg.load_validation_tokens(h.val_files, h.eval_seq_len, h.vocab_size)
    total = val.numel() - 1
    args = types.SimpleNamespace(train_seq_len=h.eval_seq_len, **{k: getattr(h, k) for k in (
        "ttt_chunk_tokens", "ttt_lr", "ttt_epochs", "ttt_freeze_blocks", "ttt_momentum", "ttt_batch_seqs",
        "ttt_grad_clip")})

    def timed(fn):
        """fn(tokens) first on a warm-up prefix of two TTT chunks (compiles, autotunes), then timed on all."""
        torch._dynamo.reset()  # each side compiles its own graphs
        warm = val[:2 * h.ttt_chunk_tokens + 1]
        rt.sync()
        t0 = time.perf_counter()
        model.load_state_dict(initial)
        fn(warm)
        rt.sync()
        t1 = time.perf_counter()
        model.load_state_dict(initial)
        loss, bpb = fn(val)
        rt.sync()
        return {"warmup_s": t1 - t0, "s": time.perf_counter() - t1}, loss, bpb

    def compiled_pair(rt, model):
        """The evaluation's two callables as train_gpt.py's evaluation compiles them (eager without compile)."""
        return (tg.compile_fn(rt, "eval_logits", model.forward_logits, model.graph_state, 2),
                tg.compile_fn(rt, "eval_forward", model, model.graph_state, 4))

    out = {"backend": backend, "targets": total, "compile": int(tg.compile_enabled(rt)), "device": str(rt.device)}
    logits_fn, forward = compiled_pair(rt, model)
    ours, loss, bpb = timed(lambda v: tg.eval_sliding(rt, model, logits_fn, v, luts))
    tail = record_tail_sums(rt, model, val, luts, 1)
    recs, _, rec_bpb = timed(lambda v: rec.eval_val_sliding(args, model, 0, 1, rt.device, v, *rec_luts,
                                                            stride=h.eval_stride, batch_seqs=h.eval_batch_seqs,
                                                            eval_seq_len=h.eval_seq_len))
    out["sliding"] = {"ours": ours, "ours_bpb": bpb, "ours_as_record_bpb": with_tail(loss, bpb, total, tail),
                      "record": recs, "record_bpb": rec_bpb}
    logits_fn, forward = compiled_pair(rt, model)
    ours, loss, bpb = timed(lambda v: tg.eval_ttt(rt, model, logits_fn, forward, v, luts))
    tail = record_tail_sums(rt, model, val, luts, h.eval_stride)  # the model as it scored the last chunk
    recs, _, rec_bpb = timed(lambda v: rec.eval_val_sliding_ttt(args, model, 0, 1, rt.device, v, *rec_luts,
                                                                stride=h.eval_stride, batch_seqs=h.eval_batch_seqs,
                                                                log0=lambda *a, **k: None))
    out["ttt"] = {"ours": ours, "ours_bpb": bpb, "ours_as_record_bpb": with_tail(loss, bpb, total, tail),
                  "record": recs, "record_bpb": rec_bpb}
    print(EVAL_TAG + json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------------- table


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(rows):
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [str(r.get(c, "-") if r.get(c) is not None else "-").replace("|", "/") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def training_cells(row, result, peak, record_ms):
    cells = {"row": row["name"], "settings": " ".join(f"{k}={v}" for k, v in row["env"].items()) or "-",
             "status": result.get("status", row.get("note", "-")), "note": result.get("note", "")}
    if result.get("status") != "ok":
        cells["note"] = (cells["note"] + " " + (f"log: {result['log']}" if "log" in result else "")).strip()
        return cells
    ms = result["ms_per_step"]
    cells.update(ms_per_step=f"{ms:.2f}", tokens_per_s=f"{result['tokens_per_s']:,.0f}",
                 data_wait_ms=fmt(result.get("data_wait_ms"), ".3f"), peak_mib=fmt(result.get("peak_mib"), "d"),
                 compile_s=fmt(result.get("compile_s"), ".1f"))
    if peak:
        cells["mfu"] = f"{100 * result['flops_per_token'] * result['tokens_per_s'] / (peak * 1e12):.1f}%"
    if record_ms:  # the step time of the row it races (row["vs"])
        cells["ours_vs_record"] = f"{ms / record_ms:.3f}"
    backend, packed = result.get("backend"), result.get("packed_backend")
    cells["note"] = "; ".join(filter(None, [f"backend {backend}" if backend else "",
                                            f"packed rows {packed}" if packed else "",
                                            f"{result['flops_per_token'] / 1e6:.1f} MFLOP/token",
                                            f"log: {result['log']}"]))
    return cells


def race_cells(cfg, cells, ours, record):
    """A record_script row's first losses beside its pair's (ours: the same initial weights, the same batches): in
    its note; in tiny mode (CPU, fp32 both) a difference beyond RACE_LOSS_TOL is the row's status."""
    if ours.get("status") != "ok":
        cells["note"] = "first losses not compared (our row has no result); " + cells["note"]
        return cells
    steps = [s for s in sorted(RACE_LOSS_TOL) if s in ours["losses"] and s in record["losses"]]
    pairs = ", ".join(f"{s}: {record['losses'][s]:.4f}/{ours['losses'][s]:.4f}" for s in steps)
    cells["note"] = f"first losses record/ours {pairs}; " + cells["note"]
    bad = [s for s in steps if abs(record["losses"][s] - ours["losses"][s]) > RACE_LOSS_TOL[s]]
    if cfg["tiny"] and (bad or not steps):
        cells["status"] = f"losses differ from ours' at steps {bad or 'compared: none'} (tolerance {RACE_LOSS_TOL})"
    return cells


def eval_cells(result, note):
    rows = []
    for kind in ("sliding", "ttt"):
        name = {"sliding": "eval sliding window", "ttt": "eval legal TTT"}[kind]
        if result is None:
            rows.append({"row": name, "status": note})
            continue
        r = result[kind]
        diff = abs(r["ours_as_record_bpb"] - r["record_bpb"])
        ours_s, rec_s = r["ours"]["s"], r["record"]["s"]
        rows.append({"row": name, "settings": f"{result['targets']:,} targets, {result['backend']}",
                     "status": "ok" if diff <= 1e-4 else f"bpb differs by {diff:.2e}",
                     "tokens_per_s": f"{result['targets'] / ours_s:,.0f}", "ours_vs_record": f"{ours_s / rec_s:.3f}",
                     "bpb": f"{r['ours_bpb']:.6f}",
                     "note": (f"ours {ours_s:.2f} s, record's function {rec_s:.2f} s after a warm-up on 2 TTT chunks "
                              f"(incl. compile: ours {r['ours']['warmup_s']:.1f} s, record "
                              f"{r['record']['warmup_s']:.1f} s); record bpb {r['record_bpb']:.6f} = ours with its "
                              f"tail re-scoring {r['ours_as_record_bpb']:.6f} (diff {diff:.1e})")})
    if result is not None:
        ours, rec = (sum(result[k][side]["s"] for k in ("sliding", "ttt")) for side in ("ours", "record"))
        rows.append({"row": "eval sliding + TTT", "status": "ok", "ours_vs_record": f"{ours / rec:.3f}",
                     "note": f"ours {ours:.2f} s, record's functions {rec:.2f} s (goal: ratio <= 0.6)"})
    return rows


def environment_lines(cfg, backends, peak_info):
    import torch

    lines = [f"bench_gpu: {'tiny shapes (no CUDA or BENCH_TINY=1)' if cfg['tiny'] else 'record shapes'}, "
             f"{cfg['steps']} timed steps after {cfg['warmup']} warm-up steps per row, PyTorch {torch.__version__}, "
             f"Python {sys.version.split()[0]}"]
    if torch.cuda.is_available():
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            smi = ""
        lines.append(f"gpu: {smi or torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})")
    stand_in = "" if backends["record"] == "flash_attn_3" else " (FA3 missing: the SDPA stand-in of ../shared/anchors)"
    lines.append(f"attention: ours {backends['ours']} by default, record {backends['record']}{stand_in}"
                 + ("; FA4 (flash_attn.cute) importable" if backends["fa4"] else "")
                 + ("; PyTorch's varlen_attn usable (torch_varlen)" if backends["torch_varlen"] else ""))
    lines.append("races (race ... rows): ours with ATTENTION_BACKEND="
                 f"{'torch_varlen' if backends['torch_varlen'] else 'sdpa'} against the record's own script through "
                 "scripts/record/record_shim (its flash_attn_interface calls the same PyTorch kernels) from our "
                 "initial weights; ours_vs_record = ours / its script")
    lines.append("peak for MFU: " + (f"{peak_info['tflops']:.3f} TFLOP/s measured ({peak_info['what']})"
                                     if peak_info else "not measured"))
    lines.append("ms_per_step: (train_time at the last step - at step 1) / (steps - 1); MFU: FLOPs/token x tokens/s "
                 "/ peak; compile_s: warm-up time minus its steps at ms_per_step")
    if cfg["tiny"]:
        lines.append("tiny mode tests this script: its timings (CPU, tiny model) and MFU (small fp32 matmul peak) "
                     "say nothing about a GPU")
    lines.append(ROWS.summary())
    return lines


def backend_plan(tiny):
    """Which attention kernel ours picks by default here, and which the record's script gets (tiny: CPU, SDPA)."""
    def importable(mod, attr="flash_attn_func"):
        try:  # finding a submodule imports its package, which may fail in any way
            spec = importlib.util.find_spec(mod)
        except Exception:
            return False
        return spec is not None and attr in (Path(spec.origin).read_text(errors="replace") if spec.origin else "")

    fa3 = importable("flash_attn_interface")
    if tiny:
        return {"ours": "sdpa", "record": "sdpa", "fa4": False, "torch_varlen": False}
    import train_gpt as tg

    ours = "flash_attn_3" if fa3 else ("flash_attn_2" if importable("flash_attn") else "sdpa")
    return {"ours": ours, "record": "flash_attn_3" if fa3 else "sdpa", "fa4": importable("flash_attn.cute"),
            "torch_varlen": tg.import_torch_varlen() is not None}


def run_eval(cfg, data_for, backends, deadline):
    """The evaluation comparison in its own process: (result or None, note)."""
    try:
        _, eval_dir, tokenizer = data_for({"env": {}})
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return None, f"failed: {e}"
    left = deadline - time.monotonic()
    if left < 20:
        return None, "skipped: BENCH_BUDGET used up (BENCH_ROWS=eval runs it alone)"
    if not RECORD_SCRIPT.is_file():
        return None, f"skipped: {RECORD_SCRIPT} is not here (BENCH_ANCHORS)"
    env = {**cfg["model"], "DATA_PATH": str(eval_dir), "TOKENIZER_PATH": str(tokenizer), "RUN_ID": "bench_eval",
           "TTT_ENABLED": "1", "SEED": "1337", "ATTENTION_BACKEND": backends["record"]}  # one model for both sides
    if cfg["tiny"]:  # the record's functions autocast only on CUDA: compare in fp32, eager, on CPU
        env.update(DEVICE="cpu", AUTOCAST_DTYPE="fp32", TORCHDYNAMO_DISABLE="1")
    return internal("eval", cfg, env, min(cfg["row_timeout"] * 2, left))


def main():
    if sys.argv[1:2] == ["--row-server"] and len(sys.argv) == 3:
        return serve_rows(int(sys.argv[2]))
    if sys.argv[1:] == ["--matmul"]:
        return matmul_peak()
    if sys.argv[1:] == ["--eval"]:
        return eval_compare()
    if sys.argv[1:]:
        raise SystemExit(f"error: unexpected argument {sys.argv[1]!r}: settings are BENCH_* variables (docs/gpu.md)")
    cfg = bench_config(os.environ)
    start = time.monotonic()
    deadline = start + cfg["budget"]
    cfg["dir"].mkdir(parents=True, exist_ok=True)
    if cfg["tiny"]:
        ROWS.start_server(child_env(cfg, cfg["model"]))
    try:
        run_bench(cfg, start, deadline)
    finally:
        ROWS.stop()


def run_bench(cfg, start, deadline):
    """Every row, run and tabulated (main's work, around the row server's life)."""
    sys.path.insert(0, str(REPO))
    import train_gpt as tg

    # the optional rows run only for settings this train_gpt.py lists (its --help, forked in tiny mode)
    _, _, lines = run_logged([sys.executable, str(REPO / "train_gpt.py"), "--help"], child_env(cfg, cfg["model"]),
                             cfg["dir"], 120)
    help_text = "\n".join(line for _, line in lines)
    presets = tg.PRESETS
    backends = backend_plan(cfg["tiny"])
    rows = plan_rows(cfg, help_text, presets, backends)
    data = {}

    def data_for(row):
        preset = row["env"].get("PRESET")
        vocab = int(row["env"].get("VOCAB_SIZE") or presets.get(preset, {}).get("VOCAB_SIZE") or 1024)
        if vocab not in data:
            data[vocab] = build_data(cfg, vocab)
        return data[vocab]

    def hparams_for(env):
        return tg.Hyperparameters(env)

    peak_info, peak_note = internal("matmul", cfg, {k: v for k, v in cfg["model"].items() if k == "DEVICE"}, 120)
    results = []
    for row in rows:
        if row["kind"] != "skip":
            print(f"bench_gpu: {row['name']} ...", file=sys.stderr, flush=True)
        if row["kind"] == "skip":
            results.append((row, {"status": row["note"]}))
        elif row["kind"] == "eval":
            results.append((row, run_eval(cfg, data_for, backends, deadline)))
        else:
            results.append((row, run_training_row(cfg, row, data_for, deadline, hparams_for)))
    by_name = {row["name"]: res for row, res in results if row["kind"] != "eval"}
    out_rows = []
    for row, res in results:
        if row["kind"] == "eval":
            out_rows += eval_cells(*res)
            continue
        vs = by_name.get(row.get("vs") or "", {})
        cells = training_cells(row, res, peak_info and peak_info["tflops"],
                               vs.get("ms_per_step") if vs.get("status") == "ok" else None)
        if row["kind"] == "record_script" and res.get("status") == "ok":
            cells = race_cells(cfg, cells, by_name.get(row["pair"], {}), res)
        out_rows.append(cells)
    if peak_info is None:
        out_rows.append({"row": "matmul peak", "status": peak_note})
    text = "\n".join(environment_lines(cfg, backends, peak_info) + ["", table(out_rows), "",
                     f"bench_gpu: done in {time.monotonic() - start:.0f} s; logs in {cfg['dir']}"])
    (cfg["dir"] / "table.md").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
