"""A frontier record's own train_gpt.py, driven for the GPU benchmark's record rows (issue 41; docs/gpu.md, "The
presets against the records' own scripts").

    python scripts/bench/bench_record.py record_0427     # its Hyperparameters from the environment (record_env())

Imports the record's script (../shared/anchors/frontier/<record>/train_gpt.py, never copied) with
scripts/record/record_shim first on sys.path (its flash_attn_interface runs our attention kernels) and runs the
record's own training code:
main() on CUDA (its backend flags, its torch.compile calls, its train_model and step_fn), stopped after training.
Around it, without touching its math: every `N/M train_loss:` line it logs (TRAIN_LOG_EVERY=1, each after its
`.item()`) is followed by the same step in our log format with a synchronised clock; its loader's next_batch() is
timed (data wait, as ours measures it); the end of its warm-up is logged as our warmup_time line; its end-of-training
validation (not timed, not a step) is skipped. A driver rather than its log alone (as the 03-23 record's row is
read): its log gives train_time in tenths of a minute and no data wait, and its main() needs CUDA.

Without CUDA (tests, BENCH_TINY=1) the same training code runs on CPU: train_and_eval() instead of main(), eager
(TORCHDYNAMO_DISABLE=1), fp32 (the model's parameters as float32, its bf16-rounded embedding values kept), its Triton
MLP and cross-entropy off (use_fused, FUSED_CE_ENABLED=0), CUDA streams and synchronisation as no-ops. That is the
record's math at tiny shapes, for the first losses to be compared with ours (tests/test_bench_gpu.py).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "scripts" / "record" / "record_shim"
RECORDS = ("record_0427", "record_0430", "record_0501")
DONE = "bench_record: done"
# logged names that are this run's, not the record's settings (rank, paths, seed), or not environment variables
RUN_LOCAL = {"world_size", "rank", "local_rank", "grad_accum_steps", "distributed", "is_main_process", "data_dir",
             "datasets_dir", "train_files", "val_files", "val_bytes_files", "tokenizer_path", "logfile", "model_path",
             "quantized_model_path", "run_id", "artifact_dir", "seed"}
# what the runs' launch commands set that their dumps do not show (#2014's README sets ASYM_LOGIT_RESCALE=1)
LAUNCH = {"record_0430": {"ASYM_LOGIT_RESCALE": "1"}}
# the settings a benchmark row gives ours -> the record's environment variable of the same meaning
OURS_TO_RECORD = {**{name: name for name in (
    "NUM_LAYERS", "MODEL_DIM", "NUM_HEADS", "NUM_KV_HEADS", "TRAIN_SEQ_LEN", "EVAL_SEQ_LEN", "TRAIN_BATCH_TOKENS",
    "LOOP_START", "LOOP_END", "XSA_LAST_N", "NUM_LOOPS", "ENABLE_LOOPING_AT", "ITERATIONS", "WARMUP_STEPS",
    "MAX_WALLCLOCK_SECONDS", "WARMDOWN_ITERS", "SEED", "DATA_PATH", "TOKENIZER_PATH", "RUN_ID", "OMP_NUM_THREADS")},
    "PARALLEL_RESIDUAL_START": "PARALLEL_START_LAYER", "VAL_BATCH_SIZE": "VAL_BATCH_TOKENS",
    "TRAIN_SEQ_LEN_SCHEDULE": "TRAIN_SEQ_SCHEDULE"}
# ... and those with no counterpart there: ours only (the preset is the record's logged run, the attention kernel
# is the shim's, the precision its own), evaluation settings (the rows only train) or set by record_env itself
OURS_ONLY = {"PRESET", "ATTENTION_BACKEND", "AUTOCAST_DTYPE", "DEVICE", "VE_LAYERS", "COMPRESSOR", "NGRAM_TILT",
             "TTT_ENABLED", "EVAL_STRIDE", "TTT_CHUNK_TOKENS", "EVAL_BATCH_SEQS", "TTT_BATCH_SEQS", "TRAIN_LOG_EVERY",
             "VAL_LOSS_EVERY"}


def record_script(anchors, record):
    return Path(anchors) / "frontier" / record / "train_gpt.py"


def logged_env(anchors, record):
    """The record's run as environment variables: every value its seed-42 run logged (FRONTIER/<record>_hparams.txt;
    True/False as 1/0; list values and this run's rank, paths and seed left out), the values its header lists as
    read outside the dump (A=1, B=2) and what its launch set besides (LAUNCH)."""
    text = (Path(anchors) / "frontier" / f"{record}_hparams.txt").read_text(encoding="utf-8")
    env = {}
    for line in text.splitlines():
        if line.startswith("#"):
            m = re.search(r"missing from this dump: (.*?)\.?$", line)
            for item in (m.group(1).split(", ") if m else []):
                key, _, value = item.partition("=")
                env[key.strip()] = value.strip()
            continue
        key, sep, value = line.partition(": ")
        if not sep and line.endswith(":"):
            key, value = line[:-1], ""
        if not key or key in RUN_LOCAL or value.startswith(("[", "(")):
            continue
        env[key.upper()] = {"True": "1", "False": "0"}.get(value, value)
    return {**env, **LAUNCH.get(record, {})}


def record_schedule(ours):
    """Our TRAIN_SEQ_LEN_SCHEDULE ('L@start,...': L from that training fraction on) as the record's
    TRAIN_SEQ_SCHEDULE ('L@end,...': L until that fraction)."""
    stages = [(int(s.split("@")[0]), float(s.split("@")[1])) for s in ours.split(",") if s.strip()]
    ends = [start for _, start in stages[1:]] + [1.0]
    return ",".join(f"{n}@{end:g}" for (n, _), end in zip(stages, ends))


def record_env(anchors, record, ours_env, tiny):
    """The environment of the record's row: its logged run, then the row's settings in the record's names (shapes,
    loop, schedule, steps, data), the bench's logging (a train line per step, no validation) and plain (not CaseOps)
    sample data; on CPU (tiny) its fused Triton cross-entropy off."""
    env = logged_env(anchors, record)
    unknown = sorted(set(ours_env) - set(OURS_TO_RECORD) - OURS_ONLY)
    if unknown:
        raise ValueError(f"bench_record.record_env: no mapping to the record's settings for {', '.join(unknown)}")
    for key, value in ours_env.items():
        if key in OURS_TO_RECORD:
            env[OURS_TO_RECORD[key]] = record_schedule(value) if key == "TRAIN_SEQ_LEN_SCHEDULE" else value
    if ours_env.get("TRAIN_SEQ_LEN_SCHEDULE"):  # the record wants TRAIN_SEQ_LEN = its schedule's longest context
        env["TRAIN_SEQ_LEN"] = str(max(int(s.split("@")[0]) for s in ours_env["TRAIN_SEQ_LEN_SCHEDULE"].split(",")))
    env.update(TRAIN_LOG_EVERY="1", VAL_LOSS_EVERY="0", CASEOPS_ENABLED="0")
    if tiny:  # on CPU, even on a machine with a GPU (as ours runs with DEVICE=cpu)
        env.update(FUSED_CE_ENABLED="0", TORCHDYNAMO_DISABLE="1", CUDA_VISIBLE_DEVICES="")
    return env


# our parameter names -> the 04-27 records' (the banks and the rest are named alike; tests/test_model_0427.py)
RECORD_NAMES = {"lanes.post": "parallel_post_lambdas", "lanes.resid": "parallel_resid_lambdas",
                "smear_bos.gate": "smear_gate.weight", "smear_bos.lam": "smear_lambda"}


def write_initial_weights(h, path):
    """Our model's initial weights at h.seed (train_gpt.build_model, what our run starts from) in the record's names,
    for the record's row to start from (BENCH_RECORD_INIT): the records draw their initialisation in another order
    (e.g. 04-27: every attention bank, then the MLP banks; ours layer by layer), so at one SEED they start elsewhere."""
    import torch

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import train_gpt as tg

    state = tg.build_model(h).state_dict()
    torch.save({RECORD_NAMES.get(k, k.replace(".attn.attn_gate.weight", ".attn.attn_gate_w")): v
                for k, v in state.items()}, path)
    return path


# ---------------------------------------------------------------------------------------------- the driver


class _NoStream:
    """torch.cuda.Stream and current_stream() on CPU: the record's optimizer overlaps on an aux stream."""

    def wait_stream(self, other):
        pass


