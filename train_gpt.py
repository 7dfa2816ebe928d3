"""Parameter Golf: 11-layer GPT, LeakyReLU^2 MLP, Parallel Muon, int6+lzma artifact, legal score-first TTT.

Run: torchrun --standalone --nproc_per_node=8 train_gpt.py   (settings: environment variables, see --help)
Defaults reproduce the 2026-03-23 record; improvements sit behind toggles, and PRESET=record_0409, record_0427,
record_0430 and record_0501 set those records' logged values (docs/presets.md). Sections in pipeline order.
"""

from __future__ import annotations

import bisect
import contextlib
import concurrent.futures
import copy
import datetime
import fnmatch
import glob
import importlib.util
import inspect
import io
import itertools
import json
import lzma
import math
import os
import queue
import random
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback
import uuid
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# ==================================================
# CONFIG
# ==================================================

# PREFLIGHT=1 changes these settings for the rehearsal (Hyperparameters._rehearse); the report gives both values
PREFLIGHT_CHANGES = ("ITERATIONS", "WARMDOWN_ITERS", "MAX_WALLCLOCK_SECONDS", "GPTQ_CALIBRATION_BATCHES",
                     "CHECKPOINT_EVERY", "VAL_LOSS_EVERY", "EVAL_BUDGET_SECONDS")
SIZE_CAP_BYTES = 16_000_000  # the competition's artifact cap: compressed model + code, decimal bytes
TRACK_WORLD_SIZE = 8  # the track's ranks (8xH100): an evaluation on as many is held to the track's budget
GET_DATA = ("build the sample: python3 data/build_sample_data.py && bash scripts/run/sample_run.sh; "
            "or download FineWeb: python3 data/cached_challenge_fineweb.py --variant sp1024")


# Settings that describe the machine, not the run: a specialised file (scripts/pack/specialise.py) never fixes them
MACHINE_SETTINGS = ("DEVICE", "COMPILE", "COMPILE_BACKEND", "AUTOCAST_DTYPE", "ATTENTION_BACKEND", "RANK", "WORLD_SIZE",
                    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                    "DIST_TIMEOUT_SECONDS", "TRAIN_PREFETCH", "TRAIN_PREFETCH_QUEUE", "TRAIN_COPY_STREAM", "VAL_PREFETCH",
                    "VAL_COPY_STREAM", "VAL_BYTECOUNT_DEVICE", "MICRO_BATCH_SPLIT")
# A specialised file (scripts/pack/pack_code.py --for) records here the full script's sha256, the run it was made for,
# the run's value of each setting it fixed and, for those it did not fold to that value outright, the conditions it
# folded ((op, literal, result) by name); empty in the full script (docs/submitting.md)
SPECIALISED = {}


class ConfigError(ValueError):
    """A bad setting or input (exit 2); the message names the variable or file and what is wrong."""


class RunError(RuntimeError):
    """A run that cannot go on, e.g. diverged training (exit 1)."""


def first_line(e):
    """An exception's message cut to one line, for one-line errors."""
    return (str(e).strip().splitlines() or [""])[0]


# PRESET: named sets of settings. A variable set explicitly in the environment wins over its preset value.
PRESETS = {
    "record_0323": {},  # the defaults: the 2026-03-23 record (SPEC.md)
    "record_0409": {  # the 2026-04-09 record's logged values (SPEC-FRONTIER 2, 4-7, 9, 10)
        "DATA_PATH": "./data/datasets/fineweb10B_sp8192", "TOKENIZER_PATH": "./data/tokenizers/fineweb_8192_bpe.model",
        "VOCAB_SIZE": "8192", "TRAIN_LOADER": "shuffled", "WARMDOWN_ITERS": "0", "WARMDOWN_FRAC": "0.72",
        "MLP_MULT": "4", "XSA_LAST_N": "11", "QK_GAIN_INIT": "5.25", "BIGRAM_VOCAB_SIZE": "0", "VE_ENABLED": "0",
        "SMEAR_GATE": "0", "NUM_LOOPS": "2", "LOOP_START": "3", "LOOP_END": "5", "ENABLE_LOOPING_AT": "0.35",
        "PARALLEL_RESIDUAL_START": "7", "SKIP_GATES": "1", "ROPE_TRAIN_SEQ_LEN": "2048",
        "MATRIX_LR": "0.022", "SCALAR_LR": "0.02", "TIED_EMBED_LR": "0.03", "MUON_ROW_NORMALIZE": "1",
        "MUON_WD": "0.095", "EMBED_WD": "0.085", "ADAM_WD": "0.02", "EMA_DECAY": "0.9965", "LATE_QAT_THRESHOLD": "0",
        "QUANT": "gptq", "GPTQ_RESERVE_SECONDS": "12", "GPTQ_CALIBRATION_BATCHES": "64",
        "MATRIX_CLIP_SIGMAS": "12.85", "EMBED_CLIP_SIGMAS": "20", "COMPRESSOR": "brotli", "TTT_LR": "0.005",
        "MUON_MOMENTUM_FP32": "1", "MUON_NS_CA_FIRST": "1", "ROPE_FREQS_BF16": "1",
        # not the record's: our code is larger than its (16,630 bytes packed), and its model (15,975,300) beside ours
        # would pass the cap; prune +-1 codes only when over (issue 40), so every preset's artifact is valid
        "TARGET_BYTES": "16000000",
    },
}
# The 2026-04-27 record (#1855, 1.06108): every value its seed-42 log lists, on top of record_0409's model
# (SPEC-FRONTIER 18; the name-by-name mapping and what is not mapped: docs/presets.md, tests/test_presets.py).
PRESETS["record_0427"] = {
    **PRESETS["record_0409"],
    # data: the CaseOps export (data/cached_challenge_fineweb.py --variant sp8192_caseops), documents packed
    "DATA_PATH": "./data/datasets/fineweb10B_sp8192_lossless_caps_caseops_v1_reserved",
    "TOKENIZER_PATH": "./data/tokenizers/fineweb_8192_bpe_lossless_caps_caseops_v1_reserved.model",
    "TRAIN_LOADER": "packed", "EVAL_SPLIT_AT_BOS": "1", "ITERATIONS": "20000", "VAL_LOSS_EVERY": "0",
    # model: SmearGate v2, the sparse attention gate, two lanes from layer 8, QK gain 5.0
    "QK_GAIN_INIT": "5.0", "SMEAR_GATE": "2", "GATE_WINDOW": "12", "ATTN_GATE": "sparse", "ATTN_GATE_SCALE": "0.5",
    "ATTN_GATE_INIT_STD": "0", "PARALLEL_MODE": "lanes", "PARALLEL_RESIDUAL_START": "8",
    # optimisers and schedule (its Parallel Muon keeps bf16 momentum and computes c*(A*A): our defaults)
    "MATRIX_LR": "0.026", "MUON_MOMENTUM": "0.97", "MUON_NS_COEFFS": "polar_express", "MUON_MOMENTUM_FP32": "0",
    "MUON_NS_CA_FIRST": "0", "BETA2": "0.99", "WARMDOWN_FRAC": "0.85", "MIN_LR": "0.1", "FUSED_MLP": "1",
    "FUSED_CE": "1",
    # artifact: per-class SDClip, int7 embeddings, quant gate, LQER, per-group compression
    "GPTQ_RESERVE_SECONDS": "0.5", "GPTQ_CALIBRATION_BATCHES": "16", "GPTQ_CALIBRATION_SEQS": "48",
    "EMBED_BITS": "7", "EMBED_CLIP_SIGMAS": "14", "MLP_CLIP_SIGMAS": "11.5", "ATTN_CLIP_SIGMAS": "13",
    "QUANT_GATE": "1", "LQER_RANK": "4", "LQER_TOP_K": "3", "LQER_GROUP": "64", "LQER_FACTOR_BITS": "4",
    "COMPRESSOR": "pergroup",
    # evaluation: document LoRA TTT with three global SGD phases over the first 2500 scored documents
    "TTT_MODE": "lora", "TTT_LORA_RANK": "80", "TTT_LORA_ALPHA": "144", "TTT_LORA_LR": "0.0001",
    "TTT_LORA_TARGETS": "q,k,v,o,mlp,head", "TTT_WARM_START_A": "1", "TTT_BETA1": "0", "TTT_BETA2": "0.99",
    "TTT_WEIGHT_DECAY": "0.5", "TTT_CHUNK_SIZE": "48", "TTT_BATCH_SIZE": "64", "PHASED_TTT_PREFIX_DOCS": "2500",
    "PHASED_TTT_NUM_PHASES": "3", "TTT_LR": "0.001", "TTT_EPOCHS": "1", "TTT_MOMENTUM": "0.9",
    "TTT_CHUNK_TOKENS": "32768", "TTT_BATCH_SEQS": "32", "TTT_GRAD_CLIP": "1.0",
    # its scored evaluations (scored_evaluations): no sliding window (its logged eval_stride is read by nothing)
    "EVAL_STRIDE": "0",
    # not the record's: its two diagnostic scores are left out of the 600 s evaluation (issue 46, docs/evaluation.md)
    "DIAGNOSTIC_POST_EMA": "0", "DIAGNOSTIC_ROUNDTRIP": "0",
}
# The 2026-04-30 row (#2014, 1.05759; SPEC-FRONTIER 19): #1855 plus AWQ-lite, QK gain 5.25, progressive training
# context 1024 -> 2048 -> 3072 with a 32-step LR re-warmup, context 3072 in evaluation and TTT, the tail scored,
# K/O/MLP/head LoRA only (TTT_MASK=no_qv) at 0.75x the LoRA LR, chunks of 8 / 24 tokens for batches whose longest
# document has <= 256 / 2000 tokens, batches of 24 documents, one phase.
PRESETS["record_0430"] = {
    **PRESETS["record_0427"],
    "QK_GAIN_INIT": "5.25", "TRAIN_SEQ_LEN": "3072", "ROPE_TRAIN_SEQ_LEN": "3072",
    "TRAIN_SEQ_LEN_SCHEDULE": "1024@0,2048@0.1,3072@0.7", "SEQ_LEN_REWARMUP_STEPS": "32",
    "EVAL_SEQ_LEN": "3072", "EVAL_INCLUDE_TAIL": "1", "GPTQ_RESERVE_SECONDS": "4",
    "AWQ_LITE": "1", "AWQ_LITE_BITS": "8", "AWQ_LITE_GROUP": "64", "AWQ_LITE_TOP_K": "1",
    "TTT_LORA_TARGETS": "k,o,mlp,head", "TTT_BATCH_SIZE": "24", "PHASED_TTT_NUM_PHASES": "1",
    "TTT_LOCAL_LR_MULT": "0.75", "TTT_CHUNK_SIZE_BY_DOC_LEN": "256:8,2000:24",
}

# The 2026-05-01 row (#2135, 1.05651, the top audited row; SPEC-FRONTIER 20): #1855 with MATRIX_LR 0.028, LQER groups of
# 32, 32 calibration batches, one phase, context 2560 in evaluation and TTT (never NTK-stretched: the record's RoPE
# does not stretch, ours does beyond ROPE_TRAIN_SEQ_LEN, so it is set to the longest context; its logged 2048 is
# read by nothing there), LoRA LR 8e-5 and wd 2.0 without the K adapters, no quant gate (attn_gate_w stored fp16),
# SmearGate v2 without its BOS mask as the run trained it, and the token n-gram tilt of its final score.
PRESETS["record_0501"] = {
    **PRESETS["record_0427"],
    "MATRIX_LR": "0.028", "LQER_GROUP": "32", "GPTQ_CALIBRATION_BATCHES": "32", "PHASED_TTT_NUM_PHASES": "1",
    "EVAL_SEQ_LEN": "2560", "ROPE_TRAIN_SEQ_LEN": "2560", "TTT_LORA_LR": "0.00008", "TTT_WEIGHT_DECAY": "2.0",
    "TTT_LORA_TARGETS": "q,v,o,mlp,head", "QUANT_GATE": "0", "VAL_LOSS_EVERY": "4000", "SMEAR_GATE_BOS_FIX": "0",
    "NGRAM_TILT": "1", "NGRAM_TILT_ORDER": "16", "NGRAM_TILT_THRESHOLD": "0.8", "NGRAM_TILT_BOOST": "2.625",
}


def file_name_max(folder):
    """The longest file name, in bytes, that `folder`'s filesystem allows (255 where it does not say)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (AttributeError, ValueError, OSError):
        return 255


def parse_chunk_steps(raw):
    """TTT_CHUNK_SIZE_BY_DOC_LEN "N1:C1,N2:C2,..." -> [(N, C)] sorted by N (SPEC-FRONTIER 19, #2014's
    TTT_SHORT_SCORE_FIRST_STEPS): a batch whose longest document has <= N tokens uses chunk C (the first N that
    fits), a longer one TTT_CHUNK_SIZE. "" -> []."""
    steps = []
    for item in filter(None, raw.replace(" ", "").split(",")):
        n, _, c = item.partition(":")
        if not (n.isdigit() and c.isdigit() and int(n) > 0 and int(c) > 0):
            raise ConfigError(f"TTT_CHUNK_SIZE_BY_DOC_LEN={raw!r} must look like '256:8,2000:24' (doc length:chunk "
                              "size, positive integers)")
        steps.append((int(n), int(c)))
    return sorted(steps)


# ---- replay clocks (issue 40; docs/running.md "Replaying a run"): TRAIN_CLOCK=record | log:PATH
# What a log says about its clock, as (kind, step, value): "ms" the elapsed ms after `step` steps (the 03-23
# record's and this script's train lines; a replayed run's replayed_time), "tok/s" the later records' rate after
# `step` steps (elapsed = step x tokens per step / rate), "frac" a decision logged at a training fraction (the
# layer loop, a context phase), "stop" the step the run stopped at for the cap (value: its logged train_time),
# "batch" the tokens per step the log states (step 0; the tok/s lines' batch: the records' hyperparameter lines,
# this script's settings dump).
CLOCK_LINES = (
    ("batch", r"(?:train_batch_tokens: ?|setting TRAIN_BATCH_TOKENS=)(?P<value>\d+)(?: \[\w+\]| train_seq_len:.*)?"),
    ("ms", r"step:(?P<step>\d+)/\d+ train_loss:\S+ train_time:(?P<value>\d+)ms.*?(?:replayed_time:(?P<replayed>\d+)ms)?"),
    ("tok/s", r"(?P<step>\d+)/\d+ train_loss: \S+ train_time: \S+m tok/s: (?P<value>\d+)"),
    ("frac", r"layer_loop:enabled step:(?P<step>\d+) frac:(?P<value>[\d.]+) .*"),
    ("frac", r"seq_len:\d+ step:(?P<step>\d+) frac:(?P<value>[\d.]+)"),
    ("frac", r"growth_stage:seq_len:\d+ progress:(?P<value>[\d.]+) step:(?P<step>\d+)"),
    ("stop", r"stopping_early: wallclock_cap train_time: ?(?P<value>\d+)ms step: ?(?P<step>\d+)/\d+"
             r"(?: replayed_time:(?P<replayed>\d+)ms)?"),
)
# TRAIN_CLOCK=record: each preset's record run, the entries clock_entries() reads from its seed log in
# ../shared/anchors, its batch first (tests/test_replay.py checks them against the logs).
RECORD_CLOCKS = {
    "record_0323": ("seed 1337", (("batch", 0, 786432),
        ("ms", 1, 133), ("ms", 2, 166), ("ms", 3, 246), ("ms", 4, 327), ("ms", 5, 409),
        ("ms", 6, 489), ("ms", 7, 571), ("ms", 8, 652), ("ms", 9, 733), ("ms", 10, 816), ("ms", 500, 41450),
        ("ms", 1000, 83020), ("ms", 1500, 124687), ("ms", 2000, 166425), ("ms", 2500, 208180), ("ms", 3000, 249938),
        ("ms", 3500, 291695), ("ms", 4000, 333469), ("ms", 4500, 375247), ("ms", 5000, 417014), ("ms", 5500, 458773),
        ("ms", 6000, 500541), ("ms", 6500, 542303), ("ms", 7000, 584853), ("stop", 7179, 600128))),
    "record_0409": ("seed 42", (("batch", 0, 786432),
        ("tok/s", 1, 8348323), ("tok/s", 2, 7501070), ("tok/s", 3, 7450650),
        ("tok/s", 4, 7463659), ("tok/s", 5, 7497425), ("tok/s", 500, 7691255), ("tok/s", 1000, 7698918),
        ("tok/s", 1500, 7705554), ("tok/s", 2000, 7710490), ("frac", 2018, 0.35), ("tok/s", 2500, 7021940),
        ("tok/s", 3000, 6642896), ("tok/s", 3500, 6396259), ("tok/s", 4000, 6223343), ("tok/s", 4500, 6095957),
        ("stop", 4550, 588047))),
    "record_0427": ("seed 42", (("batch", 0, 786432),
        ("tok/s", 1, 17921784), ("tok/s", 2, 4839117), ("tok/s", 3, 5502039),
        ("tok/s", 4, 5944320), ("tok/s", 5, 6200017), ("tok/s", 500, 8217810), ("tok/s", 1000, 8195099),
        ("tok/s", 1500, 8184986), ("tok/s", 2000, 8167705), ("frac", 2178, 0.35), ("tok/s", 2500, 7705526),
        ("tok/s", 3000, 7245517), ("tok/s", 3500, 6949337), ("tok/s", 4000, 6741955), ("tok/s", 4500, 6589668),
        ("stop", 4945, 599592))),
    "record_0430": ("seed 42", (("batch", 0, 786432),
        ("tok/s", 1, 16816914), ("tok/s", 2, 11473671), ("tok/s", 3, 10576385),
        ("tok/s", 4, 10065769), ("tok/s", 5, 9789599), ("tok/s", 500, 8580039), ("frac", 646, 0.1),
        ("tok/s", 1000, 8394433), ("tok/s", 1500, 8299557), ("tok/s", 2000, 8253338), ("frac", 2185, 0.35),
        ("tok/s", 2500, 7770424), ("tok/s", 3000, 7291702), ("tok/s", 3500, 6983904), ("frac", 3664, 0.7),
        ("tok/s", 4000, 6745846), ("tok/s", 4500, 6561659), ("stop", 4888, 596025))),
    "record_0501": ("seed 42", (("batch", 0, 786432),
        ("tok/s", 1, 11979212), ("tok/s", 2, 11457637), ("tok/s", 3, 10270494),
        ("tok/s", 4, 9773216), ("tok/s", 5, 9496601), ("tok/s", 500, 8341171), ("tok/s", 1000, 8279023),
        ("tok/s", 1500, 8271404), ("tok/s", 2000, 8270074), ("frac", 2206, 0.35), ("tok/s", 2500, 7836770),
        ("tok/s", 3000, 7358144), ("tok/s", 3500, 7050260), ("tok/s", 4000, 6835701), ("tok/s", 4500, 6679430),
        ("tok/s", 5000, 6559111), ("stop", 5001, 599672))),
}


def clock_entries(lines):
    """The clock entries (kind, step, value) of a log's lines, in log order (CLOCK_LINES; a replayed run's lines
    give their replayed time)."""
    entries = []
    for line in lines:
        for kind, pattern in CLOCK_LINES:
            m = re.fullmatch(pattern, line.strip())
            if m:
                entries.append((kind, int(m.groupdict().get("step") or 0),
                                float(m.groupdict().get("replayed") or m["value"])))
                break
    return entries


def least_ms_at(frac, cap_ms):
    """The least float ms whose training fraction (ms / cap_ms, as training_fraction divides) reaches `frac`."""
    ms = frac * cap_ms
    while ms / cap_ms < frac:
        ms = math.nextafter(ms, math.inf)
    return ms


class ReplayClock:
    """A replay clock (TRAIN_CLOCK other than wall, issue 40): the elapsed training time the schedule reads after each
    step, the same on every rank and machine. ms:X: step x X. record and log:PATH: a log's points, linear between
    them from 0 ms at step 0, at the last interval's rate after the last point. batch: (tokens a step, whose) that
    converted the log's tok/s lines, None where it has none."""

    def __init__(self, name, points=(), rate=None, batch=None):
        self.name, self.rate, self.batch = name, rate, batch
        self.steps, self.times = [s for s, _ in points], [ms for _, ms in points]

    def _point(self, i):
        return (0, 0.0) if i < 0 else (self.steps[i], self.times[i])

    def ms(self, step):
        if self.rate is not None:
            return step * self.rate
        i = bisect.bisect_left(self.steps, step)
        if i < len(self.steps) and self.steps[i] == step:
            return self.times[i]
        j = min(i, len(self.steps) - 1)  # past the last point: the last interval, extended
        (s0, m0), (s1, m1) = self._point(j - 1), self._point(j)
        return m0 + (step - s0) * (m1 - m0) / (s1 - s0)


def clock_points(entries, cap_ms, batch_tokens):
    """A log's clock entries as (step, ms) points, sorted by step. A logged decision is an exact point: the least ms
    at which it is taken (a fraction F: least_ms_at(F, cap); the stop: the cap itself; its logged train_time is
    measured after the step, once the cap is already passed), and it wins over a train line of the same step."""
    points, exact = {}, set()
    for kind, step, value in entries:
        if kind == "batch":
            continue
        if kind in ("frac", "stop"):
            points[step] = least_ms_at(value, cap_ms) if kind == "frac" else cap_ms
            exact.add(step)
        elif step not in exact and step not in points and value > 0:  # a train line: the first of its step
            points[step] = value if kind == "ms" else 1000.0 * step * batch_tokens / value
    return sorted((s, ms) for s, ms in points.items() if s > 0)


def make_clock(h):
    """TRAIN_CLOCK's ReplayClock, or None for wall; a setting it cannot use is a ConfigError naming it."""
    text = h.train_clock
    if text == "wall":
        return None
    kind, _, arg = text.partition(":")
    bad = ConfigError(f"TRAIN_CLOCK={text!r} must be wall, record, log:PATH or ms:X (X > 0, the milliseconds each "
                      "training step counts for)")
    if kind == "ms":  # X ms a step: the warmdown, loop switch, phases, late QAT, SWA and stop at the same steps anywhere
        try:
            rate = float(arg)
        except ValueError:
            raise bad from None
        if not (math.isfinite(rate) and rate > 0):
            raise bad
        return ReplayClock(text, rate=rate)
    if not (text == "record" or (kind == "log" and arg)):
        raise bad
    if h.max_wallclock_ms is None:
        raise ConfigError(f"TRAIN_CLOCK={text} needs MAX_WALLCLOCK_SECONDS > 0: without a cap no decision of training "
                          "reads the clock (training fractions are step / ITERATIONS)")
    if kind == "record":
        if h.preset not in RECORD_CLOCKS:
            raise ConfigError(f"TRAIN_CLOCK=record: PRESET={h.preset} has no record clock (presets with one: "
                              f"{', '.join(RECORD_CLOCKS)}); use TRAIN_CLOCK=log:PATH with its run's log")
        label, entries = RECORD_CLOCKS[h.preset]
        name = f"record({h.preset} {label})"
    else:
        try:
            with open(arg, encoding="utf-8", errors="replace") as f:
                entries = clock_entries(f)
        except OSError as e:
            raise ConfigError(f"TRAIN_CLOCK={text}: cannot read the log ({e.strerror})") from None
        if not entries:
            raise ConfigError(f"TRAIN_CLOCK={text}: the log has no clock lines (train lines with train_time or tok/s, "
                              "layer_loop / seq_len / growth_stage / stopping_early lines)")
        name = f"log({arg})"
    # tok/s converts with the replayed run's batch, a fact of its log: the first one it states, else this run's
    stated = [value for k, _, value in entries if k == "batch"]
    batch = ((int(stated[0]), f"the {'record' if kind == 'record' else 'log'}'s batch") if stated
             else (h.train_batch_tokens, "this run's TRAIN_BATCH_TOKENS: the log states none"))
    points = clock_points(entries, h.max_wallclock_ms, batch[0])
    for (s0, m0), (s1, m1) in zip(points, points[1:]):
        if m1 <= m0:
            raise ConfigError(f"TRAIN_CLOCK={text}: the clock goes back at step {s1} ({m1:.0f} ms after {m0:.0f} ms "
                              f"at step {s0}) with the cap {h.max_wallclock_ms:.0f} ms and {batch[0]} tokens a step "
                              f"({batch[1]}): set the replayed run's own cap{'' if stated else ' and batch'}")
    return ReplayClock(name, points, batch=batch if any(k == "tok/s" for k, _, _ in entries) else None)


class Hyperparameters:
    """Every setting of a run. Reads the environment when constructed and validates it, before any work.

    torchrun's RANK / WORLD_SIZE / LOCAL_RANK are read here too, so that batch divisibility is checked
    against the real world size before any work starts. `Hyperparameters({})` gives the defaults.
    """

    def __init__(self, environ=None):
        self._environ = os.environ if environ is None else environ
        self.settings: list[tuple[str, str]] = []  # (name, default) of every variable read, for --help
        self.effective: dict[str, tuple[object, str]] = {}  # name -> (value, "env" | "preset" | "default")
        self._preset = {}
        self.preset = self._env("PRESET", "record_0323", str)
        if self.preset not in PRESETS:
            raise ConfigError(f"PRESET={self.preset!r} must be {' or '.join(PRESETS)}")
        self._preset = PRESETS[self.preset]
        # ---- run and data
        self.data_path = self._env("DATA_PATH", "./data/datasets/fineweb10B_sp1024", str)
        self.tokenizer_path = self._env("TOKENIZER_PATH", "./data/tokenizers/fineweb_1024_bpe.model", str)
        self.run_id = self._env("RUN_ID", "", str)
        self.run_id = self.run_id or self._resolved("RUN_ID", str(uuid.uuid4()))
        self.overwrite_run = self._env("OVERWRITE_RUN", False, bool)  # 1: a finished RUN_ID's outputs are replaced
        self.seed = self._env("SEED", 1337)
        self.device = self._env("DEVICE", "", str)
        self.compile = self._env("COMPILE", None, bool)
        self.compile_backend = self._env("COMPILE_BACKEND", "inductor", str)
        self.autocast_dtype = self._env("AUTOCAST_DTYPE", "auto", str)
        self.debug_traceback = self._env("DEBUG_TRACEBACK", False, bool)
        self.tracker = self._env("TRACKER", "", str)  # wandb or tensorboard: rank 0 sends the log's numbers (issue 63)
        self.tracker_project = self._env("TRACKER_PROJECT", "parameter-golf", str)  # W&B's project
        self.tracker_system = self._env("TRACKER_SYSTEM", True, bool)  # W&B's system metrics (GPU, CPU, memory)
        self.peak_tflops = self._env("PEAK_TFLOPS", 0.0, float)  # one device's peak for MFU; 0: known GPUs' (issue 72)
        # ---- schedule
        self.iterations = self._env("ITERATIONS", 9000)
        self.warmdown_iters = self._env("WARMDOWN_ITERS", 3500)
        self.warmdown_frac = self._env("WARMDOWN_FRAC", 0.0, float)
        if self.warmdown_frac > 0 and self.warmdown_iters > 0:  # the fraction replaces the default step count
            if self.effective["WARMDOWN_ITERS"][1] != "default":
                raise ConfigError(f"WARMDOWN_FRAC={self.warmdown_frac:g} and WARMDOWN_ITERS={self.warmdown_iters} "
                                  "both set the warmdown; set one of them to 0")
            self.warmdown_iters = self._resolved("WARMDOWN_ITERS", 0)
        self.min_lr = self._env("MIN_LR", 0.0, float)
        self.warmup_steps = self._env("WARMUP_STEPS", 20)
        self.train_batch_tokens = self._env("TRAIN_BATCH_TOKENS", 786432)
        self.train_seq_len = self._env("TRAIN_SEQ_LEN", 2048)
        self.eval_seq_len = self._env("EVAL_SEQ_LEN", 2048)
        self.max_wallclock_seconds = self._env("MAX_WALLCLOCK_SECONDS", 600.0, float)
        self.train_clock = self._env("TRAIN_CLOCK", "wall", str)  # wall, record, log:PATH, ms:X (issue 40)
        self.val_batch_size = self._env("VAL_BATCH_SIZE", 524288)
        self.val_loss_every = self._env("VAL_LOSS_EVERY", 4000)
        self.train_log_every = self._env("TRAIN_LOG_EVERY", 500)
        self.grad_accum_override = self._env("GRAD_ACCUM_STEPS", 0)
        self.micro_batch_split = self._env("MICRO_BATCH_SPLIT", 1)  # pieces of each micro-batch; 0: auto (issue 40)
        # ---- model
        self.vocab_size = self._env("VOCAB_SIZE", 1024)
        self.num_layers = self._env("NUM_LAYERS", 11)
        self.model_dim = self._env("MODEL_DIM", 512)
        self.num_heads = self._env("NUM_HEADS", 8)
        self.num_kv_heads = self._env("NUM_KV_HEADS", 4)
        self.mlp_mult = self._env("MLP_MULT", 3.0, float)
        self.tie_embeddings = self._env("TIE_EMBEDDINGS", True, bool)
        self.rope_base = self._env("ROPE_BASE", 10000.0, float)
        self.rope_dims = self._env("ROPE_DIMS", 16)
        self.logit_softcap = self._env("LOGIT_SOFTCAP", 30.0, float)
        self.qk_gain_init = self._env("QK_GAIN_INIT", 1.5, float)
        self.tied_embed_init_std = self._env("TIED_EMBED_INIT_STD", 0.005, float)
        self.bigram_vocab_size = self._env("BIGRAM_VOCAB_SIZE", 1536)
        self.bigram_dim = self._env("BIGRAM_DIM", 128)
        self.xsa_last_n = self._env("XSA_LAST_N", 4)
        self.ln_scale = self._env("LN_SCALE", True, bool)
        self.ve_enabled = self._env("VE_ENABLED", True, bool)
        self.ve_dim = self._env("VE_DIM", 128)
        self.ve_layers = self._env_int_list("VE_LAYERS", "9,10")
        self.smear_gate = self._env("SMEAR_GATE", 1)  # 0 off, 1 the 03-23 record's, 2 v2 with the BOS mask
        self.smear_gate_bos_fix = self._env("SMEAR_GATE_BOS_FIX", True, bool)  # 0: v2 without its BOS mask (#2135)
        self.skip_gates = self._env("SKIP_GATES", False, bool)
        self.parallel_residual_start = self._env("PARALLEL_RESIDUAL_START", -1)
        self.num_loops = self._env("NUM_LOOPS", 0)
        self.loop_start = self._env("LOOP_START", 3)
        self.loop_end = self._env("LOOP_END", 5)
        self.enable_looping_at = self._env("ENABLE_LOOPING_AT", 0.0, float)
        # ---- the 2026-04-27 model (issue 18; SPEC-FRONTIER 5, 8, 18)
        self.rope_train_seq_len = self._env("ROPE_TRAIN_SEQ_LEN", 1024)
        self.rope_freqs_bf16 = self._env("ROPE_FREQS_BF16", False, bool)
        self.gate_window = self._env("GATE_WINDOW", 12)
        self.attn_gate = self._env("ATTN_GATE", "none", str)
        self.attn_gate_scale = self._env("ATTN_GATE_SCALE", 1.0, float)
        self.attn_gate_init_std = self._env("ATTN_GATE_INIT_STD", 0.0, float)
        self.parallel_mode = self._env("PARALLEL_MODE", "gptj", str)
        # ---- optimisers
        self.embed_lr = self._env("EMBED_LR", 0.6, float)
        self.head_lr = self._env("HEAD_LR", 0.008, float)
        self.tied_embed_lr = self._env("TIED_EMBED_LR", 0.035, float)
        self.matrix_lr = self._env("MATRIX_LR", 0.025, float)
        self.scalar_lr = self._env("SCALAR_LR", 0.025, float)
        self.muon_momentum = self._env("MUON_MOMENTUM", 0.99, float)
        self.muon_backend_steps = self._env("MUON_BACKEND_STEPS", 5)
        self.muon_ns_coeffs = self._env("MUON_NS_COEFFS", "fixed", str)
        self.muon_row_normalize = self._env("MUON_ROW_NORMALIZE", False, bool)
        self.muon_momentum_warmup_start = self._env("MUON_MOMENTUM_WARMUP_START", 0.92, float)
        self.muon_momentum_warmup_steps = self._env("MUON_MOMENTUM_WARMUP_STEPS", 1500)
        self.muon_wd = self._env("MUON_WD", 0.04, float)
        self.adam_wd = self._env("ADAM_WD", 0.04, float)
        self.embed_wd = self._env("EMBED_WD", None, float)  # auto: ADAM_WD, as the record
        self.embed_wd = self._resolved("EMBED_WD", self.adam_wd) if self.embed_wd is None else self.embed_wd
        self.beta1 = self._env("BETA1", 0.9, float)
        self.beta2 = self._env("BETA2", 0.95, float)
        self.adam_eps = self._env("ADAM_EPS", 1e-8, float)
        self.grad_clip_norm = self._env("GRAD_CLIP_NORM", 0.3, float)
        # ---- the records' training semantics (issue 18; SPEC-FRONTIER 9, 18)
        self.grad_clip_scope = self._env("GRAD_CLIP_SCOPE", "local", str)
        self.muon_momentum_fp32 = self._env("MUON_MOMENTUM_FP32", False, bool)
        self.muon_ns_ca_first = self._env("MUON_NS_CA_FIRST", False, bool)
        # ---- weight averaging and quantisation-aware training
        self.ema_enabled = self._env("EMA_ENABLED", True, bool)
        self.ema_decay = self._env("EMA_DECAY", 0.997, float)
        self.swa_enabled = self._env("SWA_ENABLED", False, bool)
        self.swa_every = self._env("SWA_EVERY", 50)
        self.swa_apply = self._env("SWA_APPLY", False, bool)
        self.late_qat_threshold = self._env("LATE_QAT_THRESHOLD", 0.15, float)
        self.qat_enabled = self._env("QAT_ENABLED", False, bool)
        # ---- artifact (SPEC-FRONTIER 11-12; defaults: the record's GPTQ-lite int6 + lzma)
        self.quant = self._env("QUANT", "gptq_lite", str)
        self.gptq_reserve_seconds = self._env("GPTQ_RESERVE_SECONDS", 12.0, float)
        self.gptq_calibration_batches = self._env("GPTQ_CALIBRATION_BATCHES", 64)
        self.matrix_clip_sigmas = self._env("MATRIX_CLIP_SIGMAS", 0.0, float)
        self.embed_clip_sigmas = self._env("EMBED_CLIP_SIGMAS", 0.0, float)
        self.embed_bits = self._env("EMBED_BITS", 8)
        self.compressor = self._env("COMPRESSOR", "lzma", str)
        self.pergroup_level = self._env("PERGROUP_LEVEL", PERGROUP_ZPAQ_LEVEL)
        self.target_bytes = self._env("TARGET_BYTES", 0)
        # ---- artifact of the 2026-04-27 record and #1945 (issue 19; SPEC-FRONTIER 8, 11, 12, 18, 19)
        self.mlp_clip_sigmas = self._env("MLP_CLIP_SIGMAS", 0.0, float)  # 0: MATRIX_CLIP_SIGMAS
        self.attn_clip_sigmas = self._env("ATTN_CLIP_SIGMAS", 0.0, float)  # 0: MATRIX_CLIP_SIGMAS
        self.quant_gate = self._env("QUANT_GATE", False, bool)
        self.lqer_rank = self._env("LQER_RANK", 0)
        self.lqer_top_k = self._env("LQER_TOP_K", 3)
        self.lqer_group = self._env("LQER_GROUP", 64)
        self.lqer_factor_bits = self._env("LQER_FACTOR_BITS", 4)
        self.awq_lite = self._env("AWQ_LITE", False, bool)
        self.awq_lite_bits = self._env("AWQ_LITE_BITS", 8)
        self.awq_lite_group = self._env("AWQ_LITE_GROUP", 64)
        self.awq_lite_top_k = self._env("AWQ_LITE_TOP_K", 1)
        self.gptq_calibration_seqs = self._env("GPTQ_CALIBRATION_SEQS", 0)
        # ---- data path (SPEC 8)
        self.train_loader = self._env("TRAIN_LOADER", "stream", str)
        self.train_prefetch = self._env("TRAIN_PREFETCH", True, bool)
        self.train_prefetch_queue = self._env("TRAIN_PREFETCH_QUEUE", 2)
        self.train_copy_stream = self._env("TRAIN_COPY_STREAM", True, bool)
        self.val_prefetch = self._env("VAL_PREFETCH", True, bool)
        self.val_copy_stream = self._env("VAL_COPY_STREAM", True, bool)
        self.val_bytecount_device = self._env("VAL_BYTECOUNT_DEVICE", "cpu", str)
        self.val_progress_log_every = self._env("VAL_PROGRESS_LOG_EVERY", 0)
        self.training_timing_breakdown = self._env("TRAINING_TIMING_BREAKDOWN", False, bool)
        self.training_timing_every = self._env("TRAINING_TIMING_EVERY", 200)
        self.profile = self._env("PROFILE", False, bool)
        self.profile_steps = self._env("PROFILE_STEPS", "5:8", str)
        # ---- checkpoints and resume (issue 30; docs/running.md)
        self.checkpoint_every = self._env("CHECKPOINT_EVERY", 0)  # steps; 0: no checkpoints
        self.checkpoint_dir = self._env("CHECKPOINT_DIR", "", str)
        self.checkpoint_dir = self.checkpoint_dir or self._resolved("CHECKPOINT_DIR",
                                                                    os.path.join(self.run_dir, "checkpoints"))
        self.checkpoint_keep = self._env("CHECKPOINT_KEEP", 2)
        self.resume = self._env("RESUME", "", str)  # "": a fresh run; auto: the newest checkpoint of RUN_ID; a path
        self.test_kill_at_checkpoint = self._env("TEST_KILL_AT_CHECKPOINT", "", str)  # test hook: STEP:after|during
        # ---- preflight (issue 36; docs/running.md): the whole run rehearsed in minutes before the real one
        self.preflight = self._env("PREFLIGHT", False, bool)
        self.preflight_steps = self._env("PREFLIGHT_STEPS", 3)  # timed training steps in each training state, at least
        self.preflight_val_tokens = self._env("PREFLIGHT_VAL_TOKENS", 0)  # the evaluations' slice; 0: 4 rows a rank
        # ---- attention kernel (issue 23)
        self.attention_backend = self._env("ATTENTION_BACKEND", "auto", str)
        # ---- documents (issue 17; SPEC-FRONTIER 2, 3, 18, 19)
        self.eval_split_at_bos = self._env("EVAL_SPLIT_AT_BOS", None, bool)  # auto: on with TRAIN_LOADER=packed
        if self.eval_split_at_bos is None:
            self.eval_split_at_bos = self._resolved("EVAL_SPLIT_AT_BOS", self.train_loader == "packed")
        self.eval_include_tail = self._env("EVAL_INCLUDE_TAIL", False, bool)
        self.train_seq_len_schedule = self._env("TRAIN_SEQ_LEN_SCHEDULE", "", str)
        self.seq_len_rewarmup_steps = self._env("SEQ_LEN_REWARMUP_STEPS", 32)
        # ---- evaluation
        self.eval_stride = self._env("EVAL_STRIDE", 64)
        self.eval_batch_seqs = self._env("EVAL_BATCH_SEQS", 32)
        self.eval_only = self._env("EVAL_ONLY", "", str)
        # ---- the evaluation's budget (issue 46; docs/evaluation.md "The evaluation's budget")
        self.eval_budget_seconds = self._env("EVAL_BUDGET_SECONDS", None, float)  # auto (below); 0: none
        self.eval_ttt_stop_at = self._env("EVAL_TTT_STOP_AT", -1)  # TTT adapts in its first N steps only; -1: all
        self.diagnostic_post_ema = self._env("DIAGNOSTIC_POST_EMA", True, bool)  # the post-EMA score, before quantising
        self.diagnostic_roundtrip = self._env("DIAGNOSTIC_ROUNDTRIP", True, bool)  # the artifact's plain score
        self.ttt_enabled = self._env("TTT_ENABLED", True, bool)
        self.ttt_lr = self._env("TTT_LR", 0.002, float)
        self.ttt_epochs = self._env("TTT_EPOCHS", 3)
        self.ttt_chunk_tokens = self._env("TTT_CHUNK_TOKENS", 32768)
        self.ttt_freeze_blocks = self._env("TTT_FREEZE_BLOCKS", 0)
        self.ttt_momentum = self._env("TTT_MOMENTUM", 0.9, float)
        self.ttt_batch_seqs = self._env("TTT_BATCH_SEQS", 32)
        self.ttt_grad_clip = self._env("TTT_GRAD_CLIP", 1.0, float)
        # ---- document LoRA TTT (issue 20; SPEC-FRONTIER 14, 18, 19): TTT_MODE=lora, the 04-27 record's settings
        self.ttt_mode = self._env("TTT_MODE", "sgd", str)
        self.ttt_lora_rank = self._env("TTT_LORA_RANK", 80)
        self.ttt_lora_alpha = self._env("TTT_LORA_ALPHA", 144.0, float)
        self.ttt_lora_lr = self._env("TTT_LORA_LR", 1e-4, float)
        self.ttt_lora_targets = self._env("TTT_LORA_TARGETS", "q,k,v,o,mlp,head", str)
        self.ttt_warm_start_a = self._env("TTT_WARM_START_A", True, bool)
        self.ttt_beta1 = self._env("TTT_BETA1", 0.0, float)
        self.ttt_beta2 = self._env("TTT_BETA2", 0.99, float)
        self.ttt_weight_decay = self._env("TTT_WEIGHT_DECAY", 0.5, float)
        self.ttt_chunk_size = self._env("TTT_CHUNK_SIZE", 48)
        self.ttt_batch_size = self._env("TTT_BATCH_SIZE", 64)
        self.ttt_eval_seq_len = self._env("TTT_EVAL_SEQ_LEN", 0)  # 0: EVAL_SEQ_LEN
        # 0: no global SGD phases; auto (issue 52): the largest prefix, up to PHASED_TTT_PREFIX_DOCS_MAX (0: every val
        # document), whose projected evaluation fits the budget (plan_prefix_docs)
        prefix = self._env("PHASED_TTT_PREFIX_DOCS", "0", str)
        self.phased_ttt_prefix_docs_max = self._env("PHASED_TTT_PREFIX_DOCS_MAX", 0)
        self.phased_ttt_prefix_auto = prefix == "auto"
        try:  # a count, checked in _validate: a specialised file's _check_specialised first refuses a changed "auto"
            count = int(prefix)
        except ValueError:
            count = -1
        self.phased_ttt_prefix_docs = self.phased_ttt_prefix_docs_max or 2 ** 62 if self.phased_ttt_prefix_auto else count
        self.phased_ttt_num_phases = self._env("PHASED_TTT_NUM_PHASES", 1)
        # ---- document LoRA TTT, the 04-30 record's additions (issue 20; SPEC-FRONTIER 19, #2014)
        self.ttt_local_lr_mult = self._env("TTT_LOCAL_LR_MULT", 1.0, float)
        self.ttt_chunk_size_by_doc_len = self._env("TTT_CHUNK_SIZE_BY_DOC_LEN", "", str)  # "": TTT_CHUNK_SIZE
        # ---- the token n-gram tilt of the final score (issue 29; SPEC-FRONTIER 20, #2135's token channel)
        self.ngram_tilt = self._env("NGRAM_TILT", False, bool)
        self.ngram_tilt_order = self._env("NGRAM_TILT_ORDER", 16)  # context of order - 1 earlier targets
        self.ngram_tilt_threshold = self._env("NGRAM_TILT_THRESHOLD", 0.8, float)  # gate: hint prob >= it
        self.ngram_tilt_boost = self._env("NGRAM_TILT_BOOST", 2.625, float)
        # ---- fused Triton kernels (issue 21, SPEC-FRONTIER 15): training only, eager where they cannot run
        self.fused_mlp = self._env("FUSED_MLP", False, bool)
        self.fused_ce = self._env("FUSED_CE", False, bool)
        # ---- distributed layout (set by torchrun)
        self.rank = self._env("RANK", 0)
        self.world_size = self._env("WORLD_SIZE", 1)
        self.local_rank = self._env("LOCAL_RANK", 0)
        self.local_world_size = self._env("LOCAL_WORLD_SIZE", 1)
        self.master_addr = self._env("MASTER_ADDR", "", str)
        self.master_port = self._env("MASTER_PORT", "", str)
        self.omp_num_threads = self._env("OMP_NUM_THREADS", 0)
        self.dist_timeout_seconds = self._env("DIST_TIMEOUT_SECONDS", 600.0, float)
        # ---- replay (issue 40): the ranks whose batches the run draws; 0: WORLD_SIZE
        self.replay_world_size = self._env("REPLAY_WORLD_SIZE", 0)
        if self.replay_world_size == 0:
            self.replay_world_size = self._resolved("REPLAY_WORLD_SIZE", self.world_size)
        self.eval_budget_note = ""  # why auto chose 0 (the start lines)
        if self.eval_budget_seconds is None:  # auto: the training cap, but none where the score is what counts
            if self.train_clock != "wall" or self.replay_world_size != self.world_size:
                self.eval_budget_note = "auto: a replay's evaluation is not held to the record's 8-GPU budget"
            elif self.eval_only and self.world_size != TRACK_WORLD_SIZE:
                self.eval_budget_note = (f"auto: EVAL_ONLY on WORLD_SIZE={self.world_size}, not the track's "
                                         f"{TRACK_WORLD_SIZE}: the artifact's whole evaluation, unbudgeted; "
                                         "EVAL_BUDGET_SECONDS=600 holds it to the track's")
            self.eval_budget_seconds = self._resolved(
                "EVAL_BUDGET_SECONDS", 0.0 if self.eval_budget_note else self.max_wallclock_seconds)
        self._check_specialised()
        self._validate()
        self.real = None  # PREFLIGHT=1: the real run's settings that the rehearsal changes
        if self.preflight:
            self._rehearse()

    def _check_specialised(self):
        """A specialised file runs the values it was made for (SPECIALISED): a setting whose every read was folded to
        the run's value must keep it, and one with folded conditions their outcomes; another value is refused (the code
        for it is gone; the full train_gpt.py runs it)."""
        ops = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, "in": lambda a, b: a in b,
               "not in": lambda a, b: a not in b, "is": lambda a, b: a is b, "is not": lambda a, b: a is not b,
               "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
               "truth": lambda a, b: bool(a)}
        inverse = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "==", "in": "not in",
                   "not in": "in", "is": "is not", "is not": "is"}
        for name, ran in SPECIALISED.get("values", {}).items():  # ran: the value of the run the file was made for
            if name in self.effective:  # the value read (a setting read into a local has no attribute of its own)
                v = self.effective[name][0]
            else:  # no code reads it any more: only the environment can give another value
                raw = self._environ.get(name, "").strip()
                if raw == "":
                    continue
                v = self._parse(name, raw, type(ran))
            for op, lit, want in SPECIALISED["conditions"].get(name, [("==", ran, True)]):
                if ops[op](v, lit) != want:
                    if op == "==" and want:  # a setting folded outright (a bool, a mode): its run's value
                        rule = f"{name}={self._text(lit)}"
                    else:
                        test = ("set" if want else "unset") if op == "truth" else \
                            f"{op if want else inverse[op]} {lit!r}"
                        rule = f"{name} {test} (its run's {self._text(ran)})"
                    raise ConfigError(f"{name}={self._text(v)}: this file is specialised to {rule} (made for "
                                      f"{' '.join(f'{k}={x}' for k, x in SPECIALISED['run'].items())}); the full "
                                      "train_gpt.py runs other values")

    def _rehearse(self):
        """PREFLIGHT=1 (issue 36): keep the real values in self.real (what the report projects to), then set the
        rehearsal's: no wallclock cap, so training fractions are step fractions; the fewest steps that give every
        training state of the schedule PREFLIGHT_STEPS timed steps (preflight_iterations); WARMDOWN_ITERS over all of
        them (rehearsal_warmdown); at most 2 GPTQ calibration batches; no checkpoints; validation only after the last
        step."""
        if self.resume or self.eval_only:
            name, value = ("RESUME", self.resume) if self.resume else ("EVAL_ONLY", self.eval_only)
            raise ConfigError(f"{name}={value!r}: PREFLIGHT=1 rehearses a fresh training run; unset {name}")
        self.real = {name: getattr(self, name.lower()) for name in PREFLIGHT_CHANGES}
        self.real["max_wallclock_ms"] = self.max_wallclock_ms
        self.max_wallclock_seconds, self.checkpoint_every, self.val_loss_every = 0.0, 0, 0
        self.eval_budget_seconds = 0.0  # the slice's evaluation runs unguarded; the report projects the real budget
        self.gptq_calibration_batches = min(self.gptq_calibration_batches, 2)
        self.iterations = preflight_iterations(self)
        self.warmdown_iters = rehearsal_warmdown(self, self.iterations)

    def _env(self, name, default, kind=int):
        """Read one environment variable as `kind` (int, float, str or bool '0'/'1'); floats must be finite.
        Unset (or empty) falls back to the PRESET's value, then to `default`."""
        self.settings.append((name, self._text(default)))
        raw, source = self._environ.get(name, "").strip(), "env"
        if raw == "" and name in self._preset:
            raw, source = self._preset[name], "preset"
        value = default if raw == "" else self._parse(name, raw, kind)
        self.effective[name] = (value, source if raw else "default")
        return value

    def _resolved(self, name, value):
        """An 'auto' default made concrete, recorded so that the settings dump shows it."""
        self.effective[name] = (value, self.effective[name][1])
        return value

    @staticmethod
    def _parse(name, raw, kind):
        if kind is bool:
            if raw not in ("0", "1"):
                raise ConfigError(f"{name}={raw!r} must be 0 or 1")
            return raw == "1"
        if kind is str:
            return raw
        try:
            value = kind(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
        if not math.isfinite(value):
            raise ConfigError(f"{name}={raw!r} must be a finite number")
        return value

    @staticmethod
    def _text(value):
        """A setting's value as --help and the settings dump show it."""
        return {None: "auto", "": "-", True: "1", False: "0"}.get(value, str(value))

    def dump(self):
        """The effective value and source of every setting, one per line: a log alone says what ran."""
        return [f"setting {name}={self._text(v)} [{src}]" for name, (v, src) in self.effective.items()]

    def _env_int_list(self, name, default):
        raw = self._env(name, default, str)
        try:
            return [int(v) for v in raw.split(",") if v.strip() != ""]
        except ValueError:
            raise ConfigError(f"{name}={raw!r} must be a comma-separated list of integers") from None

    # Derived values
    @property
    def train_files(self):
        return os.path.join(self.data_path, "fineweb_train_*.bin")

    @property
    def val_files(self):
        return os.path.join(self.data_path, "fineweb_val_*.bin")

    @property
    def grad_accum_steps(self):
        """Micro-batches per rank of REPLAY_WORLD_SIZE and step: GRAD_ACCUM_STEPS, else the record's 8 over the ranks."""
        return self.grad_accum_override or self.record_grad_accum_steps

    @property
    def record_grad_accum_steps(self):
        """The record's split: its 8 micro-batches a step over the ranks of REPLAY_WORLD_SIZE (at least 1 each)."""
        return 8 // self.replay_world_size if self.replay_world_size <= 8 else 1

    @property
    def virtual_ranks(self):
        """The ranks of REPLAY_WORLD_SIZE each real rank stands for (issue 40): 1 without a replay."""
        return self.replay_world_size // self.world_size

    @property
    def micro_steps(self):
        """Micro-batches each real rank computes a step: its virtual ranks' GRAD_ACCUM_STEPS each."""
        return self.virtual_ranks * self.grad_accum_steps

    @property
    def local_tokens(self):
        """Tokens of one drawn micro-batch: a rank's (of REPLAY_WORLD_SIZE) share of a micro-step."""
        return self.train_batch_tokens // (self.replay_world_size * self.grad_accum_steps)

    @property
    def longest_train_seq_len(self):
        """The longest training context: TRAIN_SEQ_LEN_SCHEDULE's longest cut, else TRAIN_SEQ_LEN."""
        return max((n for n, _ in self.seq_len_phases), default=self.train_seq_len)

    @property
    def split_limit(self):
        """The most pieces MICRO_BATCH_SPLIT may cut a drawn micro-batch into: its rows (which it must divide), or
        for a packed row its tokens over the longest training context (a piece holds whole segments)."""
        if self.train_loader == "packed":
            return self.local_tokens // self.longest_train_seq_len
        return self.local_tokens // self.train_seq_len

    def split_ok(self, pieces):
        return 0 < pieces <= self.split_limit and (self.train_loader == "packed" or self.split_limit % pieces == 0)

    @property
    def replaying(self):
        """A replay clock or virtual ranks: the run reproduces another, and its log says so (train_clock:)."""
        return self.clock is not None or self.virtual_ranks > 1

    @property
    def seq_len_phases(self):
        """TRAIN_SEQ_LEN_SCHEDULE 'L0@0,L1@f1,...' as [(cut length, training fraction)]; [] when unset."""
        if not self.train_seq_len_schedule:
            return []
        try:
            phases = [(int(length), float(frac)) for length, frac in
                      (item.split("@") for item in self.train_seq_len_schedule.split(","))]
        except ValueError:
            raise ConfigError(f"TRAIN_SEQ_LEN_SCHEDULE={self.train_seq_len_schedule!r} must look like "
                              "1024@0,2048@0.1,3072@0.7 (length@training fraction, ...)") from None
        return phases

    @property
    def run_dir(self):
        """runs/$RUN_ID: this run's artifacts, preflight.json and, by default, its checkpoints (issue 47)."""
        return os.path.join("runs", self.run_id)

    @property
    def mlp_hidden(self):
        return int(self.mlp_mult * self.model_dim)

    @property
    def head_dim(self):
        return self.model_dim // self.num_heads

    @property
    def profile_range(self):
        try:
            a, b = (int(v) for v in self.profile_steps.split(":"))
        except ValueError:
            return None
        return (a, b) if 0 < a < b else None

    @property
    def test_kill_step(self):
        """TEST_KILL_AT_CHECKPOINT "STEP:when" as (STEP, when), () when unset, None when malformed; "STEP:after:R" and
        "STEP:node:R" as (STEP, when, R): rank R alone dies (node: with its parent, torchrun's agent; issue 62)."""
        if not self.test_kill_at_checkpoint:
            return ()
        step, when, *rank = self.test_kill_at_checkpoint.split(":")
        ok = step.isdigit() and int(step) > 0 and (when in ("after", "during") and not rank or when in ("after", "node")
                                                   and len(rank) == 1 and rank[0].isdigit())
        return (int(step), when, *map(int, rank)) if ok else None

    @property
    def max_wallclock_ms(self):
        """The training loop's cap; QUANT=gptq keeps GPTQ_RESERVE_SECONDS of it for the Hessians."""
        if self.max_wallclock_seconds <= 0:
            return None
        return 1000.0 * (self.max_wallclock_seconds - (self.gptq_reserve_seconds if self.quant == "gptq" else 0.0))

    def _validate(self):
        def need(ok, msg):
            if not ok:
                raise ConfigError(msg)

        for names, ok, rule in (
                ("ITERATIONS WARMUP_STEPS WARMDOWN_ITERS VAL_LOSS_EVERY TRAIN_LOG_EVERY GRAD_ACCUM_STEPS XSA_LAST_N "
                 "ROPE_DIMS BIGRAM_VOCAB_SIZE EVAL_STRIDE TTT_EPOCHS TTT_FREEZE_BLOCKS MUON_MOMENTUM_WARMUP_STEPS "
                 "RANK LOCAL_RANK OMP_NUM_THREADS VAL_PROGRESS_LOG_EVERY MAX_WALLCLOCK_SECONDS EMBED_LR HEAD_LR "
                 "TIED_EMBED_LR MATRIX_LR SCALAR_LR MUON_WD ADAM_WD GRAD_CLIP_NORM TTT_LR TTT_GRAD_CLIP ADAM_EPS "
                 "TIED_EMBED_INIT_STD LATE_QAT_THRESHOLD GPTQ_RESERVE_SECONDS MATRIX_CLIP_SIGMAS EMBED_CLIP_SIGMAS "
                 "TARGET_BYTES NUM_LOOPS LOOP_START LOOP_END EMBED_WD ATTN_GATE_INIT_STD MLP_CLIP_SIGMAS ATTN_CLIP_SIGMAS "
                 "LQER_RANK GPTQ_CALIBRATION_SEQS CHECKPOINT_EVERY REPLAY_WORLD_SIZE MICRO_BATCH_SPLIT "
                 "EVAL_BUDGET_SECONDS SEQ_LEN_REWARMUP_STEPS NGRAM_TILT_BOOST", lambda v: v >= 0, ">= 0"),
                ("TRAIN_BATCH_TOKENS TRAIN_SEQ_LEN EVAL_SEQ_LEN VAL_BATCH_SIZE VOCAB_SIZE NUM_LAYERS MODEL_DIM "
                 "NUM_HEADS NUM_KV_HEADS MUON_BACKEND_STEPS BIGRAM_DIM VE_DIM SWA_EVERY EVAL_BATCH_SEQS "
                 "TTT_CHUNK_TOKENS TTT_BATCH_SEQS WORLD_SIZE LOCAL_WORLD_SIZE DIST_TIMEOUT_SECONDS MLP_MULT "
                 "LOGIT_SOFTCAP QK_GAIN_INIT TRAIN_PREFETCH_QUEUE TRAINING_TIMING_EVERY GPTQ_CALIBRATION_BATCHES "
                 "ROPE_TRAIN_SEQ_LEN GATE_WINDOW LQER_TOP_K LQER_GROUP AWQ_LITE_GROUP AWQ_LITE_TOP_K CHECKPOINT_KEEP "
                 "TTT_LORA_RANK TTT_CHUNK_SIZE TTT_BATCH_SIZE TTT_LORA_LR PHASED_TTT_NUM_PHASES TTT_LOCAL_LR_MULT",
                 lambda v: v > 0, "> 0"),
                ("MUON_MOMENTUM MUON_MOMENTUM_WARMUP_START BETA1 BETA2 EMA_DECAY TTT_MOMENTUM ENABLE_LOOPING_AT "
                 "WARMDOWN_FRAC MIN_LR TTT_BETA1 TTT_BETA2", lambda v: 0 <= v < 1, "in [0, 1)")):
            for name in (n for n in names.split() if n in self.effective):  # a specialised file reads fewer
                v = getattr(self, self._attr(name))
                need(ok(v), f"{name}={v} must be {rule}")
        for name, choices in (("DEVICE", ("", "cpu", "cuda")), ("TRAIN_LOADER", ("stream", "shuffled", "packed")),
                              ("VAL_BYTECOUNT_DEVICE", ("cpu", "cuda")), ("AUTOCAST_DTYPE", ("auto", "bf16", "fp32")),
                              ("QUANT", ("gptq_lite", "gptq")), ("COMPRESSOR", ("lzma", "brotli", "pergroup")),
                              ("PERGROUP_LEVEL", (1, 2, 3, 4, 5)),
                              ("EMBED_BITS", (8, 7)), ("MUON_NS_COEFFS", tuple(NS_COEFFICIENTS)),
                              ("SMEAR_GATE", (0, 1, 2)), ("ATTN_GATE", ("none", "sparse", "output", "dense")),
                              ("PARALLEL_MODE", ("gptj", "lanes")), ("GRAD_CLIP_SCOPE", ("local", "reduced")),
                              ("ATTENTION_BACKEND", ("auto", *ATTENTION_MODULES, TORCH_VARLEN)),
                              ("LQER_FACTOR_BITS", (2, 3, 4, 5, 6, 7, 8)), ("AWQ_LITE_BITS", (7, 8)),
                              ("TTT_MODE", ("sgd", "lora")), ("TRACKER", ("", "wandb", "tensorboard"))):
            if name not in self.effective:
                continue
            v = getattr(self, name.lower())
            need(v in choices, f"{name}={v!r} must be {' or '.join(str(c) for c in choices if c != '')}")
        if self.train_seq_len_schedule:
            phases, name = self.seq_len_phases, f"TRAIN_SEQ_LEN_SCHEDULE={self.train_seq_len_schedule!r}"
            need(self.train_loader == "packed", f"{name} needs TRAIN_LOADER=packed (it changes the document cut)")
            need(phases[0][1] == 0 and all(a[1] < b[1] for a, b in zip(phases, phases[1:]))
                 and phases[-1][1] < 1, f"{name}: fractions must start at 0 and increase, below 1")
            need(all(length > 0 for length, _ in phases), f"{name}: lengths must be > 0")
        need(self.train_loader != "packed" or (self.bigram_vocab_size == 0 and self.smear_gate != 1),
             "TRAIN_LOADER=packed needs BIGRAM_VOCAB_SIZE=0 and SMEAR_GATE=0 or 2 (the bigram hash and SmearGate "
             "v1 mix each token with the previous one across document boundaries; v2 is masked at BOS)")
        for module, package in missing_modules(self.compressor):
            need(False, f"COMPRESSOR={self.compressor} needs the {module} package: {module_fix(module, package)}")
        need(not self.tracker or importlib.util.find_spec(self.tracker), f"TRACKER={self.tracker} needs the "
             f"{self.tracker} package (an optional extra, docs/running.md): pip install {self.tracker}")
        need(math.isfinite(self.peak_tflops) and self.peak_tflops >= 0,
             f"PEAK_TFLOPS={self.peak_tflops:g} must be a device's peak TFLOP/s (> 0), or 0 for the known GPUs'")
        need(not self.awq_lite or self.quant == "gptq", "AWQ_LITE=1 needs QUANT=gptq (its saliency reads the "
                                                       "calibration activations)")
        need(self.gptq_calibration_seqs == 0 or self.quant == "gptq",
             f"GPTQ_CALIBRATION_SEQS={self.gptq_calibration_seqs} needs QUANT=gptq")
        need(self.quant != "gptq" or self.max_wallclock_seconds == 0
             or self.gptq_reserve_seconds < self.max_wallclock_seconds,
             f"GPTQ_RESERVE_SECONDS={self.gptq_reserve_seconds} leaves no training time of "
             f"MAX_WALLCLOCK_SECONDS={self.max_wallclock_seconds}")
        need(self.eval_ttt_stop_at >= -1, f"EVAL_TTT_STOP_AT={self.eval_ttt_stop_at} must be >= 0 (the adaptation "
             "steps TTT takes) or -1 (all)")
        need(self.rope_base > 1, f"ROPE_BASE={self.rope_base} must be > 1")
        need(0 <= self.seed < 2**32, f"SEED={self.seed} must be in [0, 2^32)")
        need(self.run_id not in (".", "..") and not any(c in self.run_id for c in "/\\\0"),
             f"RUN_ID={self.run_id!r} must be a plain file name (the log is logs/$RUN_ID.txt)")
        longest = max(f"{self.run_id}_profile_rank{self.world_size - 1}.json" if self.profile else "",
                      f"{self.run_id}.preflight.txt" if self.preflight else f"{self.run_id}.txt", key=len)
        need(len(os.fsencode(longest)) <= file_name_max("."), f"RUN_ID={self.run_id[:24]!r}... is too long: "
             f"its {len(os.fsencode(self.run_id))} bytes + {longest[len(self.run_id):]!r} exceed this filesystem's "
             f"{file_name_max('.')}-byte limit on a file name (logs/$RUN_ID.txt)")
        done = artifact_files(self, "final_model")[1]
        need(self.overwrite_run or not os.path.exists(done), f"RUN_ID={self.run_id} is a finished run ({done} exists): "
             "choose a new RUN_ID, or set OVERWRITE_RUN=1 to replace its outputs")
        need(not self.eval_only or os.path.isfile(self.eval_only), f"EVAL_ONLY={self.eval_only}: no such artifact file")
        need(not (self.eval_only and self.resume), f"RESUME={self.resume} and EVAL_ONLY both set: EVAL_ONLY trains nothing")
        need(self.test_kill_step is not None, f"TEST_KILL_AT_CHECKPOINT={self.test_kill_at_checkpoint!r} must be "
             "STEP:after, STEP:during, STEP:after:RANK or STEP:node:RANK (a test hook), or empty")
        need(self.profile_range is not None, f"PROFILE_STEPS={self.profile_steps!r} must be START:END, 0 < START < END")
        need(self.model_dim % self.num_heads == 0,
             f"NUM_HEADS={self.num_heads} must divide MODEL_DIM={self.model_dim}")
        need(self.num_heads % self.num_kv_heads == 0,
             f"NUM_KV_HEADS={self.num_kv_heads} must divide NUM_HEADS={self.num_heads}")
        need(self.head_dim % 2 == 0, f"MODEL_DIM/NUM_HEADS={self.head_dim} must be even for rotary embeddings")
        need(self.rope_dims % 2 == 0 and self.rope_dims <= self.head_dim,
             f"ROPE_DIMS={self.rope_dims} must be even and <= head dim {self.head_dim} (0 = full head dim)")
        need((self.rope_dims or self.head_dim) > 2
             or max(self.train_seq_len, self.eval_seq_len) <= self.rope_train_seq_len,
             f"ROPE_DIMS={self.rope_dims}: NTK scaling beyond ROPE_TRAIN_SEQ_LEN={self.rope_train_seq_len} "
             "tokens needs >= 4 rotated dims")
        need(self.mlp_hidden > 0, f"MLP_MULT={self.mlp_mult} gives an empty MLP")
        need(self.xsa_last_n <= self.num_layers, f"XSA_LAST_N={self.xsa_last_n} exceeds NUM_LAYERS={self.num_layers}")
        if self.num_loops > 0:
            need(self.loop_start <= self.loop_end < self.num_layers, f"LOOP_START={self.loop_start} and "
                 f"LOOP_END={self.loop_end} must satisfy LOOP_START <= LOOP_END < NUM_LAYERS={self.num_layers}")
        runs = self.num_layers + self.num_loops * (self.loop_end - self.loop_start + 1) * (self.num_loops > 0)
        need(runs <= 1024, f"NUM_LAYERS={self.num_layers} and NUM_LOOPS={self.num_loops} run {runs:,} layers, over "
             "1,024 (the model is built on the meta device to count its parameters before anything is allocated)")
        need(-1 <= self.parallel_residual_start < self.num_layers, f"PARALLEL_RESIDUAL_START="
             f"{self.parallel_residual_start} must be a layer index < NUM_LAYERS={self.num_layers}, or -1 (off)")
        need(self.parallel_mode != "lanes" or self.parallel_residual_start >= 0,
             "PARALLEL_MODE=lanes needs PARALLEL_RESIDUAL_START >= 0 (the first layer of the two lanes)")
        need(self.gate_window <= self.model_dim, f"GATE_WINDOW={self.gate_window} exceeds MODEL_DIM={self.model_dim}")
        need(self.bigram_vocab_size != 1, "BIGRAM_VOCAB_SIZE=1 leaves no hash bucket (use 0 to disable, or >= 2)")
        need(self.ttt_freeze_blocks <= self.num_layers,
             f"TTT_FREEZE_BLOCKS={self.ttt_freeze_blocks} exceeds NUM_LAYERS={self.num_layers}")
        if self.ve_enabled:
            need(len(self.ve_layers) > 0, "VE_LAYERS is empty while VE_ENABLED=1")
            need(len(set(self.ve_layers)) == len(self.ve_layers), f"VE_LAYERS={self.ve_layers} repeats a layer")
            need(all(0 <= i < self.num_layers for i in self.ve_layers),
                 f"VE_LAYERS={self.ve_layers} must lie in [0, NUM_LAYERS={self.num_layers})")
        need(self.rank < self.world_size and self.local_rank < self.world_size,
             f"RANK={self.rank} / LOCAL_RANK={self.local_rank} must be < WORLD_SIZE={self.world_size}")
        need(self.replay_world_size % self.world_size == 0, f"REPLAY_WORLD_SIZE={self.replay_world_size} must be a "
             f"multiple of WORLD_SIZE={self.world_size} (each rank stands for as many virtual ranks)")
        ranks = ("REPLAY_WORLD_SIZE", self.replay_world_size) if self.virtual_ranks > 1 else ("WORLD_SIZE", self.world_size)
        split = f"({ranks[0].lower()} {ranks[1]} x grad_accum {self.grad_accum_steps})"
        if self.grad_accum_override == 0 and self.replay_world_size <= 8:
            need(8 % self.replay_world_size == 0,
                 f"{ranks[0]}={ranks[1]} must divide 8 (the record splits 8 micro-batches over ranks); "
                 "set GRAD_ACCUM_STEPS to choose another split")
        micro = self.replay_world_size * self.grad_accum_steps
        need(self.train_batch_tokens % (micro * self.train_seq_len) == 0,
             f"TRAIN_BATCH_TOKENS={self.train_batch_tokens} must split into whole sequences of "
             f"TRAIN_SEQ_LEN={self.train_seq_len} per rank and micro-step {split}")
        need(self.val_batch_size // micro >= self.eval_seq_len, f"VAL_BATCH_SIZE={self.val_batch_size} gives less than "
             f"one sequence of EVAL_SEQ_LEN={self.eval_seq_len} per rank and micro-step {split}")
        need(self.train_loader != "packed" or self.split_limit > 0,
             f"TRAIN_BATCH_TOKENS={self.train_batch_tokens} gives each packed micro-batch {self.local_tokens} tokens "
             f"{split}, fewer than the longest training "
             f"context, {self.longest_train_seq_len} (TRAIN_SEQ_LEN_SCHEDULE, else TRAIN_SEQ_LEN): raise "
             f"TRAIN_BATCH_TOKENS to {micro * self.longest_train_seq_len} or shorten the context")
        need(self.micro_batch_split != 0 or self.warmup_steps > 0, "MICRO_BATCH_SPLIT=0 (auto) is found in the warmup "
             "(twice the pieces after each out-of-memory error): it needs WARMUP_STEPS > 0")
        rule = (f"be at most {self.split_limit} with TRAIN_LOADER=packed (a piece holds whole segments: at least the "
                "longest training context of tokens)" if self.train_loader == "packed" else
                f"divide the {self.split_limit} rows of TRAIN_SEQ_LEN={self.train_seq_len} in each micro-batch (the "
                "pieces are computed with the same math: equal ones)")
        need(self.micro_batch_split == 0 or self.split_ok(self.micro_batch_split),
             f"MICRO_BATCH_SPLIT={self.micro_batch_split} must {rule}")
        need(self.virtual_ranks == 1 or self.quant != "gptq" or self.gptq_calibration_seqs > 0
             or self.gptq_calibration_batches % self.grad_accum_steps == 0,
             f"GPTQ_CALIBRATION_BATCHES={self.gptq_calibration_batches} must be a multiple of GRAD_ACCUM_STEPS="
             f"{self.grad_accum_steps} with virtual ranks (REPLAY_WORLD_SIZE={self.replay_world_size}): each virtual "
             "rank's next training batches calibrate, as many from each")
        need(self.eval_stride <= self.eval_seq_len,
             f"EVAL_STRIDE={self.eval_stride} must be <= EVAL_SEQ_LEN={self.eval_seq_len}")
        need(self.phased_ttt_prefix_docs_max >= 0, f"PHASED_TTT_PREFIX_DOCS_MAX={self.phased_ttt_prefix_docs_max} must "
             "be >= 0 (0: every val document)")
        need(self.phased_ttt_prefix_docs >= 0, f"PHASED_TTT_PREFIX_DOCS={self.effective['PHASED_TTT_PREFIX_DOCS'][0]} "
             "must be a number of documents >= 0, or auto")
        if self.phased_ttt_prefix_auto:
            need(self.ttt_mode == "lora", f"PHASED_TTT_PREFIX_DOCS=auto plans the global SGD phases of TTT_MODE=lora, "
                 f"not TTT_MODE={self.ttt_mode}")
            need(self.eval_budget_seconds > 0, "PHASED_TTT_PREFIX_DOCS=auto fits the prefix to the evaluation's budget: "
                 "it needs EVAL_BUDGET_SECONDS > 0 (auto gives 0 here: set it, or give the prefix as a number)")
            need(self.eval_ttt_stop_at < 0, "PHASED_TTT_PREFIX_DOCS=auto reads the clock; with EVAL_TTT_STOP_AT, which "
                 "reads none, give the prefix as a number (a stop line names the prefix its run chose)")
        need(self.ttt_eval_seq_len >= 0, f"TTT_EVAL_SEQ_LEN={self.ttt_eval_seq_len} must be >= 0 (0: EVAL_SEQ_LEN)")
        need(self.ttt_lora_alpha > 0, f"TTT_LORA_ALPHA={self.ttt_lora_alpha:g} must be > 0 (the LoRA output scale is "
             "alpha / rank)")
        need(self.ttt_weight_decay >= 0, f"TTT_WEIGHT_DECAY={self.ttt_weight_decay:g} must be >= 0")
        need(self.attn_gate_scale > 0, f"ATTN_GATE_SCALE={self.attn_gate_scale:g} must be > 0")
        need(self.preflight_steps > 0, f"PREFLIGHT_STEPS={self.preflight_steps} must be > 0 (the timed steps in each "
             "training state: with none, nothing would be timed)")
        need(self.preflight_val_tokens == 0 or self.preflight_val_tokens >= self.world_size * self.eval_seq_len,
             f"PREFLIGHT_VAL_TOKENS={self.preflight_val_tokens} must be 0 (4 EVAL_SEQ_LEN rows a rank) or at least "
             f"one row of EVAL_SEQ_LEN={self.eval_seq_len} a rank ({self.world_size * self.eval_seq_len})")
        need(self.ngram_tilt_order in NGRAM_ORDERS, f"NGRAM_TILT_ORDER={self.ngram_tilt_order} must be in "
             f"{NGRAM_ORDERS.start}..{NGRAM_ORDERS.stop - 1} (a context of order-1 earlier targets, one hash "
             "coefficient each)")
        need(0 < self.ngram_tilt_threshold <= 1,
             f"NGRAM_TILT_THRESHOLD={self.ngram_tilt_threshold} must be in (0, 1] (the gate: hint probability >= it)")
        need(not self.ngram_tilt or self.ttt_enabled or self.eval_stride > 0,
             "NGRAM_TILT=1 tilts the final score, which is the legal TTT score (TTT_ENABLED=1) or the sliding "
             "window (EVAL_STRIDE > 0); with neither it would tilt nothing")
        self.ttt_chunk_steps = parse_chunk_steps(self.ttt_chunk_size_by_doc_len)
        targets = self.ttt_lora_targets.split(",")
        need(targets != [""] and set(targets) <= set(LORA_TARGETS) and len(set(targets)) == len(targets),
             f"TTT_LORA_TARGETS={self.ttt_lora_targets!r} must be distinct names among {','.join(LORA_TARGETS)}")
        if self.ttt_enabled and self.ttt_mode == "sgd":
            need(self.eval_stride > 0, "TTT_ENABLED=1 needs EVAL_STRIDE > 0 (TTT scores sliding windows)")
            need(self.ttt_chunk_tokens >= self.eval_seq_len,
                 f"TTT_CHUNK_TOKENS={self.ttt_chunk_tokens} is shorter than EVAL_SEQ_LEN={self.eval_seq_len}")
        if self.swa_apply:
            need(self.swa_enabled, "SWA_APPLY=1 needs SWA_ENABLED=1 (the snapshots it averages)")
            need(self.swa_snapshot_possible(), f"SWA_APPLY=1 but no SWA snapshot would be taken (no step with LR "
                                               f"scale < 0.2 on a multiple of SWA_EVERY={self.swa_every})")
        self.clock = make_clock(self)  # last: it reads the cap (and TRAIN_BATCH_TOKENS where a log states none)

    def rehearsal_settings(self):
        """PREFLIGHT=1: the settings the rehearsal ran with in place of the real ones (a run with these and
        MAX_WALLCLOCK_SECONDS=0 trains the same weights and writes the same artifact)."""
        return {name: getattr(self, name.lower()) for name in PREFLIGHT_CHANGES}

    def swa_snapshot_possible(self):
        """Exact without a wallclock cap; under one the warmdown is timed, so only its presence is checked."""
        if self.max_wallclock_ms is not None:
            return self.warmdown_iters > 0
        return any(lr_multiplier(self, s, 0.0) < 0.2 and (s + 1) % self.swa_every == 0 for s in range(self.iterations))

    @staticmethod
    def _attr(env_name):
        return {"GRAD_ACCUM_STEPS": "grad_accum_override"}.get(env_name, env_name.lower())


# ==================================================
# DATA
# ==================================================

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
BOS_ID = 1  # <s>: every document starts with it (SPEC-FRONTIER 2)
SIDECAR_PREFIX = "fineweb_val_bytes_"  # val byte sidecars: fineweb_val_XXXXXX.bin -> fineweb_val_bytes_XXXXXX.bin
CASEOPS_OPERATORS = ("\ue001", "\ue002", "\ue003", "\ue004")  # data/caseops.py, SPEC-FRONTIER 2


def _open_shard(path):
    """Open and validate a shard; return (fd, token count)."""
    fd = -1
    try:
        # open() of a FIFO would block: refuse non-regular files first.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError(f"shard {path}: not a regular file")
        fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        raw = os.pread(fd, SHARD_HEADER_BYTES, 0)
        if len(raw) < SHARD_HEADER_BYTES:
            raise ConfigError(f"shard {path}: file is {size} bytes, shorter than the {SHARD_HEADER_BYTES}-byte header")
        header = np.frombuffer(raw, dtype="<i4")
        if int(header[0]) != SHARD_MAGIC:
            raise ConfigError(f"shard {path}: bad magic {int(header[0])} (expected {SHARD_MAGIC})")
        if int(header[1]) != SHARD_VERSION:
            raise ConfigError(f"shard {path}: unsupported version {int(header[1])} (expected {SHARD_VERSION})")
        num_tokens = int(header[2])
        expected = SHARD_HEADER_BYTES + 2 * num_tokens
        if num_tokens < 0 or size != expected:
            raise ConfigError(f"shard {path}: size mismatch: header says {num_tokens} tokens "
                              f"({expected} bytes) but the file has {size} bytes")
    except BaseException as e:
        if fd >= 0:
            os.close(fd)
        if isinstance(e, OSError):
            raise ConfigError(f"shard {path}: cannot read ({e.strerror})") from None
        raise
    return fd, num_tokens


def read_shard_header(path):
    """Validate a shard; return its token count."""
    fd, num_tokens = _open_shard(Path(path))
    os.close(fd)
    return num_tokens


class ShardReader:
    """A validated shard read with pread: a file cut short in use is a ConfigError naming it, where a memory
    map would die of SIGBUS. With vocab_size set, token ids are checked."""

    def __init__(self, path, vocab_size=None):
        self.path, self.vocab_size, self.fd = Path(path), vocab_size, -1
        self.fd, self.num_tokens = _open_shard(self.path)

    def _pread(self, start, count):
        nbytes, offset = 2 * count, SHARD_HEADER_BYTES + 2 * start
        try:
            data = os.pread(self.fd, nbytes, offset)
            while len(data) < nbytes:  # reads may come up short; an empty one is EOF
                more = os.pread(self.fd, nbytes - len(data), offset + len(data))
                if not more:
                    raise ConfigError(f"shard {self.path}: truncated while in use (tokens {start}..{start + count} "
                                      f"wanted, the file now has {os.fstat(self.fd).st_size} bytes; "
                                      f"its header says {self.num_tokens} tokens)")
                data += more
        except OSError as e:
            raise ConfigError(f"shard {self.path}: cannot read ({e.strerror})") from None
        return data

    def _check(self, tokens):
        if self.vocab_size is not None and tokens.size and int(tokens.max()) >= self.vocab_size:
            raise ConfigError(f"shard {self.path}: token id {int(tokens.max())} >= VOCAB_SIZE={self.vocab_size}")

    def read(self, start, count):
        tokens = np.frombuffer(self._pread(start, count), dtype="<u2")
        self._check(tokens)
        return tokens

    def read_windows(self, starts, width):
        out = np.empty((len(starts), width), dtype=np.uint16)
        for row, s in zip(out, starts.tolist()):
            row[:] = np.frombuffer(self._pread(s, width), dtype="<u2")
        self._check(out)
        return out

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit `os` may already be gone
            self.close()


def load_shard(path):
    with contextlib.closing(ShardReader(path)) as reader:
        return reader.read(0, reader.num_tokens)


def list_shards(pattern):
    files = sorted(glob.glob(pattern))
    if not files:
        raise ConfigError(f"DATA_PATH: no files match {pattern}; to get data, {GET_DATA}")
    return files


def switch_shard(loader, file_idx, pos=0):
    """Point a shard-walking loader (its .files, .vocab_size, .reader, .file_idx, .pos) at token `pos` of shard
    `file_idx`: the new shard is opened (and checked), then the one it had open, if any, is closed."""
    old, loader.reader = loader.reader, ShardReader(loader.files[file_idx], loader.vocab_size)
    loader.file_idx, loader.pos = file_idx, pos
    if old is not None:
        old.close()


class TokenStream:
    """One endless stream over the sorted shards, wrapping after the last."""

    def __init__(self, files, vocab_size=None):
        if sum(read_shard_header(f) for f in files) == 0:
            raise ConfigError(f"DATA_PATH: the {len(files)} train shards ({files[0]} ...) hold no tokens")
        self.files, self.vocab_size, self.file_idx, self.pos = files, vocab_size, 0, 0
        self.reader = ShardReader(files[0], vocab_size)

    def _advance(self, n, keep):
        parts = []
        while n > 0:
            avail = self.reader.num_tokens - self.pos
            if avail <= 0:  # open (and re-check) the next shard only when reached
                switch_shard(self, (self.file_idx + 1) % len(self.files))
                continue
            k = min(n, avail)
            if keep:
                parts.append(self.reader.read(self.pos, k))
            self.pos += k
            n -= k
        return parts

    def take(self, n):
        parts = self._advance(n, keep=True)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def skip(self, n):
        self._advance(n, keep=False)

    def seek(self, file_idx, pos):
        """Continue from token `pos` of shard `file_idx` (a checkpoint's loader position)."""
        if file_idx != self.file_idx:
            switch_shard(self, file_idx)
        self.pos = pos


class _HostLoader:
    """next_batch() for an unthreaded loader."""

    def next_batch(self):
        return self.to_device(self.next_host())

    def to_device(self, host):
        return host_to_device(host, self.seq_len, self.device)

    def shutdown(self):
        pass


class DistributedTokenLoader(_HostLoader):
    """Record-faithful sequential loader (SPEC 2): each micro-step takes world_size spans of local+1 tokens
    from one stream; rank r keeps span r."""

    def __init__(self, files, rank, world_size, device, local_tokens, seq_len, vocab_size=None):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.local_tokens, self.seq_len = local_tokens, seq_len
        self.stream = TokenStream(files, vocab_size)

    def next_host(self):
        """This rank's span; the others are skipped, not read."""
        span = self.local_tokens + 1
        self.stream.skip(self.rank * span)
        mine = self.stream.take(span)
        self.stream.skip((self.world_size - 1 - self.rank) * span)
        return mine

    def position(self):
        """Where the next batch starts: plain numbers, saved in a checkpoint (issue 30)."""
        return {"file_idx": self.stream.file_idx, "pos": self.stream.pos}

    def restore(self, position):
        self.stream.seek(position["file_idx"], position["pos"])


class ShuffledSequenceLoader(_HostLoader):
    """TRAIN_LOADER=shuffled (SPEC 2): rank r owns shards [r::world_size], each cut at a random phase into
    L+1-token windows in random order, drawn without replacement across shards and all re-cut when used
    up. Deterministic given (SEED, rank)."""

    def __init__(self, files, rank, world_size, device, local_tokens, seq_len, seed, vocab_size=None):
        if len(files) < world_size:
            raise ConfigError(f"TRAIN_LOADER=shuffled needs at least one train shard per rank: "
                              f"{len(files)} shards for WORLD_SIZE={world_size}")
        self.files, self.device, self.seq_len = files[rank::world_size], device, seq_len
        self.batch_seqs = local_tokens // seq_len
        self.rng = np.random.default_rng([seed, rank])
        self.readers = [ShardReader(f, vocab_size) for f in self.files]
        for r in self.readers:
            if r.num_tokens < seq_len + 1:
                raise ConfigError(f"shard {r.path}: {r.num_tokens} tokens, fewer than one sequence of {seq_len} "
                                  f"plus one")
        self._recut()

    def _recut(self):
        self._recut_state = self.rng.bit_generator.state  # the cut is rebuilt from it on restore()
        L, self.starts = self.seq_len, []
        for r in self.readers:
            max_phase = min(L - 1, r.num_tokens - L - 1)
            phase = int(self.rng.integers(max_phase + 1)) if max_phase > 0 else 0
            self.starts.append(phase + self.rng.permutation((r.num_tokens - 1 - phase) // L) * L)
        self.used = np.zeros(len(self.readers), dtype=np.int64)

    def next_host(self):
        """(batch_seqs, L+1) windows, drawn in one go (hypergeometric counts, then a random order) so the
        prefetch thread holds the GIL only for microseconds."""
        L = self.seq_len
        parts, need = [], self.batch_seqs
        while need > 0:
            remaining = np.array([len(s) for s in self.starts], dtype=np.int64) - self.used
            if remaining.sum() == 0:
                self._recut()
                continue
            take = min(need, int(remaining.sum()))
            counts = self.rng.multivariate_hypergeometric(remaining, take)
            labels = self.rng.permutation(np.repeat(np.arange(len(self.readers)), counts))
            rows = np.empty((take, L + 1), dtype=np.uint16)
            for si in np.flatnonzero(counts):
                starts = self.starts[si][self.used[si]:self.used[si] + counts[si]]
                self.used[si] += counts[si]
                rows[labels == si] = self.readers[si].read_windows(starts, L + 1)
            parts.append(rows)
            need -= take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def position(self):
        """The generator's state now and before the current cut, and the windows used of each shard."""
        return {"rng": self.rng.bit_generator.state, "recut_rng": self._recut_state, "used": self.used.tolist()}

    def restore(self, position):
        self.rng.bit_generator.state = position["recut_rng"]
        self._recut()
        self.used = np.array(position["used"], dtype=np.int64)
        self.rng.bit_generator.state = position["rng"]


CU_SEQLENS_BUCKET = 64  # cu_seqlens entries are padded to a multiple of this (few shapes to compile)


def doc_starts(row, bos=BOS_ID):
    """Where the documents of a packed row start: 0 (maybe mid-document) and every BOS (int32)."""
    return np.union1d([0], np.flatnonzero(np.asarray(row) == bos)).astype(np.int32)


def cut_cu_seqlens(starts, n, max_len, bucket=CU_SEQLENS_BUCKET):
    """cu_seqlens (int32) of an n-token row whose documents start at `starts` (SPEC-FRONTIER 3): segments cut
    every max_len tokens, the list right-padded with n to a multiple of `bucket` entries."""
    ends = np.append(starts[1:], n)
    cuts = [np.arange(a, b, max_len) for a, b in zip(starts.tolist(), ends.tolist())]
    cu = np.append(np.concatenate(cuts), n).astype(np.int32)
    return np.pad(cu, (0, -cu.size % bucket), constant_values=n)


def packed_cu_seqlens(row, max_len, bos=BOS_ID, bucket=CU_SEQLENS_BUCKET):
    """cu_seqlens of one packed row: segments at 0 and every BOS, cut every max_len tokens, padded."""
    return cut_cu_seqlens(doc_starts(row, bos), len(row), max_len, bucket)


def rows_cu_seqlens(rows, bucket=CU_SEQLENS_BUCKET):
    """cu_seqlens over the flattened (B, T) host rows: each row split at its BOS tokens (BOS-split
    evaluation, SPEC-FRONTIER 3), right-padded with B*T to a multiple of `bucket` entries."""
    B, T = rows.shape
    parts = [packed_cu_seqlens(r, T, bucket=1)[:-1] + b * T for b, r in enumerate(np.asarray(rows))]
    cu = np.append(np.concatenate(parts), B * T).astype(np.int32)
    return np.pad(cu, (0, -cu.size % bucket), constant_values=B * T)


def packed_pieces(starts, n, max_len, width, bucket=CU_SEQLENS_BUCKET):
    """MICRO_BATCH_SPLIT on a packed row (issue 40): its n tokens cut into pieces of at most `width` (>= max_len) at
    segment boundaries only (cut_cu_seqlens': document starts and every max_len tokens of a document), each filled
    with whole segments in order, so no segment spans two pieces. Per piece: (a, b, the cu_seqlens of tokens a..b
    padded to `width` tokens: its segments from 0, the padding cut every max_len tokens, right-padded with width to a
    multiple of `bucket` entries)."""
    cu = cut_cu_seqlens(starts, n, max_len, bucket=1)
    pieces, a = [], 0
    while a < n:
        b = int(cu[np.searchsorted(cu, a + width, side="right") - 1])
        local = np.concatenate(([0], cu[(cu > a) & (cu < b)] - a, np.arange(b - a, width, max_len), [width]))
        pieces.append((a, b, np.pad(local.astype(np.int32), (0, -local.size % bucket), constant_values=width)))
        a = b
    return pieces


def small_to_device(array, device):
    """A small host array (cu_seqlens) on `device` without stopping the host: on CUDA through pinned memory and a
    non-blocking copy (a copy from pageable memory waits for all the GPU work already queued, which held the host
    at every packed micro-batch until the GPU caught up, booked as data wait: issue 35), plainly elsewhere."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def eval_doc_bounds(rt, rows):
    """A forward's extra arguments on eval rows (host tensor or array, (B, T)): (DocBounds,) with EVAL_SPLIT_AT_BOS."""
    if not rt.h.eval_split_at_bos:
        return ()
    rows = np.asarray(rows)
    return (DocBounds(small_to_device(rows_cu_seqlens(rows), rt.device), rows.shape[1]),)


class DocumentPackingLoader(_HostLoader):
    """TRAIN_LOADER=packed (SPEC-FRONTIER 3, the 04-10+ records): shards in sorted order, each read from its
    first BOS; every micro-step takes the next contiguous span of world_size * (local_tokens + 1) tokens of
    the current shard (the next shard when it does not fit; after the last, the first again), and rank r
    its r-th slice: one packed row (1, local_tokens) with cu_seqlens at BOS, segments cut at seq_len. The
    cut is applied when a batch is handed out, so set_cut_len() (progressive context) acts on the next batch
    even with batches prefetched; rope_len is the length RoPE is scaled for (the longest cut of the run)."""

    def __init__(self, files, rank, world_size, device, local_tokens, seq_len, vocab_size=None, rope_len=0,
                 first_bos=None):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.local_tokens, self.seq_len, self.vocab_size = local_tokens, seq_len, vocab_size
        self.rope_len = rope_len
        self.span = world_size * (local_tokens + 1)
        self.files = files
        self.first_bos = first_bos  # another rank's of the same world (virtual ranks), else scanned here
        if first_bos is None:
            self.first_bos = []
            for f in files:  # where each shard's documents start; shards too short for one span are skipped
                first = self._first_bos(f)
                self.first_bos.append(first if first is not None and read_shard_header(f) - first >= self.span
                                      else None)
        if all(b is None for b in self.first_bos):
            raise ConfigError(f"TRAIN_LOADER=packed: no train shard ({files[0]} ...) holds a BOS token followed "
                              f"by one span of WORLD_SIZE x (tokens per rank and micro-step + 1) = {self.span} "
                              f"tokens")
        self.file_idx, self.reader = -1, None
        self._next_shard()

    @staticmethod
    def _first_bos(path, block=1 << 16):
        with contextlib.closing(ShardReader(path)) as reader:
            for start in range(0, reader.num_tokens, block):
                hits = np.flatnonzero(reader.read(start, min(block, reader.num_tokens - start)) == BOS_ID)
                if hits.size:
                    return start + int(hits[0])
            return None

    def _next_shard(self):
        nxt = (self.file_idx + 1) % len(self.files)
        while self.first_bos[nxt] is None:
            nxt = (nxt + 1) % len(self.files)
        switch_shard(self, nxt, self.first_bos[nxt])

    def next_host(self):
        """(this rank's local_tokens + 1 tokens, where its documents start)."""
        if self.pos + self.span > self.reader.num_tokens:
            self._next_shard()
        mine = self.reader.read(self.pos + self.rank * (self.local_tokens + 1), self.local_tokens + 1)
        self.pos += self.span
        return mine, doc_starts(mine[:-1])

    def set_cut_len(self, seq_len):
        self.seq_len = seq_len

    def position(self):
        return {"file_idx": self.file_idx, "pos": self.pos}

    def restore(self, position):
        if position["file_idx"] != self.file_idx:
            switch_shard(self, position["file_idx"])
        self.pos = position["pos"]

    def doc_bounds(self, starts, device):
        cu = cut_cu_seqlens(starts, self.local_tokens, self.seq_len)
        return DocBounds(small_to_device(cu, device), self.seq_len, self.rope_len, starts=starts)

    def to_device(self, host):
        tokens, starts = host
        x, y = host_to_device(tokens, self.local_tokens, self.device)
        return x, y, self.doc_bounds(starts, self.device)


class VirtualRankLoader(_HostLoader):
    """REPLAY_WORLD_SIZE (issue 40): the loaders of the virtual ranks one rank stands for, each drawing exactly as that
    rank of a REPLAY_WORLD_SIZE-rank run draws (its shard stride, its generator, its span of each micro-step); a step
    takes `block` (GRAD_ACCUM_STEPS) micro-batches from each in turn. A packed one hands out its first's documents'
    bounds (the cut length is set on all)."""

    def __init__(self, loaders, block):
        self.loaders, self.block, self.taken = loaders, block, 0
        # what make_train_loader's prefetcher reads of a packed base; batches go to the device as the first's do
        self.local_tokens = getattr(loaders[0], "local_tokens", 0)

    def next_host(self):
        source = self.loaders[(self.taken // self.block) % len(self.loaders)]
        self.taken += 1
        return source.next_host()

    def to_device(self, host):
        return self.loaders[0].to_device(host)

    def doc_bounds(self, starts, device):
        return self.loaders[0].doc_bounds(starts, device)

    def set_cut_len(self, seq_len):
        for loader in self.loaders:
            loader.set_cut_len(seq_len)

    def position(self):
        return {"virtual": [loader.position() for loader in self.loaders], "taken": self.taken}

    def restore(self, position):
        for loader, pos in zip(self.loaders, position["virtual"]):
            loader.restore(pos)
        self.taken = position["taken"]


class PrefetchingPackedLoader:
    """The prefetcher (thread, pinned ring, copy stream) around a DocumentPackingLoader: cu_seqlens travel as
    the batch's aux; next_batch() gives (x, y, DocBounds)."""

    def __init__(self, base, inner):
        self.base, self.inner = base, inner  # inner: the prefetcher of base.next_host's (tokens, starts)

    def next_batch(self):
        x, y, starts = self.inner.next()
        return x, y, self.base.doc_bounds(starts, x.device)

    def set_cut_len(self, seq_len):
        self.base.set_cut_len(seq_len)

    def position(self):
        return self.inner.position()

    def shutdown(self):
        self.inner.shutdown()


def host_to_device(host, seq_len, device):
    """Copy compact host tokens to the device, widen to int64 there, cut (x, y)."""
    if isinstance(host, np.ndarray):
        host = torch.from_numpy(host.astype(np.int32))
    return cut_batch(host.to(device).to(torch.int64), seq_len)


def cut_batch(wide, seq_len):
    """x, y views: a 1-D (n+1)-token span gives (n/L, L) rows; (B, L+1) windows their first/last L."""
    if wide.ndim == 1:
        return wide[:-1].view(-1, seq_len), wide[1:].view(-1, seq_len)
    return wide[:, :-1], wide[:, 1:]


@dataclass
class _WorkerFailure:
    """An exception from the worker thread, re-raised in the consumer."""
    exc: BaseException


_END_OF_DATA = object()


class PrefetchingDistributedTokenLoader:
    """Keeps the device fed (SPEC 8). `produce()` gives (host array, aux), or None at the end. threaded: a
    daemon thread runs it ahead into a bounded queue of pinned int32 buffers (CPU: int64 tensors); its
    failure is re-raised here. copy_stream (CUDA): handing out batch k starts batch k+1's copy on a side
    stream, overlapping step k. produce_position (optional): the source's position after each produce() call,
    carried with its batch, so position() is the consumer's (after the last batch handed out), however far
    the worker has run ahead: a checkpoint saves it, and a loader made from it rebuilds the queue from there."""

    def __init__(self, produce, seq_len, device, queue_size=2, threaded=True, copy_stream=True, name="loader",
                 produce_position=None):
        self.produce, self.seq_len, self.device = produce, seq_len, device
        self.produce_position = produce_position
        self._consumed = produce_position() if produce_position is not None else None
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if copy_stream and self.cuda else None
        self._ring = []  # [pinned int32 buffer, event of the copy that last read it]
        self._ring_size = queue_size + 3  # queued + one being filled + one in flight + one in use
        self._next_slot, self._pending, self._exhausted = 0, None, False
        self._queue = queue.Queue(maxsize=queue_size) if threaded else None
        self._stop = threading.Event()
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._work, name=f"prefetch-{name}", daemon=True)
            self._thread.start()

    def _fill_slot(self, host):
        idx = self._next_slot
        self._next_slot = (idx + 1) % self._ring_size
        if idx == len(self._ring):
            self._ring.append([None, None])
        slot = self._ring[idx]
        if slot[1] is not None:
            slot[1].synchronize()  # the copy that last read this buffer has finished
        if slot[0] is None or tuple(slot[0].shape) != host.shape:
            slot[0] = torch.empty(host.shape, dtype=torch.int32, pin_memory=self.cuda)
        np.copyto(slot[0].numpy(), host, casting="safe")
        return idx

    def _produce_one(self):
        item = self.produce()
        if item is None:
            return _END_OF_DATA
        host, aux = item
        pos = self.produce_position() if self.produce_position is not None else None
        if not self.cuda:  # no bus to cross: widen here, off the consumer's path
            return torch.from_numpy(np.asarray(host, dtype=np.int64)), aux, pos
        return self._fill_slot(host), aux, pos

    def _work(self):
        try:
            while not self._stop.is_set():
                item = self._produce_one()
                self._put(item)
                if item is _END_OF_DATA:
                    return
        except BaseException as e:  # re-raised by the consumer
            self._put(_WorkerFailure(e))

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def _take(self):
        if self._exhausted:
            return _END_OF_DATA
        if self._stop.is_set():
            raise RuntimeError("PrefetchingDistributedTokenLoader used after shutdown()")
        item = self._queue.get() if self._queue is not None else self._produce_one()
        if isinstance(item, _WorkerFailure):
            self.shutdown()
            raise item.exc
        self._exhausted = item is _END_OF_DATA
        return item

    def _copy(self, item):
        """Start a taken item's copy; returns (device int64 tokens, aux, event)."""
        if item is _END_OF_DATA:
            return item
        idx, aux, pos = item
        if not self.cuda:
            return idx, aux, None, pos  # the int64 tensor from _produce_one
        event = torch.cuda.Event()
        with torch.cuda.stream(self.copy_stream):  # a no-op when None
            wide = self._ring[idx][0].to(self.device, non_blocking=True).to(torch.int64)
        event.record(self.copy_stream)  # None: the current stream
        self._ring[idx][1] = event
        return wide, aux, event, pos

    @torch.inference_mode(False)
    def next(self):
        """(x, y, aux) of the next batch; raises StopIteration at the end of a finite source. The tokens are
        ordinary tensors even when called inside inference mode (evaluation), whichever thread made them: the
        compiled graphs guard on it, and the evaluation's warmup makes its tokens outside inference mode too."""
        current = self._pending if self._pending is not None else self._copy(self._take())
        self._pending = None
        if isinstance(current, _WorkerFailure):
            raise current.exc
        if current is _END_OF_DATA:
            raise StopIteration
        if self.copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(current[2])
            current[0].record_stream(compute)  # the allocator must not reuse it while the step runs
            try:
                self._pending = self._copy(self._take())  # overlaps the step that uses `current`
            except BaseException as e:  # hand out the good batch first; the error comes next call
                self._pending = _WorkerFailure(e)
        x, y = cut_batch(current[0], self.seq_len)
        self._consumed = current[3]
        return x, y, current[1]

    def position(self):
        """The source's position after the last batch handed out (None without produce_position)."""
        return self._consumed

    def next_batch(self):
        return self.next()[:2]

    def shutdown(self):
        """Stop and join the worker, so the stream does not advance in the background."""
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                with contextlib.suppress(queue.Empty):
                    self._queue.get_nowait()
                self._thread.join(timeout=0.05)
            self._thread = None
        self._pending = None


def val_token_shards(pattern):
    """The val token shards: the byte sidecars (fineweb_val_bytes_*) match the same glob and are left out."""
    files = [f for f in list_shards(pattern) if not Path(f).name.startswith(SIDECAR_PREFIX)]
    if not files:
        raise ConfigError(f"DATA_PATH: only byte sidecars match {pattern}, no validation token shards")
    return files


def load_validation_tokens(pattern, seq_len, vocab_size, include_tail=False):
    """All val shards concatenated, cut to whole sequences plus one target token (include_tail: not cut,
    EVAL_INCLUDE_TAIL, #2014 in SPEC-FRONTIER 19)."""
    tokens = np.concatenate([load_shard(f) for f in val_token_shards(pattern)])
    usable = ((tokens.size - 1) // seq_len) * seq_len
    if include_tail and usable > 0:
        usable = tokens.size - 1
    if usable <= 0:
        raise ConfigError(f"DATA_PATH: validation shards {pattern} hold {tokens.size} tokens, "
                          f"fewer than one sequence of {seq_len} plus one")
    if int(tokens.max()) >= vocab_size:
        raise ConfigError(f"DATA_PATH: validation shards {pattern} contain token id {int(tokens.max())} "
                          f">= VOCAB_SIZE={vocab_size}")
    return torch.from_numpy(tokens[:usable + 1].astype(np.int32))


@dataclass
class ByteLuts:
    """Per-token byte accounting for bits-per-byte (SPEC 7), or, with a byte sidecar, per val position."""
    base_bytes: Tensor  # int16: UTF-8 bytes of the piece without its leading space marker
    has_leading_space: Tensor  # bool
    is_boundary: Tensor  # bool: control / unknown / unused ids (0 bytes, reset the space rule)
    caseops: bool = False  # ids 4-7 are the CaseOps operators: the tokenizer's byte rule does not apply
    sidecar: Tensor = None  # int32 per val position: bytes of the token there as a target (load_byte_sidecar)

    def to(self, device):
        return ByteLuts(self.base_bytes.to(device), self.has_leading_space.to(device), self.is_boundary.to(device),
                        self.caseops, None if self.sidecar is None else self.sidecar.to(device))

    def target_bytes(self, prev_ids, tgt_ids, tgt_pos):
        """Bytes of each target (float64): the sidecar's at val positions tgt_pos if there is one, else count()."""
        if self.sidecar is not None:
            return self.sidecar[tgt_pos].to(torch.float64)
        return self.count(prev_ids, tgt_ids)

    def count(self, prev_ids, tgt_ids):
        """Bytes of each target token given its predecessor, as float64."""
        prev_ids, tgt_ids = prev_ids.long(), tgt_ids.long()
        nbytes = self.base_bytes[tgt_ids].to(torch.int32)
        nbytes += (self.has_leading_space[tgt_ids] & ~self.is_boundary[prev_ids]).to(torch.int32)
        return nbytes.to(torch.float64)


def build_byte_luts(tokenizer_path, vocab_size):
    import sentencepiece as spm

    if not os.path.isfile(tokenizer_path):
        raise ConfigError(f"TOKENIZER_PATH: {tokenizer_path} does not exist; to get data, {GET_DATA}")
    try:
        sp = spm.SentencePieceProcessor(model_file=tokenizer_path)
    except (RuntimeError, OSError) as e:
        raise ConfigError(f"TOKENIZER_PATH: {tokenizer_path} is not a SentencePiece model "
                          f"({first_line(e) or type(e).__name__})") from None
    n = int(sp.vocab_size())
    if n != vocab_size:
        raise ConfigError(f"TOKENIZER_PATH: {tokenizer_path} has {n} pieces but VOCAB_SIZE={vocab_size}")
    base, lead, boundary = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.bool_), np.ones(n, dtype=np.bool_)
    for i in range(n):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            continue
        boundary[i] = False
        if sp.is_byte(i):
            base[i] = 1
            continue
        piece = sp.id_to_piece(i)
        if piece.startswith("\u2581"):
            lead[i] = True
            piece = piece[1:]
        base[i] = len(piece.encode("utf-8"))
    caseops = [sp.id_to_piece(i) for i in range(4, min(n, 8))] == list(CASEOPS_OPERATORS)
    return ByteLuts(torch.from_numpy(base), torch.from_numpy(lead), torch.from_numpy(boundary), caseops)


def load_byte_sidecar(pattern, val_tokens, luts):
    """SPEC-FRONTIER 2: with byte sidecars beside the val shards (one per shard, same format, one uint16 per
    token: the UTF-8 bytes of original text it stands for), BPB counts those bytes. Returns (luts with the
    sidecar cut like val_tokens, or luts unchanged without sidecars; 'sidecar' or 'tokenizer')."""
    pairs = [(Path(f), Path(f).with_name(SIDECAR_PREFIX + Path(f).name[len("fineweb_val_"):]))
             for f in val_token_shards(pattern)]
    present = [side for _, side in pairs if side.exists()]
    if not present:
        if luts.caseops:
            raise ConfigError(f"DATA_PATH: byte sidecar {pairs[0][1]} missing: a CaseOps tokenizer needs the val "
                              f"byte sidecars for bits per byte")
        return luts, "tokenizer"
    parts = []
    for shard, side in pairs:
        if not side.exists():
            raise ConfigError(f"DATA_PATH: byte sidecar {side} missing for val shard {shard.name}")
        n_tok, n_side = read_shard_header(shard), read_shard_header(side)
        if n_side != n_tok:
            raise ConfigError(f"DATA_PATH: byte sidecar {side} is {'short' if n_side < n_tok else 'mismatched'}: "
                              f"{n_side} entries for the {n_tok} tokens of {shard.name}")
        parts.append(load_shard(side))
    sidecar = torch.from_numpy(np.concatenate(parts)[:val_tokens.numel()].astype(np.int32))
    bad = torch.nonzero((val_tokens == BOS_ID) & (sidecar != 0))
    if bad.numel():
        raise ConfigError(f"DATA_PATH: byte sidecars {present[0].parent}/{SIDECAR_PREFIX}* are mismatched: "
                          f"{int(sidecar[bad[0, 0]])} bytes at val position {int(bad[0, 0])}, a BOS token")
    return replace(luts, sidecar=sidecar), "sidecar"


def data_split_note(data_path):
    """The split of a variant built by data/build_shards.py, from its manifest.json beside the shards: a log line
    ('data_split: ...'), or None for data without one (the published exports: the challenge's split)."""
    try:
        with open(os.path.join(data_path, "manifest.json"), encoding="utf-8") as f:
            split = json.load(f).get("split")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(split, dict) or "val_docs" not in split:
        return None
    kind = "the challenge's" if split.get("challenge") else "NOT the challenge's"
    return f"data_split: {kind}: the first {split['val_docs']} documents are validation (manifest.json)"


# ==================================================
# MODEL
# ==================================================

# causal_attention's kernels, set by select_attention_backend(): dense, varlen (document-packed rows, called as
# varlen(q, k, v, cu_seqlens, max_len) on (tokens, heads, dim)) and the packed rows' name in the log.
_ATTENTION = {"name": "sdpa", "fn": None, "varlen": None, "packed": "torch_doc_blocks"}
# ATTENTION_BACKEND name -> module whose flash_attn_func takes (B, T, H, D) q, k, v; AUTO_ATTENTION: auto's order.
# torch_varlen: PyTorch's own varlen FlashAttention, for packed rows only (dense rows keep SDPA).
ATTENTION_MODULES = {"flash_attn_3": "flash_attn_interface", "flash_attn_2": "flash_attn",
                     "flash_attn_4": "flash_attn.cute", "sdpa": None}
TORCH_VARLEN = "torch_varlen"
AUTO_ATTENTION = ("flash_attn_3", "flash_attn_2", TORCH_VARLEN)  # flash_attn_4 only when named: not yet measured


def import_flash_attn(module):
    """The module if it imports and has flash_attn_func, else None."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    return mod if hasattr(mod, "flash_attn_func") else None


def import_torch_varlen():
    """torch.nn.attention.varlen.varlen_attn if this PyTorch has it with a window_size argument (2.11 on: its
    causal mask; an older one took is_causal), else None. enable_gqa came in 2.12: varlen_gqa_mode."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if "window_size" in inspect.signature(varlen_attn).parameters else None


# Whether varlen_attn without enable_gqa (2.11) takes k, v with fewer heads than q as they are (2.13 hands them so to
# the same ATen FlashAttention 2 op, its enable_gqa a Python check); False until a GPU check shows it (issue 41;
# docs/gpu.md "Attention"), so they are expanded.
VARLEN_GQA_NATIVE = False


def varlen_gqa_mode(signature):
    """How torch_varlen hands varlen_attn k, v of H_kv < H_q heads (issue 41), from its inspect.signature:
    "enable_gqa" where it takes that argument (2.12 on), else "native" (as they are) if VARLEN_GQA_NATIVE, else
    "expand" (each KV head repeated for its H_q / H_kv query heads, as SDPA's enable_gqa groups them: exact)."""
    if "enable_gqa" in signature.parameters:
        return "enable_gqa"
    return "native" if VARLEN_GQA_NATIVE else "expand"


def flash_varlen(fn):
    """FlashAttention 2/3's flash_attn_varlen_func as _ATTENTION["varlen"]: causal within each segment."""
    def attend(q, k, v, cu, max_len):
        out = fn(q, k, v, cu, cu, max_len, max_len, causal=True)
        return out[0] if isinstance(out, tuple) else out
    return attend


def torch_varlen(varlen_attn, gqa):
    """PyTorch's varlen_attn as _ATTENTION["varlen"] (SPEC-FRONTIER 3's per-document attention): window
    (-1, 0) is its causal mask within each segment; k, v of H_kv heads (H_q a multiple) as varlen_gqa_mode's
    gqa says. A torch.library custom op with a fake and an autograd formula: torch.compile(fullgraph=True) keeps one
    graph."""
    def attend(q, k, v, cu, max_len):
        if gqa == "expand" and k.size(1) != q.size(1):
            k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
        kw = {"enable_gqa": True} if gqa == "enable_gqa" else {}
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0), **kw)
    return attend


def select_attention_backend(device, choice="auto"):
    """ATTENTION_BACKEND: auto is FlashAttention 3, else 2 (CUDA only), else PyTorch SDPA; a named flash kernel
    that is missing (or asked for without CUDA) is a ConfigError. On packed rows (docs given) the same library's
    flash_attn_varlen_func; without FlashAttention (auto, or named torch_varlen) on CUDA PyTorch's varlen_attn,
    else the exact PyTorch path of doc_causal_attention. Returns the name logged (the dense rows' kernel)."""
    _ATTENTION.update(name="sdpa", fn=None, varlen=None, packed="torch_doc_blocks")
    if choice == "sdpa":
        return "sdpa"
    if choice != "auto" and device.type != "cuda":
        raise ConfigError(f"ATTENTION_BACKEND={choice} needs CUDA (this run is on {device.type})")
    for name in AUTO_ATTENTION if choice == "auto" else (choice,):
        if device.type != "cuda":
            break
        if name == TORCH_VARLEN:
            varlen_attn = import_torch_varlen()
            if varlen_attn is not None:
                gqa = varlen_gqa_mode(inspect.signature(varlen_attn))
                _ATTENTION.update(varlen=torch_varlen(varlen_attn, gqa), packed=f"{TORCH_VARLEN} gqa:{gqa}")
                break
            missing = (f"this PyTorch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn taking "
                       "window_size (2.11 on)")
        else:
            mod = import_flash_attn(ATTENTION_MODULES[name])
            if mod is not None:
                fa_varlen = getattr(mod, "flash_attn_varlen_func", None)
                _ATTENTION.update(name=name, fn=mod.flash_attn_func)
                if fa_varlen is not None:
                    _ATTENTION.update(varlen=flash_varlen(fa_varlen), packed=f"{name}_varlen")
                break
            missing = f"cannot import {ATTENTION_MODULES[name]}.flash_attn_func"
        if choice != "auto":
            raise ConfigError(f"ATTENTION_BACKEND={choice}: {missing} (docs/gpu.md, Attention)")
    return _ATTENTION["name"]


def varlen_backend_name():
    """What attends on packed rows (the log's attention_backend_packed; torch_varlen with its gqa mode)."""
    return _ATTENTION["packed"]


class DocBounds(NamedTuple):
    """Document boundaries of packed rows (SPEC-FRONTIER 3): cu_seqlens (int32) over the B*T flattened
    tokens, [0, starts..., B*T], right-padded with B*T (empty segments); every row start is a boundary and
    no segment is longer than max_len. RoPE is scaled for rope_len tokens (0: max_len)."""
    cu_seqlens: Tensor
    max_len: int
    rope_len: int = 0
    # a piece of a packed row (MICRO_BATCH_SPLIT, issue 40): its first RoPE position in the row (0-dim fp32), the
    # token before it ((1, 1) ids, SmearGate's previous token) and whether there is one ((1, 1, 1) fp 0/1)
    pos0: Tensor | None = None
    prev: Tensor | None = None
    prev_keep: Tensor | None = None
    starts: object = None  # the training loader's: where the row's documents start (host), for the Trainer alone


def flash_device(t):
    """Whether the flash kernels run on t's device (CUDA only)."""
    return t.is_cuda


def flash_inputs(q, k, v):
    """(q, k, v) as the flash kernels take them, or None where they cannot: on CUDA, one dtype, bf16 or fp16.
    Under autocast they are cast to its dtype, as autocast casts SDPA's: F.rms_norm is on autocast's fp32 list,
    so the QK-normed q and k arrive in fp32 beside a bf16 v."""
    if not flash_device(q):
        return None
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return (q, k, v) if q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype else None


def causal_attention(q, k, v, docs=None):
    """Causal GQA attention on (B, T, H, D) tensors; with docs (DocBounds) no token attends across a
    document boundary."""
    if docs is not None:
        return doc_causal_attention(q, k, v, docs)
    fn = _ATTENTION["fn"]
    flash = None if fn is None else flash_inputs(q, k, v)
    if flash is not None:
        out = fn(*flash, causal=True)
        return out[0] if isinstance(out, tuple) else out
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=k.size(2) != q.size(2))
    return y.transpose(1, 2)


def doc_causal_attention(q, k, v, docs):
    """Per-document causal attention (varlen). Flash (FlashAttention's flash_attn_varlen_func or PyTorch's
    varlen_attn): the (B, T, H, D) tensors flattened to (B*T, H, D) with docs.cu_seqlens and docs.max_len. PyTorch
    (no varlen kernel): per_document_attention on CPU in eager mode, else doc_block_attention."""
    B, T, H, D = q.shape
    cu = docs.cu_seqlens
    fn = _ATTENTION["varlen"]
    flash = None if fn is None else flash_inputs(q, k, v)
    if flash is not None:
        out = fn(*[t.reshape(B * T, *t.shape[2:]) for t in flash], cu, docs.max_len)
        return out.view(B, T, H, D)
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        return per_document_attention(q, k, v, cu)
    return doc_block_attention(q, k, v, docs)


def doc_block_attention(q, k, v, docs):
    """The exact masked path of doc_causal_attention (torch_doc_blocks), in blocks of S = docs.max_len tokens: a
    segment is at most S long, so the queries of block c see keys of blocks c-1 and c only; one masked SDPA call
    over all blocks, each (S x 2S). Cost O(N * 2S) per head for N packed tokens (linear in N, not N^2) and a bool
    mask of N * 2S."""
    B, T, H, D = q.shape
    cu = docs.cu_seqlens
    S, N = docs.max_len, B * T
    nb = -(-N // S)
    pad = nb * S - N
    pos = torch.arange(nb * S, device=q.device)
    # document index per token; padding tokens get their own index, past the last document
    doc = torch.searchsorted(cu, pos.clamp(max=N - 1).to(cu.dtype), right=True)
    doc = torch.where(pos < N, doc, cu.numel() + 1)

    def blocks(t):  # (N, h, D) -> (nb, h, S, D), zero-padded
        return F.pad(t.reshape(N, *t.shape[2:]), (0, 0, 0, 0, 0, pad)).view(nb, S, *t.shape[2:]).transpose(1, 2)

    def with_previous(t):  # (nb, h, S, D) -> (nb, h, 2S, D): block c-1 (zeros before the first) then block c
        return torch.cat((F.pad(t, (0, 0, 0, 0, 0, 0, 1, 0))[:-1], t), dim=2)

    qb, kb, vb = blocks(q), with_previous(blocks(k)), with_previous(blocks(v))
    doc_q = doc.view(nb, S)
    doc_k = torch.cat((F.pad(doc_q, (0, 0, 1, 0), value=-1)[:-1], doc_q), dim=1)
    pos_q = pos.view(nb, S)
    pos_k = torch.cat((pos_q - S, pos_q), dim=1)
    mask = (doc_q[:, :, None] == doc_k[:, None, :]) & (pos_k[:, None, :] <= pos_q[:, :, None])
    y = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[:, None], enable_gqa=kb.size(1) != qb.size(1))
    return y.transpose(1, 2).reshape(nb * S, H, D)[:N].view(B, T, H, D)


def per_document_attention(q, k, v, cu):
    """Exact per-document causal attention on CPU in eager mode (issue 34): one causal SDPA call per non-empty
    segment of cu_seqlens, which CPU runs with its fused (flash) kernel, no mask; cost sum(L_i^2 / 2) per head, where
    the masked blocks of doc_causal_attention cost N * 2S and a mask. Its loop reads cu_seqlens on the host, so a
    compiled graph takes the blocks instead (traceable, no sync)."""
    B, T, H, D = q.shape
    flat = [t.reshape(B * T, *t.shape[2:]) for t in (q, k, v)]
    bounds = cu.tolist()
    gqa = k.size(2) != H
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            seg = [t[a:b].transpose(0, 1) for t in flat]  # (h, L, D)
            outs.append(F.scaled_dot_product_attention(*seg, is_causal=True, enable_gqa=gqa).transpose(0, 1))
    return torch.cat(outs).view(B, T, H, D)


def rms_norm(x):
    return F.rms_norm(x, (x.size(-1),))


_RECORDER = [None]  # the GPTQ Hessian recorder while calibrating (collect_hessians), else None


def linear(x, w):
    """x @ w^T, w cast to x's dtype; while GPTQ calibrates, x is recorded for w's Hessian."""
    if _RECORDER[0] is not None:
        _RECORDER[0].add(x, w)
    return F.linear(x, w.to(x.dtype))


# ---- fused Triton kernels (issue 21, SPEC-FRONTIER 15 and 18): FUSED_MLP, FUSED_CE; training mode only

# What select_fused_kernels() switched on, read by Block.mlp and GPT.forward. "dtype": the dtype the fused
# MLP casts its inputs to (the autocast dtype, else fp32); "interpret": CPU tensors may run the kernels
# (Triton's CPU interpreter, TRITON_INTERPRET=1: how the tests run them).
_FUSED = {"mlp": False, "ce": False, "dtype": torch.float32, "interpret": False}
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
triton = tl = None  # bound by triton_kernels(); until then the kernels below are plain Python functions
_JITTED = {}  # Triton's interpret flag -> the jitted kernels (Triton reads the flag when it jits)


def triton_interpreting():
    """Whether Triton runs kernels in its CPU interpreter (its knob for TRITON_INTERPRET=1); False without it."""
    try:
        import triton as t
    except ImportError:
        return False
    knobs = getattr(t, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


def triton_kernels():
    """The three kernels, jitted on first use. Raises ImportError without Triton, and Triton's error where it
    cannot read their source (inspect.getsource: code exec'd from a string; the packed file of scripts/pack/pack_code.py
    registers its source in linecache, and keeps the `tl.constexpr` annotations, so it runs these kernels). The
    helper the kernels call, _bf16_rtne, is jitted too and its global name bound to the jitted form of the current
    mode (Triton refuses kernels that name plain functions)."""
    global triton, tl
    import triton
    import triton.language as tl
    key = triton_interpreting()
    if key not in _JITTED:
        _JITTED[key] = {f.__name__: triton.jit(f) for f in (_mlp_tile_kernel, _ce_fwd_kernel, _ce_bwd_kernel,
                                                            _KERNEL_HELPERS["_bf16_rtne"])}
    globals()["_bf16_rtne"] = _JITTED[key]["_bf16_rtne"]
    return _JITTED[key]


def _mlp_tile_kernel(a_ptr, b_ptr, out_ptr, aux_ptr, M, N, K, s_am, s_ak, s_bn, s_bk,
                     FORWARD: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, ROUND_BF16: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of acc = A @ B^T (A: M x K, B: N x K, any strides; fp32 accumulation), then
    FORWARD: out = pre = acc and aux = post = LeakyReLU(pre, 0.5)^2, in out's dtype (post from the rounded pre,
    as eager computes it); backward (aux = pre): out = dpre = acc * (2 pre if pre > 0 else 0.5 pre), rounded
    once. out and aux are contiguous M x N. Tiles run in groups of GROUP_M tile rows, so B's tiles stay in L2.
    UPCAST (the interpreter, whose tl.dot gives garbage on bf16 in Triton 3.9): A and B go to fp32 first, the
    same products (a bf16 product is exact in fp32) and the same fp32 accumulation. ROUND_BF16: see _bf16_rtne."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm[:, None].to(tl.int64) * s_am
    b_cols = b_ptr + rn[None, :].to(tl.int64) * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_rows + kk[None, :] * s_ak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_cols + kk[:, None] * s_bk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    if FORWARD:
        if ROUND_BF16:
            pre = _bf16_rtne(acc)
        else:
            pre = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, pre, mask=inside)
        p = pre.to(tl.float32)
        act = tl.where(p > 0, p, 0.5 * p)
        if ROUND_BF16:
            post = _bf16_rtne(act * act)
        else:
            post = (act * act).to(aux_ptr.dtype.element_ty)
        tl.store(aux_ptr + offs, post, mask=inside)
    else:
        p = tl.load(aux_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        dpre = acc * tl.where(p > 0, 2.0 * p, 0.5 * p)
        if ROUND_BF16:
            dpre = _bf16_rtne(dpre)
        tl.store(out_ptr + offs, dpre.to(out_ptr.dtype.element_ty), mask=inside)


def _bf16_rtne(x):
    """fp32 -> bf16 rounded to nearest even by integer arithmetic on the bits, for the interpreter only: Triton
    3.9's interpreter truncates in .to(tl.bfloat16), where a GPU rounds to nearest even (finite x)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


_KERNEL_HELPERS = {"_bf16_rtne": _bf16_rtne}  # the plain functions, for triton_kernels() to jit


def mlp_tile_config(dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of _mlp_tile_kernel, on a GPU and in the interpreter."""
    return (64, 64, 32, 4, 3) if dtype == torch.float32 else (128, 128, 64, 8, 3)


def mlp_tiles(a, b_nk, pre=None, config=None):
    """a @ b_nk^T through _mlp_tile_kernel: forward (pre None) -> (pre, post); backward -> dpre."""
    (M, K), N = a.shape, b_nk.shape[0]
    bm, bn, bk, warps, stages = config or mlp_tile_config(a.dtype)
    out = a.new_empty((M, N))
    aux = a.new_empty((M, N)) if pre is None else pre.contiguous()
    triton_kernels()["_mlp_tile_kernel"][(-(-M // bm) * -(-N // bn),)](
        a, b_nk, out, aux, M, N, K, a.stride(0), a.stride(1), b_nk.stride(0), b_nk.stride(1),
        FORWARD=pre is None, IEEE=a.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32,
        UPCAST=not a.is_cuda, ROUND_BF16=not a.is_cuda and a.dtype == torch.bfloat16,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return (out, aux) if pre is None else out


def _ce_fwd_kernel(x_ptr, t_ptr, loss_ptr, lse_ptr, R, V, s_row, cap, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    """ROWS rows of logits x per program: z = cap*tanh(x/cap), computed as cap*(2*sigmoid(2x/cap) - 1) in fp32
    and streamed in BLOCK_V columns with a running max (never stored); lse = logsumexp(z), loss = lse - z[t]."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < R
    base = x_ptr + rows.to(tl.int64)[:, None] * s_row
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    s = tl.zeros((ROWS,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols[None, :], mask=live[:, None] & (cols[None, :] < V), other=0.0).to(tl.float32)
        z = tl.where(cols[None, :] < V, cap * (2.0 * tl.sigmoid(x * (2.0 / cap)) - 1.0), float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(t_ptr + rows, mask=live, other=0)
    scored = live & (t >= 0)  # an IGNORE target (< 0): loss 0
    xt = tl.load(x_ptr + rows.to(tl.int64) * s_row + t, mask=scored, other=0.0).to(tl.float32)
    tl.store(lse_ptr + rows, lse, mask=live)
    tl.store(loss_ptr + rows, tl.where(scored, lse - cap * (2.0 * tl.sigmoid(xt * (2.0 / cap)) - 1.0), 0.0), mask=live)


def _ce_bwd_kernel(x_ptr, t_ptr, lse_ptr, g_ptr, gl_ptr, dx_ptr, R, V, s_row, cap,
                   ROWS: tl.constexpr, BLOCK_V: tl.constexpr, ROUND_BF16: tl.constexpr, LSE_GRAD: tl.constexpr):
    """dloss/dx = g * (softmax(z) - onehot(t)) * (1 - tanh^2(x/cap)), with 1 - tanh^2(x/cap) = 4 sg (1 - sg),
    sg = sigmoid(2x/cap), and softmax(z) = exp(z - lse) from the forward's lse; dx contiguous like x. LSE_GRAD:
    plus gl * softmax(z) * (1 - tanh^2(x/cap)), gl the lse output's gradient (every live row, padding too)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < R
    lse = tl.load(lse_ptr + rows, mask=live, other=0.0)
    g = tl.load(g_ptr + rows, mask=live, other=0.0)
    if LSE_GRAD:
        gl = tl.load(gl_ptr + rows, mask=live, other=0.0)
    t = tl.load(t_ptr + rows, mask=live, other=-1)
    g = tl.where(t >= 0, g, 0.0)  # an IGNORE target's row: no gradient
    row_offs = rows.to(tl.int64)[:, None] * s_row
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        inside = live[:, None] & (cols[None, :] < V)
        x = tl.load(x_ptr + row_offs + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        sg = tl.sigmoid(x * (2.0 / cap))
        p = tl.exp(cap * (2.0 * sg - 1.0) - lse[:, None])
        dz = g[:, None] * (p - tl.where(cols[None, :] == t[:, None], 1.0, 0.0))
        if LSE_GRAD:
            dz = dz + gl[:, None] * p
        dx = dz * 4.0 * sg * (1.0 - sg)
        if ROUND_BF16:
            dx = _bf16_rtne(dx)
        tl.store(dx_ptr + row_offs + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=inside)


def ce_rows_config(x):
    """(ROWS, BLOCK_V, num_warps) of the CE kernels: one row per program on a GPU (the record's layout);
    in the interpreter 16 rows per program, so its per-program overhead stays small."""
    return (1, 1024, 4) if x.is_cuda else (16, 256, 1)


def ce_rows(kernel, x, targets, cap, extra, **constexprs):
    """Launch a CE kernel over x's rows; `extra`: the kernel's tensors between targets and (R, V, ...)."""
    rows, block, warps = ce_rows_config(x)
    R, V = x.shape
    triton_kernels()[kernel][(-(-R // rows),)](x, targets, *extra, R, V, x.stride(0), float(cap),
                                                 ROWS=rows, BLOCK_V=block, num_warps=warps, **constexprs)


def _fused_mlp_impl(x, w1, w2):
    x2 = x.reshape(-1, x.size(-1))
    pre, post = mlp_tiles(x2, w1)
    return (post @ w2.t()).reshape(*x.shape[:-1], w2.size(0)), pre, post


def _fused_mlp_fake(x, w1, w2):
    rows = x.numel() // x.size(-1)
    return (x.new_empty((*x.shape[:-1], w2.size(0))), x.new_empty((rows, w1.size(0))),
            x.new_empty((rows, w1.size(0))))


def _fused_mlp_backward_impl(g, x, w1, w2, pre, post):
    x2, g2 = x.reshape(-1, x.size(-1)), g.reshape(-1, g.size(-1)).to(x.dtype)
    dpre = mlp_tiles(g2, w2.t(), pre=pre)
    return (dpre @ w1).reshape(x.shape), dpre.t() @ x2, g2.t() @ post


def _fused_mlp_backward_fake(g, x, w1, w2, pre, post):
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2)


def _softcapped_ce_impl(logits, targets, softcap):
    x = logits.contiguous()
    losses = x.new_empty(x.size(0), dtype=torch.float32)
    lse = torch.empty_like(losses)
    ce_rows("_ce_fwd_kernel", x, targets.contiguous(), softcap, (losses, lse))
    return losses, lse


def _softcapped_ce_fake(logits, targets, softcap):
    return logits.new_empty(logits.size(0), dtype=torch.float32), logits.new_empty(logits.size(0),
                                                                                   dtype=torch.float32)


def _softcapped_ce_backward_impl(grad, logits, targets, lse, softcap, grad_lse=None):
    """The logits' gradient for the losses' gradient `grad` and, where the lse output was used, its `grad_lse`."""
    x = logits.contiguous()
    dx = torch.empty_like(x)
    g = grad.float().contiguous()
    gl = g if grad_lse is None else grad_lse.float().contiguous()  # not read without LSE_GRAD
    ce_rows("_ce_bwd_kernel", x, targets.contiguous(), softcap, (lse.contiguous(), g, gl, dx),
            ROUND_BF16=not x.is_cuda and x.dtype == torch.bfloat16, LSE_GRAD=grad_lse is not None)
    return dx


def _softcapped_ce_backward_fake(grad, logits, targets, lse, softcap, grad_lse=None):
    return torch.empty_like(logits)


def _register_op(name, schema, impl, fake):
    """A torch.library custom op pgolf::name (opaque to torch.compile, one graph with fullgraph=True). The
    schema is written out: a packed script has no annotations to infer it from."""
    op = torch.library.custom_op(f"pgolf::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    return op


def _save_mlp(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output[1:])  # x, w1, w2, pre, post
    ctx.mark_non_differentiable(*output[1:])


def _save_ce(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], output[1])  # logits, targets, lse
    ctx.softcap = inputs[2]
    ctx.set_materialize_grads(False)  # an output nothing used has no gradient (None): the lse, unless a term reads it


def _ce_backward(ctx, g, g_lse):
    g = torch.zeros_like(g_lse) if g is None else g  # only the lse used
    return torch.ops.pgolf.softcapped_ce_backward(g, *ctx.saved_tensors, ctx.softcap, g_lse), None, None


def register_fused_ops():
    """The kernels as the custom ops torch.ops.pgolf.*, registered once per process, when select_fused_kernels first
    switches one on: a run with both off (or a file specialised to one) registers none. A copy of this file imported
    in the same process (the tests' worked examples) finds them registered and uses them."""
    if hasattr(torch.ops.pgolf, "softcapped_ce_backward"):  # the last one: all four are there
        return
    _register_op("fused_mlp", "(Tensor x, Tensor w1, Tensor w2) -> (Tensor, Tensor, Tensor)",
                 _fused_mlp_impl, _fused_mlp_fake).register_autograd(
        lambda ctx, g, _g_pre, _g_post: torch.ops.pgolf.fused_mlp_backward(g, *ctx.saved_tensors),
        setup_context=_save_mlp)
    _register_op("fused_mlp_backward",
                 "(Tensor g, Tensor x, Tensor w1, Tensor w2, Tensor pre, Tensor post) -> (Tensor, Tensor, Tensor)",
                 _fused_mlp_backward_impl, _fused_mlp_backward_fake)
    _register_op("softcapped_ce", "(Tensor logits, Tensor targets, float softcap) -> (Tensor, Tensor)",
                 _softcapped_ce_impl, _softcapped_ce_fake).register_autograd(_ce_backward, setup_context=_save_ce)
    _register_op("softcapped_ce_backward", "(Tensor grad, Tensor logits, Tensor targets, Tensor lse, float softcap, "
                 "Tensor? grad_lse=None) -> Tensor", _softcapped_ce_backward_impl, _softcapped_ce_backward_fake)


def fused_ready(t):
    """Whether the kernels can take t: a supported dtype, on CUDA (on CPU only under Triton's interpreter)."""
    return t.dtype in FUSED_DTYPES and (t.is_cuda or _FUSED["interpret"])


def leaky_relu2_mlp(x, up_w, down_w):
    """The eager MLP: W_down LeakyReLU(W_up x, 0.5)^2 (through `linear`, which GPTQ's calibration watches)."""
    return linear(F.leaky_relu(linear(x, up_w), 0.5).square(), down_w)


def fused_leaky_relu2_mlp(x, up_w, down_w):
    """FUSED_MLP (SPEC-FRONTIER 15, 18): leaky_relu2_mlp with pre = x W_up^T and post = LeakyReLU(pre, 0.5)^2 from
    one Triton kernel and W_down by cuBLAS; backward: dW_down = g^T post, dpre = (g W_down) * (2 pre if pre > 0
    else 0.5 pre) from the same kernel, dW_up = dpre^T x, dx = dpre W_up. Inputs cast to _FUSED["dtype"] (what
    autocast would give); eager where the kernels cannot run."""
    dt = _FUSED["dtype"]
    if dt not in FUSED_DTYPES or not fused_ready(x):
        return leaky_relu2_mlp(x, up_w, down_w)
    return torch.ops.pgolf.fused_mlp(x.to(dt), up_w.to(dt), down_w.to(dt))[0]


def softcap_logits(logits, softcap):
    return softcap * torch.tanh(logits / softcap)


IGNORE = -100  # a padding target: no loss (F.cross_entropy's ignore_index)


class Outputs(NamedTuple):
    """GPT.outputs, for training's objective: hidden, the final hidden state (after the last RMSNorm, the head's input);
    logits, the head's raw logits (before the softcap), for GPT.cross_entropy (the CE with its lse and scored mask);
    taps, {name: layer state} of the states the objective's pieces asked for (GPT.hidden's names), else empty."""
    hidden: Tensor
    logits: Tensor
    taps: dict


class CE(NamedTuple):
    """softcapped_ce(..., lse=True): what a term added to the loss reads (training_loss). mean: the loss; lse: each
    row's fp32 logsumexp of the softcapped logits, with its gradient (softmax times the softcap's derivative; padding
    rows too); targets: the flat targets."""
    mean: Tensor
    lse: Tensor
    targets: Tensor

    @property
    def scored(self):
        """1.0 where the target is not IGNORE, else 0.0: a term's mask for padding rows."""
        return (self.targets != IGNORE).float()


def softcapped_ce(logits, targets, softcap, lse=False):
    """The eager training loss: mean cross-entropy of the fp32 softcapped logits over the targets not IGNORE; lse:
    a CE with each row's logsumexp."""
    z = softcap_logits(logits, softcap).float().reshape(-1, logits.size(-1))
    mean = F.cross_entropy(z, targets.reshape(-1), ignore_index=IGNORE)
    return CE(mean, torch.logsumexp(z, -1), targets.reshape(-1)) if lse else mean


def fused_softcapped_ce(logits, targets, softcap, padded=False, lse=False):
    """FUSED_CE (SPEC-FRONTIER 15, 18): softcapped_ce from raw logits in one Triton pass per row, without
    materialising the softcapped logits; it keeps the fp32 per-row lse for the backward kernel (an IGNORE target's
    row: loss 0, gradient 0), which adds the lse's own gradient only where a term used it. padded: targets may be
    IGNORE (the mean is then over the others). Eager where the kernels cannot run."""
    flat = logits.reshape(-1, logits.size(-1))
    if not fused_ready(flat):
        return softcapped_ce(logits, targets, softcap, lse)
    losses, rows_lse = torch.ops.pgolf.softcapped_ce(flat, targets.reshape(-1), float(softcap))
    mean = losses.sum() / (targets != IGNORE).sum() if padded else losses.mean()
    return CE(mean, rows_lse, targets.reshape(-1)) if lse else mean


def _fused_smoke_error(name, h, device, dtype):
    """Run one kernel forward and backward on small inputs of the run's widths: None if it ran, else why not."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_()

    try:
        if name == "mlp":
            out = torch.ops.pgolf.fused_mlp(rand(16, h.model_dim), rand(h.mlp_hidden, h.model_dim),
                                            rand(h.model_dim, h.mlp_hidden))[0]
        else:
            targets = torch.randint(0, h.vocab_size, (16,), generator=g).to(device)
            out = torch.ops.pgolf.softcapped_ce(rand(16, h.vocab_size), targets, h.logit_softcap)[0]
        out.float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # a GPU or Triton build the kernels do not run on: said in the log, eager instead
        return f"the kernel failed a trial run ({type(e).__name__}: {first_line(e)})"
    return None


def select_fused_kernels(h, device, dtype):
    """FUSED_MLP / FUSED_CE: switch the kernels on where they run (CUDA, or Triton's interpreter on CPU) for the
    compute dtype `dtype`; returns one log line per kernel saying whether it runs, or why it falls back."""
    _FUSED.update(mlp=False, ce=False, dtype=dtype, interpret=False)
    if not (h.fused_mlp or h.fused_ce):
        return ["fused_mlp: eager (FUSED_MLP=0)", "fused_ce: eager (FUSED_CE=0)"]
    register_fused_ops()
    reason = None
    try:
        triton_kernels()
    except ImportError:
        reason = "Triton is not installed (pip install triton)"
    except Exception as e:  # e.g. no source to read (code exec'd from a string without it in linecache)
        reason = f"Triton cannot build the kernels ({type(e).__name__}: {first_line(e)})"
    _FUSED["interpret"] = reason is None and triton_interpreting()
    if reason is None and device.type != "cuda" and not _FUSED["interpret"]:
        reason = "no CUDA device (on CPU the kernels run only in Triton's interpreter, TRITON_INTERPRET=1)"
    if reason is None and dtype not in FUSED_DTYPES:
        reason = f"unsupported dtype {dtype}"
    where = "Triton interpreter on CPU, TRITON_INTERPRET=1" if device.type != "cuda" else "CUDA"
    lines = []
    for name, on in (("mlp", h.fused_mlp), ("ce", h.fused_ce)):
        why = (reason or _fused_smoke_error(name, h, device, dtype)) if on else None
        _FUSED[name] = on and why is None
        state = "triton kernel" if _FUSED[name] else f"eager, fallback: {why}" if on else "eager"
        lines.append(f"fused_{name}: {state}" + (f" ({where}, {str(dtype).replace('torch.', '')})"
                                                  if _FUSED[name] else f" (FUSED_{name.upper()}={int(on)})"))
    return lines


class CastedEmbedding(nn.Embedding):
    """Rows cast to `out_dtype` if set (fp32 runs), so bf16 tables keep bf16 out of the residual stream."""

    out_dtype = None

    def forward(self, ids):
        rows = super().forward(ids)
        return rows if self.out_dtype is None else rows.to(self.out_dtype)


class CastedLinear(nn.Linear):
    """fp32 weights cast to the activation dtype; with `qat` on (late QAT), fake-quantised to int6 per row in
    training mode, straight-through."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)
        self.qat = False

    def forward(self, x):
        w = self.weight.to(x.dtype)
        if self.training and self.qat:  # (in eval mode the flag is not read: one eval graph serves either)
            with torch.no_grad():
                w32 = self.weight.float()
                scale = (w32.abs().amax(dim=1) / 31.0).clamp_min(1.0 / 31.0)
                wq = (torch.clamp(torch.round(w32 / scale[:, None]), -31, 31) * scale[:, None]).to(x.dtype)
            w = w + (wq - w).detach()
        return F.linear(x, w)


def rotary_tables(seq_len, rd, base, device, train_len=1024, context_len=None, freqs_bf16=False, pos0=None):
    """(cos, sin) for partial RoPE on rd dims, NTK-scaled beyond train_len tokens (ROPE_TRAIN_SEQ_LEN: 1024 in the
    03-23 record, 2048 from 04-09). Rebuilt each forward: cheap, and no cache for torch.compile or
    inference_mode to trip over. On packed rows context_len (the longest segment) decides the scaling, never the
    packed length (SPEC-FRONTIER 17, pitfall 10). freqs_bf16 (ROPE_FREQS_BF16): unscaled frequencies rounded to
    bf16, as the records from 04-09 on ran them (rope_frequencies_bf16)."""
    context_len = seq_len if context_len is None else context_len
    if context_len > train_len:
        base = base * (context_len / train_len) ** (rd / (rd - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd))
    if freqs_bf16 and context_len <= train_len:
        inv_freq = rope_frequencies_bf16(inv_freq)
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    if pos0 is not None:  # a piece of a row: its tokens' positions in the row (whole numbers: exact in fp32)
        positions = positions + pos0
    freqs = torch.outer(positions, inv_freq)
    return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]


def rope_frequencies_bf16(inv_freq):
    """RoPE's frequencies as the records from 04-09 on ran them (issue 29 item 4): `GPT(h).bfloat16()` casts the
    Rotary module's fp32 `inv_freq` buffer to bf16 (round to nearest even), and the 04-27/04-30/05-01 records read
    it back with `.float()`; positions and angles stay fp32. Only the unscaled frequencies: the records' NTK
    branch builds fresh fp32 frequencies (the 03-23 record always takes it, so it stays exact)."""
    return inv_freq.to(torch.bfloat16).float()


def apply_rotary(x, cos, sin, rope_dims):
    """Rotate-half RoPE on the first rope_dims of the head dim; the rest pass through."""
    half = rope_dims // 2
    a, b, rest = x[..., :half], x[..., half:rope_dims], x[..., rope_dims:]
    return torch.cat((a * cos + b * sin, -a * sin + b * cos, rest), dim=-1)


class AttentionGate(nn.Module):
    """A per-head gate on the attention output (SPEC-FRONTIER 8, 18; ATTN_GATE), applied after XSA and before the
    output projection: y_{t,h} *= g_{t,h}, read from the attention input x_t (the block's normed input):
      sparse (04-23, 04-27): g = sigmoid(k * W_h . x_t[0:GATE_WINDOW]), k = ATTN_GATE_SCALE;
      output (04-16):        g = 2 * sigmoid(W_h . x_t[0:GATE_WINDOW]);
      dense (04-19):         g = sigmoid(W_h . x_t), W_h over the full width.
    W (heads x width) starts at zero (g = 0.5, 1, 0.5) or, with ATTN_GATE_INIT_STD > 0, N(0, std^2)."""
    setting = "ATTN_GATE"

    def __init__(self, kind, num_heads, model_dim, window, scale, init_std):
        super().__init__()
        self.kind, self.scale = kind, scale
        self.width = model_dim if kind == "dense" else window
        w = torch.zeros(num_heads, self.width, dtype=torch.float32)
        if init_std > 0:
            nn.init.normal_(w, std=init_std)
        self.weight = nn.Parameter(w)

    def forward(self, y, x):
        z = F.linear(x[..., :self.width], self.weight.to(x.dtype))
        if self.kind == "sparse":
            g = torch.sigmoid(self.scale * z)
        elif self.kind == "output":
            g = 2.0 * torch.sigmoid(z)
        else:
            g = torch.sigmoid(z)
        return y * g[..., None]


class Positions(NamedTuple):
    """What every attention layer needs about token positions: the RoPE tables and, on packed rows, the
    document boundaries (None: one causal sequence per row)."""
    cos: Tensor
    sin: Tensor
    docs: DocBounds = None


class RunContext:
    """Where the run is, for the pieces that act by it (docs/frontier.md "State across steps"): `stage`, what the model
    runs for (STAGES: training's steps, the validation inside training, GPTQ calibration, the scored evaluation, legal
    TTT's adapting and scoring), never read from `self.training` (TTT and calibration run in train mode); `step`, the
    training steps done (before the one running; in a validation, all so far), and `progress`, training_fraction at
    the last step's start. step_t (int64) and progress_t
    (float32) hold the same as 0-d tensors on the run's device, updated in place: a compiled graph takes them as inputs
    and never recompiles for a new step. A graph that reads the stage (a string) guards on it: the evaluation's graphs
    serve both its scoring and TTT. Set by enter() alone: train (warmup), _train_loop (each step, its validation),
    collect_hessians, prepare_evaluation, run's post-EMA diagnostic and evaluate_artifact."""
    STAGES = ("training", "validation", "calibration", "evaluation", "ttt")

    def __init__(self):
        self.stage, self.step, self.progress = "evaluation", 0, 0.0
        self.step_t, self.progress_t = torch.zeros((), dtype=torch.int64), torch.zeros(())

    def place(self, device):
        self.step_t, self.progress_t = self.step_t.to(device), self.progress_t.to(device)

    def enter(self, stage, step=None, progress=None):
        """The stage from now on; step and progress where given (else as they were)."""
        assert stage in self.STAGES, stage
        self.stage = stage
        if step is not None:
            self.step = step
            self.step_t.fill_(step)
        if progress is not None:
            self.progress = progress
            self.progress_t.fill_(progress)

    def uniform(self, *keys):
        """A number in [0, 1), a 0-d float32 tensor, from the step and the integers `keys` (SEED, a layer...): a fixed
        integer hash (MINSTD rounds), so every rank draws the same and a compiled graph reads the step as an input."""
        x = self.step_t % 2147483647
        for key in (*keys, 0, 0):
            x = (x * 48271 + key % 2147483647 + 1) % 2147483647
        return (x // 128).to(torch.float32) / 2 ** 24  # 24 bits: exact in fp32, below 1


CONTEXT = RunContext()


class LayerStates:
    """What the layers made so far in one forward pass, by name (docs/frontier.md "State across layers"); only the
    names asked for (a term's `taps`, a piece's `reads`) are kept, none asked: nothing. Layer run J of the current
    order (encoder then decoder, from 0) runs physical layer I and names its states runs.J.NAME and blocks.I.NAME:
    input (the residual it reads), q, k, v (as attention reads them: after QK-norm, RoPE and the gain; v with its value
    embedding), attn and mlp (the branch outputs as they join the residual), and runs.J / blocks.I, the residual after
    it. Each is what Block.branch's pieces for that name returned. Under the layer loop blocks.I is layer I's latest
    run before the read; with two lanes a residual is the lanes' mean (a + m) / 2."""

    def __init__(self, names):
        self.wanted, self.kept, self.run, self.block = frozenset(names), {}, -1, None

    def enter(self, block, x):
        """Block.forward's start: the next layer run, of `block`, reading the residual x."""
        self.run, self.block = self.run + 1, block
        self.keep("input", x)

    def keep(self, name, t):
        """t kept under the current run's `name` ("": the residual after it) where asked for; returns t."""
        for key in (f"runs.{self.run}", f"blocks.{self.block.index}") if self.wanted else ():
            key = key + "." + name if name else key
            if key in self.wanted:
                self.kept[key] = 0.5 * (t[0] + t[1]) if isinstance(t, tuple) else t
        return t

    def branch(self, name, t):
        """t through the current block's hook `name` (Block.branch): q, k, v inside attention."""
        return self.block.branch(name, t, self)

    def __getitem__(self, name):
        if name not in self.kept:  # not asked for (no piece's reads or taps), or not made yet in this order
            raise ConfigError(f"layer state {name!r} is read before it is made, or no piece's `reads` names it")
        return self.kept[name]


# ---- document LoRA adapters for test-time training (issue 20; SPEC-FRONTIER 14, 18): TTT_MODE=lora

LORA_TARGETS = ("head", "q", "v", "k", "mlp", "o")  # TTT_LORA_TARGETS names, in the 04-27 record's draw order


class LoRAAdapters(nn.Module):
    """Batched LoRA of the doc-LoRA TTT (SPEC-FRONTIER 14, 18): per target and virtual-layer slot, A (bsz, r, in)
    ~ U(+-1/sqrt(in)) and B (bsz, out, r) = 0, one independent adapter per batch row (document); the delta of a
    row x is (alpha/r) * (x A^T) B^T. Targets: q, k, v (on the attention input, added to the projection), o (input:
    the attention input, added to the projected attention output), mlp (input: the MLP input, added to the MLP
    output), head (input: the final hidden, added to the logits before the softcap). A is drawn with `generator`
    target by target, slot by slot, in LORA_TARGETS order (the record's order)."""

    def __init__(self, bsz, model, h, generator=None):
        super().__init__()
        d, kv, slots = h.model_dim, h.num_kv_heads * h.head_dim, sum(map(len, model.orders[model.looping]))
        shapes = {"head": (d, h.vocab_size), "q": (d, d), "v": (d, kv), "k": (d, kv), "mlp": (d, d), "o": (d, d)}
        on = h.ttt_lora_targets.split(",")
        self.bsz, self.scale, self.warm_start_a, self.generator = bsz, h.ttt_lora_alpha / h.ttt_lora_rank, \
            h.ttt_warm_start_a, generator
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        for name in (t for t in LORA_TARGETS if t in on):
            n_in, n_out = shapes[name]
            count = 1 if name == "head" else slots
            self.A[name] = nn.Parameter(torch.empty(count, bsz, h.ttt_lora_rank, n_in))
            self.B[name] = nn.Parameter(torch.zeros(count, bsz, n_out, h.ttt_lora_rank))
            self._draw_a(name, generator)

    @torch.no_grad()
    def _draw_a(self, name, generator):
        a = self.A[name]
        for s in range(a.size(0)):  # one draw per slot, as the record's one module per slot
            a[s].uniform_(-1.0 / math.sqrt(a.size(-1)), 1.0 / math.sqrt(a.size(-1)), generator=generator)

    @torch.no_grad()
    def reset(self, generator=None):
        """Between document batches: B zeroed; A kept (TTT_WARM_START_A=1, 04-23 on) or drawn afresh from
        `generator` (default: the one it was built with)."""
        for name in self.B:
            self.B[name].zero_()
            if not self.warm_start_a:
                self._draw_a(name, generator or self.generator)

    def add(self, name, slot, y, x):
        """y plus target `name`'s delta of input x at virtual-layer `slot` (y unchanged if the target is off)."""
        if name not in self.A:
            return y
        return y + ((x @ self.A[name][slot].transpose(1, 2)) @ self.B[name][slot].transpose(1, 2)) * self.scale


class LoRASlot(NamedTuple):
    """The adapters of one virtual layer, handed down the forward (None everywhere outside TTT_MODE=lora)."""
    adapters: LoRAAdapters
    slot: int


def lora_add(lora, name, y, x):
    """The LoRA hook of the forward pieces: y, plus the LoRASlot's delta of input x for target `name`."""
    return y if lora is None else lora.adapters.add(name, lora.slot, y, x)


class CausalSelfAttention(nn.Module):
    """GQA attention with QK-norm, partial RoPE, a per-head query gain, optional XSA and an optional output gate."""

    def __init__(self, h, use_xsa):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = h.num_heads, h.num_kv_heads, h.head_dim
        self.rope_dims = h.rope_dims or h.head_dim
        self.q_gain = nn.Parameter(torch.full((h.num_heads,), h.qk_gain_init, dtype=torch.float32))
        self.use_xsa = use_xsa
        self.attn_gate = None if h.attn_gate == "none" else AttentionGate(
            h.attn_gate, h.num_heads, h.model_dim, h.gate_window, h.attn_gate_scale, h.attn_gate_init_std)

    def forward(self, x, w, v_embed, rope, lora=None, hooks=None):
        q_w, k_w, v_w, out_w = w
        B, T, D = x.shape
        q = lora_add(lora, "q", linear(x, q_w), x).view(B, T, self.num_heads, self.head_dim)
        k = lora_add(lora, "k", linear(x, k_w), x).view(B, T, self.num_kv_heads, self.head_dim)
        v = lora_add(lora, "v", linear(x, v_w), x)
        if v_embed is not None:
            v = v + v_embed
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        q, k = rms_norm(q), rms_norm(k)
        cos, sin = rope[0].to(q.dtype), rope[1].to(q.dtype)
        q, k = apply_rotary(q, cos, sin, self.rope_dims), apply_rotary(k, cos, sin, self.rope_dims)
        q = q * self.q_gain.to(q.dtype)[None, None, :, None]
        if hooks is not None:  # the block's hooks: Block.branch, through its LayerStates where one keeps them by name
            q, k, v = hooks.branch("q", q), hooks.branch("k", k), hooks.branch("v", v)
        y = causal_attention(q, k, v, rope.docs if isinstance(rope, Positions) else None)  # bare (cos, sin): no docs
        if self.use_xsa:
            y = self._exclude_self_value(y, v)
        if self.attn_gate is not None:
            y = self.attn_gate(y, x)
        return lora_add(lora, "o", linear(y.reshape(B, T, D), out_w), x)

    def _exclude_self_value(self, y, v):
        """XSA: remove from each head's output its component along its own position's unit value."""
        B, T, H, Dh = y.shape
        group = H // self.num_kv_heads
        yg = y.view(B, T, self.num_kv_heads, group, Dh)
        vn = F.normalize(v, dim=-1).unsqueeze(-2)
        return (yg - (yg * vn).sum(dim=-1, keepdim=True) * vn).view(B, T, H, Dh)


class Block(nn.Module):
    """One layer, the one forward of every layer kind the presets use (SPEC 4; SPEC-FRONTIER 5, 18): the x0 residual
    mix, attention and a leaky-ReLU^2 MLP, each branch with a per-channel output scale, combined into the residual by
    the layer's kind. w: the block's six bank slices (GPT.block_weights)."""

    def __init__(self, h, layer_idx):
        super().__init__()
        d = h.model_dim
        self.attn = CausalSelfAttention(h, use_xsa=layer_idx >= h.num_layers - h.xsa_last_n)
        self.attn_scale = nn.Parameter(torch.ones(d, dtype=torch.float32))
        self.mlp_scale = nn.Parameter(torch.ones(d, dtype=torch.float32))
        self.resid_mix = nn.Parameter(torch.ones(2, d))  # the weights of x (1) and x0 (0)
        self.resid_mix.data[1] = 0.0
        self.ln_scale = 1.0 / math.sqrt(layer_idx + 1) if h.ln_scale else 1.0
        self.index = layer_idx
        # GPT-J parallel residual (SPEC-FRONTIER 5; the 04-09 record from PARALLEL_RESIDUAL_START=7)
        self.parallel = h.parallel_mode == "gptj" and 0 <= h.parallel_residual_start <= layer_idx

    def mix_in(self, x, x0):
        mix = self.resid_mix.to(x.dtype)
        return mix[0] * x + mix[1] * x0

    def mlp(self, x, up_w, down_w):
        """FUSED_MLP's kernel while training, unless GPTQ's recorder is listening (it needs `linear`'s inputs)."""
        if self.training and _FUSED["mlp"] and _RECORDER[0] is None:
            return fused_leaky_relu2_mlp(x, up_w, down_w)
        return leaky_relu2_mlp(x, up_w, down_w)

    def forward(self, x, x0, w, v_embed, rope, lora=None, lanes=None, states=None):
        """y = mix(x, x0), A = branch(attn_scale * Attn(RMS(y) * c)), M = branch(mlp_scale * MLP(RMS(u) * c)), c the
        LN scale; the kinds differ only in u and how A and M join the residual. Sequential: u = y + A, returns u + M.
        Parallel (GPT-J): u = y, returns y + A + M. Two lanes (lanes: GPT.lanes; x = (a, m), y = mix(a, x0)): u = m,
        returns the lanes' routing of A and M (TwoLaneResidual). states: this forward's LayerStates (GPT.hidden)."""
        if states is not None:
            states.enter(self, x)
        y = self.mix_in(x if lanes is None else x[0], x0)
        n = rms_norm(y) * self.ln_scale
        a = self.attn(n, w[:4], v_embed, rope, lora, states or self)  # q, k, v: through states where they keep
        attn = self.branch("attn", self.attn_scale.to(y.dtype) * a, states)
        u = x[1] if lanes is not None else y if self.parallel else y + attn
        n = n if u is y else rms_norm(u) * self.ln_scale  # parallel: both branches read one RMS (one backward)
        mlp = self.branch("mlp", self.mlp_scale.to(u.dtype) * lora_add(lora, "mlp", self.mlp(n, *w[4:]), n), states)
        out = lanes(self.index, x, attn, mlp) if lanes is not None else (y + attn if self.parallel else u) + mlp
        return out if states is None else states.keep("", out)

    def branch(self, name, out, states=None):
        """The one place a per-block change goes, in every layer kind: a branch's output ("attn" or "mlp") on its way
        into the residual, or attention's "q", "k", "v" (CausalSelfAttention). Each submodule declaring `block_branch`
        (the names it maps; True: "attn" and "mlp") maps it, piece(name, out, states), in the order they were assigned
        (docs/frontier.md "A per-layer scale that ships"); the result is kept as this run's state `name`."""
        for piece in tuple(p for p in self.children() if hasattr(p, "block_branch")):
            names = piece.block_branch
            if name in (("attn", "mlp") if names is True else names):
                out = piece(name, out, states)
        return out if states is None else states.keep(name, out)


class TwoLaneResidual(nn.Module):
    """Two-lane parallel residuals (SPEC-FRONTIER 5, 18; the 04-27 record; PARALLEL_MODE=lanes): an attention lane a
    and an MLP lane m. Layer l, from the lanes before its update (Block.forward: A reads mix(a, x0), M reads m alone),
      a <- rho[l,0]*a + pi[l,0,0]*A + pi[l,1,0]*M,    m <- rho[l,1]*m + pi[l,0,1]*A + pi[l,1,1]*M.
    pi (routing, layers x 2 x 2) starts at 1, rho (lane residual, layers x 2) at 1.1, one row per physical layer."""
    setting = "PARALLEL_MODE"

    def __init__(self, num_layers):
        super().__init__()
        self.post = nn.Parameter(torch.ones(num_layers, 2, 2, dtype=torch.float32))
        self.resid = nn.Parameter(torch.full((num_layers, 2), 1.1, dtype=torch.float32))

    def forward(self, i, lanes, attn, mlp):
        (a, m), post, resid = lanes, self.post[i].to(attn.dtype), self.resid[i].to(attn.dtype)
        return (resid[0] * a + post[0, 0] * attn + post[1, 0] * mlp,
                resid[1] * m + post[0, 1] * attn + post[1, 1] * mlp)


def virtual_layers(num_layers, num_loops=0, loop_start=0, loop_end=-1):
    """Depth recurrence (SPEC-FRONTIER 4): the physical layer indices in the order they run, split into the
    U-Net's encoder (first half, rounded down) and decoder. With num_loops > 0 the span loop_start..loop_end
    runs num_loops + 1 times in a row, e.g. 11 layers, (2, 3, 5) -> [0,1,2,3,4,5,3,4] + [5,3,4,5,6,7,8,9,10]."""
    order = list(range(num_layers))
    if num_loops > 0:
        order = order[:loop_start] + order[loop_start:loop_end + 1] * (num_loops + 1) + order[loop_end + 1:]
    half = len(order) // 2
    return order[:half], order[half:]


class BigramHash(nn.Module):
    """Embedding of a hash of (previous, current) token, projected to the model width."""
    setting = "BIGRAM_VOCAB_SIZE"  # the setting that adds this piece (check_artifact_tensors names it)

    def __init__(self, buckets, dim, model_dim):
        super().__init__()
        self.buckets = buckets
        self.embed = CastedEmbedding(buckets, dim)
        self.proj = CastedLinear(dim, model_dim)
        self.scale = nn.Parameter(torch.tensor(0.05, dtype=torch.float32))

    def hash(self, ids):
        t = ids.to(torch.int32)
        mod = self.buckets - 1
        out = torch.full_like(t, mod)  # position 0 has no predecessor: its own bucket
        out[..., 1:] = torch.bitwise_xor(36313 * t[..., 1:], 27191 * t[..., :-1]) % mod
        return out.long()

    def forward(self, ids):
        h = self.proj(self.embed(self.hash(ids)))
        return h * self.scale.to(h.dtype)


class SmearGate(nn.Module):
    """Blend each position with its predecessor through a learned per-channel sigmoid gate."""
    setting = "SMEAR_GATE"

    def __init__(self, dim):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, x):
        g = torch.sigmoid(self.gate.to(x.dtype))
        prev = torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1]), dim=1)
        return (1 - g) * x + g * prev


class SmearGateBOS(nn.Module):
    """SmearGate v2 (SPEC-FRONTIER 8, 18; the 04-16 gate with the 04-27 BOS fix; SMEAR_GATE=2), on the raw input
    embeddings e before the first RMSNorm: e'_0 = e_0, e'_t = e_t + lam * sigmoid(w . e_t[0:GATE_WINDOW]) * e_{t-1}
    * [ids_t != BOS_ID]. w (1 x window) and lam start at zero: the identity at init. The mask keeps the last token
    of one document out of the next document's BOS position in a packed row. bos_mask=False (SMEAR_GATE_BOS_FIX=0,
    #2135's run, SPEC-FRONTIER 20(e)1) drops the mask: e'_t = e_t + lam * sigmoid(...) * e_{t-1} at every t >= 1."""
    setting = "SMEAR_GATE"

    def __init__(self, window, bos_id, bos_mask=True):
        super().__init__()
        self.window, self.bos_id, self.bos_mask = window, bos_id, bos_mask
        self.gate = nn.Parameter(torch.zeros(1, window, dtype=torch.float32))
        self.lam = nn.Parameter(torch.zeros(1, dtype=torch.float32))

    def forward(self, e, ids, prev=None):
        """prev ((B, 1, d) or None): the embedding of the token before each row (a piece of a packed row,
        MICRO_BATCH_SPLIT): the first token is then gated with it as every other is with its predecessor."""
        if prev is not None:
            return self.forward(torch.cat((prev, e), dim=1), torch.cat((ids[:, :1], ids), dim=1))[:, 1:]
        g = self.lam.to(e.dtype) * torch.sigmoid(F.linear(e[:, 1:, :self.window], self.gate.to(e.dtype)))
        if not self.bos_mask:
            return torch.cat((e[:, :1], e[:, 1:] + g * e[:, :-1]), dim=1)
        keep = (ids[:, 1:] != self.bos_id).to(e.dtype).unsqueeze(-1)
        return torch.cat((e[:, :1], e[:, 1:] + g * e[:, :-1] * keep), dim=1)


class ValueEmbedding(nn.Module):
    """A token embedding added to the attention values of selected layers."""
    setting = "VE_ENABLED"  # the setting that adds this piece (check_artifact_tensors names it)

    def __init__(self, vocab, dim, kv_dim):
        super().__init__()
        self.embed = CastedEmbedding(vocab, dim)
        # Drawn here, as in the record: that fixes its place in the seed's random stream.
        nn.init.normal_(self.embed.weight, std=0.01)
        self.proj = CastedLinear(dim, kv_dim)
        self.scale = nn.Parameter(torch.tensor(0.1, dtype=torch.float32))

    def forward(self, ids):
        h = self.proj(self.embed(ids))
        return h * self.scale.to(h.dtype)


class GPT(nn.Module):
    """U-Net of blocks whose matrices live in four banks (one Muon-optimised tensor per kind). With NUM_LOOPS > 0,
    switching `looping` on makes some layers run several times (virtual_layers); the skip rows are sized for
    the looped order, and the plain order uses the first of them. With PARALLEL_MODE=lanes the decoder runs two
    lanes (TwoLaneResidual) from its first step at a physical layer >= PARALLEL_RESIDUAL_START to its end."""

    def __init__(self, h):
        super().__init__()
        n, d, kv = h.num_layers, h.model_dim, h.num_kv_heads * h.head_dim
        self.num_layers, self.logit_softcap = n, h.logit_softcap
        self.orders = {False: virtual_layers(n), True: virtual_layers(n, h.num_loops, h.loop_start, h.loop_end)}
        self.looping = False  # switched on during training (ENABLE_LOOPING_AT); a compiled graph per value
        self.tok_emb = CastedEmbedding(h.vocab_size, d)
        self.bigram = BigramHash(h.bigram_vocab_size, h.bigram_dim, d) if h.bigram_vocab_size > 0 else None
        self.smear = SmearGate(d) if h.smear_gate == 1 else None
        self.smear_bos = SmearGateBOS(h.gate_window, BOS_ID, h.smear_gate_bos_fix) if h.smear_gate == 2 else None
        num_skips = min(len(half) for half in self.orders[h.num_loops > 0])
        self.skip_weights = nn.Parameter(torch.ones(num_skips, d))
        self.skip_gates = nn.Parameter(torch.zeros(num_skips, d)) if h.skip_gates else None
        self.qo_bank = nn.Parameter(torch.empty(2 * n, d, d))
        self.kv_bank = nn.Parameter(torch.empty(2 * n, kv, d))
        self.mlp_up_bank = nn.Parameter(torch.empty(n, h.mlp_hidden, d))
        self.mlp_down_bank = nn.Parameter(torch.empty(n, d, h.mlp_hidden))
        self.blocks = nn.ModuleList([Block(h, i) for i in range(n)])
        self.lanes = TwoLaneResidual(n) if h.parallel_mode != "gptj" and h.parallel_residual_start >= 0 else None
        self.lane_start = h.parallel_residual_start  # -1: none
        self.rope_dims, self.rope_base = h.rope_dims or h.head_dim, h.rope_base
        self.rope_train_len, self.rope_freqs_bf16 = h.rope_train_seq_len, h.rope_freqs_bf16
        self.ve_layers = list(h.ve_layers) if h.ve_enabled else []
        self.ve_shared = ValueEmbedding(h.vocab_size, h.ve_dim, kv) if self.ve_layers else None
        self.ve_layer_scales = nn.ParameterList(
            [nn.Parameter(torch.ones(1, dtype=torch.float32)) for _ in self.ve_layers])
        self.lm_head = None if h.tie_embeddings else CastedLinear(d, h.vocab_size)
        self._init_weights(h)

    @torch.no_grad()
    def _init_weights(self, h):
        n = self.num_layers
        nn.init.normal_(self.tok_emb.weight, std=h.tied_embed_init_std)
        if self.bigram is not None:
            nn.init.zeros_(self.bigram.embed.weight)
        for i in range(n):
            for w in (self.qo_bank[i], self.kv_bank[i], self.kv_bank[n + i], self.mlp_up_bank[i]):
                nn.init.orthogonal_(w)
        nn.init.zeros_(self.qo_bank[n:])
        nn.init.zeros_(self.mlp_down_bank)
        # As in the record: zero, then its re-init of every Linear with both sides >= 64 makes them orthogonal
        # (at the record's shapes both are; a narrower one stays zero, e.g. ve proj below 64 kv dims).
        for lin in (getattr(self.bigram, "proj", None), getattr(self.ve_shared, "proj", None)):
            if lin is not None and min(lin.weight.shape) >= 64:
                nn.init.orthogonal_(lin.weight)
            elif lin is not None:
                nn.init.zeros_(lin.weight)
        if self.lm_head is not None:
            nn.init.zeros_(self.lm_head.weight)

    def block_weights(self, i):
        n = self.num_layers
        return (self.qo_bank[i], self.kv_bank[i], self.kv_bank[n + i], self.qo_bank[n + i],
                self.mlp_up_bank[i], self.mlp_down_bank[i])

    def set_compute_dtype(self, dtype):
        for m in self.modules():
            if isinstance(m, CastedEmbedding):
                m.out_dtype = dtype

    def set_qat(self, enabled):
        for m in self.modules():
            if isinstance(m, CastedLinear):
                m.qat = enabled

    def qat_on(self):
        return any(m.qat for m in self.modules() if isinstance(m, CastedLinear))

    def graph_state(self):
        """What a compiled graph of this model depends on besides its inputs (CompiledFunction's key): train/eval
        mode, the layer order, late QAT (in training mode only: CastedLinear reads it only there), and which weights
        train (LoRA and SGD TTT freeze some)."""
        return self.training, self.looping, self.training and self.qat_on(), tuple(p.requires_grad for p in self.parameters())

    def forward_logits(self, ids, docs=None, lora=None):
        return softcap_logits(self.head(self.hidden(ids, docs, lora), lora), self.logit_softcap)

    def outputs(self, ids, docs=None, taps=()):
        """What the model computes on (B, T) ids, for training's objective (training_loss): Outputs(hidden, logits,
        taps), taps {name: state} of the layer states named (GPT.hidden)."""
        x, tapped = self.hidden(ids, docs, taps=taps) if taps else (self.hidden(ids, docs), {})
        return Outputs(x, self.head(x), tapped)

    def head(self, x, lora=None):
        """The output head's raw logits (before the softcap) of hidden states x: the tied embedding or lm_head."""
        logits = self.lm_head(x) if self.lm_head is not None else linear(x, self.tok_emb.weight)
        return logits if lora is None else lora.add("head", 0, logits, x)

    def hidden(self, ids, docs=None, lora=None, taps=()):
        """The final hidden state of (B, T) ids, after the last RMSNorm; docs (DocBounds): packed rows whose documents
        do not attend to each other (RoPE positions stay the index within the row, as in the records); lora
        (LoRAAdapters, TTT_MODE=lora): its slot k adapts the k-th virtual layer run, its head the logits. taps (names;
        then returns (state, {name: tapped state})): layer states (LayerStates), e.g. "runs.J", the residual after the
        J-th layer run of the current order (encoder then decoder, from 0), and "blocks.I", after physical layer I's
        last run in it (the layer loop runs a layer several times); with two lanes the state is their mean (a + m) / 2,
        as the final state; no final RMSNorm. Only the names asked for (taps, and every module's `reads`) are kept:
        none asked, nothing is done (eager and compiled alike)."""
        slots = itertools.count()

        def at():  # this virtual layer's adapters
            return None if lora is None else LoRASlot(lora, next(slots))
        x = self.tok_emb(ids)
        if self.bigram is not None:
            x = x + self.bigram(ids)
        if self.smear_bos is not None:
            prev = None if docs is None or docs.prev is None else self.tok_emb(docs.prev) * docs.prev_keep.to(x.dtype)
            x = self.smear_bos(x, ids, prev)
        x0 = x = rms_norm(x) if self.smear is None else self.smear(rms_norm(x))
        ve = self.ve_shared(ids) if self.ve_shared is not None else None
        rope = Positions(*rotary_tables(ids.size(1), self.rope_dims, self.rope_base, ids.device, self.rope_train_len,
                                        context_len=None if docs is None else docs.rope_len or docs.max_len,
                                        freqs_bf16=self.rope_freqs_bf16, pos0=None if docs is None else docs.pos0),
                         docs)
        encoder, decoder = self.orders[self.looping]
        reads = tuple(n for m in self.modules() for n in getattr(m, "reads", ()))
        skips, states = [], LayerStates({*taps, *reads}) if taps or reads else None
        for j, i in enumerate(encoder + decoder):
            k = j - len(encoder)  # the decoder's step (< 0: an encoder step)
            if k >= 0 and self.lanes is not None and not isinstance(x, tuple) and i >= self.lane_start:
                x = (x, x)  # the two lanes (attention, MLP) from here to the end
            if 0 <= k < len(self.skip_weights) and skips:  # with lanes the skip joins the attention lane only
                x = (self._merge_skip(k, x[0], skips.pop()), x[1]) if isinstance(x, tuple) else \
                    self._merge_skip(k, x, skips.pop())
            x = self._block(i, x, x0, ve, rope, at(), states)
            if k < 0:
                skips.append(x)
        if isinstance(x, tuple):
            x = 0.5 * (x[0] + x[1])
        if not taps:
            return rms_norm(x)
        tapped = {name: states.kept[name] for name in taps if name in states.kept}
        if len(tapped) < len(taps):
            raise ConfigError(f"no layer state {sorted(set(taps) - set(tapped))} in this model's order (GPT.hidden)")
        return rms_norm(x), tapped

    def _value_embed(self, i, ve):
        return ve * self.ve_layer_scales[self.ve_layers.index(i)].to(ve.dtype) if i in self.ve_layers else None

    def _block(self, i, x, x0, ve, rope, lora=None, states=None):
        """Layer i's run; x: the residual, or the two lanes (a, m)."""
        lanes = self.lanes if isinstance(x, tuple) else None
        return self.blocks[i](x, x0, self.block_weights(i), self._value_embed(i, ve), rope, lora, lanes, states)

    def terms(self):
        """The pieces whose term training's loss adds (training_loss): every module declaring `term_weight`."""
        return tuple(m for m in self.modules() if hasattr(m, "term_weight"))

    def _merge_skip(self, j, x, skip):
        """U-Net skip j: x + w*skip, or with SKIP_GATES the sigmoid-gated lerp s*x + (1-s)*(w*skip), s = sigmoid(g)
        (SPEC-FRONTIER 6; g = 0 at init, an even mix)."""
        scaled = self.skip_weights[j].to(x.dtype) * skip
        if self.skip_gates is None:
            return x + scaled
        s = torch.sigmoid(self.skip_gates[j].to(x.dtype))
        return s * x + (1 - s) * scaled

    def cross_entropy(self, logits, targets, padded=False, lse=False):
        """The mean cross-entropy of raw logits (softcapped) over the targets that are not IGNORE; FUSED_CE's kernel
        while training (select_fused_kernels); padded: targets may be IGNORE (said by the caller, never guessed);
        lse: a CE, with each row's logsumexp."""
        if self.training and _FUSED["ce"]:
            return fused_softcapped_ce(logits, targets, self.logit_softcap, padded, lse)
        return softcapped_ce(logits, targets, self.logit_softcap, lse)

    def forward(self, ids, targets, docs=None):
        """The scoring loss (validation, evaluation, TTT): the mean cross-entropy. Training's is training_loss."""
        return self.cross_entropy(self.outputs(ids, docs).logits, targets)


@contextlib.contextmanager
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


BANK_NAMES = ("qo_bank", "kv_bank", "mlp_up_bank", "mlp_down_bank")
EMBEDDING_NAMES = ("tok_emb.weight", "bigram.embed.weight", "ve_shared.embed.weight")


def build_model(h):
    """The GPT on CPU (bf16 embedding tables, all else fp32), initialised from SEED bit for bit as the
    record, which casts it to bf16 and the non-embeddings back to fp32, so those start bf16-rounded."""
    # orthogonal_'s QR depends on the thread count in its last bits; the record used one thread per rank.
    with one_torch_thread():
        torch.manual_seed(h.seed)
        model = GPT(h)
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.bfloat16)
        if name not in EMBEDDING_NAMES:
            p.data = p.data.to(torch.float32)
    return model


def marked(model, attr):
    """{state_dict name: value} of a piece's declaration `attr` (a module attribute: `training_only`,
    `optimizer_group`) for every tensor of that piece; an inner piece's declaration wins."""
    out = {}
    for prefix, m in model.named_modules():
        if hasattr(m, attr):
            out.update(dict.fromkeys(m.state_dict(prefix=prefix + "." if prefix else ""), getattr(m, attr)))
    return out


def artifact_state_dict(model):
    """model.state_dict() less the training-only pieces' tensors (`training_only = True`: read by training's objective
    alone): what the artifact and final_model.pt store, GPTQ calibrates and model_params counts; checkpoints keep them."""
    state, skip = model.state_dict(), marked(model, "training_only")
    for name in [k for k in state if skip.get(k)]:
        del state[name]  # state_dict()'s own dict, its _metadata kept: final_model.pt's bytes as before
    return state


def meta_model(h):
    """GPT(h) on the meta device: its tensors' names and shapes, no memory, no numbers."""
    normal_, nn.init.normal_ = nn.init.normal_, lambda t, *a, **k: t  # its draws skipped: normal_ on meta tensors takes
    try:  # a second the first time (torch loads its reference decompositions)
        with torch.device("meta"):
            return GPT(h)
    finally:
        nn.init.normal_ = normal_


def model_params(h, model=None):
    """(name, shape, bytes per element, optimizer group, training-only) of each of GPT(h)'s parameters, read from
    `model` when it is built, else from the model built on the meta device (no memory, no numbers: absurd sizes are
    refused before any allocation)."""
    model = meta_model(h) if model is None else model
    groups, skip = param_groups(model), marked(model, "training_only")
    return [(n, p.shape, 2 if n in EMBEDDING_NAMES else 4, groups[n], bool(skip.get(n)))
            for n, p in model.named_parameters()]


def model_param_counts(h, model=None):
    """GPT(h)'s parameter counts (model_params, of `model` when built): "banks" (Muon's), "embeddings" (bf16 tables),
    "other" (fp32 rest), and apart from them "training_only" (the training-only pieces', not in the artifact)."""
    counts = dict.fromkeys(("banks", "embeddings", "other", "training_only"), 0)
    for name, shape, size, group, only in model_params(h, model):
        kind = "training_only" if only else "banks" if group == "matrix" else "embeddings" if size == 2 else "other"
        counts[kind] += shape.numel()
    return counts


# ==================================================
# OPTIMISER
# ==================================================

NS_COEFFICIENTS = {  # (a, b, c) of Newton-Schulz iterations 1, 2, ...; the last repeats
    "fixed": ((3.4445, -4.7750, 2.0315),),  # the record's quintic
    # Polar Express (SPEC-FRONTIER 9; 04-23 record): one triple per iteration, at most these 5 iterations
    "polar_express": ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                      (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                      (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                      (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                      (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)),
}


def ns_schedule(kind, steps):
    """The (a, b, c) of each iteration: "fixed" repeats one triple `steps` times; "polar_express" is capped at 5."""
    table = NS_COEFFICIENTS[kind]
    return [table[0]] * steps if len(table) == 1 else list(table[:steps])


def zeropower_via_newtonschulz5(g, steps=5, eps=1e-7, dtype=torch.bfloat16, coeffs="fixed", ca_first=False):
    """Orthogonalise each trailing matrix of g (quintic Newton-Schulz in bf16 as the record; fp32 runs: fp32):
    X <- aX + (bA + cA^2)X, A = XX^T. The last term is c(AA); ca_first (MUON_NS_CA_FIRST) rounds it as (cA)A,
    as the 04-09 record's code does (SPEC-FRONTIER 9)."""
    x = g.to(dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for a, b, c in ns_schedule(coeffs, steps):
        m = x @ x.mT
        x = a * x + (b * m + ((c * m) @ m if ca_first else c * (m @ m))) @ x
    return x.mT if transposed else x


def normalize_rows(u, eps=1e-7):
    """MuonEq-R (SPEC-FRONTIER 9; 04-03 record): each row of each matrix divided by max(its L2 norm, eps), before
    Newton-Schulz. Norms in fp32."""
    u32 = u.float()
    return (u32 / u32.norm(dim=-1, keepdim=True).clamp_min(eps)).to(u.dtype)


_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Muon(torch.optim.Optimizer):
    """Muon on banked matrices (Parallel Muon, SPEC 4). `launch_reduce_scatters()` starts async bf16
    reduce-scatters after backward; `step()` then, bank by bank, runs momentum + Newton-Schulz on this
    rank's shard, starts its all-gather and applies the previous bank's update."""

    def __init__(self, params, lr, momentum, backend_steps, weight_decay, ns_dtype=torch.bfloat16,
                 ns_coeffs="fixed", row_normalize=False, momentum_fp32=False, ns_ca_first=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, backend_steps=backend_steps, weight_decay=weight_decay,
                                      ns_coeffs=ns_coeffs, row_normalize=row_normalize))
        self._meta = self._pending = None
        self.ns_dtype = ns_dtype
        # MUON_MOMENTUM_FP32: momentum and Nesterov step in fp32 (the 04-09 record), not on the bf16 gradient
        self.momentum_dtype = torch.float32 if momentum_fp32 else torch.bfloat16
        self.ns_ca_first = ns_ca_first

    def _build(self):
        self._ws = ws = dist.get_world_size() if dist.is_initialized() else 1
        meta = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                shard = -(-p.shape[0] // ws)  # ceil: the bank is zero-padded along dim 0 to ws * shard
                m = dict(p=p, group_index=gi, rows=p.shape[0], scale=max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5)
                if ws > 1:
                    for key, n in (("padded", shard * ws), ("recv", shard), ("gathered", shard * ws)):
                        m[key] = torch.zeros(n, *p.shape[1:], device=p.device, dtype=torch.bfloat16)
                meta.append(m)
        self._meta = sorted(meta, key=lambda m: -m["p"].numel())  # biggest communication first

    def launch_reduce_scatters(self):
        if self._meta is None:
            self._build()
        if self._ws == 1:
            return
        self._pending = []
        for m in self._meta:
            m["padded"][:m["rows"]].copy_(m["p"].grad)
            self._pending.append(_reduce_scatter(m["recv"], m["padded"], op=dist.ReduceOp.AVG, async_op=True))

    def reduced_bank_grads(self):
        """This rank's shards of the bank gradients averaged over ranks (waits for the reduce-scatters);
        one process: the gradients themselves."""
        if self._pending is None:
            self.launch_reduce_scatters()  # (builds the banks' metadata first; one process: nothing to launch)
        if self._ws == 1:
            return [m["p"].grad for m in self._meta]
        for handle in self._pending:
            if handle is not None:
                handle.wait()
        # waited once: a gloo handle waited again copies its result over the shard anew
        self._pending = [None] * len(self._pending)
        return [m["recv"] for m in self._meta]

    def _apply(self, m, update):
        # Looked up on every use: load_state_dict() replaces the group dicts.
        p, group = m["p"], self.param_groups[m["group_index"]]
        lr, wd = group["lr"], group["weight_decay"]
        if wd > 0:
            p.mul_(1.0 - lr * wd)
        p.add_(update.to(p.dtype), alpha=-lr * m["scale"])

    @torch.no_grad()
    def step(self, closure=None):
        if self._meta is None:
            self._build()
        distributed = self._ws > 1
        if distributed and self._pending is None:
            self.launch_reduce_scatters()
        previous = None  # (meta, handle) of the bank whose all-gather is in flight
        for i, m in enumerate(self._meta):
            group = self.param_groups[m["group_index"]]
            if distributed:
                if self._pending[i] is not None:  # None: waited by reduced_bank_grads
                    self._pending[i].wait()
                g = m["recv"].to(self.momentum_dtype)
            else:
                g = m["p"].grad.to(self.momentum_dtype)
            state = self.state[m["p"]]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g)
            mom = group["momentum"]
            buf = state["momentum_buffer"].mul_(mom).add_(g)
            u = g.add(buf, alpha=mom)
            if group["row_normalize"]:
                u = normalize_rows(u)
            update = zeropower_via_newtonschulz5(u, group["backend_steps"], dtype=self.ns_dtype,
                                                 coeffs=group["ns_coeffs"], ca_first=self.ns_ca_first)
            if not distributed:
                self._apply(m, update)
                continue
            handle = _all_gather(m["gathered"], update.to(m["gathered"].dtype).contiguous(), async_op=True)
            if previous is not None:
                self._apply_gathered(*previous)
            previous = (m, handle)
        if previous is not None:
            self._apply_gathered(*previous)
        self._pending = None

    def _apply_gathered(self, m, handle):
        handle.wait()
        self._apply(m, m["gathered"][:m["rows"]])


# Optimizer groups: a parameter's is the one its piece declares (an `optimizer_group` attribute of the module), else
# the first pattern (fnmatch: "*" spans dots) below that its name matches, else "scalar" for a tensor of < 2 dims; a
# matrix named nowhere is refused. The records' small matrices (projections, gates, mixes) are AdamW's scalars.
OPTIMIZER_GROUPS = (*((name, "matrix") for name in BANK_NAMES), *((name, "embed") for name in EMBEDDING_NAMES),
                    ("lm_head.weight", "head"), *((name, "scalar") for name in (
                        "bigram.proj.weight", "ve_shared.proj.weight", "skip_*", "blocks.*.resid_mix",
                        "blocks.*.attn_gate.weight", "smear_bos.gate", "lanes.*")))


def group_settings(h):
    """Each optimizer group's (optimizer, learning rate, weight decay), in the order of build_optimizers."""
    return {"matrix": ("muon", h.matrix_lr, h.muon_wd), "embed": ("adamw", h.tied_embed_lr if h.tie_embeddings
                                                                  else h.embed_lr, h.embed_wd),
            "scalar": ("adamw", h.scalar_lr, h.adam_wd), "head": ("adamw", h.head_lr, h.adam_wd)}


def param_groups(model):
    """{parameter name: its optimizer group} (OPTIMIZER_GROUPS); a ConfigError names a matrix no rule names."""
    declared, groups = marked(model, "optimizer_group"), {}
    for name, p in model.named_parameters():
        groups[name] = declared.get(name) or next((g for pat, g in OPTIMIZER_GROUPS if fnmatch.fnmatchcase(name, pat)),
                                                  "scalar" if p.ndim < 2 else None)
        if groups[name] is None:
            raise ConfigError(f"{name} {tuple(p.shape)}: a matrix that neither OPTIMIZER_GROUPS nor its piece's "
                              "optimizer_group names would be trained as a scalar; name its group")
    return groups


def optimizer_lines(h, model):
    """The log's start lines: each group's optimizer, LR, weight decay and parameters (blocks.*: every layer's)."""
    groups, lines = param_groups(model), []
    for group, (opt, lr, wd) in group_settings(h).items():
        names = [n for n, g in groups.items() if g == group]
        short = dict.fromkeys(re.sub(r"^blocks\.\d+\.", "blocks.*.", n) for n in names)
        if names:
            lines.append(f"optimizer_group:{group} {opt} lr:{lr:g} wd:{wd:g} tensors:{len(names)} names:{','.join(short)}")
    return lines


def build_optimizers(h, model, ns_dtype=torch.bfloat16):
    """Muon for the "matrix" group, an AdamW for each other group with parameters (param_groups). Returns (muon, adams)."""
    groups, fused, settings = param_groups(model), next(model.parameters()).is_cuda, group_settings(h)
    params = {name: [] for name in settings}
    for name, p in model.named_parameters():
        params[groups[name]].append(p)
    adams = [torch.optim.AdamW([dict(params=params[k], lr=lr, base_lr=lr)], betas=(h.beta1, h.beta2), eps=h.adam_eps,
                               weight_decay=wd, fused=fused) for k, (opt, lr, wd) in settings.items()
             if opt == "adamw" and params[k]]
    muon = Muon([dict(params=params["matrix"], base_lr=h.matrix_lr)], lr=h.matrix_lr, momentum=h.muon_momentum,
                backend_steps=h.muon_backend_steps, weight_decay=h.muon_wd, ns_dtype=ns_dtype,
                ns_coeffs=h.muon_ns_coeffs, row_normalize=h.muon_row_normalize, momentum_fp32=h.muon_momentum_fp32,
                ns_ca_first=h.muon_ns_ca_first)
    return muon, adams


# ==================================================
# TRAINING
# ==================================================

@dataclass
class Runtime:
    """Where this process runs and how it reports."""
    h: Hyperparameters
    device: torch.device
    distributed: bool
    is_main: bool
    log_path: Path | None
    autocast_dtype: torch.dtype | None = None  # None: fp32, no autocast
    precision_note: str = ""
    threads_note: str = ""
    resume: ResumePoint | None = None  # RESUME's checked checkpoint (find_resume)
    compiled: list = field(default_factory=list)  # this run's CompiledFunctions, in creation order
    tracker: Tracker | None = None  # TRACKER's (rank 0)

    def __post_init__(self):
        # The timing breakdown turns overlap off; copy streams need CUDA.
        h, overlap = self.h, not self.h.training_timing_breakdown
        streams = overlap and self.device.type == "cuda"
        self.train_prefetch, self.train_copy_stream = h.train_prefetch and overlap, h.train_copy_stream and streams
        self.val_prefetch, self.val_copy_stream = h.val_prefetch and overlap, h.val_copy_stream and streams
        CONTEXT.place(self.device)

    def describe_data_path(self):
        h, note = self.h, ""
        if h.training_timing_breakdown:
            note = " (TRAINING_TIMING_BREAKDOWN=1 turns prefetch and copy streams off)"
        elif self.device.type != "cuda" and (h.train_copy_stream or h.val_copy_stream):
            note = " (copy streams need CUDA: off)"
        return (f"data_path: loader:{h.train_loader} train_prefetch:{int(self.train_prefetch)} "
                f"queue:{h.train_prefetch_queue} train_copy_stream:{int(self.train_copy_stream)} "
                f"val_prefetch:{int(self.val_prefetch)} val_copy_stream:{int(self.val_copy_stream)} "
                f"val_bytecount:{h.val_bytecount_device}{note}")

    def log(self, msg, console=True):
        if not self.is_main:
            return
        msg = msg if isinstance(msg, str) else "\n".join(msg)  # a list of lines (never empty): each on its own
        if console:
            print(msg, flush=True)
        if self.log_path is not None:
            with open(self.log_path, "a", encoding="utf-8") as f:
                print(msg, file=f)
        if self.tracker is not None and console:
            self.tracker.send(self, msg)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def prepare_model(self, model):
        model = model.to(self.device)
        model.set_compute_dtype(None if self.autocast_dtype is not None else torch.float32)
        return model

    def all_reduce(self, t, op=dist.ReduceOp.SUM):
        if self.distributed:
            dist.all_reduce(t, op=op)
        return t

    def all_reduce_coalesced(self, tensors):
        """Sum tensors in one fp32 collective, not one per tensor."""
        if not self.distributed:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        dist.all_reduce(flat)
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))


def cpu_has_native_bf16():
    """Whether oneDNN runs bf16 natively (AVX512-BF16/AMX); emulated, it measured 59x slower than fp32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def choose_precision(h, device):
    """AUTOCAST_DTYPE (auto: bf16 on CUDA and native-bf16 CPUs, else fp32) -> (dtype or None, reason)."""
    if h.autocast_dtype == "bf16":
        return torch.bfloat16, "bf16 autocast (AUTOCAST_DTYPE=bf16)"
    if h.autocast_dtype == "fp32":
        return None, "fp32, no autocast (AUTOCAST_DTYPE=fp32)"
    if device.type == "cuda":
        return torch.bfloat16, "bf16 autocast (CUDA)"
    if cpu_has_native_bf16():
        return torch.bfloat16, "bf16 autocast (this CPU runs bf16 natively)"
    return None, "fp32, no autocast (this CPU has no native bf16; AUTOCAST_DTYPE=bf16 forces it)"


def choose_cpu_threads(h):
    if h.omp_num_threads > 0:
        torch.set_num_threads(h.omp_num_threads)
        return f"{h.omp_num_threads} (OMP_NUM_THREADS)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // h.local_world_size)
    torch.set_num_threads(threads)
    return f"{threads} ({cores} cores / {h.local_world_size} local ranks)"


def open_log(h, append=False):
    """Start logs/$RUN_ID.txt afresh (a rerun replaces, never appends); a resumed run (append) continues it.
    PREFLIGHT=1 writes logs/$RUN_ID.preflight.txt: a rehearsal's log never reads as a run's."""
    path = Path("logs") / f"{h.run_id}{'.preflight' if h.preflight else ''}.txt"
    try:
        os.makedirs("logs", exist_ok=True)
        replaced = path.exists() and not append
        with open(path, "a" if append else "w", encoding="utf-8"):
            pass
    except OSError as e:
        raise ConfigError(f"cannot write the log {path} ({e.strerror or e}); run from a writable directory") from None
    if replaced:
        print(f"note: {path} existed (an earlier run with RUN_ID={h.run_id}); it is replaced", flush=True)
    return path


def make_run_dir(h):
    """runs/$RUN_ID, made at start: a folder that cannot be made stops the run before any work."""
    try:
        os.makedirs(h.run_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"RUN_ID={h.run_id}: cannot make its folder {h.run_dir} ({e.strerror or e}); run from a "
                          "writable directory") from None


class Tracker:
    """TRACKER=wandb|tensorboard (issue 63; docs/running.md "Experiment trackers"), rank 0 only: the run's effective
    settings with their sources at start, then the numbers of every line the log gets (train and val lines at their
    step; scores, evaluation times and artifact bytes at the last step), read from the line's own text, so the tracker
    holds what the log says. A tracker that cannot start stops the run before any work (ConfigError, one line, its
    package's `pip install` where an import failed); one that fails later costs one warning line, and the run goes on
    without it. Its package is imported here only. Issue 72: one W&B run per RUN_ID (its id, wandb_run_id), resumed
    after RESUME; W&B's system metrics unless TRACKER_SYSTEM=0; the artifact and the log as a W&B artifact at the
    end; each exact score line also as TensorBoard text (its scalars are float32)."""
    PAIR = re.compile(r"(\w+):([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))(ms|s)?(?=[\s,]|$)")

    def __init__(self, h, resume=None):
        self.kind, self.step, self.failed, self.id = h.tracker, 0, False, wandb_run_id(h.run_id)
        settings = {name: {"value": value, "source": source} for name, (value, source) in h.effective.items()}
        try:
            os.makedirs(h.run_dir, exist_ok=True)
            if self.kind == "wandb":  # WANDB_MODE=offline (read by wandb) writes runs/$RUN_ID/wandb/offline-run-*
                import wandb
                self.run = wandb.init(project=h.tracker_project, name=h.run_id, id=self.id, dir=h.run_dir,
                                      config=settings, resume="allow" if resume else None, settings=wandb.Settings(
                                          console="off", silent=True, x_disable_stats=not h.tracker_system))
            else:
                from torch.utils.tensorboard import SummaryWriter
                folder = os.path.join(h.run_dir, "tensorboard")
                os.makedirs(folder, exist_ok=True)
                probe = os.path.join(folder, f".write_test.{os.getpid()}")  # unwritable: refused here, before
                open(probe, "wb").close()  # SummaryWriter, whose writer thread would print a traceback
                os.remove(probe)
                self.run = SummaryWriter(folder, purge_step=1 if resume else None)  # the replay's steps, once
                self.run.add_text("settings", "\n".join(f"    {name}={v['value']} [{v['source']}]"
                                                         for name, v in settings.items()))
            if resume is not None:
                self.replay(Path("logs") / f"{h.run_id}.txt", resume.manifest["step"])
        except ImportError as e:
            package = "tensorboard" if self.kind == "tensorboard" else self.kind
            raise ConfigError(f"TRACKER={self.kind} cannot start: {type(e).__name__}: {first_line(e)} (pip install "
                              f"{package}, or pip install --force-reinstall {package} if it is installed)") from None
        except Exception as e:
            raise ConfigError(f"TRACKER={self.kind} cannot start: {type(e).__name__}: {first_line(e)}") from None

    def replay(self, log, resumed_step):
        """A resumed run's steps up to its checkpoint's, from the log's step lines (the last of each, as a run
        resumed twice logs some twice) that the tracker lacks: a process killed loses what its tracker had not
        written (W&B keeps a block in memory); W&B says its next step where it knows it (online), TensorBoard
        drops its earlier files' steps (purge_step)."""
        lines = {}
        for line in log.read_text(encoding="utf-8").splitlines() if log.is_file() else ():
            step = re.match(r"step:(\d+)/\d+ (train|val)_loss:", line)
            if step and int(step[1]) <= resumed_step:
                lines[int(step[1]), step[2]] = line
        first = getattr(self.run, "step", 0) if self.kind == "wandb" else 0
        for key in sorted(k for k in lines if k[0] >= first):
            self.send(None, lines[key])

    def metrics(self, line):
        """{name: number} of one log line: step:S/N lines as train/KEY or val/KEY (self.step = S), score lines and
        evaluation_time: as eval/LABEL/KEY, byte lines as artifact/NAME_bytes; {} for any other line."""
        pairs = {k + (f"_{unit}" if unit else ""): float(v) for k, v, unit in self.PAIR.findall(line)}
        step = re.match(r"step:(\d+)/", line)
        if step:
            self.step = int(step[1])
            return {f"{'train' if 'train_loss' in pairs else 'val'}/{k}": v for k, v in pairs.items()}
        if "val_bpb" in pairs or line.startswith("evaluation_time:"):
            label = "_".join(w.rstrip(":") for w in line.split() if ":" not in w.rstrip(":"))
            return {f"eval/{label}/{k}": v for k, v in pairs.items()}
        name, _, size = line.partition(": ")
        size = size.removesuffix(" bytes")
        return {f"artifact/{re.sub(r'[^a-z0-9]+', '_', name.lower())}_bytes": int(size)} if size.isdigit() else {}

    def send(self, rt, text):
        """Each line's numbers to the tracker; its first failure is one warning line, and it is sent nothing more."""
        try:
            for line in [] if self.failed else text.splitlines():
                metrics = self.metrics(line)
                if metrics and self.kind == "wandb":
                    self.run.log(metrics, step=self.step)
                for name, value in metrics.items() if self.kind == "tensorboard" else ():
                    self.run.add_scalar(name, value, self.step)
                if self.kind == "tensorboard" and re.match(r"\w+_exact\s", line):  # all its digits, as the log's
                    self.run.add_text(f"eval/{line.split()[0]}", line, self.step)
        except Exception as e:
            if rt is None:  # at start (replay): the run does not start
                raise
            self.failed = True
            rt.log(f"warning: TRACKER={self.kind} failed ({type(e).__name__}: {first_line(e)}); the run goes on "
                   "without it")

    def close(self, code, rt=None):
        """Ends the tracker's run; a finished run's artifact and log go to W&B as an artifact first."""
        with contextlib.suppress(Exception):
            if self.kind == "wandb" and code == 0 and rt is not None and not self.failed:
                import wandb
                art = wandb.Artifact(f"{self.id}-submission", type="model")
                for path in (artifact_files(rt.h)[1], rt.log_path):
                    if path is not None and os.path.isfile(path) and not rt.h.preflight:
                        art.add_file(str(path))
                if art.manifest.entries:
                    self.run.log_artifact(art)
        with contextlib.suppress(Exception):
            self.run.finish(exit_code=code) if self.kind == "wandb" else self.run.close()


def wandb_run_id(run_id):
    """The W&B run id of RUN_ID (one W&B run per RUN_ID): RUN_ID itself where W&B takes it (letters, digits, - _ .;
    at most 64), else its W&B-safe part and its CRC-32, so two RUN_IDs never share one."""
    if re.fullmatch(r"[\w.-]{1,64}", run_id, re.ASCII):
        return run_id
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', run_id)[:55].strip('-')}-{zlib.crc32(run_id.encode()):08x}"


# The settings that scale the model's memory; a refusal names the one that grew it most beyond its default.
SIZE_SETTINGS = ("NUM_LAYERS", "MODEL_DIM", "MLP_MULT", "NUM_KV_HEADS", "NUM_LOOPS", "VOCAB_SIZE",
                 "BIGRAM_VOCAB_SIZE", "BIGRAM_DIM", "VE_DIM")


def model_memory_bytes(h):
    """A lower bound on one process's memory for the model (model_params): weights at their dtype; when training also
    their gradients, Muon's momentum (its 1/WORLD_SIZE shard), AdamW's two moments, the fp32 EMA and SWA copies.
    Activations, data and compiled graphs come on top."""
    copies = 4 * (h.ema_enabled + h.swa_enabled)
    momentum = (4 if h.muon_momentum_fp32 else 2) / h.world_size
    return int(sum(shape.numel() * (size if h.eval_only else 2 * size + copies + (momentum if group == "matrix"
                                                                                  else 2 * size))
                   for _, shape, size, group, _ in model_params(h)))


def available_memory(device):
    """(bytes, what) this process may still allocate on `device`: CUDA's free memory, or the host's MemAvailable
    (bounded by a cgroup v2 limit); None where the system does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return None
    try:
        limit, used = (Path("/sys/fs/cgroup", f).read_text().strip() for f in ("memory.max", "memory.current"))
        avail = min(avail, int(limit) - int(used))
    except (OSError, ValueError):  # no cgroup v2 files, or memory.max is "max"
        pass
    return avail, "available on this machine"


def size_culprit(h, need):
    """'NAME=value' of the size setting whose return to its default shrinks `need(h)` the most (in a specialised file,
    of those it leaves open: it would refuse another value of a fixed one, and folded code reads the run's)."""
    default, best = Hyperparameters({}), (1.0, "the model's sizes")
    for name in SIZE_SETTINGS:
        value = getattr(default, name.lower())
        if getattr(h, name.lower()) != value and name not in SPECIALISED.get("values", {}):
            try:  # the run's settings with this one at its default (a new object: h is never changed)
                alt = Hyperparameters({**h._environ, name: str(value)})
            except ConfigError:  # a combination no run could have (another size no longer divides it)
                continue
            best = max(best, (need(h) / max(need(alt), 1), f"{name}={h.effective[name][0]}"))
    return best[1]


def check_model_memory(h, device):
    """Refuse, before any allocation, a model whose weights and optimizer state cannot fit: on `device`
    (model_memory_bytes per process) and, for CUDA, in host memory, where build_model first makes it in fp32."""
    ranks = h.local_world_size
    what = "weights" if h.eval_only else "weights, gradients, optimizer state, EMA"
    needs = [(device, model_memory_bytes, 1 if device.type == "cuda" else ranks, what)]
    if device.type == "cuda":
        needs.append((torch.device("cpu"), lambda hh: 4 * sum(model_param_counts(hh).values()), ranks,
                      "fp32 weights while it is built"))
    for where, need, copies, what in needs:
        avail = available_memory(where)
        if avail is None or need(h) * copies <= avail[0]:
            continue
        params = sum(model_param_counts(h).values())
        each = f" x {copies} local ranks" if copies > 1 else ""
        raise ConfigError(f"{size_culprit(h, need)}: the model would need at least {need(h) * copies / 1e9:,.1f} GB "
                          f"of {where.type.upper()} memory ({params:,} parameters{each}: {what}), "
                          f"but {avail[0] / 1e9:,.1f} GB is {avail[1]}")


def run_device_type(h):
    """DEVICE, or cuda when this machine has it, else cpu."""
    return h.device or ("cuda" if torch.cuda.is_available() else "cpu")


def run_precision(h):
    """(device type, autocast dtype name) this run computes with: what a checkpoint records and a resume compares
    (DEVICE and AUTOCAST_DTYPE at auto resolve per machine)."""
    device = run_device_type(h)
    return device, str(choose_precision(h, torch.device(device))[0] or "fp32").replace("torch.", "")


def check_checkpoint_dir(folder):
    """CHECKPOINT_DIR must be a folder this process can create or write in, refused at start-up (not at the first
    checkpoint, minutes of training later): no part of the path is a file, and the nearest existing folder is writable."""
    path = Path(folder).absolute()
    for part in [path, *path.parents]:
        if part.exists():
            if not part.is_dir():
                raise ConfigError(f"CHECKPOINT_DIR={folder}: {part} is a file, not a folder")
            if not os.access(part, os.W_OK | os.X_OK):
                raise ConfigError(f"CHECKPOINT_DIR={folder}: {part} is not writable by this user")
            return


def setup_runtime(h, resume=None):
    want = run_device_type(h)
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("DEVICE=cuda but CUDA is not available on this machine")
    if h.val_bytecount_device == "cuda" and want != "cuda":
        raise ConfigError("VAL_BYTECOUNT_DEVICE=cuda but the run is on CPU (no CUDA device)")
    distributed = h.world_size > 1
    if distributed and not (h.master_addr and h.master_port):
        raise ConfigError(f"WORLD_SIZE={h.world_size} but MASTER_ADDR/MASTER_PORT are not set: launch with "
                          "torchrun --standalone --nproc_per_node=N train_gpt.py")
    device = torch.device("cuda", h.local_rank) if want == "cuda" else torch.device("cpu")
    if h.checkpoint_every > 0 and not h.eval_only:
        check_checkpoint_dir(h.checkpoint_dir)
    if h.compile or (h.compile is None and device.type == "cuda"):
        check_compile_backend(h.compile_backend)
    check_model_memory(h, device)
    threads = choose_cpu_threads(h)
    fresh = next((d for d in (os.path.dirname(h.run_dir), h.run_dir) if not os.path.exists(d)), None)  # made here
    try:
        if h.rank == 0 and not h.eval_only:
            make_run_dir(h)
        # the tracker before the log: one that fails replaces none
        tracker = Tracker(h, resume) if h.tracker and h.rank == 0 else None
        log_path = open_log(h, append=resume is not None) if h.rank == 0 else None
    except ConfigError:  # a refused start leaves no run folder it made (nor a failed tracker's files in it)
        if fresh and h.rank == 0:
            shutil.rmtree(fresh, ignore_errors=True)
        raise
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if distributed:
        # a collective stuck on a dead peer raises after the timeout
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=h.dist_timeout_seconds))
    return Runtime(h, device, distributed, h.rank == 0, log_path, *choose_precision(h, device), threads, resume,
                   tracker=tracker)


def log_environment(rt):
    """The log starts with this script's source, then versions and the GPU listing (SPEC 5)."""
    rt.log([Path(__file__).read_text(encoding="utf-8"), "=" * 100, f"Running Python {sys.version}",
            f"Running PyTorch {torch.__version__}"], console=False)
    if rt.device.type == "cuda":
        rt.log(subprocess.run(["nvidia-smi"], capture_output=True, text=True, check=False).stdout, console=False)
    else:
        rt.log(f"no GPU: running on CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)",
               console=False)
    rt.log("=" * 100, console=False)


def clock_ms(h, step, wall_ms):
    """The elapsed training time the schedule reads after `step` steps: the real one (TRAIN_CLOCK=wall), or the
    replay clock's (issue 40)."""
    return wall_ms if h.clock is None else h.clock.ms(step)


def training_fraction(h, step, elapsed_ms):
    """How far training is: elapsed / the loop's cap (net of the GPTQ reserve), or step / ITERATIONS without a cap."""
    if h.max_wallclock_ms is None:
        return step / max(h.iterations, 1)
    return elapsed_ms / max(h.max_wallclock_ms, 1e-9)


def lr_multiplier(h, step, elapsed_ms):
    """1 until warmdown, then linear to 0 (floored at MIN_LR). WARMDOWN_ITERS (the record): by step without a
    wallclock cap, by time with one. WARMDOWN_FRAC (SPEC-FRONTIER 10): the last fraction of training_fraction."""
    if h.warmdown_frac > 0:
        left = 1.0 - training_fraction(h, step, elapsed_ms)
        return 1.0 if left > h.warmdown_frac else max(left / h.warmdown_frac, h.min_lr)
    if h.warmdown_iters <= 0:
        return 1.0
    if h.max_wallclock_ms is None:
        start = max(h.iterations - h.warmdown_iters, 0)
        m = max((h.iterations - step) / h.warmdown_iters, 0.0) if start <= step < h.iterations else 1.0
    else:
        warmdown_ms = h.warmdown_iters * (elapsed_ms / max(step, 1))
        remaining = max(h.max_wallclock_ms - elapsed_ms, 0.0)
        m = remaining / max(warmdown_ms, 1e-9) if remaining <= warmdown_ms else 1.0
    return max(m, h.min_lr)


def seq_len_phase(h, step, elapsed_ms):
    """Index of the TRAIN_SEQ_LEN_SCHEDULE phase due at this point of training (agreed elapsed time)."""
    frac = training_fraction(h, step, elapsed_ms)
    return max(i for i, (_, start) in enumerate(h.seq_len_phases) if start <= frac)


def swa_snapshot_due(h, step, lr_scale):
    """SWA_ENABLED=1 (SPEC 5): a snapshot after `step` steps when the LR scale is below 0.2 on a multiple of SWA_EVERY."""
    return h.swa_enabled and lr_scale < 0.2 and step % h.swa_every == 0


class Schedule:
    """Every time-based decision of training, as _train_loop takes them (SPEC 3-5, SPEC-FRONTIER 10, 19): given the
    ranks' agreed elapsed time after each step (after_step: the stop at the cap, the loop switch due), before_step
    says what changes before the next step (the layer loop, the context phase, late QAT) and sets its LR scale.
    replay_schedule() runs the same object on a replay clock, without training."""

    def __init__(self, h):
        self.h, self.elapsed_ms, self.loop_due, self.stop_after = h, 0.0, False, None
        self.looping = h.num_loops > 0 and h.enable_looping_at == 0
        self.qat_on, self.phase, self.switch_step = h.qat_enabled, 0, None
        self.scale = self.lr_scale = 1.0

    @property
    def seq_len(self):
        """The training context (cut length) of the current phase."""
        return self.h.seq_len_phases[self.phase][0] if self.h.seq_len_phases else self.h.train_seq_len

    def done(self, step):
        return step == self.h.iterations or (self.stop_after is not None and step >= self.stop_after)

    def before_step(self, step):
        """The changes due before step `step` + 1, as (event, detail): ("layer_loop", training fraction),
        ("seq_len", training fraction), ("late_qat", LR scale); sets .scale (the warmdown's; SWA and late QAT read
        it) and .lr_scale (with the context phase's re-warmup)."""
        h, events = self.h, []
        frac = self.progress = training_fraction(h, step, self.elapsed_ms)  # CONTEXT.progress
        if self.loop_due and not self.looping:
            self.looping = True
            events.append(("layer_loop", frac))
        if h.seq_len_phases and seq_len_phase(h, step, self.elapsed_ms) != self.phase:
            self.phase, self.switch_step = seq_len_phase(h, step, self.elapsed_ms), step
            events.append(("seq_len", frac))
        self.scale = lr_multiplier(h, step, self.elapsed_ms)
        self.lr_scale = self.scale * seq_len_rewarmup(h, None if self.switch_step is None else step - self.switch_step)
        if h.late_qat_threshold > 0 and self.scale < h.late_qat_threshold and not self.qat_on:
            self.qat_on = True
            events.append(("late_qat", self.scale))
        return events

    def after_step(self, step, elapsed_ms):
        """The ranks' agreed elapsed time after `step` steps."""
        h, self.elapsed_ms = self.h, elapsed_ms
        if h.max_wallclock_ms is not None and elapsed_ms >= h.max_wallclock_ms and self.stop_after is None:
            self.stop_after = step
        self.loop_due = h.num_loops > 0 and training_fraction(h, step, elapsed_ms) >= h.enable_looping_at

    STATE = ("elapsed_ms", "loop_due", "looping", "qat_on", "phase", "switch_step")  # what a checkpoint keeps

    def state(self):
        return {name: getattr(self, name) for name in self.STATE}

    def restore(self, state):
        for name in self.STATE:
            setattr(self, name, state[name])


def state_key(looping, cut, qat):
    """A training state's name (the preflight report, replay_schedule): 'loop:1 seq:2048 qat:0'."""
    return f"loop:{int(looping)} seq:{cut} qat:{int(qat)}"


class ReplaySchedule(NamedTuple):
    events: dict  # event -> the steps it happens at: layer_loop, seq_len, late_qat (before step+1), swa (snapshots)
    stop: int  # the steps trained
    states: dict  # state_key -> steps trained in that state


def replay_schedule(h):
    """A run's schedule on its replay clock (TRAIN_CLOCK other than wall), without training: the Schedule that
    _train_loop runs, fed the clock's time after each step."""
    sched, events, states, step = Schedule(h), {}, {}, 0
    while not sched.done(step):
        for name, _ in sched.before_step(step):
            events.setdefault(name, []).append(step)
        key = state_key(sched.looping, sched.seq_len, sched.qat_on)
        states[key] = states.get(key, 0) + 1
        step += 1
        if swa_snapshot_due(h, step, sched.scale):
            events.setdefault("swa", []).append(step)
        sched.after_step(step, h.clock.ms(step))
    return ReplaySchedule(events, step, states)


def schedule_states(h, n):
    """The training state (layer loop on, cut length, QAT on) of each of n steps without a wallclock cap, decided as
    _train_loop decides: the loop from the step whose fraction reaches ENABLE_LOOPING_AT (from the start at 0), the
    TRAIN_SEQ_LEN_SCHEDULE phase due, late QAT from the first step with LR scale below its threshold (its Schedule)."""
    g = copy.copy(h)
    g.iterations, g.warmdown_iters, g.max_wallclock_seconds = n, rehearsal_warmdown(h, n), 0.0
    sched, states = Schedule(g), []
    for step in range(n):
        sched.before_step(step)
        states.append((sched.looping, sched.seq_len, sched.qat_on))
        sched.after_step(step + 1, 0.0)
    return states


def rehearsal_warmdown(h, n):
    """PREFLIGHT=1's WARMDOWN_ITERS for n steps: all n when the real run has one (under the real wallclock cap its
    share of the steps is only known from the step time, and a warmdown over the whole rehearsal gives late QAT the
    steps it needs at any threshold); WARMDOWN_FRAC, a fraction already, is kept as it is."""
    return n if h.warmdown_iters > 0 else 0


def preflight_iterations(h, most=400):
    """PREFLIGHT=1's step count: the fewest steps in which every training state that takes a share of a long run
    (schedule_states over 1,000 steps) gets PREFLIGHT_STEPS steps; `most` at most."""
    wanted = set(schedule_states(h, 1000))
    for n in range(max(h.preflight_steps * len(wanted), 1), most):
        states = schedule_states(h, n)
        if all(states.count(s) >= h.preflight_steps for s in wanted):
            return n
    return most


def seq_len_rewarmup(h, steps_since_switch):
    """LR factor after a training-context switch (#2014, SPEC-FRONTIER 19): linear 1/N, 2/N, ... 1 over the
    N = SEQ_LEN_REWARMUP_STEPS steps from the switch; 1 before any switch (None) and with N = 0."""
    if steps_since_switch is None or h.seq_len_rewarmup_steps <= 0:
        return 1.0
    return min(1.0, (steps_since_switch + 1) / h.seq_len_rewarmup_steps)


def muon_momentum_at(h, step):
    frac = min(step / h.muon_momentum_warmup_steps, 1.0) if h.muon_momentum_warmup_steps > 0 else 1.0
    return (1 - frac) * h.muon_momentum_warmup_start + frac * h.muon_momentum


def compile_enabled(rt):
    return rt.h.compile if rt.h.compile is not None else rt.device.type == "cuda"


def check_compile_backend(name):
    """COMPILE_BACKEND must name a torch.compile backend (checked at start-up where the run compiles: listing them
    imports Dynamo, a second of every start otherwise)."""
    backends = torch._dynamo.list_backends(exclude_tags=())
    if name not in backends:
        raise ConfigError(f"COMPILE_BACKEND={name!r} is not a torch.compile backend (inductor, aot_eager, eager, ...: "
                          "torch._dynamo.list_backends(exclude_tags=()))")


# ---- torch.compile with a graph plan (issue 34; docs/gpu.md "Compiled graphs")
# Each compiled callable knows how many graphs the run's settings need of it (its plan); the warmups compile them
# before the timers; inside a timed region a call whose graph was not warmed runs eager once per shape (logged), and
# a graph Dynamo compiles there anyway is counted and logged (compile_region lines), never hidden.

_REGION = [None]  # the timed region running now (compile_region), else None


@contextlib.contextmanager
def compile_region(name):
    """Marks a timed region (the training steps, each scored evaluation): compiled callables compile nothing in it."""
    outer, _REGION[0] = _REGION[0], name
    try:
        yield
    finally:
        _REGION[0] = outer


class CompiledFunction:
    """One callable under torch.compile(fullgraph=True, backend=COMPILE_BACKEND) with its plan: `planned` graphs. The
    backend is wrapped to count graphs (per function and per region) and calls that compiled are timed (trace, compile
    and that call's run: compile_s). A graph is keyed as Dynamo guards it: argument shapes and dtypes (only their
    number of dims with dynamic=True), DocBounds' lengths (cu_seqlens' length is marked dynamic: one graph serves every
    number of documents), grad and inference mode, autocast, and state() (the model's train/eval, loop and QAT flags
    and which weights train). Outside timed regions new keys compile; inside, an unseen key runs eager (logged once),
    and a call past Dynamo's recompile limit runs eager instead of ending the run."""

    def __init__(self, rt, name, fn, state, planned, dynamic=False):
        self.rt, self.name, self.fn, self.state, self.planned, self.dynamic = rt, name, fn, state, planned, dynamic
        self.graphs, self.compile_s, self.eager_calls = 0, 0.0, 0
        self.region_graphs, self.region_eager, self.region_calls = {}, {}, {}
        self.keys, self.logged = set(), set()
        self.compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True, backend=self._backend)
        rt.compiled.append(self)
        # Dynamo's per-code-object limit (default 8) from the plan: functions of one model share code objects
        # (forward and forward_logits), so the limit is the plan's total over the run, never below the default
        limit = max(8, sum(f.planned for f in rt.compiled))
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                               4 * limit)

    def _backend(self, gm, example_inputs):
        compiled = torch._dynamo.lookup_backend(self.rt.h.compile_backend)(gm, example_inputs)
        # counted once it returns: a backend that asks Dynamo to restart its analysis raises, and is called again
        self.graphs += 1
        if _REGION[0] is not None:
            self.region_graphs[_REGION[0]] = self.region_graphs.get(_REGION[0], 0) + 1
        return compiled

    def _sig(self, a):
        if isinstance(a, Tensor):
            return (a.dim() if self.dynamic else tuple(a.shape)), a.dtype, a.requires_grad
        if isinstance(a, DocBounds):
            return "docs", a.max_len, a.rope_len, a.prev is not None
        if isinstance(a, (tuple, list)):
            return tuple(self._sig(x) for x in a)
        if isinstance(a, nn.Module):
            return type(a).__name__
        return a

    def key(self, args, kwargs):
        dev = self.rt.device.type
        autocast = torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev)
        return (self._sig(args), self._sig(sorted(kwargs.items())), self.state(), torch.is_grad_enabled(),
                torch.is_inference_mode_enabled(), autocast)

    def _eager(self, why, key, args, kwargs):
        self.eager_calls += 1
        region = _REGION[0] or "-"
        self.region_eager[region] = self.region_eager.get(region, 0) + 1
        if key not in self.logged:
            self.logged.add(key)
            self.rt.log(f"compile: {self.name} ran eager in {region}: {why}")
        return self.fn(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        for a in (*args, *kwargs.values()):
            if isinstance(a, DocBounds) and a.cu_seqlens.numel() > 1:
                torch._dynamo.maybe_mark_dynamic(a.cu_seqlens, 0)
        key = self.key(args, kwargs)
        if _REGION[0] is not None and key not in self.keys:
            return self._eager("a shape not warmed before the timer", key, args, kwargs)
        if _REGION[0] is not None:
            self.region_calls[_REGION[0]] = self.region_calls.get(_REGION[0], 0) + 1
        self.keys.add(key)
        graphs, t0 = self.graphs, time.perf_counter()
        try:
            out = self.compiled(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            return self._eager(f"past Dynamo's recompile limit {torch._dynamo.config.recompile_limit}", key, args,
                               kwargs)
        if self.graphs > graphs:
            self.rt.sync()
            self.compile_s += time.perf_counter() - t0
        return out

    def summary(self):
        """The log line: graphs compiled against the plan, compile seconds, eager calls."""
        return (f"compile: {self.name} graphs:{self.graphs} planned:{self.planned} "
                f"recompiles:{max(self.graphs - 1, 0)} compile_s:{self.compile_s:.1f} eager_calls:{self.eager_calls} "
                f"backend:{self.rt.h.compile_backend}" + (" dynamic:1" if self.dynamic else ""))


def compile_fn(rt, name, fn, state, planned, dynamic=False):
    """fn as a CompiledFunction where torch.compile is on (CUDA, or COMPILE=1), else fn itself."""
    return CompiledFunction(rt, name, fn, state, planned, dynamic) if compile_enabled(rt) else fn


def log_compile_region(rt, name):
    """One line per timed region (all ranks' worst): graphs compiled inside it (0 when the warmups covered the plan),
    calls that ran eager, and calls that ran a compiled graph."""
    if not compile_enabled(rt):
        return
    counts = torch.tensor([[sum(getattr(f, field).get(name, 0) for f in rt.compiled)
                            for field in ("region_graphs", "region_eager", "region_calls")]], dtype=torch.float64,
                          device=rt.device)
    graphs, eager, calls = rt.all_reduce(counts, op=dist.ReduceOp.MAX)[0].tolist()
    rt.log(f"compile_region: {name} graphs_compiled:{graphs:.0f} eager_calls:{eager:.0f} compiled_calls:{calls:.0f}")
    if _PREFLIGHT[0] is not None:
        _PREFLIGHT[0].regions[name] = (int(graphs), int(eager))


def log_compiled(rt):
    for f in rt.compiled:
        rt.log(f.summary())


class StepTimer:
    """TRAINING_TIMING_BREAKDOWN: ms per phase, each bracketed by device syncs."""

    PHASES = ("batch_cpu", "h2d", "forward", "backward", "clip", "optimizer", "val")

    def __init__(self, rt):
        self.rt, self.ms, self.steps = rt, dict.fromkeys(self.PHASES, 0.0), 0

    @contextlib.contextmanager
    def __call__(self, phase):
        self.rt.sync()
        t0 = time.perf_counter()
        yield
        self.rt.sync()
        self.ms[phase] += 1000.0 * (time.perf_counter() - t0)

    def pop_line(self, step):
        """Per-step averages since the last line (validation time spread over them)."""
        n = max(self.steps, 1)
        line = f"timing step:{step} steps:{n} " + " ".join(f"{k}_ms:{v / n:.2f}" for k, v in self.ms.items())
        self.ms, self.steps = dict.fromkeys(self.PHASES, 0.0), 0
        return line


def train_flops_per_token(h, seq_len, looping):
    """Training's matmul FLOPs per token of the model as configured (docs/log_format.md, "The train line's numbers"):
    6 x the matmul weights a token passes through (forward 2 FLOPs a multiply-add, backward twice the forward), each
    layer once per run in the current order (the depth loop runs some twice; the two lanes add no matmul), plus 12 x
    seq_len x model_dim a layer run for attention's QK^T and AV over the whole context (the usual convention: no
    causal halving), plus SmearGate v2's gate on all tokens but the first."""
    d, kv, heads = h.model_dim, h.num_kv_heads * h.head_dim, h.num_heads
    encoder, decoder = virtual_layers(h.num_layers, *((h.num_loops, h.loop_start, h.loop_end) if looping else ()))
    gate = {"none": 0, "dense": heads * d}.get(h.attn_gate, heads * h.gate_window)
    layer = 2 * d * d + 2 * kv * d + 2 * d * h.mlp_hidden + gate + 2 * seq_len * d
    once = (h.vocab_size * d + h.bigram_dim * d * (h.bigram_vocab_size > 0) + h.gate_window * (seq_len - 1) / seq_len
            * (h.smear_gate == 2) + h.ve_dim * kv * bool(h.ve_enabled and h.ve_layers))
    return 6 * ((len(encoder) + len(decoder)) * layer + once)


# One GPU's dense bf16 peak TFLOP/s (NVIDIA's data sheets), by name, first match: MFU's denominator (or PEAK_TFLOPS)
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


class TrainMeter:
    """The train line's numbers for researchers (issue 72; docs/log_format.md): each optimizer group's LR and Muon's
    momentum as the step used them, the gradient norm the clip computed (read only here, at a logged step, in the
    one host read of the loss), tokens a second since the last train line, and MFU: train_flops_per_token x tok/s
    over the peak (PEAK_TFLOPS, else PEAK_BF16_TFLOPS' for a bf16 run) x ranks; none without a known peak."""

    def __init__(self, rt, trainer, step, train_ms):
        h, present = rt.h, set(param_groups(trainer.model).values())
        self.h, self.last = h, (step, train_ms)
        self.names = [g for g, (opt, _, _) in group_settings(h).items() if opt == "adamw" and g in present]
        self.tokens = h.local_tokens * h.replay_world_size * h.grad_accum_steps  # all ranks' tokens a step
        name = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "CPU"
        known = next((p for key, p in PEAK_BF16_TFLOPS if key in name), None) if rt.autocast_dtype else None
        self.peak = h.peak_tflops or known
        source = "PEAK_TFLOPS" if h.peak_tflops else f"{name} bf16" if known else f"{name}: unknown; PEAK_TFLOPS=..."
        rt.log(f"mfu: train_flops_per_token:{train_flops_per_token(h, h.train_seq_len, False):.6g} "
               f"peak_tflops:{self.peak or '-'} ({source}; docs/log_format.md)")

    def fields(self, trainer, train_loss, step, ms, seq_len, looping):
        """(the step's loss, the text between step_avg: and data_wait_ms: in the train line)."""
        norm = trainer.grad_norm
        loss, *norm = torch.stack([train_loss.float(), *([] if norm is None else [norm.float()])]).tolist()
        lrs = [f"lr_{n}:{opt.param_groups[0]['lr']:.4g}" for n, opt in zip([*self.names, "matrix"], trainer.optimizers)]
        tok_s = self.tokens * (step - self.last[0]) / max(ms - self.last[1], 1e-3) * 1000.0
        self.last = (step, ms)
        text = " ".join([*lrs, f"muon_momentum:{trainer.muon.param_groups[0]['momentum']:.4g}",
                         *(f"grad_norm:{n:.4g}" for n in norm), f"tok_s:{tok_s:.0f}"])
        if self.peak:
            mfu = train_flops_per_token(self.h, seq_len, looping) * tok_s / (self.peak * 1e12 * self.h.world_size)
            text += f" mfu:{mfu:.4g}"
        return loss, " " + text


def training_loss(h, model, ids, targets, docs=None, padded=False):
    """Training's objective (SPEC 3; SPEC-FRONTIER 18, item 7), what Trainer minimises: the mean cross-entropy, as
    the scoring loss (GPT.forward, which evaluation and TTT use), plus each objective piece's term (GPT.terms: a module
    declaring `term_weight`, its `taps` (names) and term(model, out, targets)), weighted; with none, the CE alone.
    padded: targets may be IGNORE (a packed row's piece). A piece adds its term by declaration, not by editing this
    (docs/frontier.md "Adding a technique"); the layer states its taps name are computed only then."""
    terms = model.terms()
    out = model.outputs(ids, docs, tuple(name for piece in terms for name in piece.taps))
    loss = model.cross_entropy(out.logits, targets, padded)
    for piece in terms:
        loss = loss + piece.term_weight * piece.term(model, out, targets)
    return loss


class Trainer:
    """A step: grad_accum micro-batches, clip, overlapped Parallel Muon; data_wait_ms: time blocked on data."""

    def __init__(self, rt, model):
        self.rt, self.h, self.model = rt, rt.h, model
        self.forward = compile_fn(rt, "train_forward", lambda *a, **k: training_loss(rt.h, model, *a, **k),
                                  model.graph_state, len(training_graph_states(rt)))
        # validation inside training (not timed): a callable of its own, compiled at its first call
        self.val_forward = compile_fn(rt, "val_forward", model, model.graph_state, 3 * len(loop_states(rt.h)))
        # (eval_val's row shapes: full batches, the last batch and the tail row, in each layer order; eval mode reads no
        # QAT flag)
        self.muon, self.adams = build_optimizers(self.h, model, rt.autocast_dtype or torch.float32)
        self.optimizers = [*self.adams, self.muon]
        groups = param_groups(model)  # all but Muon's "matrix" group: replicated and all-reduced (no DDP wrapper)
        self.replicated = [p for name, p in model.named_parameters() if groups[name] != "matrix"]
        self.data_wait_ms = 0.0
        # MICRO_BATCH_SPLIT: each drawn micro-batch computed in this many pieces (0, auto: from 1, doubled on
        # out-of-memory during the warmup: grow_split)
        self.split = max(self.h.micro_batch_split, 1)

    def zero_grad(self):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def forward_backward(self, x, y, docs, scale, phase):
        """One drawn micro-batch's loss (detached), its gradients x `scale` accumulated: in self.split equal pieces of
        its rows (MICRO_BATCH_SPLIT; the mean of the pieces' mean losses is the micro-batch's), else whole; a packed
        row in pieces of whole segments (packed_forward_backward)."""
        if docs and docs[0].starts is not None:  # the training loader's packed row
            if self.split > 1:
                return self.packed_forward_backward(x, y, docs[0], scale, phase)
            docs = [docs[0]._replace(starts=None)]  # host data: never an argument of the (compiled) forward
        pieces = zip(x.chunk(self.split), y.chunk(self.split)) if self.split > 1 else [(x, y)]
        total = 0.0
        for xp, yp in pieces:
            with phase("forward"), self.rt.autocast():
                loss = self.forward(xp, yp, *docs)
            with phase("backward"):
                (loss * (scale / self.split)).backward()
            total = total + loss.detach()
        return total / self.split

    def packed_forward_backward(self, x, y, docs, scale, phase):
        """MICRO_BATCH_SPLIT on a packed (1, n) row: pieces of whole segments (packed_pieces), each padded to
        ceil(n / split) tokens (padding: token 0 in segments of its own, targets IGNORE), with its first RoPE position
        in the row and the token before it for SmearGate, so every real token computes what it computes in the whole
        row; the loss is the pieces' means weighted by their tokens (the row's mean)."""
        n, dev = x.size(1), x.device
        width = -(-n // self.split)
        total = 0.0
        for a, b, cu in packed_pieces(docs.starts, n, docs.max_len, width):
            piece = DocBounds(small_to_device(cu, dev), docs.max_len, docs.rope_len,
                              pos0=small_to_device(np.array(a, dtype=np.float32), dev),
                              prev=x[:, max(a - 1, 0):max(a, 1)],
                              prev_keep=small_to_device(np.full((1, 1, 1), float(a > 0), dtype=np.float32), dev))
            # (1, width) with strides (width, 1) whether padded or not: one compiled graph serves every piece
            xp = F.pad(x[0, a:b], (0, width - (b - a)))[None]
            yp = F.pad(y[0, a:b], (0, width - (b - a)), value=IGNORE)[None]
            with phase("forward"), self.rt.autocast():
                loss = self.forward(xp, yp, piece, padded=True)
            with phase("backward"):
                (loss * (scale * (b - a) / n)).backward()
            total = total + loss.detach() * ((b - a) / n)
        return total

    def grow_split(self):
        """MICRO_BATCH_SPLIT=0 (auto) after an out-of-memory error: twice the pieces, if the micro-batch allows; False
        if not."""
        if self.h.micro_batch_split != 0 or not self.h.split_ok(2 * self.split):
            return False
        self.split *= 2
        self.zero_grad()
        if self.rt.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def step(self, loader, lr_scale, momentum, timer=None):
        h, rt = self.h, self.rt
        phase = timer or contextlib.nullcontext  # nullcontext(name) times nothing
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * lr_scale
        for g in self.muon.param_groups:
            g["momentum"] = momentum
        self.zero_grad()
        accum, k = h.grad_accum_steps, h.virtual_ranks
        # As the records (03-23 and 04-27, SPEC-FRONTIER 18): each rank's local gradients, before any communication
        # (each virtual rank's); GRAD_CLIP_SCOPE=reduced: the rank-averaged gradients (one process: its mean gradient).
        clip_local = h.grad_clip_norm > 0 and h.grad_clip_scope == "local"
        clip_reduced = h.grad_clip_norm > 0 and h.grad_clip_scope == "reduced" and rt.distributed
        clip_mean = h.grad_clip_norm > 0 and not (clip_local or clip_reduced)
        kept, self.grad_norm = None, None  # grad_norm: the clip's norm before clipping (the first virtual rank's)
        totals = []
        for _ in range(k):  # this rank's virtual ranks (REPLAY_WORLD_SIZE), each as that rank computes its step
            total = torch.zeros((), device=rt.device)
            for _ in range(accum):
                t0 = time.perf_counter()
                if timer is None:
                    x, y, *docs = loader.next_batch()  # docs: [DocBounds] from the packed loader
                else:  # the plain loader: time batch building and the copy separately
                    with phase("batch_cpu"):
                        host = loader.next_host()
                    with phase("h2d"):
                        x, y, *docs = loader.to_device(host)
                self.data_wait_ms += 1000.0 * (time.perf_counter() - t0)
                total += self.forward_backward(x, y, docs, 1.0 / (accum if clip_local else accum * k), phase)
            totals.append(total)
            with phase("clip"):
                if clip_local:
                    norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), h.grad_clip_norm)
                    self.grad_norm = norm if self.grad_norm is None else self.grad_norm
                if clip_local and k > 1:
                    kept = keep_virtual_rank_grads(self.model, kept, k)
        if kept is not None:
            for p, g in zip(self.model.parameters(), kept):
                p.grad = g
        if clip_mean:
            with phase("clip"):
                self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), h.grad_clip_norm)
        with phase("optimizer"):
            self.muon.launch_reduce_scatters()
            for p in self.replicated:
                if p.grad is not None:
                    rt.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            if clip_reduced:
                self.grad_norm = clip_reduced_grads(rt, self.muon, self.replicated, h.grad_clip_norm)
            for opt in self.adams:
                opt.step()
            self.muon.step()
        self.zero_grad()
        if k == 1:
            return totals[0] / accum
        # the first virtual rank's loss (what that rank logs), made non-finite when any virtual rank's is
        every = torch.stack(totals).sum()
        return torch.where(torch.isfinite(every), totals[0] / accum, every)


def keep_virtual_rank_grads(model, kept, k):
    """Virtual ranks with local clipping (issue 40): one virtual rank's clipped gradients / k added to `kept` (the
    gradients of those before it; None for the first), the parameters' .grad cleared for the next."""
    grads = [p.grad for p in model.parameters()]
    if kept is None:
        kept = [None if g is None else g.div_(k) for g in grads]
    else:
        kept = [a if g is None else (g.div_(k) if a is None else a.add_(g, alpha=1.0 / k)) for a, g in zip(kept, grads)]
    for p in model.parameters():
        p.grad = None
    return kept


@torch.no_grad()
def clip_reduced_grads(rt, muon, replicated, max_norm):
    """GRAD_CLIP_SCOPE=reduced: clip the norm of the rank-averaged gradient (the banks' reduce-scattered shards and
    the all-reduced replicated gradients), as one process with the mean gradient clips: coefficient
    min(1, max_norm / (norm + 1e-6)), as torch's clip_grad_norm_."""
    shards = muon.reduced_bank_grads()
    rep = [p.grad for p in replicated if p.grad is not None]
    # each rank holds different bank rows (zero-padded), the same replicated gradients
    bank_sq = rt.all_reduce(sum(s.float().square().sum() for s in shards))
    norm = (bank_sq + sum(g.float().square().sum() for g in rep)).sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # (the norm before clipping is returned: the train line's)
    for g in (*shards, *rep):
        g.mul_(coef.to(g.dtype))
    return norm


def rank_loader(rt, rank, first_bos=None):
    """TRAIN_LOADER's host loader for `rank` of REPLAY_WORLD_SIZE ranks (the real world without a replay)."""
    h = rt.h
    args = (list_shards(h.train_files), rank, h.replay_world_size, rt.device, h.local_tokens, h.train_seq_len)
    if h.train_loader == "shuffled":
        return ShuffledSequenceLoader(*args, h.seed, vocab_size=h.vocab_size)
    if h.train_loader == "packed":
        phases = h.seq_len_phases
        base = DocumentPackingLoader(*args, vocab_size=h.vocab_size, first_bos=first_bos,
                                     rope_len=h.longest_train_seq_len)
        if phases:
            base.set_cut_len(phases[0][0])
        return base
    return DistributedTokenLoader(*args, vocab_size=h.vocab_size)


def make_train_loader(rt, position=None):
    """TRAIN_LOADER's loader (with virtual ranks, theirs in turn); TRAIN_PREFETCH* and TRAIN_COPY_STREAM never
    change the batches. position: a checkpoint's (the loader's position() when it was saved) to continue from."""
    h = rt.h
    base = rank_loader(rt, h.rank * h.virtual_ranks)
    if h.virtual_ranks > 1:
        bos = getattr(base, "first_bos", None)
        base = VirtualRankLoader([base] + [rank_loader(rt, h.rank * h.virtual_ranks + j, bos)
                                           for j in range(1, h.virtual_ranks)], h.grad_accum_steps)
    if position is not None:
        base.restore(position)
    if not (rt.train_prefetch or rt.train_copy_stream):
        return base
    packed = h.train_loader == "packed"  # its host batches carry their document starts; a row is local_tokens long
    inner = PrefetchingDistributedTokenLoader(base.next_host if packed else lambda: (base.next_host(), None),
                                              base.local_tokens if packed else h.train_seq_len, rt.device,
                                              h.train_prefetch_queue, threaded=rt.train_prefetch,
                                              copy_stream=rt.train_copy_stream, name="train",
                                              produce_position=base.position)
    return PrefetchingPackedLoader(base, inner) if packed else inner


def make_calibration_loader(rt):
    """GPTQ_CALIBRATION_SEQS > 0, the 2026-04-27 record's calibration data (SPEC-FRONTIER 18): per rank (of
    REPLAY_WORLD_SIZE), batches of that many TRAIN_SEQ_LEN windows from a shuffled loader over the rank's shards,
    seeded by the rank alone (not SEED), read through the final (looped) model like today's batches."""
    h = rt.h
    loaders = [ShuffledSequenceLoader(list_shards(h.train_files), h.rank * h.virtual_ranks + j, h.replay_world_size,
                                      rt.device, h.gptq_calibration_seqs * h.train_seq_len, h.train_seq_len, 0,
                                      h.vocab_size) for j in range(h.virtual_ranks)]
    return loaders[0] if len(loaders) == 1 else VirtualRankLoader(loaders, h.gptq_calibration_batches)


def loop_states(h, start=False):
    """The layer orders training runs: the starting one and, with NUM_LOOPS > 0, the looped one."""
    return sorted({start, h.num_loops > 0})


def qat_states(rt):
    """The QAT flags training runs with: QAT_ENABLED's, and on too when LATE_QAT_THRESHOLD switches it on mid-run
    (a compiled graph each; warmed only where compiled: eager has nothing to warm)."""
    h = rt.h
    return sorted({h.qat_enabled, h.qat_enabled or (h.late_qat_threshold > 0 and compile_enabled(rt))})


def training_graph_states(rt, start=False):
    """Every (looping, cut length, QAT) the timed training steps can run in: one compiled graph each (the plan of
    train_forward; cu_seqlens' length is dynamic, so the number of documents in a row adds none)."""
    h = rt.h
    loops = loop_states(h, start)
    cuts = [n for n, _ in h.seq_len_phases] or [None]  # progressive context: every cut length
    return [(lp, cut, qat) for lp in loops for cut in cuts for qat in qat_states(rt)]


def warmup_and_restore(rt, trainer, position=None):
    """WARMUP_STEPS real steps (compile, kernels) in every state of training_graph_states (layer order, cut length,
    QAT), so that every compiled graph the timed steps need exists before the timer, then restore the initial
    state; returns a fresh loader (at a resumed checkpoint's `position`)."""
    h, model = rt.h, trainer.model
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_states = [copy.deepcopy(opt.state_dict()) for opt in trainer.optimizers]
    loader = make_train_loader(rt)
    start, qat_start = model.looping, model.qat_on()
    states = training_graph_states(rt, start)
    rt.sync()
    t0 = time.perf_counter()
    for looping, cut, qat in states:
        model.looping = looping
        model.set_qat(qat)
        if cut is not None:
            loader.set_cut_len(cut)
        for i in range(h.warmup_steps):
            while True:  # MICRO_BATCH_SPLIT=0: out of memory -> twice the pieces (the warmup's batches are thrown away)
                try:
                    trainer.step(loader, 1.0, muon_momentum_at(h, 0))
                    break
                except torch.OutOfMemoryError:
                    if not trainer.grow_split():
                        raise
                    rt.log(f"micro_batch_split:{trainer.split} (auto: out of memory in {trainer.split // 2} pieces)")
            rt.log(f"warmup_step:{i + 1}/{h.warmup_steps}" + (" looping:1" if looping else "")
                   + (f" seq_len:{cut}" if cut is not None else "") + (" qat:1" if qat != h.qat_enabled else ""))
    model.looping = start
    model.set_qat(qat_start)
    rt.sync()
    rt.log(f"warmup_time: steps:{h.warmup_steps * len(states)} "
           f"ms:{1000.0 * (time.perf_counter() - t0):.0f} (compile and first steps; not in train_time)")
    log_compiled(rt)
    loader.shutdown()  # first: its thread must not advance the stream during the rewind
    model.load_state_dict(weights, strict=True)
    for opt, state in zip(trainer.optimizers, opt_states):
        opt.load_state_dict(state)
    trainer.zero_grad()
    return make_train_loader(rt, position)


class WeightAverager:
    """fp32 EMA (the record's final weights) and SWA: SWA_ENABLED=1 collects (as the record), SWA_APPLY=1 applies."""

    def __init__(self, h, model):
        self.h, self.model = h, model
        self.ema = {k: v.detach().float().clone() for k, v in model.state_dict().items()} if h.ema_enabled else None
        self.swa, self.swa_count = None, 0

    @torch.no_grad()
    def update(self, step, lr_scale):
        state = self.model.state_dict()
        if self.ema is not None:
            d = self.h.ema_decay
            for k, v in state.items():
                self.ema[k].mul_(d).add_(v.detach().float(), alpha=1.0 - d)
        if swa_snapshot_due(self.h, step, lr_scale):
            if self.swa is None:
                self.swa = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in state.items()}
            for k, v in state.items():
                self.swa[k].add_(v.detach().float())
            self.swa_count += 1

    @torch.no_grad()
    def apply_final(self):
        """Load the final weights; returns their source."""
        if self.h.swa_apply:
            if self.swa_count == 0:
                raise RunError("SWA_APPLY=1 but no SWA snapshot was taken (LR scale never < 0.2 on a multiple of "
                               "SWA_EVERY); no artifact written")
            averaged, source = {k: v / self.swa_count for k, v in self.swa.items()}, f"swa({self.swa_count})"
        elif self.ema is not None:
            averaged, source = self.ema, "ema"
        else:
            return "raw"
        current = self.model.state_dict()
        self.model.load_state_dict({k: averaged[k].to(current[k].dtype) for k in current}, strict=True)
        if self.h.swa_enabled and not self.h.swa_apply:
            source += f" (swa snapshots collected: {self.swa_count}, not applied; SWA_APPLY=1 applies them)"
        return source


# ---- checkpoints and an exact resume (issue 30; docs/running.md)

CHECKPOINT_MANIFEST = "manifest.json"  # written last, before the rename: a step_* folder with it is complete
# Settings a resume may change: none of them changes a number training computes (where files go, logging,
# validation, prefetch and copy streams, timeouts, the launcher's own variables). Every other setting, world size
# included (no resharding), must equal the checkpoint's.
RESUME_FREE_SETTINGS = frozenset((
    "RUN_ID", "CHECKPOINT_EVERY", "CHECKPOINT_DIR", "CHECKPOINT_KEEP", "RESUME", "TEST_KILL_AT_CHECKPOINT",
    "DEBUG_TRACEBACK", "DIST_TIMEOUT_SECONDS", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "RANK",
    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WARMUP_STEPS", "TRAIN_PREFETCH", "TRAIN_PREFETCH_QUEUE", "TRAIN_COPY_STREAM",
    "VAL_PREFETCH", "VAL_COPY_STREAM", "VAL_BYTECOUNT_DEVICE", "VAL_PROGRESS_LOG_EVERY", "VAL_LOSS_EVERY",
    "TRAIN_LOG_EVERY", "TRAINING_TIMING_BREAKDOWN", "TRAINING_TIMING_EVERY", "PROFILE", "PROFILE_STEPS",
    "OVERWRITE_RUN", "PEAK_TFLOPS", "TRACKER_SYSTEM"))


@dataclass
class ResumePoint:
    """A checked checkpoint to resume from: its folder and manifest."""
    path: Path
    manifest: dict


def checkpoint_payload_bytes(h):
    """A checkpoint's tensor bytes from the settings (model_params; training-only ones too): (replicated, Muon's per
    rank). Replicated: the weights (fp32 banks and rest, bf16 embeddings), the fp32 EMA, AdamW's two moments at each
    parameter's dtype, and SWA's fp32 sums once collected (SWA_ENABLED, LR scale < 0.2: not counted here). Per rank:
    Muon's momentum (bf16, fp32 with MUON_MOMENTUM_FP32) for its 1/WORLD_SIZE of each matrix's rows, zero-padded. Not
    counted: RNG and loader state, AdamW's step counters, torch.save's framing (a few KB)."""
    shared = muon = 0
    for _, shape, size, group, _ in model_params(h):
        shared += shape.numel() * (size + 4 * h.ema_enabled + (0 if group == "matrix" else 2 * size))
        if group == "matrix":
            muon += (4 if h.muon_momentum_fp32 else 2) * -(-shape[0] // h.world_size) * shape[1:].numel()
    return shared, muon


def checkpoint_name(step):
    return f"step_{step:08d}"


def complete_checkpoints(folder):
    """[(step, folder)] of the complete checkpoints (with a manifest) in `folder`, oldest first."""
    found = []
    for p in Path(folder).glob("step_*"):
        if p.name[5:].isdigit() and (p / CHECKPOINT_MANIFEST).is_file():
            found.append((int(p.name[5:]), p))
    return sorted(found)


def settings_text(h):
    """Every setting's effective value as text: what a checkpoint records and a resume compares."""
    return {name: Hyperparameters._text(value) for name, (value, _) in h.effective.items()}


def code_crc():
    return zlib.crc32(Path(__file__).read_bytes())


def write_synced(path, data):
    """Write and fsync: on disk before the checkpoint that lists it can be marked complete."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def file_crc(path, block=1 << 24):
    """(bytes, CRC-32) of a file, read in blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def read_checkpoint_manifest(path):
    """A checkpoint folder's manifest; a missing or damaged one is a one-line ConfigError naming the file."""
    file = Path(path) / CHECKPOINT_MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
        if not (isinstance(manifest, dict) and {"step", "world_size", "settings", "files"} <= set(manifest)):
            raise ValueError("keys missing")
        return manifest
    except (OSError, ValueError) as e:
        raise ConfigError(f"RESUME: checkpoint file {file} is unreadable or corrupted ({first_line(e)})") from None


def verify_checkpoint_files(path, manifest):
    """Every file the manifest lists has its recorded size and CRC-32 (each rank checks all, so all agree)."""
    for name, (size, crc) in sorted(manifest["files"].items()):
        file = Path(path) / name
        if not file.is_file():
            raise ConfigError(f"RESUME: checkpoint file {file} is missing")
        got_size, got_crc = file_crc(file)
        if got_size != size:
            raise ConfigError(f"RESUME: checkpoint file {file} is truncated or altered: {got_size} bytes, the "
                              f"manifest says {size}")
        if got_crc != crc:
            raise ConfigError(f"RESUME: checkpoint file {file} is corrupted (its CRC-32 differs from the manifest's)")


def find_resume(h):
    """Before any work (and before the log is opened): RESUME's checkpoint, its settings compared and its files
    checked, or None for a fresh run (RESUME unset, or auto with no checkpoint yet). Refusals are one-line
    ConfigErrors, and nothing on disk has changed."""
    if not h.resume:  # a fresh run, refused where it would write over another run's checkpoints
        found = complete_checkpoints(Path(h.checkpoint_dir)) if h.checkpoint_every > 0 else ()
        if found:
            raise ConfigError(f"CHECKPOINT_DIR={h.checkpoint_dir} already holds checkpoints of a run with RUN_ID="
                              f"{h.run_id} (up to {found[-1][1].name}): continue it with RESUME=auto, or choose another "
                              "RUN_ID or CHECKPOINT_DIR")
        return None
    folder = Path(h.checkpoint_dir)
    if h.resume == "auto":
        found = complete_checkpoints(folder)
        if not found:
            return None
        path = found[-1][1]
    else:
        path = Path(h.resume)
        if not path.is_dir():
            raise ConfigError(f"RESUME={h.resume}: no such checkpoint folder")
        if not (path / CHECKPOINT_MANIFEST).is_file():
            found = complete_checkpoints(path)
            if not found:
                raise ConfigError(f"RESUME={h.resume}: no {CHECKPOINT_MANIFEST} (an incomplete checkpoint) and no "
                                  "complete step_* checkpoint inside")
            path = found[-1][1]
    manifest = read_checkpoint_manifest(path)
    now = settings_text(h)
    differ = [f"{k}={v} (now {now.get(k, 'unset')})" for k, v in manifest["settings"].items()
              if k not in RESUME_FREE_SETTINGS and now.get(k) != v]
    differ += [f"{k} (new, now {v})" for k, v in now.items()
               if k not in RESUME_FREE_SETTINGS and k not in manifest["settings"]]
    saved, here = manifest.get("precision"), list(run_precision(h))
    if saved is not None and saved != here:
        differ.append(f"device/precision={'/'.join(saved)} (now {'/'.join(here)}; set DEVICE and AUTOCAST_DTYPE)")
    if differ:
        raise ConfigError(f"RESUME: {path} was written with settings that change the training: {', '.join(differ)}")
    newer = [p.name for s, p in complete_checkpoints(folder) if s > manifest["step"]]
    if h.checkpoint_every > 0 and newer:
        raise ConfigError(f"RESUME: CHECKPOINT_DIR={folder} holds {newer[-1]}, past the resumed step "
                          f"{manifest['step']}: the new checkpoints would mix with it; choose another CHECKPOINT_DIR")
    verify_checkpoint_files(path, manifest)
    return ResumePoint(path, manifest)


def rng_state():
    """Every generator a run draws from: Python's, NumPy's global one, torch's CPU and CUDA ones."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []}


def set_rng_state(state):
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def optimizer_state(opt):
    """(hyperparameters of each group, [state dict] per parameter in group order) as they are: unlike
    Optimizer.state_dict()/load_state_dict(), which cast state to each parameter's dtype (Muon's bf16 momentum
    would come back fp32)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return ([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            [dict(opt.state[p]) if p in opt.state else {} for p in params])


def load_optimizer_state(opt, groups, states):
    """The inverse of optimizer_state: dtypes kept; tensors on the parameter's device, AdamW's step counter
    where torch keeps it (on the CPU unless the group is fused or capturable)."""
    for g, saved in zip(opt.param_groups, groups):
        g.update(saved)
    params = [(p, g) for g in opt.param_groups for p in g["params"]]
    for (p, g), state in zip(params, states):
        on_cpu = not (g.get("fused") or g.get("capturable"))
        opt.state[p] = {k: (v.to("cpu" if k == "step" and on_cpu else p.device) if torch.is_tensor(v) else v)
                        for k, v in state.items()}


def training_state(trainer, averager, loader, schedule):
    """What the next step reads, as (replicated tensors, this rank's own part). Replicated (equal on every
    rank): the weights, EMA, SWA, AdamW moments. Own: Muon's momentum (in a multi-rank run each rank's shard of
    the banks, Parallel Muon), the loader position, the RNGs, optimizer hyperparameters and the schedule."""
    shared = {f"model.{k}": v.detach() for k, v in trainer.model.state_dict().items()}
    for kind, table in (("ema", averager.ema), ("swa", averager.swa)):
        shared.update({f"{kind}.{k}": v for k, v in (table or {}).items()})
    own = {"schedule": schedule, "swa_count": averager.swa_count, "loader": loader.position(), "rng": rng_state(),
           "groups": [], "muon": []}
    for i, opt in enumerate(trainer.optimizers):
        groups, states = optimizer_state(opt)
        own["groups"].append(groups)
        if opt is trainer.muon:
            own["muon"] = states
        else:
            shared.update({f"opt{i}.{j}.{k}": v for j, st in enumerate(states) for k, v in st.items()})
    return shared, own


def restore_training_state(state, trainer, averager):
    """Loads a checkpoint's state (load_checkpoint) into the model, optimizers and averager, then the RNGs;
    returns the schedule dict."""
    shared, own = state
    trainer.model.load_state_dict({k[6:]: v for k, v in shared.items() if k.startswith("model.")}, strict=True)
    with torch.no_grad():
        for k, v in (averager.ema or {}).items():
            v.copy_(shared[f"ema.{k}"])
    device = next(trainer.model.parameters()).device
    swa = {k[4:]: v.to(device) for k, v in shared.items() if k.startswith("swa.")}
    averager.swa, averager.swa_count = swa or None, own["swa_count"]
    for i, (opt, groups) in enumerate(zip(trainer.optimizers, own["groups"])):
        if opt is trainer.muon:
            states = own["muon"]
        else:
            n = sum(len(g["params"]) for g in opt.param_groups)
            states = [{k.split(".", 2)[2]: v for k, v in shared.items() if k.startswith(f"opt{i}.{j}.")}
                      for j in range(n)]
        load_optimizer_state(opt, groups, states)
    set_rng_state(own["rng"])
    return own["schedule"]


def load_checkpoint(rt):
    """(replicated tensors from every rank's slice, this rank's own part) of the checked RESUME checkpoint, on
    the CPU; a file that cannot be read back is a one-line ConfigError naming it."""
    path, ws = rt.resume.path, rt.resume.manifest["world_size"]
    shared = {}
    for name in [f"shared{r}.pt" for r in range(ws)] + [f"rank{rt.h.rank}.pt"]:
        try:
            part = torch.load(path / name, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ConfigError(f"RESUME: checkpoint file {path / name} cannot be read ({first_line(e)})") from None
        if name.startswith("shared"):
            shared.update(part)
    return shared, part


def share_out(tensors, world_size):
    """Replicated tensors split over the ranks for writing, largest first to the least loaded rank (the same
    split on every rank): each byte is written once, by all ranks in parallel."""
    loads, parts = [0] * world_size, [{} for _ in range(world_size)]
    for k in sorted(tensors, key=lambda k: (-tensors[k].numel() * tensors[k].element_size(), k)):
        r = loads.index(min(loads))
        parts[r][k] = tensors[k]
        loads[r] += tensors[k].numel() * tensors[k].element_size()
    return parts


def to_host(obj):
    """A copy of obj with every tensor copied to the CPU (what an asynchronous write holds)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj


class Checkpointer:
    """CHECKPOINT_EVERY: each rank writes its own part (torch.save; not torch.distributed.checkpoint: the state is
    replicated but for Muon's momentum shards and the loaders, so a per-rank split does what DCP would, with no
    planning step, and a resume needs the same world size anyway): its slice of the replicated tensors
    (share_out) and its own state, into CHECKPOINT_DIR/.tmp_step_N, with rankR.json giving each file's size and
    CRC-32. When every rank's files are on disk, rank 0 writes manifest.json and renames the folder to step_N:
    a checkpoint is visible only complete, and a kill during the write leaves the previous one. The newest
    CHECKPOINT_KEEP are kept. CUDA: the stall is the copy to host memory; a thread writes while training goes
    on, and the step's all-reduce tells when every rank is done. CPU: written in place (the stall is the write)."""

    def __init__(self, rt):
        self.rt, self.h = rt, rt.h
        self.folder = Path(rt.h.checkpoint_dir)
        self.asynchronous = rt.device.type == "cuda"
        self.pending = None  # (step, temporary folder, writer thread or None)
        self.failure = None

    def save(self, step, shared, own):
        rt, h = self.rt, self.h
        self.wait()
        t0 = time.perf_counter()
        tmp = self.folder / f".tmp_{checkpoint_name(step)}"
        os.makedirs(tmp, exist_ok=True)
        mine = share_out(shared, h.world_size)[h.rank]
        if self.asynchronous:
            mine, own = to_host(mine), to_host(own)
            rt.sync()
            thread = threading.Thread(target=self._write_guarded, args=(tmp, step, mine, own),
                                      name="checkpoint", daemon=True)
            thread.start()
        else:
            self._write(tmp, step, mine, own)
            thread = None
        self.pending = (step, tmp, thread)
        rt.log(f"checkpoint: step:{step} stall_ms:{1000.0 * (time.perf_counter() - t0):.1f} "
               f"write:{'async' if self.asynchronous else 'sync'}")
        if not self.asynchronous:
            self.wait()

    def _write_guarded(self, tmp, step, mine, own):
        try:
            self._write(tmp, step, mine, own)
        except BaseException as e:  # reported by the next poll() or wait()
            self.failure = e

    def _write(self, tmp, step, mine, own):
        rank, files = self.h.rank, {}
        for name, obj in ((f"shared{rank}.pt", mine), (f"rank{rank}.pt", own)):
            buf = io.BytesIO()
            torch.save(obj, buf)
            data = buf.getvalue()
            if self.h.test_kill_step == (step, "during"):  # test hook: every rank killed mid-write
                write_synced(tmp / name, data[:len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            write_synced(tmp / name, data)
            files[name] = [len(data), zlib.crc32(data)]
        write_synced(tmp / f"rank{rank}.json", json.dumps(files).encode())

    def pending_flag(self):
        """For the step's all-reduce (max): 0 written or nothing pending, 1 still writing, 2 failed."""
        busy = self.pending is not None and self.pending[2] is not None and self.pending[2].is_alive()
        return torch.tensor(2.0 if self.failure else float(busy), dtype=torch.float64, device=self.rt.device)

    def poll(self, flag):
        """After the step's all-reduce: a write every rank has finished is made complete."""
        if flag >= 2:
            raise RunError(f"writing a checkpoint failed{f': {first_line(self.failure)}' if self.failure else ' on another rank'}")
        if self.pending is not None and flag == 0:
            self._finish()

    def wait(self):
        """Waits for this rank's write and every other rank's (a collective), then makes it complete."""
        if self.pending is None:
            return
        if self.pending[2] is not None:
            self.pending[2].join()
        self.poll(self.rt.all_reduce(self.pending_flag(), op=dist.ReduceOp.MAX).item())  # joined: 0 or 2

    def _finish(self):
        rt, h = self.rt, self.h
        step, tmp, _ = self.pending
        self.pending = None
        if rt.is_main:
            files = {}
            for r in range(h.world_size):
                files.update(json.loads((tmp / f"rank{r}.json").read_text(encoding="utf-8")))
            manifest = {"format": 1, "step": step, "world_size": h.world_size, "settings": settings_text(h),
                        "precision": list(run_precision(h)), "code_crc32": code_crc(), "files": files}
            write_synced(tmp / CHECKPOINT_MANIFEST, json.dumps(manifest, indent=1).encode())
            final = self.folder / checkpoint_name(step)
            if final.exists():
                self._discard(final)
            os.rename(tmp, final)
            self._sync_folder()
            for _, old in complete_checkpoints(self.folder)[:-h.checkpoint_keep]:
                self._discard(old)
            for stale in [*self.folder.glob(".tmp_step_*"), *self.folder.glob(".del_*")]:  # left by a kill
                shutil.rmtree(stale, ignore_errors=True)
            rt.log(f"checkpoint_saved:{final} step:{step} bytes:{sum(size for size, _ in files.values())}")
        kill = h.test_kill_step
        if kill[:1] == (step,) and kill[1] != "during":  # test hook: every rank (or rank R) dies after this checkpoint
            if rt.distributed:
                dist.barrier()
            if kill[2:] in ((), (h.rank,)):
                if kill[1] == "node":  # and its launcher: a node lost
                    os.kill(os.getppid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

    def _discard(self, path):
        """Out of sight first (a rename), then deleted: a kill meanwhile leaves no half-deleted checkpoint."""
        gone = path.with_name(f".del_{path.name}_{uuid.uuid4().hex[:8]}")
        os.rename(path, gone)
        shutil.rmtree(gone, ignore_errors=True)

    def _sync_folder(self):
        with contextlib.suppress(OSError):
            fd = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class StepProfiler:
    """PROFILE=1: torch.profiler trace of PROFILE_STEPS [START, END) to logs/{RUN_ID}_profile_rank{r}.json."""

    def __init__(self, rt):
        self.rt, self.prof = rt, None
        self.first, self.end = rt.h.profile_range if rt.h.profile else (0, 0)

    def before_step(self, step):  # step: 1-based, about to run
        if step == self.first:
            act = torch.profiler.ProfilerActivity
            acts = [act.CPU, act.CUDA] if self.rt.device.type == "cuda" else [act.CPU]
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True)
            self.prof.__enter__()

    def after_step(self, step):
        if step == self.end - 1:
            self.finish()

    def finish(self):
        if self.prof is None:
            return
        self.rt.sync()
        self.prof.__exit__(None, None, None)
        path = Path("logs") / f"{self.rt.h.run_id}_profile_rank{self.rt.h.rank}.json"
        path.parent.mkdir(exist_ok=True)
        self.prof.export_chrome_trace(str(path))
        self.prof = None
        self.rt.log(f"profile: steps {self.first}..{self.end - 1} written to {path}")


def train(rt, model, val_tokens, luts):
    """The record's training loop, then (QUANT=gptq) the Hessians from the next training batches.
    Returns (whether late QAT was switched on, Hessians or None)."""
    h = rt.h
    trainer = Trainer(rt, model)
    model.set_qat(h.qat_enabled)
    model.looping = h.num_loops > 0 and h.enable_looping_at == 0
    # rt.resume is set only with RESUME set (find_resume); tested first, so that a specialised file sees it
    resumed = load_checkpoint(rt) if h.resume and rt.resume is not None else None
    position = None if resumed is None else resumed[1]["loader"]
    stage("warmup (every training graph)")
    CONTEXT.enter("training", 0, 0.0)
    loader = warmup_and_restore(rt, trainer, position) if h.warmup_steps > 0 else make_train_loader(rt, position)
    try:
        stage("training")
        qat_on, train_ms = _train_loop(rt, trainer, loader, val_tokens, luts, resumed)
        if h.num_loops > 0 and not model.looping:
            model.looping = True
            rt.log(f"layer_loop:enabled after training (ENABLE_LOOPING_AT={h.enable_looping_at:g} not reached): "
                   "Hessians and evaluation run looped")
        if h.quant != "gptq":
            return qat_on, None
        stage("collecting GPTQ Hessians")
        t0 = time.perf_counter()
        hessians = collect_hessians(rt, model, make_calibration_loader(rt) if h.gptq_calibration_seqs else loader)
        ms = 1000.0 * (time.perf_counter() - t0)
        rt.log(f"gptq: hessians:{len(hessians)} batches:{h.gptq_calibration_batches}x{h.replay_world_size} "
               f"time:{ms:.0f}ms train+hessians:{train_ms + ms:.0f}ms" + (
                f" calibration:shuffled {h.gptq_calibration_seqs}x{h.train_seq_len}" if h.gptq_calibration_seqs else ""))
        if h.max_wallclock_seconds > 0 and train_ms + ms > 1000.0 * h.max_wallclock_seconds:
            rt.log(f"gptq: warning: training + Hessians exceed MAX_WALLCLOCK_SECONDS={h.max_wallclock_seconds:g}; "
                   "raise GPTQ_RESERVE_SECONDS or lower GPTQ_CALIBRATION_BATCHES")
        return qat_on, hessians
    finally:
        loader.shutdown()


def _train_loop(rt, trainer, loader, val_tokens, luts, resumed=None):
    h, model = rt.h, trainer.model
    averager = WeightAverager(h, model)
    timer = StepTimer(rt) if h.training_timing_breakdown else None
    profiler = StepProfiler(rt)
    sched = Schedule(h)  # every time-based decision; elapsed time agreed by all ranks after each step
    train_ms, step = 0.0, 0
    phases = h.seq_len_phases  # progressive context (TRAIN_SEQ_LEN_SCHEDULE)
    if trainer.split > 1 or h.micro_batch_split != 1:
        rt.log(f"micro_batch_split:{trainer.split} (" + (
            f"a packed row of {h.local_tokens} tokens in pieces of {-(-h.local_tokens // trainer.split)}"
            if h.train_loader == "packed"
            else f"{h.split_limit} rows a micro-batch, {h.split_limit // trainer.split} a piece")
            + f"{'; auto' if h.micro_batch_split == 0 else ''})")
    if h.replaying:  # a reproduction of another run: say how (recordlib reads this line)
        notes = ["every time-based decision reads the replayed time; train_time is the real time"] if h.clock else []
        if h.clock and h.clock.batch:
            notes.append(f"its tok/s lines read at {h.clock.batch[0]} tokens a step, {h.clock.batch[1]}")
        if h.virtual_ranks > 1:
            notes.append(f"virtual ranks: each rank computes the micro-batches of {h.virtual_ranks} ranks")
        rt.log(f"train_clock:{h.clock.name if h.clock else 'wall'} replay_world_size:{h.replay_world_size} "
               f"world_size:{h.world_size} grad_accum:{h.micro_steps} ({'; '.join(notes)})")
    if phases:
        rt.log(f"seq_len_schedule:{phases} rewarmup_steps:{h.seq_len_rewarmup_steps} seq_len:{phases[0][0]} step:0")
    ckpt = Checkpointer(rt) if h.checkpoint_every > 0 else None
    if ckpt is not None:
        shared, muon = checkpoint_payload_bytes(h)
        rt.log(f"checkpoints: every:{h.checkpoint_every} steps dir:{ckpt.folder} keep:{h.checkpoint_keep} "
               f"bytes:~{shared + muon * h.world_size} write:{'async' if ckpt.asynchronous else 'sync'}")
    if resumed is not None:  # everything the next step reads, as the checkpoint's step left it
        s = restore_training_state(resumed, trainer, averager)
        step, train_ms = s["step"], s["train_ms"]
        sched.restore(s)
        model.looping = sched.looping
        model.set_qat(sched.qat_on)
        if phases:
            loader.set_cut_len(sched.seq_len)
        rt.log(f"resumed_from:{rt.resume.path} step:{step} train_time:{train_ms:.0f}ms")
        if rt.resume.manifest.get("code_crc32") != code_crc():
            rt.log("resume_note: this train_gpt.py differs from the one that wrote the checkpoint (CRC-32); the "
                   "settings match, but a change in the code's math would make this run differ from an unbroken one")
    replayed = (lambda ms: "") if h.clock is None else (lambda ms: f" replayed_time:{ms:.0f}ms")
    meter = TrainMeter(rt, trainer, step, train_ms)
    trainer.data_wait_ms = 0.0
    wait_total, wait_max, wait_since_log, steps_since_log = 0.0, 0.0, 0.0, 0
    rt.sync()
    t0 = time.perf_counter()
    while True:
        last = sched.done(step)
        if last or (h.val_loss_every > 0 and step % h.val_loss_every == 0):
            rt.sync()
            train_ms += 1000.0 * (time.perf_counter() - t0)
            CONTEXT.enter("validation", step)
            with (timer or contextlib.nullcontext)("val"):
                val_loss, val_bpb = eval_val(rt, trainer.val_forward, val_tokens, luts)
            rt.log(f"step:{step}/{h.iterations} val_loss:{val_loss:.4f} val_bpb:{val_bpb:.4f} "
                   f"train_time:{train_ms:.0f}ms step_avg:{train_ms / max(step, 1):.2f}ms")
            rt.sync()
            t0 = time.perf_counter()
        if last:
            if sched.stop_after is not None and step < h.iterations:
                rt.log(f"stopping_early: wallclock_cap train_time:{train_ms:.0f}ms step:{step}/{h.iterations}"
                       + replayed(clock_ms(h, step, train_ms)))
            break
        for event, value in sched.before_step(step):
            if event == "layer_loop":
                model.looping = True
                encoder, decoder = model.orders[True]
                rt.log(f"layer_loop:enabled step:{step} frac:{value:.4f} encoder:{encoder} decoder:{decoder}")
            elif event == "seq_len":
                loader.set_cut_len(sched.seq_len)
                rt.log(f"seq_len:{sched.seq_len} step:{step} frac:{value:.4f}")
            else:
                model.set_qat(True)
                rt.log(f"late_qat:enabled step:{step} scale:{value:.4f}")
        profiler.before_step(step + 1)
        CONTEXT.enter("training", step, sched.progress)
        with compile_region("training"):
            train_loss = trainer.step(loader, sched.lr_scale, muon_momentum_at(h, step), timer)
        averager.update(step + 1, sched.scale)
        step += 1
        profiler.after_step(step)
        wait, trainer.data_wait_ms = trainer.data_wait_ms, 0.0
        wait_total, wait_max = wait_total + wait, max(wait_max, wait)
        wait_since_log, steps_since_log = wait_since_log + wait, steps_since_log + 1
        approx_ms = train_ms + 1000.0 * (time.perf_counter() - t0)
        schedule_ms = clock_ms(h, step, approx_ms)  # what the schedule reads: approx_ms, or the replayed time
        if _PREFLIGHT[0] is not None:
            _PREFLIGHT[0].training_step(model.looping, sched.seq_len, sched.qat_on, approx_ms)
        if h.train_log_every > 0 and (step <= 10 or step % h.train_log_every == 0 or sched.stop_after is not None):
            loss, fields = meter.fields(trainer, train_loss, step, approx_ms, sched.seq_len, model.looping)
            rt.log(f"step:{step}/{h.iterations} train_loss:{loss:.4f} train_time:{approx_ms:.0f}ms "
                   f"step_avg:{approx_ms / step:.2f}ms{fields} data_wait_ms:{wait_since_log / steps_since_log:.2f}"
                   + replayed(schedule_ms))
            wait_since_log, steps_since_log = 0.0, 0
        if timer is not None:
            timer.steps += 1
            if step <= 10 or step % h.training_timing_every == 0:
                rt.log(timer.pop_line(step))
        # One all-reduce (max over ranks): a non-finite loss on any rank stops the run, and the slowest clock is
        # everyone's elapsed time, so the cap, the LR schedule and the loop switch act at one step on all ranks.
        flags = torch.stack(((~torch.isfinite(train_loss.detach())).double(),
                             torch.tensor(schedule_ms, dtype=torch.float64, device=rt.device),
                             *(() if ckpt is None else (ckpt.pending_flag(),))))  # an asynchronous write's progress
        diverged, elapsed_ms, *writing = rt.all_reduce(flags, op=dist.ReduceOp.MAX).tolist()
        if diverged:
            raise RunError(f"training loss is not finite at step {step}; stopped, no artifact written (lower "
                           "MATRIX_LR, SCALAR_LR, TIED_EMBED_LR)")
        sched.after_step(step, elapsed_ms)
        if ckpt is not None:
            ckpt.poll(writing[0])
            if step % h.checkpoint_every == 0 and step < h.iterations and sched.stop_after is None:
                ckpt.save(step, *training_state(trainer, averager, loader, dict(
                    step=step, train_ms=train_ms + 1000.0 * (time.perf_counter() - t0), **sched.state())))
    if ckpt is not None:
        ckpt.wait()
    log_compile_region(rt, "training")
    profiler.finish()
    rt.log(f"data_wait: total_ms:{wait_total:.1f} mean_ms_per_step:{wait_total / max(step, 1):.3f} "
           f"max_step_ms:{wait_max:.3f}")
    if rt.device.type == "cuda":
        rt.log(f"peak memory allocated: {torch.cuda.max_memory_allocated() // 2**20} MiB "
               f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
    rt.log(f"final_weights:{averager.apply_final()}")
    return sched.qat_on, train_ms


# ==================================================
# ARTIFACT
# ==================================================

INT6_CLIP_QUANTILES = (0.999, 0.9995, 0.9999, 0.99999)  # plus the row max
INT8_CLIP_QUANTILE = 0.9999984
PASSTHROUGH_MAX_NUMEL = 65_536
PERGROUP_MODULES = {"brotli": "brotli", "zpaq": "zpaq"}  # COMPRESSOR=pergroup's modules -> their PyPI packages
COMPRESSOR_MODULES = {"lzma": {}, "brotli": {"brotli": "brotli"}, "pergroup": PERGROUP_MODULES}
BANK_SLOTS = {  # bank -> per-layer names of its [0, n) and [n, 2n) halves (SPEC 6)
    "qo_bank": (".attn.c_q.weight", ".attn.proj.weight"),
    "kv_bank": (".attn.c_k.weight", ".attn.c_v.weight"),
    "mlp_up_bank": (".mlp.fc.weight", None),
    "mlp_down_bank": (".mlp.proj.weight", None),
}


# zpaq 0.3.7 publishes wheels for glibc 2.34 or newer only (manylinux_2_34); elsewhere pip builds it from source.
ZPAQ_GLIBC = "zpaq's wheels need glibc 2.34 or newer; on older Linux pip builds it from source with a C++ compiler"


def import_error(module):
    """Why `module` does not import: None when it does, "" when it is not installed, else the first line of the
    error its import raises (installed but broken, e.g. a binary built for a newer glibc)."""
    if importlib.util.find_spec(module) is None:
        return ""
    try:
        importlib.import_module(module)
    except Exception as e:
        return f"{type(e).__name__}: {first_line(e)}"
    return None


def missing_modules(compressor):
    """The (module, PyPI package) pairs COMPRESSOR=`compressor` needs that this Python cannot import (not
    installed, or installed and failing to import)."""
    return [(m, p) for m, p in COMPRESSOR_MODULES.get(compressor, {}).items() if import_error(m) is not None]


def module_fix(module, package):
    """The one-line fix for a module missing_modules reports: `pip install PACKAGE`; for one installed whose import
    fails, a reinstall, with the import's error (and, for zpaq, the glibc its wheels need)."""
    why = import_error(module)
    if not why:
        return f"pip install {package}"
    note = f"; {ZPAQ_GLIBC}" if module == "zpaq" else ""
    return f"pip install --force-reinstall {package} (it is installed, but its import fails: {why}{note})"


def unbank_state_dict(sd, n):
    """Split the banks into per-layer 2-D matrices named like an unbanked model's."""
    out = {}
    for name, t in sd.items():
        if name not in BANK_SLOTS:
            out[name] = t
            continue
        first, second = BANK_SLOTS[name]
        for i in range(n):
            out[f"blocks.{i}{first}"] = t[i]
            if second is not None:
                out[f"blocks.{i}{second}"] = t[n + i]
    return out


def rebank_state_dict(flat, n):
    """Inverse of unbank_state_dict."""
    out, used = {}, set()
    for name, (first, second) in BANK_SLOTS.items():
        keys = [f"blocks.{i}{part}" for part in (first, second) if part is not None for i in range(n)]
        out[name] = torch.stack([flat[k] for k in keys])
        used.update(keys)
    out.update({k: v for k, v in flat.items() if k not in used})
    return out


class HessianRecorder:
    """Sums X^T X (fp64) of the input of every matrix that goes through `linear` (the bank slices and the tied
    head, whose input is the final RMSNorm output), named as in the artifact: unbank_state_dict's views share
    the parameters' storage, so a weight's data pointer names it."""

    def __init__(self, model):
        flat = unbank_state_dict(artifact_state_dict(model), model.num_layers)
        self.names = {t.data_ptr(): name for name, t in flat.items() if t.ndim == 2}
        self.sums, self.rows, self.last = {}, {}, (None, None)

    def add(self, x, w):
        name = self.names.get(w.data_ptr())
        if name is None:
            return
        if self.last[0] is not x:  # c_q, c_k and c_v share one input: one product
            x2 = x.detach().reshape(-1, x.size(-1)).float()
            # In fp32 even under bf16 autocast: a bf16-rounded X^T X is not positive definite.
            with torch.autocast(device_type=x.device.type, enabled=False):
                self.last = (x, (x2.T @ x2).double())
        if name in self.sums:
            self.sums[name] += self.last[1]
        else:
            self.sums[name] = self.last[1].clone()
        self.rows[name] = self.rows.get(name, 0) + x.numel() // x.size(-1)


class Hessians(dict):
    """name -> H (collect_hessians), with .rows: name -> input rows per calibration batch (a looped layer counts
    each pass), so that AWQ-lite reads the activation RMS as sqrt(diag(H) / rows)."""

    def __init__(self, items, rows):
        super().__init__(items)
        self.rows = rows


@torch.no_grad()
def collect_hessians(rt, model, loader):
    """GPTQ calibration on the final weights: H = sum of X^T X over GPTQ_CALIBRATION_BATCHES training micro-batches
    per rank, summed over ranks in fp64 (so 2 ranks give what 1 rank gives on the same batches), / batch count."""
    h, rec = rt.h, HessianRecorder(model)
    CONTEXT.enter("calibration")
    model.eval()
    _RECORDER[0] = rec
    try:
        for _ in range(h.gptq_calibration_batches * h.virtual_ranks):  # each virtual rank's, as many
            x, _, *docs = loader.next_batch()
            with rt.autocast():
                model.forward_logits(x, *docs)
    finally:
        _RECORDER[0] = None
        model.train()
    names = sorted(rec.sums)
    flat = rt.all_reduce(torch.cat([rec.sums[k].reshape(-1) for k in names]))
    count = h.gptq_calibration_batches * h.replay_world_size
    parts = flat.div_(count).float().split([rec.sums[k].numel() for k in names])
    rows = {k: rec.rows[k] * h.world_size / count for k in names}  # equal on every rank: same batch shapes
    return Hessians({k: p.view_as(rec.sums[k]) for k, p in zip(names, parts)}, rows)


def int6_candidate_scales(t32):
    """The record's GPTQ-lite clips: four row quantiles of |w| and the row max, as fp16 int6 scales (>= 1/31)."""
    absw = t32.abs()
    for clip in [torch.quantile(absw, q, dim=1) for q in INT6_CLIP_QUANTILES] + [absw.amax(dim=1)]:
        yield (clip / 31.0).clamp_min(1.0 / 31.0).to(torch.float16)


def sdclip_scales(t32, sigmas, q_max):
    """SDClip (SPEC-FRONTIER 11, record 04-05): s_i = k * std(W_i) / q_max, unbiased row std, fp16; floored at
    fp16's smallest normal so an all-zero row gets codes 0, not NaN."""
    return (sigmas * t32.std(dim=1) / q_max).clamp_min(2.0 ** -14).to(torch.float16)


def gptq_codes(w, hessian, s, q_max, hi=None):
    """Full-Hessian GPTQ (SPEC-FRONTIER 11) with fixed row scales s, on the Hessian's device: dead columns
    (H_jj = 0) zeroed, 1% damping, columns in descending diag(H) order (act-order), each rounded and its error
    spread over the columns after it through U, the upper Cholesky factor of H^-1, in blocks of 128.
    Rows are independent, so several scale candidates run as one taller W. Codes return in the original order.
    hi = (column mask, row scales, q_hi): AWQ-lite's columns, rounded to [-q_hi, q_hi] with those scales inside
    the same solve (their error propagates like any other)."""
    dev = hessian.device
    W, H = w.detach().float().to(dev).clone(), hessian.detach().double().clone()
    dead = (H.diagonal() == 0).nonzero().squeeze(1)
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(0.01 * H.diagonal().mean())
    perm = torch.argsort(H.diagonal(), descending=True, stable=True)
    H = H[perm][:, perm]
    L, info = torch.linalg.cholesky_ex(H)
    if info.item() != 0:
        raise RunError(f"GPTQ: a {tuple(H.shape)} Hessian is not positive definite after 1% damping")
    U = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).float()
    W, s = W[:, perm], s.float().to(dev)
    Q = torch.empty_like(W)
    if hi is not None:
        hi = (hi[0][perm.cpu()].tolist(), hi[1].float().to(dev), hi[2])
    # Thousands of tiny ops: on a busy 2-core CPU one thread took 1.9 s for a 512x1536 matrix, two took 15 s.
    with one_torch_thread() if dev.type == "cpu" else contextlib.nullcontext():
        _gptq_columns(W, U, s, Q, q_max, hi)
    return Q[:, torch.argsort(perm)].to(torch.int8).cpu()


def _gptq_columns(W, U, s, Q, q_max, hi=None):
    inv_d = 1.0 / U.diagonal()
    for a in range(0, W.size(1), 128):
        b = min(a + 128, W.size(1))
        Wb, E = W[:, a:b], torch.empty_like(W[:, a:b])
        for j in range(b - a):
            sc, qm = (hi[1], hi[2]) if hi is not None and hi[0][a + j] else (s, q_max)
            q = torch.clamp(torch.round(Wb[:, j] / sc), -qm, qm)
            Q[:, a + j] = q
            E[:, j] = (Wb[:, j] - q * sc) * inv_d[a + j]
            Wb[:, j + 1:].sub_(torch.outer(E[:, j], U[a + j, a + j + 1:b]))
        W[:, b:] -= E @ U[a:b, b:]


def quantize_rows(t, q_max, scales, hessian=None, awq=None):
    """Codes and fp16 row scales: of the candidate `scales`, the one whose reconstruction has the lowest MSE;
    codes by GPTQ when a Hessian is given (all candidates in one pass), else rounded to nearest.
    awq = (column mask, q_hi, SDClip k), with a Hessian: AWQ-lite, those columns rounded to q_hi in the same GPTQ
    solve with the scales awq_scales(...); then returns (codes, scale, that column scale)."""
    t32, scales = t.float(), list(scales)
    his = None if awq is None else [awq_scales(t32, s, q_max, awq[1], awq[2]) for s in scales]
    if hessian is not None:
        stacked = torch.cat([s.float() for s in scales])
        hi = None if awq is None else (awq[0], torch.cat(his), awq[1])
        codes = gptq_codes(t32.repeat(len(scales), 1), hessian, stacked, q_max, hi).float().split(t32.size(0))
    best = None
    for i, scale in enumerate(scales):
        s = scale.float()
        q = torch.clamp(torch.round(t32 / s[:, None]), -q_max, q_max) if hessian is None else codes[i]
        s_hi = None if awq is None else his[i]
        deq = q * s[:, None]
        if s_hi is not None:
            deq[:, awq[0]] = q[:, awq[0]] * s_hi.float()[:, None]
        err = (t32 - deq).pow(2).mean().item()
        if best is None or err < best[0]:
            best = (err, q.to(torch.int8), scale, s_hi)
    return best[1:] if awq is not None else best[1:3]


def quantize_int6_rows(t):
    """The record's GPTQ-lite: per-row int6 in [-31, 31], the clip candidate with the lowest MSE."""
    return quantize_rows(t, 31, int6_candidate_scales(t.float()))


def int8_clip(t32):
    return torch.quantile(t32.abs(), INT8_CLIP_QUANTILE, dim=1)


def quantize_int8_rows(t, q_max=127):
    """The record's embedding quantiser: rows clipped at a high quantile of |w|, fp16 scales."""
    t32 = t.float()
    clip = int8_clip(t32)
    scale = (clip / q_max).clamp_min(1.0 / q_max)
    clipped = torch.maximum(torch.minimum(t32, clip[:, None]), -clip[:, None])
    q = torch.clamp(torch.round(clipped / scale[:, None]), -q_max, q_max).to(torch.int8)
    return q, scale.to(torch.float16)


def clip_sigmas_for(name, h):
    """Per-class SDClip k (SPEC-FRONTIER 11, records 04-14 on; class by name): `.mlp.` -> MLP_CLIP_SIGMAS,
    `.attn.` -> ATTN_CLIP_SIGMAS (0: MATRIX_CLIP_SIGMAS for both), anything else (tok_emb, the other embedding
    tables) -> EMBED_CLIP_SIGMAS. 0 overall: the record's clip candidates / row quantile."""
    if ".mlp." in name:
        return h.mlp_clip_sigmas or h.matrix_clip_sigmas
    if ".attn." in name:
        return h.attn_clip_sigmas or h.matrix_clip_sigmas
    return h.embed_clip_sigmas


def is_quant_gate(name, t):
    """QUANT_GATE's tensors (SPEC-FRONTIER 8, records 04-19/04-23): a floating 2-D attention gate (ours
    `*.attn.attn_gate.weight`, the records' `*attn_gate_w`) with 32 to 8,192 entries (the dense 8x512 and the
    sparse 8x12 gates); smaller gates stay fp16."""
    return (name.endswith((".attn_gate.weight", "attn_gate_w")) and t.is_floating_point() and t.ndim == 2
            and 32 <= t.numel() <= 8192)


def quantize_gate_rows(t):
    """Quant gate (SPEC-FRONTIER 8): int8 per row (per head), s_h = max|W_h|/127 in fp16 (floored at fp16's
    smallest subnormal, so a zero row gets codes 0), q = clamp(round(W/s), +-127)."""
    t32 = t.float()
    s = (t32.abs().amax(dim=1) / 127.0).clamp_min(2.0 ** -24).to(torch.float16)
    return torch.clamp(torch.round(t32 / s.float()[:, None]), -127, 127).to(torch.int8), s


def awq_scales(t32, s, q_max, q_hi, sigmas):
    """AWQ-lite's row scales for its promoted columns (#1945, #2014; SPEC-FRONTIER 19): the same clip range at q_hi
    levels, rounded to fp16 once. With SDClip (sigmas = k > 0) the record's fp16(k * std(W_i) / q_hi), i.e.
    sdclip_scales at q_hi (#2014's gptq_quantize_weight; its floor is 1e-10, ours fp16's smallest normal), not
    the base scale s rescaled, fp16(fp16(k * std / q_max) * q_max / q_hi), which is one fp16 step off in about a
    quarter of the rows. With clip candidates (sigmas 0, which no record combines with AWQ-lite) s * q_max / q_hi."""
    if sigmas > 0:
        return sdclip_scales(t32, sigmas, q_hi)
    return (s.float() * q_max / q_hi).to(torch.float16)


def awq_lite_groups(flat, hessians, h):
    """AWQ-lite (#1945, SPEC-FRONTIER 19): over every tensor GPTQ quantises at fewer than AWQ_LITE_BITS bits,
    the saliency of column j is act_rms_j * mean_i |W_ij| (act_rms_j = sqrt(H_jj / input rows per calibration
    batch)), summed over groups of AWQ_LITE_GROUP columns; the AWQ_LITE_TOP_K highest groups of all tensors
    are promoted. Returns {name: [first column of each promoted group]}."""
    cands, rows = [], getattr(hessians, "rows", {})
    for name, t in flat.items():
        H = hessians.get(name)
        if H is None or not t.is_floating_point() or t.ndim != 2 or t.numel() <= PASSTHROUGH_MAX_NUMEL:
            continue
        bits = 6 if (".attn." in name or ".mlp." in name) else h.embed_bits
        if bits >= h.awq_lite_bits:
            continue
        act_rms = (H.diagonal().double() / rows.get(name, 1)).sqrt()
        saliency = act_rms * t.detach().cpu().double().abs().mean(dim=0)
        for start in range(0, t.size(1) - h.awq_lite_group + 1, h.awq_lite_group):
            cands.append((float(saliency[start:start + h.awq_lite_group].sum()), name, start))
    cands.sort(key=lambda c: -c[0])
    picked = {}
    for _, name, start in cands[:h.awq_lite_top_k]:
        picked.setdefault(name, []).append(start)
    return {name: sorted(starts) for name, starts in picked.items()}


def lqer_pack(A, B, group, bits):
    """LQER factor packing (SPEC-FRONTIER 11, NEWEST's asymmetric mode): A (rows x r) -> codes {-2,-1,0,1} with
    one fp16 scale max|A|/1.5; B (r x cols) flattened in groups of `group` -> codes [-2^(b-1), 2^(b-1)-1]
    with an fp16 scale max|B_g|/(2^(b-1) - 0.5) per group (b = 4: [-8, 7], /7.5). If B's size is not a
    multiple of `group`: both factors symmetric b-bit per row, s = max|row|/(2^(b-1) - 1).
    Returns (qA, sA, qB, sB, "asym" | "sym"), codes in int8 containers."""
    half = 2 ** (bits - 1)
    if B.numel() % group == 0:
        sA = (A.abs().amax().clamp_min(1e-10) / 1.5).to(torch.float16)
        qA = torch.clamp(torch.round(A / sA.float()), -2, 1).to(torch.int8)
        Bg = B.reshape(-1, group)
        sB = (Bg.abs().amax(dim=1).clamp_min(1e-10) / (half - 0.5)).to(torch.float16)
        qB = torch.clamp(torch.round(Bg / sB.float()[:, None]), -half, half - 1).to(torch.int8).reshape(B.shape)
        return qA, sA, qB, sB, "asym"
    sA, sB = ((m.abs().amax(dim=1).clamp_min(1e-10) / (half - 1)).to(torch.float16) for m in (A, B))
    qA, qB = (torch.clamp(torch.round(m / sc.float()[:, None]), 1 - half, half - 1).to(torch.int8)
              for m, sc in ((A, sA), (B, sB)))
    return qA, sA, qB, sB, "sym"


def lqer_unpack(w, name, kind):
    """Â·B̂, the correction lqer_pack stored under name.lqA/.lqAs/.lqB/.lqBs."""
    qA, sA, qB, sB = (w[name + k].float() for k in (".lqA", ".lqAs", ".lqB", ".lqBs"))
    if kind == "asym":
        return (qA * sA) @ (qB.reshape(sB.numel(), -1) * sB[:, None]).reshape(qB.shape)
    return (qA * sA[:, None]) @ (qB * sB[:, None])


def lqer_corrections(flat, w, meta, h):
    """LQER (SPEC-FRONTIER 11/18, NEWEST): E = W - Ŵ for every quantised matrix (quant gates excepted); the
    LQER_TOP_K with the largest ||E||_F get a rank-LQER_RANK correction from the fp32 SVD E ~ U S V^T,
    A = U_r S_r, B = V_r^T, packed by lqer_pack. Returns the names corrected, largest error first."""
    errs = []
    for name, info in meta.items():
        if not isinstance(info, str) and info["type"] != "gate_int8":
            errs.append((float((flat[name].detach().cpu().float() - dequantize_entry(w, name, info)).norm()), name))
    errs.sort(key=lambda e: -e[0])
    top = [name for _, name in errs[:h.lqer_top_k]]
    for name in top:
        E = flat[name].detach().cpu().float() - dequantize_entry(w, name, meta[name])
        U, S, Vh = torch.linalg.svd(E, full_matrices=False)
        r = min(h.lqer_rank, S.numel())
        qA, sA, qB, sB, kind = lqer_pack(U[:, :r] * S[:r], Vh[:r], h.lqer_group, h.lqer_factor_bits)
        w[name + ".lqA"], w[name + ".lqAs"], w[name + ".lqB"], w[name + ".lqBs"] = qA, sA, qB, sB
        meta[name]["lqer"] = kind
    return top


def quantize_state_dict(flat, h=None, hessians=None, storage=None):
    """SPEC 6: small floats as fp16, attention/MLP matrices int6, other large matrices int8 (EMBED_BITS); storage
    ({name: "fp16" | "fp32" | "int6" | "int8"}, a piece's `artifact_storage`, artifact_storage()) overrides that rule.
    Beyond the record: QUANT=gptq rounds tensors with a Hessian by GPTQ; *_CLIP_SIGMAS > 0 pick scales by SDClip
    (per class: clip_sigmas_for); QUANT_GATE=1 stores gate tensors int8 per row; AWQ_LITE=1 promotes the most
    salient column groups; LQER_RANK > 0 adds low-rank corrections of the worst tensors."""
    h, hessians, storage = h or Hyperparameters({}), hessians or {}, storage or {}
    promoted = awq_lite_groups(flat, hessians, h) if h.awq_lite else {}
    q_hi = 2 ** (h.awq_lite_bits - 1) - 1
    w, meta = {}, {}
    for name, t in flat.items():
        t = t.detach().cpu().contiguous()  # on CPU: the same codes whatever the run's device
        if not t.is_floating_point():
            w[name], meta[name] = t, "passthrough"
            continue
        if h.quant_gate and is_quant_gate(name, t):
            w[name + ".q"], w[name + ".scale"] = quantize_gate_rows(t)
            meta[name] = {"type": "gate_int8"}
            continue
        store = storage.get(name)
        if store in ("fp16", "fp32") or store is None and (t.numel() <= PASSTHROUGH_MAX_NUMEL or t.ndim != 2):
            w[name], meta[name] = t.to(torch.float32 if store == "fp32" else torch.float16), "passthrough"
            continue
        t32, H, sigmas = t.float(), hessians.get(name), clip_sigmas_for(name, h)
        awq = None
        if name in promoted:
            mask = torch.zeros(t.size(1), dtype=torch.bool)
            for start in promoted[name]:
                mask[start:start + h.awq_lite_group] = True
            awq = (mask, q_hi, sigmas)
        if store == "int6" or store is None and (".attn." in name or ".mlp." in name):
            kind = "int6"
            scales = [sdclip_scales(t32, sigmas, 31)] if sigmas > 0 else int6_candidate_scales(t32)
            q, s, *s_hi = quantize_rows(t32, 31, scales, H, awq)
        else:
            # one str object per kind: pickle stores repeats as references, so the bytes stay the record's
            bits = 8 if store == "int8" else h.embed_bits
            kind, e_max = sys.intern(f"int{bits}"), 2 ** (bits - 1) - 1
            if H is None and sigmas == 0:
                q, s = quantize_int8_rows(t32, e_max)
            else:
                scale = sdclip_scales(t32, sigmas, e_max) if sigmas > 0 else (
                    (int8_clip(t32) / e_max).clamp_min(1.0 / e_max).to(torch.float16))
                q, s, *s_hi = quantize_rows(t32, e_max, [scale], H, awq)
        w[name + ".q"], w[name + ".scale"], meta[name] = q, s, {"type": kind}
        if awq is not None:
            w[name + ".awq_start"] = torch.tensor(promoted[name], dtype=torch.int32)
            w[name + ".awq_scale"] = s_hi[0]
            meta[name]["awq"] = h.awq_lite_group
    if h.lqer_rank > 0:
        lqer_corrections(flat, w, meta, h)
    return w, meta


def prune_ones(w, meta, fits):
    """TARGET_BYTES (record 03-25's selective pruning): zero the k codes of +-1 whose loss costs least (the row
    scale squared, its squared error), k the smallest count for which fits(w) holds, by doubling then bisection
    (size taken as falling with k). Returns (w, k, the blob of the last fitting probe)."""
    blob = fits(w)
    if blob is not None:  # already fits: nothing to rank
        return w, 0, blob
    names = [n for n, m in meta.items() if not isinstance(m, str)]
    if not names:
        raise RunError("TARGET_BYTES cannot be met: no quantised matrix has +-1 codes to zero")
    costs, where = [], []
    for i, n in enumerate(names):
        q, s = w[n + ".q"], w[n + ".scale"].float()
        idx = (q.abs() == 1).reshape(-1).nonzero().squeeze(1)
        costs.append(s.repeat_interleave(q[0].numel())[idx].double() ** 2)
        where.append(torch.stack((torch.full_like(idx, i), idx), 1))
    order = torch.argsort(torch.cat(costs), stable=True)
    where = torch.cat(where)[order]

    def pruned(k):
        out = dict(w)
        for i, n in enumerate(names):
            hit = where[:k][where[:k, 0] == i, 1]
            if hit.numel():
                q = w[n + ".q"].clone()
                q.view(-1)[hit] = 0
                out[n + ".q"] = q
        return out

    lo, hi = 0, 1
    while (blob := fits(pruned(hi))) is None:
        if hi >= len(where):
            raise RunError(f"TARGET_BYTES cannot be met: zeroing all {len(where)} +-1 codes is not enough")
        lo, hi = hi, min(2 * hi, len(where))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = fits(pruned(mid))
        lo, hi, blob = (lo, mid, got) if got is not None else (mid, hi, blob)
    return pruned(hi), hi, blob


def dequantize_state_dict(w, meta, template, source):
    missing, extra = [k for k in template if k not in meta], [k for k in meta if k not in template]
    if missing or extra:
        raise ConfigError(f"{source}: artifact was built with other model settings: {len(extra)} extra entries "
                          f"(e.g. {extra[:2]}), {len(missing)} missing (e.g. {missing[:2]}); it has "
                          f"{count_blocks(meta)} blocks, NUM_LAYERS={count_blocks(template)}")
    out = {}
    for name, ref in template.items():  # every name has its entry (missing ones are refused above)
        info = meta[name]
        t = w[name] if isinstance(info, str) else dequantize_entry(w, name, info)
        if tuple(t.shape) != tuple(ref.shape):
            raise ConfigError(f"{source}: {name} has shape {tuple(t.shape)}, the model expects {tuple(ref.shape)}")
        out[name] = t.to(ref.dtype)
    return out


def dequantize_entry(w, name, info):
    """One quantised tensor in fp32: q*s per row, AWQ-lite's promoted columns q*s_hi, plus LQER's correction."""
    q, s = w[name + ".q"], w[name + ".scale"]
    t = q.float() * (s.float().view(-1, *([1] * (q.ndim - 1))) if s.ndim > 0 else s.float())
    if "awq" in info:
        for start in w[name + ".awq_start"].tolist():
            cols = slice(start, start + info["awq"])
            t[:, cols] = q[:, cols].float() * w[name + ".awq_scale"].float()[:, None]
    if "lqer" in info:
        t = t + lqer_unpack(w, name, info["lqer"])
    return t


def count_blocks(keys):
    return len({int(k.split(".")[1]) for k in keys if k.startswith("blocks.")})


def write_atomically(path, data):
    """Write to path.tmp, then rename: a failed write (disk full) never leaves a partial file."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def byte_shuffle(blob, stride=2):
    """SPEC-FRONTIER 12: header b"BSHF" + stride byte, then the bytes at offsets = 0, 1, .. (mod stride) in turn,
    so the high and low bytes of fp16/int8 pairs sit apart and compress better."""
    a = np.frombuffer(blob, dtype=np.uint8)
    return b"BSHF" + bytes([stride]) + b"".join(a[i::stride].tobytes() for i in range(stride))


def byte_unshuffle(data):
    stride, body = data[4], np.frombuffer(data, dtype=np.uint8, offset=5)
    out, start = np.empty_like(body), 0
    for i in range(stride):
        n = len(range(i, body.size, stride))
        out[i::stride] = body[start:start + n]
        start += n
    return out.tobytes()


def compress(blob, compressor):
    """COMPRESSOR: lzma preset 6 (the record), or byte shuffle + brotli quality 11."""
    if compressor == "brotli":
        import brotli
        return brotli.compress(byte_shuffle(blob), quality=11)
    return lzma.compress(blob, preset=6)


def decompress(data, path):
    """Either format, told apart by the xz magic bytes."""
    if data.startswith(b"\xfd7zXZ\x00"):
        try:
            return lzma.decompress(data)
        except lzma.LZMAError as e:
            raise ConfigError(f"{path}: corrupt lzma artifact ({e})") from None
    try:
        import brotli
    except ImportError:
        raise ConfigError(f"{path}: not an lzma artifact; brotli artifacts need `pip install brotli`") from None
    try:
        data = brotli.decompress(data)
    except brotli.error:
        raise ConfigError(f"{path}: neither an lzma nor a brotli artifact") from None
    return byte_unshuffle(data) if data[:4] == b"BSHF" and len(data) > 4 else data


PERGROUP_ROLES = ("tok_emb.weight", "attn.c_k.weight", "attn.c_q.weight", "attn.c_v.weight", "attn.proj.weight",
                  "mlp.fc.weight", "mlp.proj.weight")  # SPEC-FRONTIER 12: the groups, in stream order
PERGROUP_SORTED = ("tok_emb.weight", "attn.c_q.weight", "mlp.fc.weight")  # rows reordered by similarity
PERGROUP_MAGIC = b"PGRP"
PERGROUP_ZPAQ_LEVEL = 5  # the groups' ZPAQ level by default (PERGROUP_LEVEL): the one that matches the records' lrzip


def similarity_order(codes, metric="l2"):
    """SPEC-FRONTIER 12/18's row order: a greedy chain from row 0, each step to the unused row nearest to the
    current one (the lowest index on ties). metric "l1" is the records' distance; "l2" (squared Euclidean,
    what COMPRESSOR=pergroup uses) comes from one matrix product, |b|^2 - 2 a.b (one addmm: one pass over the
    n x n matrix), so 8192 rows take a fraction of a second where L1 (torch.cdist) takes half a minute. Both
    are exact: integer sums in fp32 while below 2^24 (int7 codes at 512 columns), else in fp64.
    Instead of the records' n steps over all rows in Python, each step is one argmin over a row of the
    distance matrix. Returns the order as uint16 (row i of the sorted matrix is codes[order[i]])."""
    x = torch.tensor(codes).float()
    n, top = x.size(0), float(x.abs().max()) if x.numel() else 0.0
    if n > 65536:
        raise RunError(f"similarity_order: {n} rows do not fit uint16 row indices")
    if 3 * x.size(1) * top * top >= 2 ** 24:
        x = x.double()
    if metric == "l1":
        d = torch.empty(n, n)
        for a in range(0, n, 1024):
            d[a:a + 1024] = torch.cdist(x[a:a + 1024], x, p=1)
    else:
        d = x.pow(2).sum(1).addmm(x, x.T, alpha=-2.0)  # |a - b|^2 - |a|^2 (each row's argmin), in one pass
    d = d.numpy()
    used = np.zeros(n, dtype=d.dtype)
    order, cur = np.zeros(n, dtype=np.int64), 0
    for i in range(1, n):
        used[cur] = np.inf
        cur = int(np.argmin(d[cur] + used))
        order[i] = cur
    return order.astype(np.uint16)


def pergroup_layout(w):
    """SPEC-FRONTIER 12/18's layout: the int8 code tensors of each role, layers in index order, each row-sorted
    (PERGROUP_SORTED) and written column-major, concatenated into one raw group blob per role.
    Returns ({role: blob}, the uint16 permutations concatenated, the other entries of w, {role: [(name, shape)]})."""
    members = {role: [] for role in PERGROUP_ROLES}
    rest = {}
    for name, t in w.items():
        base = name[:-2] if name.endswith(".q") else ""
        parts = base.split(".")
        role = ".".join(parts[2:]) if parts[0] == "blocks" and len(parts) > 2 and parts[1].isdigit() else base
        if t.dtype == torch.int8 and t.ndim == 2 and role in members:
            members[role].append((int(parts[1]) if role != base else 0, name))
        else:
            rest[name] = t
    blobs, perms, layout = {}, [], {}
    for role, found in members.items():
        chunks = []
        for _, name in sorted(found):
            a = w[name].numpy()
            if role in PERGROUP_SORTED:
                order = similarity_order(a)
                perms.append(order.tobytes())
                a = a[order.astype(np.int64)]
            chunks.append(np.ascontiguousarray(a.T).tobytes())
        blobs[role] = b"".join(chunks)
        layout[role] = [(name, tuple(w[name].shape)) for _, name in sorted(found)]
    return blobs, b"".join(perms), rest, layout


def pergroup_codec_compress(data, level):
    """COMPRESSOR=pergroup's back end for the group blobs: ZPAQ at `level` (PERGROUP_LEVEL, 5 by default) from
    PyPI's `zpaq` (libzpaq in-process), one thread so the bytes do not depend on the machine. Level 5 was chosen by
    scripts/bench/bench_pergroup.py (docs/artifact.md, "The 2026-04-27 artifact"): within 0.1% of the records'
    `lrzip -z -L 9` on the same groups, 1.3% below brotli and 2.3% below level 4."""
    import zpaq
    return zpaq.compress(data, level, threads=1) if data else b""


def pergroup_codec_decompress(data):
    import zpaq
    return zpaq.decompress(data) if data else b""


def pergroup_codec_map(fn, streams, workers=None):
    """fn (ZPAQ compress or decompress) over the group streams, up to `workers` at once (default: torch's thread
    count): libzpaq releases the GIL, so threads run the groups in parallel; each stream is still one ZPAQ call
    in one thread, so the bytes are those of the one-by-one loop on any machine. The largest group (an MLP matrix
    group) bounds the time."""
    workers = max(1, min(len(streams), workers or torch.get_num_threads()))
    if workers == 1:
        return [fn(x) for x in streams]
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="pergroup") as pool:
        return list(pool.map(fn, streams))


def pack_streams(streams):
    """The per-group container (SPEC-FRONTIER 12): b"PGRP", uint32 stream count, uint32 lengths, then (beyond
    the record's) uint32 CRC-32 of each stream, so that any damaged byte is found before decoding; the streams."""
    head = [len(streams), *map(len, streams), *map(zlib.crc32, streams)]
    return PERGROUP_MAGIC + np.array(head, dtype="<u4").tobytes() + b"".join(streams)


def unpack_streams(data, path):
    """The streams of pack_streams' container; a wrong count, length or checksum is a one-line ConfigError."""
    n = len(PERGROUP_ROLES) + 2
    if len(data) < 8 + 8 * n or int(np.frombuffer(data, dtype="<u4", count=1, offset=4)[0]) != n:
        raise ConfigError(f"{path}: corrupt per-group artifact (header is not {n} streams)")
    head = np.frombuffer(data, dtype="<u4", count=2 * n, offset=8).tolist()
    lengths, crcs = head[:n], head[n:]
    if 8 + 8 * n + sum(lengths) != len(data):
        raise ConfigError(f"{path}: corrupt per-group artifact (stream lengths {sum(lengths)} do not match the "
                          f"{len(data)}-byte file)")
    out, at = [], 8 + 8 * n
    for i, (length, crc) in enumerate(zip(lengths, crcs)):
        out.append(data[at:at + length])
        at += length
        if zlib.crc32(out[-1]) != crc:
            raise ConfigError(f"{path}: corrupt per-group artifact (stream {i} fails its CRC-32)")
    return out


def pergroup_serialize(obj, workers=None, level=PERGROUP_ZPAQ_LEVEL):
    """COMPRESSOR=pergroup: one stream per group blob (pergroup_layout) through pergroup_codec_compress at ZPAQ
    `level` (the groups in parallel: pergroup_codec_map), then the rest (scales, passthrough, LQER/AWQ entries, meta,
    layout) as torch.save + brotli q11 lgwin 24, then the permutations (brotli q11), in pack_streams' container."""
    import brotli
    blobs, perms, rest, layout = pergroup_layout(obj["w"])
    buf = io.BytesIO()
    torch.save({**obj, "w": rest, "layout": layout}, buf)
    streams = pergroup_codec_map(lambda blob: pergroup_codec_compress(blob, level),
                                 [blobs[role] for role in PERGROUP_ROLES], workers)
    streams += [brotli.compress(buf.getvalue(), quality=11, lgwin=24), brotli.compress(perms, quality=11)]
    return pack_streams(streams)


def pergroup_deserialize(data, path, workers=None):
    """Inverse of pergroup_serialize (the groups decoded in parallel too): the artifact's dict ({"w", "m",
    "late_qat"}); any damage is one line."""
    for module, package in missing_modules("pergroup"):
        raise ConfigError(f"{path}: per-group artifacts need the {module} module: {module_fix(module, package)}")
    import brotli
    streams = unpack_streams(data, path)
    try:
        rest = torch.load(io.BytesIO(brotli.decompress(streams[-2])), map_location="cpu")
        perms = np.frombuffer(brotli.decompress(streams[-1]), dtype=np.uint16)
        blobs = [np.frombuffer(b, dtype=np.int8)
                 for b in pergroup_codec_map(pergroup_codec_decompress, streams[:-2], workers)]
    except Exception as e:  # any codec or unpickling error: the file is damaged
        raise ConfigError(f"{path}: corrupt per-group artifact ({type(e).__name__}: {first_line(e)})") from None
    w, layout, p_at = dict(rest["w"]), rest.pop("layout"), 0
    for role, blob in zip(PERGROUP_ROLES, blobs):
        at = 0
        for name, (rows, cols) in layout[role]:
            if at + rows * cols > blob.size or (role in PERGROUP_SORTED and p_at + rows > perms.size):
                raise ConfigError(f"{path}: corrupt per-group artifact (group {role} is short)")
            a = blob[at:at + rows * cols].reshape(cols, rows).T
            at += rows * cols
            if role in PERGROUP_SORTED:
                inverse = np.empty(rows, dtype=np.int64)
                inverse[perms[p_at:p_at + rows].astype(np.int64)] = np.arange(rows)
                a, p_at = a[inverse], p_at + rows
            w[name] = torch.from_numpy(np.ascontiguousarray(a))
        if at != blob.size:
            raise ConfigError(f"{path}: corrupt per-group artifact (group {role} has {blob.size - at} extra bytes)")
    return {**rest, "w": w}


def serialize(w, meta, late_qat, h):
    """The artifact's bytes by h's COMPRESSOR (and PERGROUP_LEVEL). Stores `late_qat` too (the run's TTT trains with
    it, so EVAL_ONLY must)."""
    if h.compressor == "pergroup":
        return pergroup_serialize({"w": w, "m": meta, "late_qat": late_qat}, level=h.pergroup_level)
    buf = io.BytesIO()
    torch.save({"w": w, "m": meta, "late_qat": late_qat}, buf)
    return compress(buf.getvalue(), h.compressor)


def save_artifact(path, model, late_qat, h=None, hessians=None, code_bytes=0, log=print):
    """Quantise, compress (with TARGET_BYTES, prune to fit), write; returns the size."""
    h = h or Hyperparameters({})
    t0 = time.perf_counter()
    w, meta = quantize_state_dict(unbank_state_dict(artifact_state_dict(model), model.num_layers), h, hessians,
                                  artifact_storage(model))
    log("artifact_pieces: " + " ".join(f"{k}:{v}" for k, v in piece_bytes(w).items()))
    if hessians:
        log(f"gptq: {sum(not isinstance(meta[k], str) for k in hessians)} of {len(hessians)} tensors with a Hessian "
            f"quantised by GPTQ (the rest are small: fp16) "
            f"(scales: {'SDClip' if h.matrix_clip_sigmas > 0 else 'clip candidates'}) "
            f"time:{1000.0 * (time.perf_counter() - t0):.0f}ms")
    for line in quantiser_notes(meta, h):
        log(line)
    if h.target_bytes > 0:
        room = h.target_bytes - code_bytes

        def fits(ws):
            blob = serialize(ws, meta, late_qat, h)
            return blob if len(blob) <= room else None
        w, k, blob = prune_ones(w, meta, fits)
        log(f"target_bytes:{h.target_bytes} pruned_ones:{k} total:{code_bytes + len(blob)} "
            f"margin:{room - len(blob)} bytes")
    else:
        t0 = time.perf_counter()
        blob = serialize(w, meta, late_qat, h)
        if h.compressor == "pergroup":
            log(f"pergroup: {len(blob)} bytes, serialized in {time.perf_counter() - t0:.1f}s")
    write_atomically(path, blob)
    return len(blob)


def piece_name(name):
    """The piece a stored tensor belongs to: its top module, a layer's by its part (blocks.3.attn.c_q.weight.q ->
    blocks.*.attn)."""
    parts = name.split(".")
    return f"blocks.*.{parts[2]}" if parts[0] == "blocks" and len(parts) > 2 else parts[0]


def piece_bytes(w):
    """{piece: bytes it stores in the artifact before compression} (the size report's artifact_pieces line)."""
    out = {}
    for name, t in w.items():
        key = piece_name(name)
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def artifact_storage(model):
    """{unbanked name: storage} of the tensors whose piece declares `artifact_storage` ("fp16", "fp32", "int6",
    "int8"); every other tensor follows quantize_state_dict's rule (docs/frontier.md "How a tensor ships")."""
    return {k: v for k, v in marked(model, "artifact_storage").items() if v is not None}


def quantiser_notes(meta, h):
    """Log lines naming what QUANT_GATE, AWQ_LITE and LQER_RANK did (nothing when they are off)."""
    def having(test):
        return [n for n, m in meta.items() if not isinstance(m, str) and test(m)]
    lines = []
    if h.quant_gate:
        lines.append(f"quant_gate: {len(having(lambda m: m['type'] == 'gate_int8'))} gate tensors int8 per row")
    if h.awq_lite:
        lines.append(f"awq_lite: int{h.awq_lite_bits} column groups of {h.awq_lite_group} in "
                     f"{','.join(having(lambda m: 'awq' in m)) or '(none)'}")
    if h.lqer_rank > 0:
        lines.append(f"lqer: rank {h.lqer_rank} corrections of {','.join(having(lambda m: 'lqer' in m))}")
    return lines


def size_report(model_bytes, code_bytes, compressor="lzma"):
    total = model_bytes + code_bytes
    lines = [f"Code size: {code_bytes} bytes", f"Serialized model int6+{compressor}: {model_bytes} bytes",
             f"Total submission size int6+{compressor}: {total} bytes"]
    if total > SIZE_CAP_BYTES:
        lines.append(f"OVER_LIMIT total_bytes:{total} cap:{SIZE_CAP_BYTES} (over by {total - SIZE_CAP_BYTES} bytes)")
    return lines


def check_artifact_types(obj, path):
    """One line naming the file when an unpacked artifact's entries have the wrong types: 'w' must map names to
    tensors, 'm' names to a str ("passthrough") or a dict, and 'late_qat', where present, must be a bool."""
    def kind(v):
        return type(v).__name__

    w, meta = obj["w"], obj["m"]
    if not isinstance(w, dict) or not isinstance(meta, dict):
        raise ConfigError(f"{path}: artifact entries 'w' and 'm' must be dicts, not {kind(w)} and {kind(meta)}")
    bad = next((k for k, v in w.items() if not isinstance(k, str) or not isinstance(v, Tensor)), None)
    if bad is not None:
        raise ConfigError(f"{path}: artifact entry w[{bad!r}] has type {kind(w[bad])}, not a tensor")
    bad = next((k for k, v in meta.items() if not isinstance(k, str) or not isinstance(v, (str, dict))), None)
    if bad is not None:
        raise ConfigError(f"{path}: artifact metadata m[{bad!r}] has type {kind(meta[bad])}, not str or dict")
    if not isinstance(obj.get("late_qat", True), bool):
        raise ConfigError(f"{path}: artifact entry 'late_qat' has type {kind(obj['late_qat'])}, not bool")


def check_artifact_tensors(obj, model, path):
    """One ConfigError line, before any work, when an artifact's tensors (names, shapes) are not the model's: each
    piece that differs (piece_name) with the setting its module declares (`setting`) or the size settings."""
    want = {k: tuple(t.shape) for k, t in unbank_state_dict(artifact_state_dict(model), model.num_layers).items()}
    have = {k: tuple(obj["w"][k if isinstance(v, str) else k + ".q"].shape) for k, v in obj["m"].items()
            if (k if isinstance(v, str) else k + ".q") in obj["w"]}
    settings = {}
    for prefix, m in model.named_modules():
        for k in m.state_dict(prefix=prefix + "." if prefix else ""):
            settings[k] = getattr(m, "setting", settings.get(k))
    diffs, blocks = {}, (count_blocks(have), count_blocks(want))
    extra = {k for k in set(want) | set(have) if k.startswith("blocks.") and int(k.split(".")[1]) >= min(blocks)}
    for k in sorted((set(want) | set(have)) - extra):  # the blocks one side lacks: said once, by NUM_LAYERS
        if want.get(k) != have.get(k):
            what = ("not in this model" if k not in want else "not in the artifact" if k not in have
                    else f"shape {have[k]} in the artifact, {want[k]} here")
            piece = re.sub(r"\.\d+(?=\.)", ".*", k.rsplit(".", 1)[0] if "." in k else k)
            diffs.setdefault(piece, (what, settings.get(k) or ("a setting this run leaves off" if k not in want else
                                                               "NUM_LAYERS, MODEL_DIM, MLP_MULT, NUM_KV_HEADS, VOCAB_SIZE")))
    if diffs or extra:
        raise ConfigError(f"{path}: the artifact's tensors are not this model's" + (
            f" (other model settings: the artifact has {blocks[0]} blocks, NUM_LAYERS={blocks[1]} here)"
            if blocks[0] != blocks[1] else "") + ": " + "; ".join(
            f"{piece} {what} ({setting})" for piece, (what, setting) in diffs.items()))


def read_artifact(path):
    """An artifact file's payload {"w", "m", "late_qat"}, its types checked; one ConfigError line if unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: artifact does not exist") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the artifact ({e.strerror or e})") from None
    if data.startswith(PERGROUP_MAGIC):
        obj = pergroup_deserialize(data, path)
    else:
        blob = decompress(data, path)
        try:
            obj = torch.load(io.BytesIO(blob), map_location="cpu")
        except Exception as e:  # any unreadable payload: pickle, zip or torch errors alike
            raise ConfigError(f"{path}: not an int6 artifact (torch.load failed: {type(e).__name__})") from None
    if not isinstance(obj, dict) or "w" not in obj or "m" not in obj:
        raise ConfigError(f"{path}: not an int6 artifact (expected a dict with 'w' and 'm')")
    check_artifact_types(obj, path)
    return obj


def load_artifact(path, h, model=None):
    """The model of an artifact file: a fresh one, or `model` (same settings) with the artifact's weights copied into
    its parameters in place (prepare_evaluation's, whose compiled graphs then serve it)."""
    obj = read_artifact(path)
    model = model if model is not None else build_model(h)
    check_artifact_tensors(obj, model, path)
    flat = dequantize_state_dict(obj["w"], obj["m"], unbank_state_dict(artifact_state_dict(model), model.num_layers),
                                 path)  # every tensor but the training-only ones, which keep the model's own values
    model.load_state_dict({**model.state_dict(), **rebank_state_dict(flat, model.num_layers)}, strict=True)
    # The record's artifacts have no flag; its runs always end with late QAT on.
    model.set_qat(bool(obj.get("late_qat", True)))
    model.looping = h.num_loops > 0  # a looped model is evaluated looped (SPEC-FRONTIER 4)
    return model


# ==================================================
# EVALUATION
# ==================================================

def finish_loss_bpb(rt, sums):
    """sums = [nll sum, tokens, bytes] (float64) of this rank -> global (val_loss, val_bpb)."""
    loss_sum, tokens, nbytes = rt.all_reduce(sums).tolist()
    val_loss = loss_sum / tokens
    return val_loss, val_loss / math.log(2.0) * tokens / nbytes


def eval_val_split(h, num_targets):
    """This rank's batches of eval_val as (first sequence, rows; the last may have fewer), and the whole EVAL_SEQ_LEN
    sequences of all ranks."""
    L = h.eval_seq_len
    batch_seqs = h.val_batch_size // (h.world_size * h.micro_steps) // L
    total = num_targets // L
    first, last = total * h.rank // h.world_size, total * (h.rank + 1) // h.world_size
    return [(s, min(batch_seqs, last - s)) for s in range(first, last, batch_seqs)], total


def eval_val_shapes(h, num_targets):
    """The (rows, length) of this rank's eval_val forwards: its batches (the last may be shorter) and, with
    EVAL_INCLUDE_TAIL on the last rank, the tail row."""
    L = h.eval_seq_len
    batches, total = eval_val_split(h, num_targets)
    shapes = {(rows, L) for _, rows in batches}
    if h.eval_include_tail and h.rank == h.world_size - 1 and total * L < num_targets:
        shapes.add((1, num_targets - total * L))
    return sorted(shapes)


def eval_val(rt, forward, val_tokens, luts):
    """SPEC 7 standard eval: contiguous EVAL_SEQ_LEN sequences split across ranks, through the prefetcher."""
    h, dev, L = rt.h, rt.device, rt.h.eval_seq_len
    batches, total = eval_val_split(h, val_tokens.numel() - 1)
    starts, num_batches = iter(batches), len(batches)
    host_bytes = h.val_bytecount_device == "cpu" or luts.sidecar is not None
    tokens = val_tokens.numpy()

    def produce():
        s, rows = next(starts, (None, 0))
        if s is None:
            return None
        span = tokens[s * L:(s + rows) * L + 1]
        t = torch.from_numpy(span)
        pos = torch.arange(s * L + 1, s * L + span.size)
        nbytes = float(luts.target_bytes(t[:-1], t[1:], pos).sum()) if host_bytes else None
        return span, (nbytes, rows_cu_seqlens(span[:-1].reshape(-1, L)) if h.eval_split_at_bos else None)

    loader = PrefetchingDistributedTokenLoader(produce, L, dev, queue_size=2, threaded=rt.val_prefetch,
                                               copy_stream=rt.val_copy_stream, name="val")
    luts_d = None if host_bytes else luts.to(dev)
    sums = torch.zeros(3, dtype=torch.float64, device=dev)
    module = getattr(forward, "fn", forward)  # the model (a CompiledFunction's own)
    was_training = module.training
    module.eval()
    every, t0 = h.val_progress_log_every, time.perf_counter()
    try:
        with torch.inference_mode():
            for i in range(1, num_batches + 1):
                x, y, (nbytes, cu) = loader.next()
                docs = () if cu is None else (DocBounds(small_to_device(cu, dev), L),)
                with rt.autocast():
                    loss = forward(x, y, *docs).detach()
                sums[0] += loss.double() * y.numel()
                sums[1] += y.numel()
                sums[2] += nbytes if host_bytes else luts_d.count(x.reshape(-1), y.reshape(-1)).sum()
                if every > 0 and (i % every == 0 or i == num_batches):
                    rt.log(f"val_progress: batch:{i}/{num_batches} elapsed:{1000.0 * (time.perf_counter() - t0):.0f}ms")
            if h.eval_include_tail and h.rank == h.world_size - 1 and total * L < val_tokens.numel() - 1:
                sums += score_tail(rt, forward, val_tokens, total * L, luts)
    finally:
        loader.shutdown()
    module.train(was_training)
    return finish_loss_bpb(rt, sums)


def score_tail(rt, forward, val_tokens, start, luts):
    """[nll sum, tokens, bytes] of the targets after the last whole sequence (EVAL_INCLUDE_TAIL=1): one
    shorter row from `start`."""
    span = val_tokens[start:]
    x, y = (t[None].to(rt.device).to(torch.int64) for t in (span[:-1], span[1:]))
    docs = eval_doc_bounds(rt, span[None, :-1].numpy())
    with rt.autocast():
        loss = forward(x, y, *docs).detach()
    nbytes = luts.target_bytes(span[:-1], span[1:], torch.arange(start + 1, start + span.numel())).sum()
    return torch.stack([loss.double() * y.numel(), torch.tensor(float(y.numel()), dtype=torch.float64,
                                                                   device=loss.device), nbytes.to(loss.device)])


def sliding_windows(num_targets, seq_len, stride):
    """Full-length windows (start, first scored position) scoring each target once, each after the first with
    >= seq_len - stride context; the last ends at the last target (the record re-scored the tail instead)."""
    if num_targets < seq_len:
        raise ConfigError(f"EVAL_SEQ_LEN={seq_len} is longer than the {num_targets} validation targets")
    windows = [(0, 0)]
    scored_end = seq_len  # targets [0, scored_end) are scored
    while scored_end < num_targets:
        start = min(scored_end + stride - seq_len, num_targets - seq_len)
        windows.append((start, scored_end - start))
        scored_end = start + seq_len
    return windows


def score_windows(rt, logits_fn, val_tokens, windows, luts, batch_seqs, per_token=None, tilt=None):
    """Sum of [nll, tokens, bytes] over the scored positions (batches padded to one shape); per_token[pos] = nll;
    with tilt (NgramTilt) every nll is the tilted one (token_scores)."""
    dev, L = rt.device, rt.h.eval_seq_len
    host_bytes = rt.h.val_bytecount_device == "cpu" or luts.sidecar is not None
    luts_d = None if host_bytes else luts.to(dev)
    sums = torch.zeros(3, dtype=torch.float64, device=dev)
    positions = torch.arange(L)
    for b in range(0, len(windows), batch_seqs):
        batch = windows[b:b + batch_seqs]
        real = len(batch)
        batch = batch + [batch[-1]] * (batch_seqs - real)
        spans = torch.stack([val_tokens[s:s + L + 1] for s, _ in batch])
        rows = torch.tensor(batch)  # (start, first scored position) per row
        mask = positions[None, :] >= rows[:, 1:]
        mask[real:] = False
        x, y = cut_batch(spans.to(dev).to(torch.int64), L)
        mask_d = mask.to(dev)
        docs = eval_doc_bounds(rt, spans[:, :-1])
        with rt.autocast():
            logits = logits_fn(x, *docs)
        target_pos = rows[:, :1] + positions[None, :] + 1
        _, nll = token_scores(logits, y, tilt, target_pos - 1, mask)
        scored = nll.double()[mask_d]
        sums[0] += scored.sum()
        sums[1] += int(mask.sum())
        if host_bytes:
            sums[2] += float(luts.target_bytes(spans[:, :-1][mask], spans[:, 1:][mask], target_pos[mask]).sum())
        else:
            sums[2] += luts_d.count(x[mask_d], y[mask_d]).sum()
        if per_token is not None:
            per_token[target_pos[mask]] = scored.cpu()
    return sums


def eval_batch_rows(h, window_counts):
    """Rows per scoring forward: EVAL_BATCH_SEQS, at most the most windows one call scores (less padding)."""
    return max(1, min(h.eval_batch_seqs, max(window_counts, default=1)))


def rank_slice(items, h):
    n = len(items)
    return items[n * h.rank // h.world_size: n * (h.rank + 1) // h.world_size]


def eval_sliding(rt, model, logits_fn, val_tokens, luts, per_token=None, tilt=None):
    h = rt.h
    mine = rank_slice(sliding_windows(val_tokens.numel() - 1, h.eval_seq_len, h.eval_stride), h)
    model.eval()
    with torch.inference_mode():
        sums = score_windows(rt, logits_fn, val_tokens, mine, luts, eval_batch_rows(h, [len(mine)]), per_token, tilt)
    return finish_loss_bpb(rt, sums)


# ---- the evaluation's budget (issue 46; docs/evaluation.md "The evaluation's budget")

class EvalBudget:
    """EVAL_BUDGET_SECONDS: the whole evaluation's clock, from reading the artifact (the post-EMA diagnostic before it
    counted too) to the last score line, and TTT's guard. Before each adaptation step (SGD TTT: training on a scored
    chunk; LoRA TTT: a round of document batches, one a rank, and each global SGD phase) adapt() takes the projected
    end of the evaluation if the step is taken: now + the step's cost + the scoring left after it without adapting,
    the largest over the ranks (one all-reduce, so every rank decides the same). TTT adapts only while that plus the
    margin (MARGIN) fits. Once a step does not fit, adaptation ends for good: everything left is scored
    with the weights it has, each target once, as a run with EVAL_TTT_STOP_AT at that step scores it. Budget 0 and no
    EVAL_TTT_STOP_AT: nothing projected, no collective, TTT as before. costs: the warmup's timed calls
    (prepare_evaluation), the first projections' rates."""

    MARGIN = (0.02, 1.0)  # kept free for the projection's error: 2% of the budget, 1 s at least (12 s of 600 s)

    def __init__(self, rt, t0, costs=None):
        h = rt.h
        self.rt, self.t0, self.costs = rt, t0, costs or {}
        self.budget, self.stop_at = h.eval_budget_seconds, h.eval_ttt_stop_at
        self.margin = self.margin_for(self.budget)
        self.steps, self.stopped, self.cause = 0, None, None  # steps taken; where adaptation stopped, and why
        self.settings = ""  # what a plan chose that the stop line's reproduction needs too (PHASED_TTT_PREFIX_DOCS)

    @classmethod
    def margin_for(cls, budget):
        """The margin kept free under a budget of `budget` seconds (0: none)."""
        return max(cls.MARGIN[0] * budget, cls.MARGIN[1]) if budget > 0 else 0.0

    def score_note(self):
        """The legal_ttt line's words when TTT stopped adapting: budget_limited:1 (the budget stopped it) or
        ttt_stop_at:N (EVAL_TTT_STOP_AT did), with the steps it took."""
        if self.stopped is None:
            return ""
        return f" budget_limited:1 adapted_steps:{self.steps}" if self.cause == "budget" else f" ttt_stop_at:{self.steps}"

    def plan(self, projection):
        """The evaluation's first budget line: the budget, its margin and the projected scoring without adapting
        (scoring_projection); when even that ends past the budget, says so (the evaluation goes on: TTT will not
        adapt, the user decides)."""
        total = sum(projection.values())
        end = self.elapsed() + total
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in projection.items())
        self.rt.log(f"eval_budget: budget:{self.budget:g}s margin:{self.margin:.1f}s elapsed:{self.elapsed():.1f}s "
                    f"scoring_alone:{total:.1f}s ({parts}; the warmup's timed calls) projected_end:{end:.1f}s")
        if end + self.margin > self.budget and self.stop_at < 0:
            self.rt.log(f"eval_budget: warning: scoring alone is projected to end at {end:.1f}s, {end + self.margin:.1f}s "
                        f"with the {self.margin:.1f}s margin, past the {self.budget:g}s budget: TTT will not adapt; the "
                        "evaluation goes on (EVAL_BUDGET_SECONDS=0: no budget)")

    @property
    def guarded(self):
        return self.budget > 0 or self.stop_at >= 0

    def elapsed(self):
        return time.perf_counter() - self.t0

    def adapt(self, where, step_s, rest_s):
        """Whether TTT takes its next adaptation step (`where`, for the log line). False from the stop on."""
        if self.stopped is not None:
            return False
        end = None
        if self.stop_at >= 0:  # the setting alone decides, never the clock: its score is the same on any machine
            go = self.steps < self.stop_at
        elif self.budget <= 0:
            go = True
        else:
            t = torch.tensor([self.elapsed() + step_s + rest_s], dtype=torch.float64, device=self.rt.device)
            end = float(self.rt.all_reduce(t, op=dist.ReduceOp.MAX))
            go = end + self.margin <= self.budget
        if go:
            self.steps += 1
            return True
        self.stopped, self.cause = where, "EVAL_TTT_STOP_AT" if end is None else "budget"
        why = (f"EVAL_TTT_STOP_AT={self.stop_at}" if end is None else
               f"projected_end:{end:.1f}s with it, budget:{self.budget:g}s margin:{self.margin:.1f}s")
        self.rt.log(f"eval_budget: TTT stops adapting before step {self.steps} ({where}) elapsed:{self.elapsed():.1f}s "
                    f"{why}; everything left is scored with the weights it has (EVAL_TTT_STOP_AT={self.steps}{self.settings} on "
                    f"{self.rt.h.world_size} ranks gives this score again, under any budget)")
        return False


class TTTMeter:
    """One TTT loop as the budget sees it: this rank's work in units (SGD TTT: scoring windows and training rows, each
    an EVAL_SEQ_LEN forward; LoRA TTT: the warmup's predicted seconds, lora_batch_seconds), the seconds per unit it
    measured (only under a guard) and adapt()'s projection: the next step's cost at the measured adapting rate and
    the scoring left after it (`score_units`, each item's, from the next item on) at the measured scoring rate.
    Before any measurement: `adapt_rate` and `score_rate` (SGD TTT's first step without them: a training row at 3
    scoring rows)."""

    def __init__(self, rt, budget, score_units, adapt_rate=None, score_rate=None):
        self.rt, self.budget, self.units = rt, budget, score_units
        self.on = budget is not None and budget.guarded
        self.left = [*itertools.accumulate(reversed(score_units), initial=0)][::-1]  # units from item i on
        self.scored, self.adapted = [0.0, 0], [0.0, 0]  # [seconds, units]
        self.adapt_rate, self.score_rate = adapt_rate, score_rate

    @contextlib.contextmanager
    def timed(self, acc, units):
        """Adds the block's device-synchronised seconds and `units` to acc (under a guard)."""
        if self.on:
            self.rt.sync()
        t0 = time.perf_counter()
        yield
        if self.on:
            self.rt.sync()
            self.add(acc, time.perf_counter() - t0, units)

    @staticmethod
    def add(acc, secs, units):
        acc[0] += secs
        acc[1] += units

    @staticmethod
    def rate(acc, fallback):
        return acc[0] / acc[1] if acc[1] else fallback

    def adapt(self, where, units, next_item, step_s=None):
        """Whether to take the adaptation step `where` of `units` (or step_s seconds), item `next_item` being the
        first one scored after it."""
        if not self.on:
            return True
        score = self.rate(self.scored, self.score_rate if self.score_rate is not None else 0.0)
        if step_s is None:
            step_s = units * self.rate(self.adapted, self.adapt_rate if self.adapt_rate is not None else 3.0 * score)
        return self.budget.adapt(where, step_s, self.left[next_item] * score)


class Laps:
    """Seconds between marks without a device sync at each: CUDA events on CUDA (read after one sync, totals()),
    the host clock elsewhere. mark(kind) ends a lap of that kind (None: a start)."""

    def __init__(self, rt):
        self.cuda, self.marks = rt.device.type == "cuda", []

    def mark(self, kind):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((kind, event if self.cuda else time.perf_counter()))

    def totals(self):
        """{kind: seconds} of the laps since the last totals()."""
        if self.cuda and self.marks:
            self.marks[-1][1].synchronize()
        out = {}
        for (_, a), (kind, b) in zip(self.marks, self.marks[1:]):
            if kind is not None:
                out[kind] = out.get(kind, 0.0) + (a.elapsed_time(b) / 1000.0 if self.cuda else b - a)
        self.marks = []
        return out


def frozen_bank_rows(h):
    """Rows of each bank in the first TTT_FREEZE_BLOCKS blocks."""
    first = list(range(h.ttt_freeze_blocks))
    both = first + [h.num_layers + i for i in first]
    return {"qo_bank": both, "kv_bank": both, "mlp_up_bank": first, "mlp_down_bank": first}


def eval_ttt(rt, model, logits_fn, loss_fn, val_tokens, luts, per_token=None, tilt=None, budget=None):
    """Legal score-first TTT (SPEC 7): score each chunk under inference_mode (tilted with NGRAM_TILT), then train on
    it (not the last; the training loss is never tilted) while the budget (EvalBudget) lets it adapt."""
    h = rt.h
    chunk_windows, batch_rows = ttt_chunk_windows(h, val_tokens.numel() - 1)
    num_chunks = len(chunk_windows)
    frozen_rows = frozen_bank_rows(h) if h.ttt_freeze_blocks > 0 else {}
    params = ttt_params(model, h)
    opt = torch.optim.SGD([p for _, p in params], lr=h.ttt_lr, momentum=h.ttt_momentum)
    sums = torch.zeros(3, dtype=torch.float64, device=rt.device)
    c = budget.costs if budget is not None else {}
    rows = max((k[1] for k in c if isinstance(k, tuple) and k[0] == "train"), default=0)
    meter = TTTMeter(rt, budget, [len(rank_slice(w, h)) for w in chunk_windows], c[("train", rows)] / rows if rows else None)
    t0 = time.perf_counter()
    for ci in range(num_chunks):
        model.eval()
        with meter.timed(meter.scored, meter.units[ci]), torch.inference_mode():
            sums += score_windows(rt, logits_fn, val_tokens, rank_slice(chunk_windows[ci], h), luts, batch_rows,
                                  per_token, tilt)
        if ci == num_chunks - 1 or h.ttt_epochs == 0:
            continue
        rows = h.ttt_epochs * sum(len(rank_slice(range(b, e), h)) for b, e in ttt_chunk_batches(h, ci, val_tokens.numel() - 1))
        if not meter.adapt(f"chunk {ci + 1}/{num_chunks}", rows, ci + 1):
            continue
        with meter.timed(meter.adapted, rows):
            lr = ttt_train_chunk(rt, model, loss_fn, opt, params, frozen_rows, val_tokens, ci, num_chunks)
        if rt.is_main and (ci % 10 == 0 or ci == num_chunks - 2):
            rt.log(f"ttt_progress chunk:{ci + 1}/{num_chunks} lr:{lr:.6f} elapsed:{time.perf_counter() - t0:.1f}s")
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return finish_loss_bpb(rt, sums)


def ttt_chunk_windows(h, num_targets):
    """eval_ttt's sliding windows grouped by the TTT_CHUNK_TOKENS chunk of their first scored target, and the rows
    of its scoring batches."""
    L, C = h.eval_seq_len, h.ttt_chunk_tokens
    num_chunks = -(-num_targets // C)
    chunk_windows = [[] for _ in range(num_chunks)]
    for start, first in sliding_windows(num_targets, L, h.eval_stride):
        chunk_windows[min((start + first) // C, num_chunks - 1)].append((start, first))
    return chunk_windows, eval_batch_rows(h, [len(rank_slice(w, h)) for w in chunk_windows])


def ttt_train_rows(h, num_targets):
    """The row counts of this rank's SGD TTT training forwards (ttt_train_chunk's batches of TTT_BATCH_SEQS
    sequences, split over the ranks), over every chunk but the last."""
    num_chunks = -(-num_targets // h.ttt_chunk_tokens)
    rows = {len(rank_slice(list(range(b, e)), h)) for ci in range(num_chunks - 1 if h.ttt_epochs > 0 else 0)
            for b, e in ttt_chunk_batches(h, ci, num_targets)}
    return sorted(rows - {0})


def ttt_params(model, h):
    """SGD TTT's trained weights, (name, parameter): all but the first TTT_FREEZE_BLOCKS blocks' (requires_grad set
    accordingly on every weight)."""
    frozen_prefixes = tuple(f"blocks.{i}." for i in range(h.ttt_freeze_blocks))
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(frozen_prefixes))
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def ttt_train_chunk(rt, model, loss_fn, opt, params, frozen_rows, tokens, ci, num_chunks):
    """TTT_EPOCHS epochs of SGD on chunk ci of `tokens` (TTT_CHUNK_TOKENS each, whole EVAL_SEQ_LEN sequences in
    batches of TTT_BATCH_SEQS) at the cosine LR TTT_LR * (1 + cos(pi * ci / (num_chunks - 1))) / 2; returns it."""
    h, C = rt.h, rt.h.ttt_chunk_tokens
    lr = h.ttt_lr * 0.5 * (1.0 + math.cos(math.pi * ci / max(num_chunks - 1, 1)))
    for g in opt.param_groups:
        g["lr"] = lr
    model.train()
    for _ in range(h.ttt_epochs):
        for b, e in ttt_chunk_batches(h, ci, tokens.numel() - 1):
            ttt_train_batch(rt, model, loss_fn, opt, params, frozen_rows, tokens, ci * C, b, e)
    return lr


def ttt_chunk_batches(h, ci, num_targets):
    """The [b, e) sequence ranges of chunk ci's SGD batches: its whole EVAL_SEQ_LEN sequences, TTT_BATCH_SEQS at a
    time."""
    L, C = h.eval_seq_len, h.ttt_chunk_tokens
    num_seqs = (min(ci * C + C, num_targets) - ci * C) // L
    return [(b, min(b + h.ttt_batch_seqs, num_seqs)) for b in range(0, num_seqs, h.ttt_batch_seqs)]


def ttt_train_batch(rt, model, loss_fn, opt, params, frozen_rows, val_tokens, chunk_start, b, e):
    """One SGD step on sequences [b, e) of the chunk split across ranks, equal to the single-process step."""
    h, L = rt.h, rt.h.eval_seq_len
    mine = rank_slice(list(range(b, e)), h)
    opt.zero_grad(set_to_none=False)
    if mine:
        lo, hi = chunk_start + mine[0] * L, chunk_start + (mine[-1] + 1) * L + 1
        x, y = host_to_device(val_tokens[lo:hi], L, rt.device)
        docs = eval_doc_bounds(rt, val_tokens[lo:hi - 1].view(-1, L))
        with rt.autocast():
            loss = loss_fn(x, y, *docs) * (len(mine) / (e - b))
        loss.backward()
    for name, p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if name in frozen_rows:
            p.grad[frozen_rows[name]] = 0
    rt.all_reduce_coalesced([p.grad for _, p in params])
    torch.nn.utils.clip_grad_norm_([p for _, p in params], h.ttt_grad_clip)
    opt.step()


def lora_ttt_documents(val_tokens):
    """The val stream's documents for TTT_MODE=lora (SPEC-FRONTIER 14, 18), split at BOS with issue 17's doc_starts:
    doc i runs from its start through the next document's BOS (its last target); the first starts at 0, the last
    runs to the end. (start, length) pairs, those with no target left out; their targets cover 1..N-1 once."""
    starts = doc_starts(val_tokens.numpy()).tolist()
    ends = [e + 1 for e in starts[1:]] + [val_tokens.numel()]
    return [(a, b - a) for a, b in zip(starts, ends) if b - a >= 2]


def lora_ttt_queue(docs, batch_size):
    """Docs sorted by length (stable), cut into batches of TTT_BATCH_SIZE, queued longest batch first (SPEC-FRONTIER
    18): [(batch index in ascending-length order, [(start, length), ...])]."""
    ordered = sorted(docs, key=lambda d: d[1])
    batches = [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]
    return sorted(enumerate(batches), key=lambda ib: -ib[1][-1][1])


def lora_ttt_chunk(batch, ci, chunk, seq_len):
    """Chunk ci of a document batch (SPEC-FRONTIER 18): per row the window of <= seq_len tokens ending at the chunk's
    end (the doc's last target for its last chunk), right-padded. Returns (token index of each window start,
    window lengths, scored offsets, scored lengths (0: doc has no chunk ci), width, training offset of a full chunk)."""
    width = min((ci + 1) * chunk, seq_len)
    starts, lens, offs, counts = (torch.zeros(len(batch), dtype=torch.int64) for _ in range(4))
    for b, (doc_start, doc_len) in enumerate(batch):
        pred = doc_len - 1
        if ci * chunk >= pred:
            continue
        end = min((ci + 1) * chunk, pred)
        win = max(0, end - seq_len)
        starts[b], lens[b], offs[b], counts[b] = doc_start + win, end - win, ci * chunk - win, end - ci * chunk
    return starts, lens, offs, counts, width, ci * chunk - max(0, (ci + 1) * chunk - seq_len)


def lora_ttt_chunk_size(h, batch):
    """The chunk size of a document batch: TTT_CHUNK_SIZE, or with TTT_CHUNK_SIZE_BY_DOC_LEN the chunk of the first
    step whose length bound holds the batch's longest document (its tokens from its BOS through the next BOS, as
    lora_ttt_documents counts them); the 04-30 record's short-document score-first chunks (#2014, SPEC-FRONTIER 19)."""
    longest = max(n for _, n in batch)
    return next((c for bound, c in h.ttt_chunk_steps if longest <= bound), h.ttt_chunk_size)


def lora_batch_seconds(h, batch, fit):
    """A document batch's predicted (step, forward) seconds: over its chunks (lora_ttt_chunk), a + b x rows x width
    each, with fit = (a, b) of a whole step and (a, b) of its forward alone (warm_lora_ttt's timed calls; without
    them b = 1, a = 0: forward tokens). The budget's units of LoRA TTT."""
    C, L = lora_ttt_chunk_size(h, batch), h.ttt_eval_seq_len or h.eval_seq_len
    (a, b), (af, bf) = fit or ((0.0, 1.0), (0.0, 1.0))
    tokens = [len(batch) * min((ci + 1) * C, L) for ci in range(-(-(max(n for _, n in batch) - 1) // C))]
    return len(tokens) * a + b * sum(tokens), len(tokens) * af + bf * sum(tokens)


def lora_ttt_batch(rt, model, val_tokens, luts, batch, lora, opt, sums, per_token=None, forward=None, tilt=None,
                   adapt=True, laps=None):
    """Score-first doc-LoRA TTT of one document batch (SPEC-FRONTIER 14, 18): for each chunk (lora_ttt_chunk_size),
    one forward of every doc's window through the model with its row's LoRA; the chunk's per-token losses (tilted
    with tilt, NgramTilt: SPEC-FRONTIER 20(c)) and bytes are added to sums; then, if any doc has chunks left, one
    optimizer step on the sum over those docs of their chunk's mean untilted loss (a doc's last chunk is never
    trained on). forward: model.forward_logits or its compiled form. adapt=False (the budget stopped adapting): the
    same forwards and scores, no step. laps (Laps, under a budget): each chunk's scoring and step timed apart."""
    h, dev, C = rt.h, rt.device, lora_ttt_chunk_size(rt.h, batch)
    forward = forward or model.forward_logits
    L = h.ttt_eval_seq_len or h.eval_seq_len
    num_chunks = torch.tensor([-(-(n - 1) // C) for _, n in batch])
    mark = laps.mark if laps is not None else (lambda kind: None)
    for ci in range(int(num_chunks.max())):
        mark(None)
        starts, lens, offs, counts, width, train_off = lora_ttt_chunk(batch, ci, C, L)
        cols = torch.arange(width + 1)
        span = val_tokens[(starts[:, None] + cols).clamp_(max=val_tokens.numel() - 1)].long()
        valid = cols[None, :width] < lens[:, None]
        x, y = torch.where(valid, span[:, :-1], 0), torch.where(valid, span[:, 1:], 0)
        scored = (cols[None, :width] >= offs[:, None]) & (cols[None, :width] < (offs + counts)[:, None])
        with rt.autocast():
            logits = forward(x.to(dev), lora=lora)
        target_pos = starts[:, None] + 1 + cols[None, :width]
        nll, score = token_scores(logits, y.to(dev), tilt, target_pos - 1, valid)
        with torch.no_grad():
            scored_d = scored.to(dev)
            sums[0] += score.double()[scored_d].sum()
            sums[1] += int(scored.sum())
            sums[2] += float(luts.target_bytes(x[scored], y[scored], target_pos[scored]).sum())
            if per_token is not None:
                per_token[target_pos[scored]] = score[scored_d].double().cpu()
        mark("score")
        train = (num_chunks - 1 > ci).to(dev, torch.float32)
        if adapt and bool(train.any()):
            opt.zero_grad(set_to_none=True)
            (nll[:, train_off:train_off + C].mean(dim=-1) * train).sum().backward()
            opt.step()
        mark("step")


def eval_ttt_lora(rt, model, val_tokens, luts, per_token=None, forward=None, tilt=None, budget=None):
    """TTT_MODE=lora: (val_loss, val_bpb) of lora_ttt_sums over all ranks."""
    return finish_loss_bpb(rt, lora_ttt_sums(rt, model, val_tokens, luts, per_token, forward, tilt, budget))


def lora_forward(rt, model, planned):
    """TTT_MODE=lora's forward and how it runs: model.forward_logits compiled with dynamic shapes where
    torch.compile is on (CUDA, or COMPILE=1; the 04-27/04-30 records' torch.compile(dynamic=True)), else eager;
    planned: the warmup's shape count (an upper bound on its graphs)."""
    fn = compile_fn(rt, "ttt_lora", model.forward_logits, model.graph_state, planned, dynamic=True)
    return fn, "compiled" if isinstance(fn, CompiledFunction) else "eager"


@contextlib.contextmanager
def weights_trainable(model, flag=None, drop_grads=False):
    """Inside the block every weight's requires_grad is `flag` (None: as it is; False: frozen, LoRA TTT trains only its
    adapters); on leaving each weight's flag is restored and, with drop_grads, its gradient dropped."""
    saved = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in saved if flag is not None else ():
        p.requires_grad_(flag)
    try:
        yield
    finally:
        for p, requires in saved:
            if drop_grads:
                p.grad = None
            p.requires_grad_(requires)


def lora_optimizer(h, lora, device):
    """AdamW over one set of LoRA adapters (SPEC-FRONTIER 18): TTT_LORA_LR x TTT_LOCAL_LR_MULT, betas TTT_BETA1/2,
    eps 1e-10, TTT_WEIGHT_DECAY; fused on CUDA. The timed loop and its warmup step use the same one."""
    return torch.optim.AdamW(lora.parameters(), lr=h.ttt_lora_lr * h.ttt_local_lr_mult,
                             betas=(h.ttt_beta1, h.ttt_beta2), eps=1e-10, weight_decay=h.ttt_weight_decay,
                             fused=device.type == "cuda")


def lora_warm_shapes(h, batch_sizes):
    """warm_lora_ttt's (rows, width): each chunk width at TTT_BATCH_SIZE rows, the first for every other batch size."""
    L = h.ttt_eval_seq_len or h.eval_seq_len
    widths = sorted({min(c, L) for c in [h.ttt_chunk_size] + [c for _, c in h.ttt_chunk_steps]} | {L})
    return [(h.ttt_batch_size, w) for w in widths] + [(n, widths[0]) for n in sorted(set(batch_sizes) - {h.ttt_batch_size})]


def seconds(rt, fn):
    """Wall seconds of fn(), device-synchronised."""
    rt.sync()
    t0 = time.perf_counter()
    fn()
    rt.sync()
    return time.perf_counter() - t0


def warm_lora_ttt(rt, model, forward, batch_sizes, costs=None):
    """One LoRA TTT step (forward, backward, AdamW) on random tokens with throwaway adapters for each chunk width the
    evaluation starts with (each chunk size of TTT_CHUNK_SIZE and TTT_CHUNK_SIZE_BY_DOC_LEN, and the full context)
    at TTT_BATCH_SIZE rows, and at the first width for each other batch size of the queue (a compiled forward
    meets every shape it will see), before the eval timer, as the 04-27/04-30 records do: compilation is not
    scored time (SPEC-FRONTIER 18). The model's weights and every generator the evaluation uses stay untouched.
    costs (a dict, under a budget): the budget's rates from timed repeats, after the warmup, at TTT_BATCH_SIZE rows of
    the narrowest and the full width: lora_fit, seconds = a + b x rows x width of a whole step and of its forward
    alone ((a, b), (a, b)); with phases, phase_row_s (one EVAL_SEQ_LEN row of a global SGD phase, forward and
    backward). Returns [(rows, width)] warmed."""
    h = rt.h
    shapes = lora_warm_shapes(h, batch_sizes)
    g = torch.Generator().manual_seed(h.seed)
    timed, rows_ = {}, h.ttt_batch_size  # width -> (step, forward) seconds
    model.eval()
    with weights_trainable(model, False):
        for rows, width in shapes:
            lora = LoRAAdapters(rows, model, h, g).to(rt.device)
            opt = lora_optimizer(h, lora, rt.device)
            # x and y drawn apart: x must not be a view (a graph compiled for a view's input guards on its base)
            x, y = (torch.randint(0, h.vocab_size, (rows, width), generator=g).to(rt.device) for _ in range(2))

            def step(train=True):
                with rt.autocast():
                    logits = forward(x, lora=lora)
                if train:
                    F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
                    opt.step()

            step()
            if costs is not None and rows == h.ttt_batch_size and width in (shapes[0][1], h.ttt_eval_seq_len or h.eval_seq_len):
                timed[width] = (seconds(rt, step), seconds(rt, lambda: step(False)))
    if costs is not None:
        (w0, t0), (w1, t1) = sorted(timed.items())[0], sorted(timed.items())[-1]
        fit = []
        for k in range(2):  # the whole step, its forward
            b = max(0.0, (t1[k] - t0[k]) / (rows_ * (w1 - w0))) if w1 > w0 else t1[k] / (rows_ * w1)
            fit.append((max(0.0, t0[k] - b * rows_ * w0), b))
        costs["lora_fit"] = tuple(fit)
    if costs is not None and h.phased_ttt_prefix_docs > 0:
        costs["phase_row_s"] = global_sgd_row_seconds(rt, model, g)
    rt.sync()
    return shapes


def global_sgd_row_seconds(rt, model, g):
    """The seconds of one EVAL_SEQ_LEN row of a global SGD phase (forward and backward of every weight, eager as the
    phases run), timed after one untimed row; gradients dropped, requires_grad and the mode restored."""
    h = rt.h
    x, y = (torch.randint(0, h.vocab_size, (1, h.eval_seq_len), generator=g).to(rt.device) for _ in range(2))

    def row():
        with rt.autocast():
            model(x, y).backward()

    model.train()
    with weights_trainable(model, True, drop_grads=True):
        row()
        took = seconds(rt, row)
    model.eval()
    return took


def lora_ttt_sums(rt, model, val_tokens, luts, per_token=None, forward=None, tilt=None, budget=None):
    """Document-wise score-first LoRA TTT (SPEC-FRONTIER 14, 18, 19; the 04-27 and 04-30 records): this rank's [nll
    sum, tokens, bytes]. Base weights frozen outside the phases. The length-sorted queue (lora_ttt_queue) is cut
    into segments at the phase boundaries (lora_ttt_segments) and each segment dealt to the ranks
    (lora_ttt_assignment). A batch of TTT_BATCH_SIZE docs resets the reusable adapters (B and AdamW state zeroed, A
    kept with TTT_WARM_START_A, else drawn for this batch); any other size gets fresh adapters (A drawn for this
    batch) and optimizer. Every A draw comes from its own generator (lora_a_generator), keyed by the batch or the
    phase, never from a stream whose position depends on what a rank ran before. Phases (PHASED_TTT_PREFIX_DOCS > 0):
    after the segment whose last batch brings the global count of scored docs to boundary B_k = P*k/N, every rank
    runs global_sgd_phase on the first B_k scored docs (lora_ttt_prefix), and the reusable adapters are built afresh.
    So the scores do not depend on the number of ranks, except through A trained on one batch and kept for the next
    batch of the same rank (TTT_WARM_START_A=1, as in the records, whose totals moved with the rank count too).
    tilt (NgramTilt, NGRAM_TILT=1): the scores are tilted (lora_ttt_batch). budget (EvalBudget): the ranks run each
    segment in rounds (round r: batch r*W + rank) and decide together before each round and each phase whether to
    adapt; once stopped, every batch left is scored without a step and no phase runs."""
    h, dev = rt.h, rt.device
    queue_ = lora_ttt_queue(lora_ttt_documents(val_tokens), h.ttt_batch_size)
    costs = budget.costs if budget is not None else {}
    prefix = h.phased_ttt_prefix_docs
    if h.phased_ttt_prefix_auto and (budget is None or budget.budget <= 0):  # PREFLIGHT's unbudgeted slice:
        prefix = min(prefix, sum(len(b) for _, b in queue_) // 2)  # half its docs, so that every phase runs
    elif h.phased_ttt_prefix_auto:
        before = float(rt.all_reduce(torch.tensor([budget.elapsed()], dtype=torch.float64, device=dev),
                                     op=dist.ReduceOp.MAX))
        prefix, parts = plan_prefix_docs(h, queue_, costs, before, budget.budget)
        prefix = int(rt.all_reduce(torch.tensor([prefix], dtype=torch.int64, device=dev), op=dist.ReduceOp.MIN))
        log_prefix_plan(rt, prefix, parts)
        budget.settings = f" PHASED_TTT_PREFIX_DOCS={prefix}"
    N, W = h.phased_ttt_num_phases, h.world_size
    boundaries, segments, prefixes = lora_ttt_phases(h, queue_, prefix)

    def fresh(bsz, key):
        lora = LoRAAdapters(bsz, model, h, lora_a_generator(h.seed, key)).to(dev)
        return lora, lora_optimizer(h, lora, dev)

    rt.log(f"ttt_lora: docs:{sum(len(b) for _, b in queue_)} batches:{len(queue_)} rank:{h.ttt_lora_rank} "
           f"alpha:{h.ttt_lora_alpha} targets:{h.ttt_lora_targets} chunk:{h.ttt_chunk_size} "
           f"context:{h.ttt_eval_seq_len or h.eval_seq_len} warm_start_a:{int(h.ttt_warm_start_a)} "
           f"phase_boundaries:{boundaries} lr:{h.ttt_lora_lr * h.ttt_local_lr_mult:g} "
           f"chunk_by_doc_len:{h.ttt_chunk_size_by_doc_len or '-'}")
    reusable = fresh(h.ttt_batch_size, 0)
    sums = torch.zeros(3, dtype=torch.float64, device=dev)
    units, forward_s = zip(*(lora_batch_seconds(h, b, costs.get("lora_fit")) for _, b in queue_)) if queue_ else ((), ())
    mine_all = [lo + i for lo, hi in segments for i in lora_ttt_assignment(hi - lo, W)[h.rank]]
    # units: predicted seconds, so each measured rate is its prediction's correction (1.0 before any; without the
    # warmup's fit, forward tokens at an unknown rate: the first step is taken and measured)
    first = 1.0 if "lora_fit" in costs else 0.0
    meter = TTTMeter(rt, budget, [forward_s[q] for q in mine_all], first, first)
    laps = Laps(rt) if meter.on else None
    phase_s = [0.0, 0]  # the phases' seconds and rows (this rank's), for the next phase's projection
    t0, done = time.perf_counter(), 0
    model.eval()
    with weights_trainable(model, False):
        for phase, (lo, hi) in enumerate(segments):
            mine = lora_ttt_assignment(hi - lo, W)[h.rank]
            for r in range(-(-(hi - lo) // W)):  # rounds: every rank decides at each, with a batch or not
                ran = r < len(mine)
                i = mine[r] if ran else 0
                first, last = lo + r * W + 1, min(lo + r * W + W, hi)
                adapt = meter.adapt(f"document batch{f'es {first}-' if last > first else ' '}{last}/{len(queue_)}",
                                    units[lo + i] if ran else 0, done + ran)
                if not ran:
                    continue
                index, batch = queue_[lo + i]
                if len(batch) == h.ttt_batch_size:
                    lora, opt = reusable
                    lora.reset(lora_a_generator(h.seed, 1 + index))
                    opt.state.clear()
                else:
                    lora, opt = fresh(len(batch), 1 + index)
                lora_ttt_batch(rt, model, val_tokens, luts, batch, lora, opt, sums, per_token, forward, tilt, adapt,
                               laps if adapt else None)
                if adapt and laps is not None:
                    took = laps.totals()
                    meter.add(meter.scored, took.get("score", 0.0), forward_s[lo + i])
                    meter.add(meter.adapted, sum(took.values()), units[lo + i])
                done += 1
                if rt.is_main and (done % 50 == 1 or i == mine[-1] and hi == len(queue_)):
                    rt.log(f"ttt_lora_progress batch:{lo + i + 1}/{len(queue_)} doc_len:{batch[0][1]}-"
                           f"{batch[-1][1]} elapsed:{time.perf_counter() - t0:.1f}s")
            if phase < len(segments) - 1:
                scored = sum(len(b) for _, b in queue_[:hi])
                tokens = torch.cat([val_tokens[:0]] + [val_tokens[a:a + n] for a, n in prefixes[phase]])  # (B_k = 0: none)
                rows = phase_rows(h, tokens.numel())
                step_s = rows * (phase_s[0] / phase_s[1] if phase_s[1] else costs.get("phase_row_s", 0.0))
                if meter.adapt(f"phase {phase + 1}/{N}", 0, done, step_s):
                    rt.log(f"ttt_lora_phase:{phase + 1}/{N} scored_docs:{scored} trained_docs:{len(prefixes[phase])} "
                           f"elapsed:{time.perf_counter() - t0:.1f}s")
                    with meter.timed(phase_s, rows):
                        global_sgd_phase(rt, model, tokens)
                reusable = fresh(h.ttt_batch_size, len(queue_) + 1 + phase)
    return sums


def lora_a_generator(seed, key):
    """The generator of one LoRA A draw (SPEC-FRONTIER 18: A ~ U(+-1/sqrt(in))): key 0, the first reusable
    adapters, is seeded with SEED itself (what the records' global generator gives in one process); key 1 + i the
    draws for the batch of ascending-length index i; len(queue) + 1 + k the reusable adapters after phase k."""
    return torch.Generator().manual_seed((seed + (key << 32)) % (1 << 64))


def lora_ttt_segments(batch_sizes, boundaries):
    """Queue positions [lo, hi) of the segments between phases: segment k ends with the first batch that brings
    the count of scored docs to boundary k, and at least one batch after segment k-1 (the record checks its
    counter once per batch, so one batch starts at most one phase); the last segment runs to the end. Phase k
    runs after segment k when that segment is not the last; a boundary never reached runs no phase."""
    segments, lo, count = [], 0, 0
    for bound in boundaries:
        hi = lo
        while hi < len(batch_sizes) and (hi == lo or count < bound):
            count += batch_sizes[hi]
            hi += 1
        if hi == len(batch_sizes) and count < bound:
            break
        segments.append((lo, hi))
        lo = hi
    if lo < len(batch_sizes) or not segments:
        segments.append((lo, len(batch_sizes)))
    return segments


def lora_ttt_assignment(n, world_size):
    """Which of a segment's n batches (queue order, longest first) each rank runs: batch i on rank i mod W.
    Deterministic, not the records' dynamic queue (a file-locked counter in /tmp, one node only): with the trained
    A kept from batch to batch (TTT_WARM_START_A=1) a rank's scores depend on which batches it ran before, so a
    queue claimed first-come-first-served makes the totals change from run to run, and EVAL_ONLY could not repeat
    the run that wrote the artifact. Dealing longest-first batches in turn costs little balance: while a batch's
    cost falls with its queue position, the ranks' totals in a segment differ by at most one batch's cost.
    Nothing is exchanged while scoring; the ranks meet only in the phases' gradient all-reduces and the final
    all_reduce of the sums, where a dead rank makes the others fail within DIST_TIMEOUT_SECONDS of getting there
    (each first finishes its own batches of the segment)."""
    return [list(range(r, n, world_size)) for r in range(world_size)]


def lora_ttt_prefix(scored_batches, count):
    """The first `count` scored docs by (batch index in ascending-length order, position in the batch): what phase k
    trains on, cumulative (SPEC-FRONTIER 18)."""
    return [doc for _, batch in sorted(scored_batches, key=lambda ib: ib[0]) for doc in batch][:count]


def lora_ttt_phases(h, queue_, prefix):
    """The phases of a PHASED_TTT_PREFIX_DOCS prefix: the boundaries B_k = P*k/N (P at most the queue's docs), the
    queue's segments between them (lora_ttt_segments) and the docs each phase trains on (lora_ttt_prefix)."""
    P, N = min(prefix, sum(len(b) for _, b in queue_)), h.phased_ttt_num_phases
    boundaries = [P * (k + 1) // N for k in range(N)] if P > 0 else []
    segments = lora_ttt_segments([len(b) for _, b in queue_], boundaries)
    return boundaries, segments, [lora_ttt_prefix(queue_[:hi], bound) for (_, hi), bound in zip(segments[:-1], boundaries)]


def phase_rows(h, tokens):
    """The EVAL_SEQ_LEN rows a rank trains in a phase on `tokens` tokens (ttt_train_chunk's batches, TTT_EPOCHS)."""
    return h.ttt_epochs * -(-(tokens - 1) // (h.eval_seq_len * h.world_size))


def prefix_phase_rows(h, queue_, prefixes):
    """The phase rows (phase_rows, summed over the phases) of every prefix in `prefixes` (an int array) at once:
    lora_ttt_phases' segments and training docs for each, as arrays. Phase k's docs are the first B_k of the queue's
    first hi_k batches in batch-index order; their tokens come from each batch's running doc lengths."""
    N, nb = h.phased_ttt_num_phases, len(queue_)
    sizes = np.array([len(b) for _, b in queue_], dtype=np.int64)
    cum = np.cumsum(sizes)  # docs in the queue's first i + 1 batches
    index = np.array([i for i, _ in queue_])
    order = np.argsort(index, kind="stable")  # queue positions in batch-index order
    lens = [np.cumsum([0] + [n for _, n in queue_[q][1]]) for q in order]  # tokens of each batch's first j docs
    P = np.minimum(prefixes, cum[-1] if nb else 0)
    lo, alive, segs = np.zeros_like(P), P > 0, np.zeros_like(P)
    bounds, ends = [], []
    for k in range(N if nb else 0):  # lora_ttt_segments, for every prefix
        bound = P * (k + 1) // N
        first = np.minimum(np.searchsorted(cum, bound, side="left") + 1, nb)
        hi = np.where(lo < nb, np.minimum(np.maximum(lo + 1, first), nb), nb)
        alive &= cum[hi - 1] >= bound
        bounds.append(bound)
        ends.append(np.where(alive, hi, -1))
        segs += alive
        lo = np.where(alive, hi, lo)
    segs += (lo < nb) | (segs == 0)
    rows, batch_tokens = np.zeros(P.shape, dtype=np.int64), np.array([c[-1] for c in lens])
    for k, (bound, hi) in enumerate(zip(bounds, ends)):
        runs = (k < segs - 1) & (hi > 0)
        for width in np.unique(hi[runs]):  # the scored batches' docs in batch-index order: counts, then tokens
            pick, scored = runs & (hi == width), order < width  # scored: the queue's first `width` batches
            count = np.cumsum(np.where(scored, sizes[order], 0))
            tokens = np.cumsum(np.where(scored, batch_tokens, 0))
            b = bound[pick]
            j = np.searchsorted(count, b, side="left")  # the batch (in index order) holding doc b
            before = np.where(j > 0, count[np.maximum(j - 1, 0)], 0)
            t = np.where(j > 0, tokens[np.maximum(j - 1, 0)], 0) + np.array(
                [lens[jj][bb - cc] for jj, bb, cc in zip(j, b, before)])
            rows[pick] += phase_rows(h, t)
    return rows


def plan_prefix_docs(h, queue_, costs, before_s, budget_s):
    """PHASED_TTT_PREFIX_DOCS=auto (issue 52): the largest prefix up to PHASED_TTT_PREFIX_DOCS_MAX (0: every val
    document) whose projected evaluation ends inside the budget less its margin (EvalBudget.margin_for): before_s
    (the evaluation before TTT) + LoRA TTT's steps (every batch's, lora_batch_seconds from the warmup's fit, shared
    by the ranks) + the phases' rows (prefix_phase_rows, every prefix at once: a longer prefix can train on fewer
    tokens, as its phases come after shorter batches) at the warmup's phase_row_s. Returns (prefix, {the
    projection's parts}); 0 when even no prefix fits."""
    docs = sum(len(b) for _, b in queue_)
    cap = min(h.phased_ttt_prefix_docs_max or docs, docs)
    steps = sum(lora_batch_seconds(h, b, costs.get("lora_fit"))[0] for _, b in queue_) / h.world_size
    row_s, margin = costs.get("phase_row_s", 0.0), EvalBudget.margin_for(budget_s)
    rows = prefix_phase_rows(h, queue_, np.arange(cap + 1))
    ends = before_s + steps + rows * row_s
    fitting = np.flatnonzero(ends + margin <= budget_s)
    prefix = int(fitting[-1]) if fitting.size else 0
    return prefix, {"cap": cap, "docs": docs, "before_s": before_s, "steps_s": steps, "phase_rows": int(rows[prefix]),
                    "row_s": row_s, "end_s": float(ends[prefix]), "margin_s": margin, "budget_s": budget_s,
                    "fits": bool(fitting.size)}


def log_prefix_plan(rt, prefix, parts):
    """The plan's line: the choice and its arithmetic; a warning when even no prefix fits (the guard then cuts)."""
    rt.log(f"ttt_plan: PHASED_TTT_PREFIX_DOCS=auto -> {prefix} (max {parts['cap']} of {parts['docs']} docs, "
           f"{rt.h.phased_ttt_num_phases} phases) before_ttt:{parts['before_s']:.1f}s ttt_steps:{parts['steps_s']:.1f}s "
           f"phases:{parts['phase_rows'] * parts['row_s']:.1f}s ({parts['phase_rows']} rows x {parts['row_s']:.4f}s) "
           f"projected_end:{parts['end_s']:.1f}s budget:{parts['budget_s']:g}s margin:{parts['margin_s']:.1f}s")
    if not parts["fits"]:
        rt.log(f"ttt_plan: warning: even without phases TTT is projected to end at {parts['end_s']:.1f}s, past the "
               f"{parts['budget_s']:g}s budget with its margin: the guard will stop TTT adapting")


def global_sgd_phase(rt, model, tokens):
    """A phase's global SGD on all base weights (SPEC-FRONTIER 14, 18), with the chunked SGD TTT's pieces and
    settings: `tokens` (the scored docs, concatenated) in TTT_CHUNK_TOKENS chunks, all but the last trained with
    ttt_train_chunk (TTT_LR cosine over the chunks, TTT_MOMENTUM, TTT_EPOCHS, TTT_GRAD_CLIP, gradients averaged over
    ranks, rows split at BOS with EVAL_SPLIT_AT_BOS); a new optimizer each phase. requires_grad restored after (LoRA
    TTT's: frozen)."""
    params = list(model.named_parameters())
    with weights_trainable(model, True):
        opt = torch.optim.SGD([p for _, p in params], lr=rt.h.ttt_lr, momentum=rt.h.ttt_momentum)
        num_chunks = -(-(tokens.numel() - 1) // rt.h.ttt_chunk_tokens)
        for ci in range(num_chunks - 1):
            ttt_train_chunk(rt, model, model, opt, params, {}, tokens, ci, num_chunks)
    model.eval()


# ---- n-gram tilt hints (SPEC-FRONTIER 20) ----
# #2135's token channel (online_ngram_state.c, driven by online_ngram_tilt.py) as whole-array tensor operations.

NGRAM_COEFFS = (36313, 27191, 51647, 81929, 131071, 196613, 262147, 393241, 524309, 655373, 786433, 917521, 1048583,
                1179653, 1310729, 1441801, 1572869, 1703941, 1835017, 1966087, 2097169, 2228243, 2359319, 2490389,
                2621471, 2752549, 2883617, 3014687, 3145757, 3276833, 3407903, 3538973)  # the C's ROLLING_COEFFS
NGRAM_PAIR_MIX = 1000003
NGRAM_ORDERS = range(2, len(NGRAM_COEFFS) + 2)  # the C reads ROLLING_COEFFS[j] for j < order-1 <= 32


def _mark_run_starts(sorted_vals, is_start):
    """is_start[k] = True where a run of equal values of the sorted 1-D tensor begins (in place; returns it)."""
    is_start[0] = True
    torch.ne(sorted_vals[1:], sorted_vals[:-1], out=is_start[1:])
    return is_start


def _running_max(x, out, spare, width=1024):
    """Inclusive running max of the 1-D int64 tensor x, written into out (spare: a buffer of x's size that receives
    cummax's unused indices). Scanned as rows of `width` and then across row ends: CUDA's cummax gives each row one
    thread block, so one long row would run on a single block."""
    n = x.numel()
    rows = n // width
    k = rows * width
    if rows:
        torch.cummax(x[:k].view(rows, width), 1, out=(out[:k].view(rows, width), spare[:k].view(rows, width)))
    if k < n:
        torch.cummax(x[k:], 0, out=(out[k:], spare[k:]))
    if rows:
        ends = out[width - 1:k:width].cummax(0).values  # running max at each row's end
        body = out[width:k].view(rows - 1, width)
        torch.maximum(body, ends[:-1, None], out=body)
        torch.maximum(out[k:], ends[-1], out=out[k:])
    return out


def ngram_tilt_keys(targets, order):
    """SPEC-FRONTIER 20(a): the record's C keys for every target i >= order-2 (the ones with a full context), as
    int64 (its uint64 values: keys < 2^38, pair keys < 2^58): (context key, pair key, token as int32). The stream is
    S = [T[0]] + T (the C's ring seeded with T[0]), target i's context S[i+2-order .. i] read oldest first, its key
    XOR_j S[i+2-order+j]*C[j] and its pair key key*1000003 ^ T[i]*C[(order-1) % 32]."""
    L = order - 1
    m = targets.numel() - L + 1
    s = torch.cat([targets[:1], targets]).to(torch.int64)
    if int(s.min()) < 0 or int(s.max()) > 0xFFFF:
        raise ValueError("ngram_tilt_hints: token ids must lie in 0..65535 (the C keeps them as uint16)")
    key = s[:m] * NGRAM_COEFFS[0]
    pair = torch.empty_like(key)
    for j in range(1, L):
        key.bitwise_xor_(torch.mul(s[j:j + m], NGRAM_COEFFS[j], out=pair))
    tok = s[L:].to(torch.int32)
    torch.mul(key, NGRAM_PAIR_MIX, out=pair).bitwise_xor_(s[L:].mul_(NGRAM_COEFFS[L % len(NGRAM_COEFFS)]))
    return key, pair, tok


def ngram_tilt_hints(targets, order):
    """SPEC-FRONTIER 20(a): #2135's token n-gram hint for every target, equal to its C's token channel (tokens
    exactly, probabilities bit for bit), without a loop over positions. targets: 1-D integer tensor of every val
    target in order (val_tokens[1:], ids < 65536). Returns (top_token int64, top_prob float32), same length and
    device: for target i, the most frequent next token after the same order-1 earlier targets and its share,
    counted over earlier positions only (hint i depends on targets < i).

    The C's pass, restated: the stream is S = [T[0]] + T (its ring is seeded with T[0]); target i >= order-2 has the
    context S[i+2-order .. i] and the key XOR_j S[i+2-order+j]*C[j] (< 2^38: different contexts can share a key and
    then share counts). It emits the state its key was left in by earlier targets, (top_tok, float32(top_count) /
    float32(total)), or (0, 0.0) for a new key; then c = the count of the pair key key*1000003 ^ tok*C[(order-1) % 32]
    so far, itself included (different (key, tok) can share a pair key and its count too), and top becomes (c, tok)
    when c > top_count, strictly. Targets before order-2 emit (0, 0.0). Here: a stable sort by pair key makes c each
    target's rank in its run; a stable sort by key puts each key's targets in stream order, where top_count is a
    segmented running max of c (cummax of run_start*(m+1) + c) and top_tok the token where it last rose (cummax of
    the indices where it rises). Keys stay below 2^38 and pair keys below 2^58, so int64 holds the C's uint64 values.

    Memory: about 9.5 int64 arrays of the stream's length at peak; for 47,851,520 targets 3.44 GiB above the input
    (peak RSS on CPU, docs/evaluation.md). Sorts, scans, gathers and scatters only: on a CUDA tensor it all runs on
    the GPU."""
    if targets.dim() != 1:
        raise ValueError(f"ngram_tilt_hints: targets must be 1-D, got shape {tuple(targets.shape)}")
    if order not in NGRAM_ORDERS:
        raise ValueError(f"ngram_tilt_hints: order {order} outside {NGRAM_ORDERS.start}..{NGRAM_ORDERS.stop - 1}")
    n, dev, L = targets.numel(), targets.device, order - 1
    top_tok = torch.zeros(n, dtype=torch.int64, device=dev)
    top_prob = torch.zeros(n, dtype=torch.float32, device=dev)
    m = n - L + 1  # targets with a full context: i = L-1 .. n-1
    if n == 0 or m <= 0:
        return top_tok, top_prob
    key, pair, tok = ngram_tilt_keys(targets, order)
    # Full-length work buffers, reused through out= (fewer fresh allocations: on CPU each costs page faults).
    # cummax's indices output is unused; it goes to whichever buffer is free at that step.
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    vals, perm = torch.sort(pair, stable=True)
    idx, run_start = torch.arange(m, device=dev), torch.empty_like(key)
    is_start = _mark_run_starts(vals, torch.empty(m, dtype=torch.bool, device=dev))
    _running_max(torch.where(is_start, idx, zero, out=pair), run_start, vals)
    count = pair.scatter_(0, perm, torch.sub(idx, run_start, out=run_start).add_(1))  # pair count, stream order
    del idx, run_start  # (lower peak: the sort's own buffers come next)
    torch.sort(key, stable=True, out=(vals, perm))  # perm: targets by key, each key's in stream order
    _mark_run_starts(vals, is_start)
    idx, run_start = torch.arange(m, device=dev), torch.empty_like(key)
    _running_max(torch.where(is_start, idx, zero, out=key), run_start, vals)
    spare = torch.empty_like(key)
    base = torch.mul(run_start, m + 1, out=spare)
    _running_max(torch.gather(count, 0, perm, out=key).add_(base), vals, pair)  # (count is consumed here)
    top_count = vals.sub_(base)  # running max of the pair counts within each key's run
    rises = is_start.clone()
    rises[1:] |= top_count[1:] > top_count[:-1]
    _running_max(torch.where(rises, idx, zero, out=key), pair, spare)  # where top_count last rose
    del rises
    best = tok.gather(0, torch.gather(perm, 0, pair, out=key))
    del tok, pair, key
    # a key's k-th target (k >= 1) emits the state left by its (k-1)-th: (best, top_count / k); its first (0, 0.0)
    out_tok = spare
    out_tok[0] = 0
    out_tok[1:].copy_(best[:-1])
    del best
    count_f = top_count.to(torch.float32)
    del vals, top_count
    out_prob = torch.sub(idx, run_start, out=run_start).to(torch.float32)  # k
    del idx, run_start
    torch.div(count_f[:-1], out_prob[1:], out=out_prob[1:])
    out_prob[0] = 0.0
    top_tok[L - 1:].scatter_(0, perm, out_tok.masked_fill_(is_start, 0))
    top_prob[L - 1:].scatter_(0, perm, out_prob.masked_fill_(is_start, 0.0))
    return top_tok, top_prob


# ---- the tilt of the final score (issue 29; SPEC-FRONTIER 20(b)-(d)): NGRAM_TILT=1

class NgramTilt(NamedTuple):
    """NGRAM_TILT=1's hints for the whole val stream (build_ngram_tilt): hint[p] (int32, CPU) is the hinted token of
    target val_tokens[p + 1] where the gate holds (its n-gram probability >= NGRAM_TILT_THRESHOLD), else -1."""
    hint: Tensor
    boost: float  # NGRAM_TILT_BOOST


def ngram_tilt_loss(nll, log_q, y, hint, gate, boost):
    """The token n-gram tilt of per-token losses (SPEC-FRONTIER 20(c); #2135's apply_tilt_to_ptl_torch_fast), fp32:
    where `gate`, nll - boost*[y == hint] + log1p(q*expm1(boost)) with q = exp(min(log_q, 0)), log_q the model's log
    probability of the hint from the same log_softmax as nll; elsewhere nll unchanged. It is -log p'(y) for the
    tilted distribution p'(v) = p(v) * e^(boost*[v == hint]) / (1 + q*(e^boost - 1)), which still sums to 1."""
    b = torch.tensor(boost, dtype=torch.float32, device=nll.device)
    nll = nll.float()
    q = log_q.float().clamp(max=0.0).exp()
    tilted = nll - b * (y == hint).float() + torch.log1p(q * torch.expm1(b))
    return torch.where(gate, tilted, nll)


def token_scores(logits, y, tilt=None, hint_pos=None, valid=None):
    """(nll, score) of logits (..., V) for targets y: nll the fp32 cross entropy per token (autograd kept: what TTT
    trains on), score what the evaluation sums: nll detached, or with tilt (NgramTilt) ngram_tilt_loss, log q from
    the same fp32 log_softmax, for the targets whose input tokens sit at global positions hint_pos (CPU, y's shape)
    and gated only where `valid` (CPU bool)."""
    if tilt is None:
        nll = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none")
        nll = nll.view(y.shape)
        return nll, nll.detach()
    logp = F.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    hint = tilt.hint[hint_pos.clamp(0, tilt.hint.numel() - 1)]
    gate = ((hint >= 0) & valid).to(y.device)
    hint = hint.clamp(min=0).to(y.device, torch.int64)
    log_q = logp.detach().gather(-1, hint.unsqueeze(-1)).squeeze(-1)
    return nll, ngram_tilt_loss(nll.detach(), log_q, y, hint, gate, tilt.boost)


def build_ngram_tilt(rt, val_tokens, label):
    """NGRAM_TILT=1: the gated hints of every val target (ngram_tilt_hints over val_tokens[1:] at NGRAM_TILT_ORDER,
    gate: probability >= float32(NGRAM_TILT_THRESHOLD)), built once by rank 0 on its device and broadcast (#2135 had
    every rank build its own, SPEC-FRONTIER 20(d): the same hints; measured on CPU, where ranks share cores, the
    broadcast costs little and the concurrent builds slowed each other ~2x; docs/evaluation.md). The caller does it
    inside the timer of the score it tilts (`label`); a log line gives the gated count and the seconds. None with
    NGRAM_TILT=0."""
    h = rt.h
    if not h.ngram_tilt:
        return None
    pf = _PREFLIGHT[0]
    source = val_tokens if pf is None else pf.full_val  # PREFLIGHT=1: built on the whole stream, as the run builds it
    rt.sync()
    t0 = time.perf_counter()
    if rt.is_main:
        top, prob = ngram_tilt_hints(source[1:].to(rt.device), h.ngram_tilt_order)
        gate = prob >= torch.tensor(h.ngram_tilt_threshold, dtype=torch.float32, device=prob.device)
        hint = torch.where(gate, top, -1).to(torch.int32)
        del top, prob, gate
    else:
        hint = torch.empty(source.numel() - 1, dtype=torch.int32, device=rt.device)
    rt.sync()
    t1 = time.perf_counter()
    if rt.distributed:
        dist.broadcast(hint, 0)
    hint = hint.cpu()
    t2 = time.perf_counter()
    if pf is not None:
        pf.tilt_build_s[label] = round(t2 - t0, 3)
    rt.log(f"ngram_tilt: tilting {label} order:{h.ngram_tilt_order} threshold:{h.ngram_tilt_threshold:g} "
           f"boost:{h.ngram_tilt_boost:g} gated:{int((hint >= 0).sum())}/{hint.numel()} build:{t1 - t0:.2f}s "
           f"broadcast:{t2 - t1:.2f}s device:{rt.device.type} (rank 0 builds, inside the {label} timer)")
    # PREFLIGHT=1: the slice's targets are the stream's first
    return NgramTilt(hint[:val_tokens.numel() - 1], h.ngram_tilt_boost)


# ==================================================
# MAIN
# ==================================================

_STAGE = ["start-up"]  # what the run is doing: a failure's one-line error names it


_PREFLIGHT = [None]  # PREFLIGHT=1: the run's Preflight (what it measured, its report), else None


def stage(name):
    _STAGE[0] = name
    if _PREFLIGHT[0] is not None:
        _PREFLIGHT[0].begin(name)


def artifact_files(h, stem=None):
    """The raw state dict and the artifact a run writes in runs/$RUN_ID; PREFLIGHT=1 writes its own, removed after its
    report."""
    stem = stem or ("preflight_model" if h.preflight else "final_model")
    return os.path.join(h.run_dir, stem + ".pt"), os.path.join(h.run_dir, stem + ".int6.ptz")


def stale_outputs(h):
    """OVERWRITE_RUN=1: the finished run's files in runs/$RUN_ID: its raw model and artifact, and its rehearsal's
    preflight.json when no newer than its artifact (a rehearsal made since, for this run, stays)."""
    out = [name for name in artifact_files(h) if os.path.exists(name)]
    report, done = os.path.join(h.run_dir, "preflight.json"), artifact_files(h)[1]
    if os.path.exists(report) and os.path.exists(done) and os.path.getmtime(report) <= os.path.getmtime(done):
        out.append(report)
    return out


def merge_shapes(*shapes):
    """EvalShapes as one: every shape of any (PREFLIGHT=1 warms the whole val set's and its slice's)."""
    return EvalShapes(*(sorted(set().union(*x)) for x in zip(*shapes)))


def project_training(h, ms):
    """PREFLIGHT=1: the real run's steps and training seconds from each training state's measured ms per step (`ms`,
    by state_key). Each state's share of the schedule (schedule_states over 1,000 steps: ENABLE_LOOPING_AT,
    TRAIN_SEQ_LEN_SCHEDULE and WARMDOWN_FRAC exactly; late QAT's part of a WARMDOWN_ITERS warmdown as if it spanned
    the run, its length under a cap being known only from the step time) is taken as its share of the real run's
    time, as the real loop decides them by elapsed time under its cap: steps = sum(share x cap / ms), ITERATIONS at most; a
    cap that binds is the training time, else ITERATIONS steps at the shares' ms."""
    if h.clock is not None:
        return project_replay(h, ms)
    keys = [state_key(*st) for st in schedule_states(h, 1000)]
    shares, mean = {k: keys.count(k) / 1000.0 for k in dict.fromkeys(keys)}, sum(ms.values()) / len(ms)
    cap, iterations = h.real["max_wallclock_ms"], h.real["ITERATIONS"]
    steps = iterations
    if cap:
        steps = min(iterations, int(sum(f * cap / max(ms.get(k, mean), 1e-9) for k, f in shares.items())))
    if cap and steps < iterations:
        train_s = cap / 1000.0
    else:
        train_s = steps * sum(f * ms.get(k, mean) for k, f in shares.items()) / 1000.0
    return {"shares": {k: round(f, 4) for k, f in shares.items()}, "projected_steps": steps,
            "projected_train_s": round(train_s, 1)}


def project_replay(h, ms):
    """PREFLIGHT=1 under a replay clock (issue 40): the replay's steps in each training state (replay_schedule with
    the real run's settings: the steps do not depend on this machine), times each state's measured ms per step (the
    mean of the measured states for one the rehearsal did not time): how long the replay takes here."""
    real = copy.copy(h)
    for name in PREFLIGHT_CHANGES:
        setattr(real, real._attr(name), h.real[name])
    replay = replay_schedule(real)
    mean = sum(ms.values()) / len(ms)
    train_s = sum(n * ms.get(k, mean) for k, n in replay.states.items()) / 1000.0
    return {"clock": h.clock.name, "shares": {k: round(n / replay.stop, 4) for k, n in replay.states.items()},
            "projected_steps": replay.stop, "projected_train_s": round(train_s, 1)}


class Preflight:
    """PREFLIGHT=1 (issue 36; docs/running.md): the whole run rehearsed before the real one, through the run's own
    code (run(): every stage once on the real shapes, the evaluations on a slice of the val set). This object only
    keeps what the rehearsal measured: each stage's seconds (stage()), each training state's step times, the timed
    evaluations, the tilt's build, the compiled regions and the artifact; report() projects them to the real
    settings (Hyperparameters.real), writes preflight.json and the log's preflight: lines, and gives the verdict."""

    def __init__(self, rt):
        self.rt, self.stages, self.current = rt, [], None
        self.full_val = self.targets = None  # the tilt's hints come from the whole stream: its cost is the stream's
        self.steps, self.last_ms = {}, 0.0  # training state -> [ms of each timed step]
        self.scored, self.tilt_build_s, self.regions, self.artifact = set(), {}, {}, None  # scored: evaluation labels
        self.scoring_alone = None  # {label: seconds} of the real run's evaluations without adapting (under a budget)
        self.costs = {}  # the warmup's timed calls at the real shapes (under the real run's budget)
        self.begin("start-up")

    def slice(self):
        """The evaluations' val tokens: a prefix of the stream (so the whole stream's hints are its hints too) with
        PREFLIGHT_VAL_TOKENS targets (0: 4 EVAL_SEQ_LEN rows a rank, and with chunked SGD TTT 2 chunks at least, so
        that a chunk is trained on and the next scored after it: TTT's step runs)."""
        h = self.rt.h
        sgd_ttt = 2 * h.ttt_chunk_tokens if h.ttt_enabled and h.ttt_mode != "lora" else 0
        n = min(h.preflight_val_tokens or max(4 * h.world_size * h.eval_seq_len, sgd_ttt), self.full_val.numel() - 1)
        return self.full_val[:n + 1]

    def begin(self, name):
        self._close("ok")
        self.current = (name, time.perf_counter())

    def _close(self, status):
        """The current stage into self.stages with its status and seconds."""
        if self.current is not None:
            name, since = self.current
            self.stages.append({"stage": name, "status": status, "seconds": round(time.perf_counter() - since, 3)})
            self.current = None

    def training_step(self, looping, cut, qat, approx_ms):
        self.steps.setdefault(state_key(looping, cut, qat), []).append(approx_ms - self.last_ms)
        self.last_ms = approx_ms

    def training(self):
        """Each state's timed steps and mean ms per step, and the real run projected from them (project_training)."""
        total = sum(len(v) for v in self.steps.values())
        states = {k: {"steps": len(v), "ms_per_step": round(sum(v) / len(v), 3)} for k, v in self.steps.items()}
        out = {"timed_steps": total, "states": states, "max_wallclock_ms": self.rt.h.real["max_wallclock_ms"]}
        if total:
            out.update(project_training(self.rt.h, {k: v["ms_per_step"] for k, v in states.items()}))
        return out

    def evaluation(self):
        """Each evaluation stage's seconds and its projection to the whole val set: the scored evaluations and the
        diagnostic scale with the targets (the tilt's build, already the whole stream's, does not); the artifact's
        loading does not scale. Against the real run's EVAL_BUDGET_SECONDS (issue 46): whether its guard would cut
        TTT (the unguarded projection past the budget less its margin) and whether scoring alone fits (the warmup's
        timed calls at the real shapes, scoring_projection, plus the other stages' projections; at most the unguarded
        projection); without a budget,
        against MAX_WALLCLOCK_SECONDS (600 if none)."""
        sliced, full = self.targets
        scale = full / max(sliced, 1)
        rows, total = [], 0.0
        for st in self.stages:
            name = st["stage"]
            label = name[len("evaluation ("):-1] if name.startswith("evaluation (") else None
            if name == "evaluating the final weights" or label in self.scored:
                build = self.tilt_build_s.get(label, 0.0)
                projected = build + (st["seconds"] - build) * scale
            elif label is not None or name == "loading the artifact":
                projected = st["seconds"]
            else:
                continue
            rows.append({"stage": name, "seconds": st["seconds"], "projected_s": round(projected, 1)})
            total += projected
        real = self.rt.h.real
        guarded = real["EVAL_BUDGET_SECONDS"] > 0
        budget = real["EVAL_BUDGET_SECONDS"] if guarded else (real["MAX_WALLCLOCK_SECONDS"] or 600.0)
        out = {"slice_targets": sliced, "val_targets": full, "stages": rows, "tilt_build_s": self.tilt_build_s,
               "projected_s": round(total, 1), "budget_s": budget, "guarded": guarded}
        if guarded:
            margin = EvalBudget.margin_for(budget)
            out.update(guard_cuts_ttt=total + margin > budget, margin_s=round(margin, 1),  # (adapting only adds)
                       scoring_alone_s=round(min(self.scoring_alone_s(rows), total), 1))
            h = self.rt.h
            if h.phased_ttt_prefix_auto and self.costs:  # what the real run's plan would choose on this machine
                before = sum(r["projected_s"] for r in rows if r["stage"] != "evaluation (legal_ttt)")
                queue_ = lora_ttt_queue(lora_ttt_documents(self.full_val), h.ttt_batch_size)
                prefix, parts = plan_prefix_docs(h, queue_, self.costs, before + self.tilt_build_s.get("legal_ttt", 0.0),
                                                 budget)
                out["ttt_plan"] = {"prefix_docs": prefix, **{k: round(v, 4) if isinstance(v, float) else v
                                                             for k, v in parts.items()}}
        return out

    def scoring_alone_s(self, rows):
        """The real run's evaluation without adapting: each stage once, its projected seconds (the post-EMA diagnostic,
        the artifact's load, the evaluations the budget's projection leaves out), but the evaluations that
        scoring_projection projected from the warmup's timed calls at the real shapes (self.scoring_alone), with
        their tilt's build, which that projection leaves out."""
        alone = self.scoring_alone or {}
        other = sum(r["projected_s"] for r in rows if not r["stage"].startswith("evaluation (")
                    or r["stage"][len("evaluation ("):-1] not in alone)
        return other + sum(v + self.tilt_build_s.get(k, 0.0) for k, v in alone.items())

    def peak_memory_mib(self, collective):
        """Each rank's peak memory (CUDA: allocated; CPU: the process's resident set), MiB."""
        rt = self.rt
        if rt.device.type == "cuda":
            mine = torch.cuda.max_memory_allocated(rt.device) / 2 ** 20
        else:
            mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        peaks = torch.zeros(rt.h.world_size, dtype=torch.float64, device=rt.device)
        peaks[rt.h.rank] = mine
        if collective:
            rt.all_reduce(peaks)
        return [round(v, 1) for v in peaks.tolist()]

    def report(self, error=None):
        """The report (log lines and, on rank 0, preflight.json), then the rehearsal's files removed; returns the
        exit status: 0 for `preflight: ready`, 1 for `preflight: NOT READY: <the first problem>`. After an error no
        collective is made (the other ranks may be gone)."""
        rt, h = self.rt, self.rt.h
        self._close("failed" if error else "ok")
        peaks = self.peak_memory_mib(collective=error is None)
        rep = {"preset": h.preset, "world_size": h.world_size, "device": str(rt.device),
               "settings": {"real": {k: v for k, v in h.real.items() if k in PREFLIGHT_CHANGES},
                            "rehearsal": h.rehearsal_settings()},
               "stages": self.stages, "training": self.training(), "peak_memory_mib": peaks,
               "compile": [{"name": f.name, "graphs": f.graphs, "planned": f.planned, "compile_s": round(f.compile_s, 1),
                            "eager_calls": f.eager_calls} for f in rt.compiled],
               "compile_regions": {k: {"graphs_compiled": g, "eager_calls": e} for k, (g, e) in self.regions.items()}}
        if self.targets is not None and error is None:
            rep["evaluation"] = self.evaluation()
        if self.artifact is not None:
            model, code = self.artifact
            rep["artifact"] = {"model_bytes": model, "code_bytes": code, "total_bytes": model + code,
                               "cap_bytes": SIZE_CAP_BYTES}
        rep["problems"] = problems = self.problems(rep, error)
        rep["verdict"] = "preflight: ready" if not problems else f"preflight: NOT READY: {problems[0]}"
        rt.log(self.lines(rep))
        if rt.is_main:
            write_atomically(os.path.join(h.run_dir, "preflight.json"), (json.dumps(rep, indent=1) + "\n").encode())
            for name in artifact_files(h):
                with contextlib.suppress(OSError):
                    os.remove(name)
        _PREFLIGHT[0] = None
        return 1 if problems else 0

    @staticmethod
    def problems(rep, error):
        """What would make the real run fail or not count, most basic first."""
        out = [error] if error else []
        for region, c in rep["compile_regions"].items():
            if c["graphs_compiled"] or c["eager_calls"]:
                out.append(f"the timed region {region} compiled {c['graphs_compiled']} graphs and ran "
                           f"{c['eager_calls']} calls eager (the warmups missed a shape)")
        art = rep.get("artifact")
        if art and art["total_bytes"] > SIZE_CAP_BYTES:
            out.append(f"the artifact is {art['total_bytes']} bytes (model {art['model_bytes']} + code "
                       f"{art['code_bytes']}), over the {SIZE_CAP_BYTES}-byte cap")
        ev = rep.get("evaluation")
        if ev and ev["guarded"] and ev["scoring_alone_s"] > ev["budget_s"]:
            out.append(f"the evaluation's scoring alone is projected to take {ev['scoring_alone_s']:.0f}s, over its "
                       f"{ev['budget_s']:g}s budget (EVAL_BUDGET_SECONDS): no TTT could fit")
        elif ev and not ev["guarded"] and ev["projected_s"] > ev["budget_s"]:
            out.append(f"the evaluation is projected to take {ev['projected_s']:.0f}s, over its {ev['budget_s']:g}s "
                       "budget (MAX_WALLCLOCK_SECONDS; EVAL_BUDGET_SECONDS=0: no guard)")
        return out

    @staticmethod
    def lines(rep):
        out = [f"preflight: stage {st['stage']}: {st['status']} {st['seconds']:.1f}s" for st in rep["stages"]]
        tr = rep["training"]
        states = "; ".join(f"{k} {v['steps']} steps {v['ms_per_step']:.1f}ms" for k, v in tr["states"].items())
        cap = tr["max_wallclock_ms"]
        where = (f"replaying train_clock:{tr['clock']} (the replayed run's steps, at this machine's step times)"
                 if "clock" in tr else f"in the loop's {cap / 1000.0:.1f}s" if cap else "(no wallclock cap: ITERATIONS)")
        out.append(f"preflight: training timed_steps:{tr['timed_steps']} ({states}) projected_steps:"
                   f"{tr.get('projected_steps', 0)} projected_train:{tr.get('projected_train_s', 0):.1f}s " + where)
        ev = rep.get("evaluation")
        if ev:
            parts = "; ".join(f"{r['stage']} {r['seconds']:.1f}s -> {r['projected_s']:.1f}s" for r in ev["stages"])
            out.append(f"preflight: evaluation slice_targets:{ev['slice_targets']} of {ev['val_targets']} ({parts}) "
                       f"projected:{ev['projected_s']:.1f}s budget:{ev['budget_s']:g}s")
            if ev["guarded"]:
                out.append(f"preflight: eval_budget budget:{ev['budget_s']:g}s margin:{ev['margin_s']:g}s unguarded:"
                           f"{ev['projected_s']:.1f}s scoring_alone:{ev['scoring_alone_s']:.1f}s guard:" + (
                            "would cut TTT" if ev["guard_cuts_ttt"] else "would not cut TTT"))
            plan = ev.get("ttt_plan")
            if plan:
                out.append(f"preflight: ttt_plan PHASED_TTT_PREFIX_DOCS=auto would choose {plan['prefix_docs']} (max "
                           f"{plan['cap']} of {plan['docs']} docs) before_ttt:{plan['before_s']:.1f}s ttt_steps:"
                           f"{plan['steps_s']:.1f}s phases:{plan['phase_rows'] * plan['row_s']:.1f}s projected_end:"
                           f"{plan['end_s']:.1f}s on this machine's rates" + ("" if plan["fits"] else
                                                                              " (even no prefix does not fit)"))
        art = rep.get("artifact")
        if art:
            out.append(f"preflight: artifact model:{art['model_bytes']} code:{art['code_bytes']} "
                       f"total:{art['total_bytes']} cap:{art['cap_bytes']} (this rehearsal's few-step model: a trained "
                       "one compresses differently, so the real run's model bytes are not projected)")
        out.append("preflight: peak_memory_mib " + " ".join(f"rank{i}:{v:.0f}" for i, v in enumerate(rep["peak_memory_mib"])))
        for c in rep["compile"]:
            out.append(f"preflight: compile {c['name']} graphs:{c['graphs']} planned:{c['planned']} "
                       f"compile_s:{c['compile_s']} eager_calls:{c['eager_calls']}")
        out.append(rep["verdict"])
        return out


def scored_evaluations(h):
    """The run's scored evaluations in the order they run, {label: settings}: the post-EMA diagnostic (DIAGNOSTIC_POST_EMA;
    training's weights, so never with EVAL_ONLY), the artifact's round trip (DIAGNOSTIC_ROUNDTRIP), the sliding window
    (EVAL_STRIDE > 0) and legal TTT (TTT_ENABLED). run() and evaluate_artifact() run exactly these. Each preset's are
    its record's, read from the record's log by tests/test_presets.py, but for the two diagnostics the LoRA presets
    leave out of the budget (issue 51)."""
    lora = h.ttt_mode == "lora"
    plan = {"post_ema": "", "final_int6_roundtrip": "", "final_int6_sliding_window": f"stride:{h.eval_stride}",
            "legal_ttt": f"mode:{h.ttt_mode} " + (f"phases:{h.phased_ttt_num_phases} prefix_docs:" + (
                f"auto(max {h.phased_ttt_prefix_docs_max or 'all'})" if h.phased_ttt_prefix_auto else
                str(h.phased_ttt_prefix_docs)) if lora else f"epochs:{h.ttt_epochs}")}
    on = {"post_ema": h.diagnostic_post_ema and not h.eval_only, "final_int6_roundtrip": h.diagnostic_roundtrip,
          "final_int6_sliding_window": h.eval_stride > 0, "legal_ttt": h.ttt_enabled}
    return {label: settings for label, settings in plan.items() if on[label]}


class Evaluation(NamedTuple):
    """The evaluation's model and callables (prepare_evaluation); costs: the warmup's timed calls (under a budget)."""
    model: nn.Module
    forward: object  # eval_val's and SGD TTT's loss: the model or its compiled form
    logits_fn: object  # the sliding window's and SGD TTT's scoring
    lora_fn: object  # TTT_MODE=lora's forward, else None
    costs: dict


def eval_qat_states(rt):
    """The QAT flags SGD TTT's training graphs are warmed with: those training can end with (qat_states: QAT_ENABLED's,
    and on with LATE_QAT_THRESHOLD; eager runs compile nothing: one), both with EVAL_ONLY (the artifact's flag is read
    inside the evaluation's clock)."""
    return [False, True] if rt.h.eval_only and compile_enabled(rt) else qat_states(rt)


def import_lazy_modules():
    """What the evaluation's first calls would import inside its clock, imported now (issue 51): a process's first
    optimizer imports torch._dynamo (2.9 s of an EVAL_ONLY's 3.2 s SGD TTT on CPU), its first step the profiler's
    hook, torch.load its settings."""
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)
    p.grad = torch.zeros(1)
    opt.step()
    buf = io.BytesIO()
    torch.save(p.detach(), buf)
    buf.seek(0)
    torch.load(buf)


def prepare_evaluation(rt, val_tokens):
    """The evaluation's model, built and warmed before any clock starts (issue 46): before training's warmup, or with
    EVAL_ONLY before the evaluation's clock. Every graph the scored evaluations call (evaluation_shapes; LoRA TTT's
    steps, warm_lora_ttt) is called once on random tokens for each QAT flag of eval_qat_states, so the evaluation
    compiles nothing; under a budget each is timed once more (the budget's first rates). The artifact's weights are
    loaded into this model in place (load_artifact), keeping its parameters and so its graphs. The global generators
    are left as they were: the training run draws what it drew before."""
    h, pf = rt.h, _PREFLIGHT[0]
    lora = h.ttt_enabled and h.ttt_mode == "lora"
    import_lazy_modules()
    CONTEXT.enter("evaluation")
    with torch.random.fork_rng(devices=[rt.device] if rt.device.type == "cuda" else []):
        model = rt.prepare_model(build_model(h))
        model.looping = h.num_loops > 0  # a looped model is evaluated looped (SPEC-FRONTIER 4)
        streams = [val_tokens] if pf is None else [val_tokens, pf.full_val]  # PREFLIGHT=1: the real run's shapes too
        shapes = merge_shapes(*(evaluation_shapes(h, v.numel() - 1) for v in streams))
        sizes = [len(b) for v in streams for _, b in lora_ttt_queue(lora_ttt_documents(v), h.ttt_batch_size)] if lora else []
        qats = eval_qat_states(rt)  # (only SGD TTT's training graphs depend on the flag: eval mode never reads it)
        forward = compile_fn(rt, "eval_forward", model, model.graph_state, len(shapes.val) + len(qats) * len(shapes.train))
        logits_fn = compile_fn(rt, "eval_logits", model.forward_logits, model.graph_state, score_graphs(h, shapes))
        lora_fn, how = lora_forward(rt, model, len(lora_warm_shapes(h, sizes))) if lora else (None, None)
        budgeted = h.eval_budget_seconds > 0 or (pf is not None and h.real["EVAL_BUDGET_SECONDS"] > 0)
        costs = {} if budgeted else None  # PREFLIGHT=1: timed for the real run's budget (its report)
        if compile_enabled(rt) or costs is not None:
            stage("warming the evaluation graphs")
            t0 = time.perf_counter()
            for i, qat in enumerate(qats):
                model.set_qat(qat)
                warm_evaluation(rt, model, forward, logits_fn, shapes if i == 0 else EvalShapes([], [], [], shapes.train),
                                costs)
            rt.log(f"eval_warmup: time:{time.perf_counter() - t0:.1f}s qat:{','.join(str(int(q)) for q in qats)} "
                   "(every scored evaluation's graphs, random tokens, before the clocks)")
        if lora:
            stage("warming the LoRA TTT step")
            CONTEXT.enter("ttt")
            t0 = time.perf_counter()
            warmed = warm_lora_ttt(rt, model, lora_fn, sizes, costs)  # frozen weights, eval mode: any QAT flag
            rt.log(f"ttt_lora_warmup: forward:{how} shapes:{' '.join(f'{n}x{w}' for n, w in warmed)} "
                   f"time:{time.perf_counter() - t0:.1f}s (random tokens, before the clocks)")
    return Evaluation(model, forward, logits_fn, lora_fn, costs or {})


def scoring_projection(h, ev, val_tokens):
    """{label: seconds} of each scored evaluation on this rank without adapting, from the warmup's timed calls (LoRA
    TTT: the queue's forward tokens shared evenly by the ranks; the n-gram tilt's build not included): the budget's
    plan line."""
    c, L, out, num_targets = ev.costs, h.eval_seq_len, {}, val_tokens.numel() - 1
    plan = scored_evaluations(h)
    if "final_int6_roundtrip" in plan:
        batches = eval_val_split(h, num_targets)[0]
        out["final_int6_roundtrip"] = sum(c.get(("val", (rows, L)), 0.0) for _, rows in batches)
    if "final_int6_sliding_window" in plan:
        mine = len(rank_slice(sliding_windows(num_targets, L, h.eval_stride), h))
        rows = eval_batch_rows(h, [mine])
        out["final_int6_sliding_window"] = -(-mine // rows) * c.get(("score", rows), 0.0)
    if "legal_ttt" in plan:
        if h.ttt_mode == "lora":
            queue_ = lora_ttt_queue(lora_ttt_documents(val_tokens), h.ttt_batch_size)
            out["legal_ttt"] = sum(lora_batch_seconds(h, b, c.get("lora_fit"))[1] for _, b in queue_) / h.world_size
        else:
            chunks, rows = ttt_chunk_windows(h, num_targets)
            out["legal_ttt"] = sum(-(-len(rank_slice(w, h)) // rows) for w in chunks) * c.get(("score", rows), 0.0)
    return out


def evaluate_artifact(rt, ev, val_tokens, luts, t_eval):
    """Round-trip, sliding-window and legal-TTT evaluation of the model prepare_evaluation built, the artifact's
    weights in it; then evaluation_time, the TTT loop's and the whole evaluation's wall time since t_eval
    (perf_counter), which the budget (EVAL_BUDGET_SECONDS, EvalBudget) counts from too."""
    h, pf = rt.h, _PREFLIGHT[0]
    model, forward, logits_fn = ev.model, ev.forward, ev.logits_fn
    budget = EvalBudget(rt, t_eval, ev.costs)

    def timed(label, fn, extra="", note=None):
        stage(f"evaluation ({label})")
        CONTEXT.enter("ttt" if label == "legal_ttt" else "evaluation")
        rt.sync()
        t0 = time.perf_counter()
        with compile_region(label):
            loss, bpb = fn()
        rt.sync()
        log_compile_region(rt, label)
        if not math.isfinite(loss):
            lr = "TTT_LORA_LR" if h.ttt_mode == "lora" else "TTT_LR"
            raise RunError(f"{label}: val_loss is {loss}" + (f" (lower {lr})" if label == "legal_ttt" else ""))
        ms = 1000.0 * (time.perf_counter() - t0)
        if pf is not None:  # a slice's score: no line that reads as a finished run's
            pf.scored.add(label)
            rt.log(f"preflight_eval: {label} targets:{val_tokens.numel() - 1} val_loss:{loss:.4f} val_bpb:{bpb:.4f}"
                   f"{extra} eval_time:{ms:.0f}ms")
            return ms / 1000.0
        rt.log(f"{label} val_loss:{loss:.4f} val_bpb:{bpb:.4f}{extra} eval_time:{ms:.0f}ms"
               + (note.score_note() if note is not None else ""))
        rt.log(f"{label}_exact val_loss:{loss:.8f} val_bpb:{bpb:.8f}")
        return ms / 1000.0

    plan = scored_evaluations(h)
    if budget.budget > 0:
        budget.plan(scoring_projection(h, ev, val_tokens))
    if pf is not None and ev.costs:  # the real run's scoring without adapting, for the report
        pf.scoring_alone = scoring_projection(h, ev, pf.full_val)
        pf.costs = ev.costs
    if "final_int6_roundtrip" in plan:
        timed("final_int6_roundtrip", lambda: eval_val(rt, forward, val_tokens, luts))
    # NGRAM_TILT=1 tilts the final score only: legal TTT's, else the sliding window's (SPEC-FRONTIER 20(c))
    if "final_int6_sliding_window" in plan:
        label = "final_int6_sliding_window"
        timed(label, lambda: eval_sliding(rt, model, logits_fn, val_tokens, luts, tilt=None if h.ttt_enabled else
                                          build_ngram_tilt(rt, val_tokens, label)), f" stride:{h.eval_stride}")
    ttt_s = None
    if "legal_ttt" in plan and h.ttt_mode == "lora":  # the tilt's build inside the timer of the score it tilts
        ttt_s = timed("legal_ttt", lambda: eval_ttt_lora(rt, model, val_tokens, luts, forward=ev.lora_fn, budget=budget,
                                                         tilt=build_ngram_tilt(rt, val_tokens, "legal_ttt")), note=budget)
    if "legal_ttt" in plan and h.ttt_mode != "lora":
        ttt_s = timed("legal_ttt", lambda: eval_ttt(rt, model, logits_fn, forward, val_tokens, luts, budget=budget,
                                                    tilt=build_ngram_tilt(rt, val_tokens, "legal_ttt")), note=budget)
    log_evaluation_time(rt, ttt_s, time.perf_counter() - t_eval)
    log_compiled(rt)


class EvalShapes(NamedTuple):
    """The shapes of this rank's scored-evaluation forwards (evaluation_shapes): eval_val's (rows, length), the rows
    of the sliding window's scoring batches, of SGD TTT's scoring batches (its frozen blocks' weights not trainable)
    and of its training batches."""
    val: list
    score: list
    ttt_score: list
    train: list


def evaluation_shapes(h, num_targets):
    """EvalShapes of the run's scored evaluations (scored_evaluations): the compiled evaluation's plan and what
    warm_evaluation runs."""
    plan, L = scored_evaluations(h), h.eval_seq_len
    sgd_ttt = "legal_ttt" in plan and h.ttt_mode != "lora"
    val = {"post_ema", "final_int6_roundtrip"} & plan.keys()
    score = ([eval_batch_rows(h, [len(rank_slice(sliding_windows(num_targets, L, h.eval_stride), h))])]
             if "final_int6_sliding_window" in plan else [])
    return EvalShapes(eval_val_shapes(h, num_targets) if val else [], score,
                      [ttt_chunk_windows(h, num_targets)[1]] if sgd_ttt else [],
                      ttt_train_rows(h, num_targets) if sgd_ttt else [])


def score_graphs(h, shapes):
    """The graphs of eval_logits that `shapes` needs: one a row count, SGD TTT's apart from the sliding window's when
    TTT_FREEZE_BLOCKS > 0 makes its weights' requires_grad flags (part of the graph's key) differ."""
    if h.ttt_freeze_blocks > 0:
        return len(set(shapes.score)) + len(set(shapes.ttt_score))
    return len(set(shapes.score) | set(shapes.ttt_score))


def warm_evaluation(rt, model, forward, logits_fn, shapes, costs=None):
    """One call of each graph of `shapes` (EvalShapes) the scored evaluations will make (eval_val's through forward;
    the sliding window's and SGD TTT's scoring batch through logits_fn; SGD TTT's training batches through forward
    with its frozen blocks and a backward), before the clocks, on random tokens cut and moved exactly as each
    evaluation cuts its own (Dynamo guards on strides, and tells tensors made in inference mode apart). costs (a dict,
    under a budget): each call timed once more, seconds by ("val", (rows, width)), ("score", rows), ("train", rows).
    Weights, their requires_grad flags and the model's mode are left as they were; gradients are dropped."""
    h, dev, L = rt.h, rt.device, rt.h.eval_seq_len
    g = torch.Generator().manual_seed(h.seed)

    def tokens(*shape):
        return torch.randint(0, h.vocab_size, shape, generator=g, dtype=torch.int32)

    def call(key, fn):
        fn()
        if costs is not None:
            costs[key] = seconds(rt, fn)

    def val_call(rows, width):
        if width == L:  # eval_val: rows of one flat span, moved outside inference mode (its loader)
            x, y = host_to_device(tokens(rows * L + 1), L, dev)
        with torch.inference_mode(), rt.autocast():
            if width != L:  # score_tail: one shorter row, made inside
                span = tokens(width + 1).long()
                x, y = (t[None].to(dev) for t in (span[:-1], span[1:]))
            forward(x, y, *eval_doc_bounds(rt, x.cpu().numpy()))

    def score_call(rows):  # score_windows: (rows, L + 1) windows cut into views
        with torch.inference_mode(), rt.autocast():
            x, _ = cut_batch(tokens(rows, L + 1).to(dev).to(torch.int64), L)
            logits_fn(x, *eval_doc_bounds(rt, x.cpu().numpy()))

    def train_call(rows):  # ttt_train_batch
        x, y = host_to_device(tokens(rows * L + 1), L, dev)
        with rt.autocast():
            forward(x, y, *eval_doc_bounds(rt, x.cpu().numpy())).backward()

    was_training = model.training
    model.eval()
    for rows, width in shapes.val:
        call(("val", (rows, width)), lambda: val_call(rows, width))
    for rows in shapes.score:
        call(("score", rows), lambda: score_call(rows))
    if shapes.ttt_score or shapes.train:
        with weights_trainable(model, drop_grads=True):
            ttt_params(model, h)  # SGD TTT scores and trains with its frozen blocks' weights not trainable
            for rows in shapes.ttt_score:
                call(("score", rows), lambda: score_call(rows))
            model.train()
            for rows in shapes.train:
                call(("train", rows), lambda: train_call(rows))
    model.train(was_training)
    rt.sync()


def log_evaluation_time(rt, ttt_s, total_s):
    """The timed TTT loop (what the records report) and the whole evaluation (the artifact's load and the
    diagnostics included; SPEC-FRONTIER pitfall 15), with one warning line for each that passes the evaluation's
    limit: its budget (EVAL_BUDGET_SECONDS), else as long as training (MAX_WALLCLOCK_SECONDS: 600 s on the 10-minute
    track; 0: none)."""
    h = rt.h
    limit, name = ((h.eval_budget_seconds, "EVAL_BUDGET_SECONDS") if h.eval_budget_seconds > 0 else
                   (h.max_wallclock_seconds, "MAX_WALLCLOCK_SECONDS"))
    loop = "" if ttt_s is None else f"ttt_loop:{ttt_s:.1f}s "
    rt.log(f"evaluation_time: {loop}total:{total_s:.1f}s")
    for what, secs in (("the TTT loop", ttt_s), ("the whole evaluation", total_s)):
        if limit > 0 and secs is not None and secs > limit:
            rt.log(f"warning: {what} took {secs:.1f}s, over the evaluation's {limit:g}s limit ({name})")


def code_bytes():
    """Bytes of the file that runs: a packed file counts its own."""
    return len(Path(__file__).read_bytes())


def write_outputs(rt, model, late_qat, hessians):
    """Rank 0 writes the raw state dict and the int6 artifact, and logs the byte accounting."""
    if not rt.is_main:
        return
    raw, artifact = artifact_files(rt.h)
    buf = io.BytesIO()
    torch.save(artifact_state_dict(model), buf)
    write_atomically(raw, buf.getvalue())
    rt.log(f"Serialized model: {os.path.getsize(raw)} bytes")
    code = code_bytes()
    size = save_artifact(artifact, model, late_qat, rt.h, hessians, code, rt.log)
    rt.log(size_report(size, code, rt.h.compressor))
    if _PREFLIGHT[0] is not None:
        _PREFLIGHT[0].artifact = (size, code)


def run(rt):
    """The recipe, stage by stage; with PREFLIGHT=1 the rehearsal of it, ending with its report (returns the exit
    status)."""
    h = rt.h
    pf = _PREFLIGHT[0] = Preflight(rt) if h.preflight else None
    log_environment(rt)
    if h.overwrite_run and rt.is_main and not (h.eval_only or h.preflight):  # before any work: if this run fails,
        for name in stale_outputs(h):  # nothing under its name looks finished
            os.remove(name)
            rt.log(f"removed {name} of the earlier run (OVERWRITE_RUN=1)")
    if h.eval_only:  # before any work: the artifact's tensors against this run's model (built on meta: no weights)
        check_artifact_tensors(read_artifact(h.eval_only), meta_model(h), h.eval_only)
    backend = select_attention_backend(rt.device, h.attention_backend)
    overrides = [name for name in PRESETS[h.preset] if h.effective[name][1] == "env"]
    rt.log(f"preset:{h.preset}" + (f" overridden_by_env:{','.join(overrides)}" if overrides else ""))
    if SPECIALISED:  # scripts/pack/pack_code.py --for: the code of one run (docs/submitting.md)
        rt.log(f"specialised: from train_gpt.py sha256:{SPECIALISED['source_sha256']} for "
               + " ".join(f"{k}={v}" for k, v in SPECIALISED["run"].items())
               + f" ({len(SPECIALISED['values'])} settings fixed)")
    rt.log(h.dump(), console=False)
    rt.log(f"seed:{h.seed}")
    rt.log(f"device:{rt.device} world_size:{h.world_size} grad_accum_steps:{h.grad_accum_steps} "
           f"attention_backend:{backend} compile:{int(compile_enabled(rt))}")
    if h.grad_accum_steps != h.record_grad_accum_steps:
        rt.log(f"grad_accum: GRAD_ACCUM_STEPS={h.grad_accum_steps} micro-batches a step, not the record's "
               f"{h.record_grad_accum_steps}: the same tokens a step, summed in another order")
    if h.train_loader == "packed":
        rt.log(f"attention_backend_packed:{varlen_backend_name()} (document-packed rows, SPEC-FRONTIER 3)")
    if h.smear_gate == 2 and not h.smear_gate_bos_fix:
        rt.log("smear_gate: v2 without its BOS mask (SMEAR_GATE_BOS_FIX=0, as #2135 ran): each BOS position mixes in "
               "the token before it, across documents in packed rows")
    rt.log(f"precision: {rt.precision_note}")
    rt.log(select_fused_kernels(h, rt.device, rt.autocast_dtype or torch.float32))
    if rt.device.type == "cpu":
        rt.log(f"cpu_threads: {rt.threads_note}")
        rt.log("cpu: FlashAttention and CUDA copy streams need CUDA; torch.compile is off unless COMPILE=1")
    rt.log(rt.describe_data_path())
    if (split_note := data_split_note(h.data_path)) is not None:
        rt.log(split_note)
    plan = scored_evaluations(h)
    rt.log(f"eval_stride:{h.eval_stride}")
    rt.log(f"ttt_enabled:{int(h.ttt_enabled)}")
    rt.log(f"diagnostics: post_ema:{int('post_ema' in plan)} roundtrip:{int(h.diagnostic_roundtrip)}")
    rt.log("scored_evaluations: " + ", ".join(f"{k} {v}".strip() for k, v in plan.items()) if plan else
           "scored_evaluations: none")
    rt.log(f"eval_budget_seconds:{h.eval_budget_seconds:g}" + (f" ({h.eval_budget_note})" if h.eval_budget_note else "")
           + (f" eval_ttt_stop_at:{h.eval_ttt_stop_at} (no clock decision: TTT adapts in exactly its first "
              f"{h.eval_ttt_stop_at} steps)" if h.eval_ttt_stop_at >= 0 else ""))
    rt.log(f"artifact: quant:{h.quant} matrix_clip_sigmas:{h.matrix_clip_sigmas:g} embed_bits:{h.embed_bits} "
           f"embed_clip_sigmas:{h.embed_clip_sigmas:g} compressor:{h.compressor} target_bytes:{h.target_bytes}")
    torch.manual_seed(h.seed)
    np.random.seed(h.seed)
    stage("reading the tokenizer and validation data")
    luts = build_byte_luts(h.tokenizer_path, h.vocab_size)
    val_tokens = load_validation_tokens(h.val_files, max(h.train_seq_len, h.eval_seq_len), h.vocab_size,
                                        h.eval_include_tail)
    luts, bpb_bytes = load_byte_sidecar(h.val_files, val_tokens, luts)
    if pf is not None:
        pf.full_val = val_tokens
        val_tokens = pf.slice()
        pf.targets = (val_tokens.numel() - 1, pf.full_val.numel() - 1)
        rt.log(f"preflight: rehearsal of {h.preset} on {h.world_size} ranks: " + " ".join(
            f"{k}:{h.real[k]:g}->{v:g}" for k, v in h.rehearsal_settings().items() if h.real[k] != v)
            + f"; evaluations on the first {pf.targets[0]} of {pf.targets[1]} val targets")
    rt.log(f"val_tokens:{val_tokens.numel() - 1}")
    rt.log(f"bpb_bytes:{bpb_bytes}")
    if h.eval_split_at_bos or h.eval_include_tail:
        rt.log(f"documents: eval_split_at_bos:{int(h.eval_split_at_bos)} eval_include_tail:{int(h.eval_include_tail)}")

    if h.eval_only:
        ev = prepare_evaluation(rt, val_tokens)
        stage("loading the EVAL_ONLY artifact")
        t_eval = time.perf_counter()
        model = load_artifact(h.eval_only, h, ev.model)
        rt.log(f"eval_only artifact:{h.eval_only} bytes:{os.path.getsize(h.eval_only)} late_qat:{int(model.qat_on())}")
        evaluate_artifact(rt, ev, val_tokens, luts, t_eval)
        return

    if h.target_bytes and h.target_bytes <= code_bytes():
        raise ConfigError(f"TARGET_BYTES={h.target_bytes} leaves no room beside this script's {code_bytes()} bytes")
    stage("checking the training shards")
    for f in list_shards(h.train_files):
        read_shard_header(f)
    stage("building the model")
    model = rt.prepare_model(build_model(h))
    only = model_param_counts(h, model)["training_only"]  # (the model just built: no second build on meta)
    rt.log(f"model_params:{sum(p.numel() for p in model.parameters()) - only}" + (f" training_only:{only}" * (only > 0)))
    rt.log(optimizer_lines(h, model))
    if h.num_loops > 0:
        (enc, dec), (loop_enc, loop_dec) = model.orders[False], model.orders[True]
        rt.log(f"layer_loop: encoder:{enc} decoder:{dec}, looped from ENABLE_LOOPING_AT={h.enable_looping_at:g}: "
               f"encoder:{loop_enc} decoder:{loop_dec}")
    ev = prepare_evaluation(rt, val_tokens)  # before any clock: the evaluation compiles nothing
    stage("setting up training")
    qat_on, hessians = train(rt, model, val_tokens, luts)

    diagnostic_s = 0.0
    if "post_ema" in plan:  # through the evaluation's model and its warmed graphs (the round trip's), then the artifact's
        stage("evaluating the final weights")
        CONTEXT.enter("evaluation")
        t0 = time.perf_counter()
        ev.model.load_state_dict(model.state_dict())
        with compile_region("post_ema"):
            loss, bpb = eval_val(rt, ev.forward, val_tokens, luts)
        log_compile_region(rt, "post_ema")
        if not math.isfinite(loss):
            raise RunError(f"the final weights give val_loss {loss}; no artifact written")
        diagnostic_s = time.perf_counter() - t0
        rt.log(f"DIAGNOSTIC post_ema val_loss:{loss:.4f} val_bpb:{bpb:.4f} eval_time:{1000.0 * diagnostic_s:.0f}ms")
    stage("writing the artifact")
    write_outputs(rt, model, qat_on, hessians)
    if rt.distributed:
        dist.barrier()
    # Evaluate what a user submits: a fresh model read back from the file on disk. The evaluation's wall time counts
    # the diagnostic above and everything from here on; writing the artifact (quantisation) is training's side.
    t_eval = time.perf_counter() - diagnostic_s
    stage("loading the artifact")
    load_artifact(artifact_files(h)[1], h, ev.model)
    evaluate_artifact(rt, ev, val_tokens, luts, t_eval)
    if pf is not None:
        stage("report")
        return pf.report()
    return 0


def fail(rt, message):
    """Print the one error line (with the rank when there are several) and end the log with it."""
    if rt is not None and rt.distributed:
        message = f"{message} [rank {rt.h.rank}]"
    print(message, file=sys.stderr, flush=True)
    if rt is not None and rt.log_path is not None:
        with contextlib.suppress(OSError):
            with open(rt.log_path, "a", encoding="utf-8") as f:
                print(message, file=f)


def lost_peer(e):
    """gloo's words when another rank died, its node went away or it stopped answering (issue 62), naming the peer's
    address or the wait, without gloo's source path; None for any other error."""
    found = re.search(r"Connection (closed by peer|reset by peer|refused)|Timed out waiting \d+ms[^.]*", str(e))
    peer = re.search(r"\[[^\]/]+\]:\d+", str(e))
    return found and found.group(0) + (f" (peer {peer.group(0)})" if peer else "")


def help_text(environ):
    """--help: every setting with its default and its value in one preset: the environment's PRESET (validated as a
    run would), or record_0409 when PRESET is unset or record_0323. Nothing else in the environment is read."""
    h = Hyperparameters({k: v for k, v in environ.items() if k == "PRESET"})  # settings list code defaults
    shown = "record_0409" if h.preset == "record_0323" else h.preset
    rows = "".join(f"\n  {n:<28}{d:<42}{PRESETS[shown].get(n, '')}".rstrip() for n, d in h.settings)
    return (f"usage: [VAR=VALUE ...] python3 train_gpt.py (or torchrun ... train_gpt.py)\nSettings are environment "
            f"variables (docs/settings.md; PRESET=NAME --help shows that preset's column). No data? {GET_DATA}\n\n"
            f"  {'variable':<28}{'default (PRESET=record_0323)':<42}PRESET={shown}{rows}")


def main():
    if sys.argv[1:] in (["-h"], ["--help"]):
        try:
            print(help_text(os.environ))
            sys.stdout.flush()
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except BrokenPipeError:  # `--help | head`
            os._exit(0)
        return
    if len(sys.argv) > 1:
        print(f"error: unexpected argument {sys.argv[1]!r}: settings are environment variables (see --help)",
              file=sys.stderr)
        sys.exit(2)
    h, rt, code, message = None, None, 0, None
    try:
        h = Hyperparameters()
        rt = setup_runtime(h, find_resume(h))
        code = run(rt) or 0
    except (ConfigError, RunError) as e:
        message = f"error: {e}"
        code = 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        message = f"interrupted (Ctrl-C) during {_STAGE[0]}"
        code = 130
    except Exception as e:  # anything else: one line naming the stage
        if h is not None and h.debug_traceback:
            traceback.print_exc()
        lost = lost_peer(e) if rt is not None and rt.distributed else None
        message = (f"error: {_STAGE[0]} failed: " + (f"lost a peer of the {h.world_size} ranks (a rank or its node died, "
                   f"or stalled): {lost}" if lost else f"{type(e).__name__}: {first_line(e)}")
                   + ("" if h is not None and h.debug_traceback else " (DEBUG_TRACEBACK=1 shows the traceback)"))
        code = 1
    if message is not None:
        fail(rt, message)
        if _PREFLIGHT[0] is not None:  # PREFLIGHT=1: the report, its verdict naming the error
            code = _PREFLIGHT[0].report(error=message.removeprefix("error: "))
        elif (h.preflight if h is not None else os.environ.get("PREFLIGHT", "").strip() == "1"):
            print(f"preflight: NOT READY: {message.removeprefix('error: ')}", file=sys.stderr, flush=True)
            code = 1
    if rt is not None and rt.tracker is not None:
        rt.tracker.close(code, rt)
    leave(code)


def leave(code):
    """Ends the process with exit status `code`. Ranks that finished leave together (a rank exiting early can abort a
    gloo peer; after an error a barrier may hang, so then none), and os._exit skips the interpreter's teardown, where
    gloo's static destructors abort ~1 in 10 finished 2-rank CPU runs ("terminate called without an active
    exception", exit -6), even after destroy_process_group."""
    if not dist.is_initialized():
        sys.exit(code)
    if code == 0:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    # Run as a script, the interpreter's teardown is skipped too (collecting torch's module graph took ~0.9 s of every
    # single-process run's exit); imported, main() ends with SystemExit as any program's main.
    try:
        main()
        status = 0
    except SystemExit as e:
        status = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