def cpu_stand_ins(torch):
    """The CUDA calls of the record's training code as no-ops on a machine without CUDA."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = lambda *a, **k: _NoStream()
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch._dynamo.config.disable = True
    empty = torch.empty  # its loader pins its host batches: no pinned memory without an accelerator
    torch.empty = lambda *a, pin_memory=False, **k: empty(*a, **k)
    torch.Tensor.pin_memory = lambda self, *a, **k: self


def import_record(path, name):
    sys.path[:0] = [str(SHIM), str(path.parent)]  # the shim first: it shadows an installed FlashAttention 3
    spec = importlib.util.spec_from_file_location(name, path)
    rec = importlib.util.module_from_spec(spec)
    sys.modules[name] = rec
    spec.loader.exec_module(rec)
    return rec


def drive(record, anchors):
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        cpu_stand_ins(torch)
    rec = import_record(record_script(anchors, record), f"{record}_train_gpt")
    import flash_attn_interface as shim

    assert Path(shim.__file__).parent == SHIM, f"flash_attn_interface came from {shim.__file__}, not the shim"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    state = {"wait_ms": 0.0, "wait_total": 0.0, "steps": 0, "loaders": 0, "t_entry": None, "t_loop": None}
    warmup, loops = rec.Hyperparameters.warmup_steps, rec.Hyperparameters.num_loops > 0  # read at its import
    print("attention_backend:sdpa", flush=True)
    packed = f"torch_varlen gqa:{shim.GQA}" if cuda and shim.VARLEN is not None else "torch_doc_blocks"
    print(f"attention_backend_packed:{packed}", flush=True)

    class TimedLoader(rec.DocumentPackingLoader):
        """The record's loader; next_batch()'s time is the data wait (ours: the time next_batch() blocks)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            state["loaders"] += 1
            if state["loaders"] == (2 if warmup > 0 else 1):  # the timed loop's loader (after the warm-up's)
                sync()
                state["t_loop"], state["wait_ms"] = time.perf_counter(), 0.0  # the warm-up's batches are not timed
                if warmup > 0:
                    ms = 1000.0 * (state["t_loop"] - state["t_entry"])
                    print(f"warmup_time: steps:{warmup * (2 if loops else 1)} ms:{ms:.0f} (the record's train_model "
                          "up to its timed loop: build, compile-shape passes, warm-up steps, restore)", flush=True)

        def next_batch(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super().next_batch(*args, **kwargs)
            state["wait_ms"] += 1000.0 * (time.perf_counter() - t0)
            return out

    rec.DocumentPackingLoader = TimedLoader
    train_line = re.compile(r"^(\d+)/(\d+) train_loss: (\S+)")
    record_log = rec.log

    def log(msg, console=True):
        text = str(msg)
        if text.startswith("peak memory allocated") and not cuda:
            return  # no CUDA memory to report
        record_log(msg, console)
        m = train_line.match(text) if console and state["t_loop"] is not None else None
        if m:
            sync()
            ms = 1000.0 * (time.perf_counter() - state["t_loop"])
            step = int(m.group(1))
            wait, state["wait_ms"] = state["wait_ms"], 0.0
            state["wait_total"] += wait
            state["steps"] = step
            print(f"step:{step}/{m.group(2)} train_loss:{m.group(3)} train_time:{ms:.0f}ms step_avg:{ms / step:.2f}ms "
                  f"data_wait_ms:{wait:.2f}", flush=True)

    rec.log = log

    def skipped_eval_val(*args, **kwargs):
        print("bench_record: end-of-training validation skipped (not a training step)", flush=True)
        return 0.0, 0.0

    rec.eval_val = skipped_eval_val
    restore, init = rec.restore_fp32_params, os.environ.get("BENCH_RECORD_INIT", "")

    def restore_fp32_params(model):
        restore(model)
        if state.setdefault("trained", model) is not model:
            return  # a later model (its evaluation's): as the record has it
        if init:  # our initial weights (write_initial_weights); the two softcap scalars of #2014/#2135 stay at theirs
            missing, unexpected = model.load_state_dict(torch.load(init, map_location="cpu"), strict=False)
            if unexpected or set(missing) - {"softcap_pos", "softcap_neg"}:
                raise SystemExit(f"error: BENCH_RECORD_INIT={init}: missing {missing}, unexpected {unexpected}")
            print(f"bench_record: initial weights from {init} (ours at SEED)", flush=True)
        if not cuda:  # fp32 on CPU (no autocast there): its bf16 embedding table's values as fp32; no Triton MLP
            model.float()
            for m in model.modules():
                if hasattr(m, "use_fused"):
                    m.use_fused = False

    rec.restore_fp32_params = restore_fp32_params
    train_model = rec.train_model

    def train_model_then_stop(*args, **kwargs):
        state["t_entry"] = time.perf_counter()
        train_model(*args, **kwargs)
        n = max(state["steps"], 1)
        print(f"data_wait: total_ms:{state['wait_total']:.1f} mean_ms_per_step:{state['wait_total'] / n:.3f} "
              f"(the record's next_batch)", flush=True)
        print(DONE, flush=True)
        raise SystemExit(0)

    rec.train_model = train_model_then_stop
    if cuda:
        rec.main()
    else:
        os.makedirs("logs", exist_ok=True)
        h = rec.Hyperparameters()
        rec.set_logging_hparams(h)
        rec.train_and_eval(h, torch.device("cpu"))


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in RECORDS:
        raise SystemExit(f"usage: {sys.argv[0]} {{{','.join(RECORDS)}}} (settings: the record's environment)")
    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    from bench_gpu import ANCHORS

    drive(sys.argv[1], ANCHORS)


if __name__ == "__main__":
    main()
