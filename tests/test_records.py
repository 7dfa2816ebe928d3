"""Tests for the record tooling in scripts/record/ (fast: synthetic logs, no training).

Synthetic logs are written by ``write_log`` in the format train_gpt.py
produces, including a source-code preamble that contains the log format
strings, so every test also checks that the parsers skip the source text.
"""
from __future__ import annotations

import ast
import json
import math
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
sys.path[:0] = [str(SCRIPTS / "record"), str(SCRIPTS / "run")]  # the record tools; plot_logs

import check_record  # noqa: E402
import make_record  # noqa: E402
import plot_logs  # noqa: E402
import recordlib as rl  # noqa: E402

# bpb per nat of val_loss used by the synthetic logs (about the real ratio for
# the sp1024 tokenizer on FineWeb: 1.12 bpb at 1.89 nats).
RATIO = 0.5925

# The head of a log is train_gpt.py's source. Real source indents these
# calls, but module-level docstrings and comments can start at column 0, so
# both forms appear here; none may be parsed as a result line.
PREAMBLE = '''"""Format of the log lines:
step:{step}/{h.iterations} train_loss:{loss:.4f} train_time:{t:.0f}ms step_avg:{a:.2f}ms
step:{step}/{h.iterations} val_loss:{vl:.4f} val_bpb:{vb:.4f} train_time:{t:.0f}ms step_avg:{a:.2f}ms
seed:{seed}
Code size: {code_bytes} bytes
Total submission size int6+lzma: {total} bytes
OVER_LIMIT total_bytes:{total} cap:{cap}
final_int6_roundtrip_exact val_loss:{l:.8f} val_bpb:{b:.8f}
legal_ttt_exact val_loss:{l:.8f} val_bpb:{b:.8f}
ttt_enabled:{int(h.ttt_enabled)}
eval_stride:{h.eval_stride}
device:{rt.device} world_size:{h.world_size} grad_accum_steps:{h.grad_accum_steps}
train_clock:{clock} replay_world_size:{h.replay_world_size} world_size:{h.world_size} grad_accum:{h.grad_accum_steps}
train_clock:ms:{h.replay_step_ms:g} (every time-based decision reads step x {h.replay_step_ms:g} ms)
====================================================================================================
Running Python {sys.version}
"""
import os


def main():
    log0(f"seed:{h.seed}")
    log0(f"step:{step}/{h.iterations} train_loss:{train_loss.item():.4f} "
         f"train_time:{training_time_ms:.0f}ms step_avg:{training_time_ms / step:.2f}ms")
    log0(f"final_int6_roundtrip_exact val_loss:{q_val_loss:.8f} val_bpb:{q_val_bpb:.8f}")
    log0(f"OVER_LIMIT total_bytes:{total_bytes} cap:{h.size_cap}")
'''

VALID_CODE = "import math\n\n\ndef main():\n    match 1:\n        case 1:\n            return math.pi\n"
CODE_BYTES = len(VALID_CODE.encode())


def write_log(
    path: Path,
    *,
    seed: int = 1337,
    steps: int = 7000,
    iterations: int = 20000,
    step_avg: float = 85.0,
    train_time_ms: float | None = None,
    code_bytes: int = CODE_BYTES,
    quant_bytes: int = 15_850_000,
    total_bytes: int | None = None,
    roundtrip: tuple[float, float] = (1.1420, 8_000.0),
    sliding: tuple[float, float] | None = (1.1190, 90_000.0),
    ttt: tuple[float, float] | None = (1.1165, 400_000.0),
    stride: int = 64,
    over_limit: bool = False,
    flags: bool = True,
    device: str | None = "cuda:0",
    world_size: int = 8,
    drop: tuple[str, ...] = (),
    extra_lines: tuple[str, ...] = (),
    clock_line: str | None = None,
) -> Path:
    """Write a realistic log; results are (bpb, eval_time_ms) pairs.

    val_loss = bpb / RATIO, so bpb/val_loss of every result line is RATIO.
    ``drop`` removes lines starting with any of the given prefixes;
    ``flags`` writes the ttt_enabled / eval_stride config lines; ``device``
    (None: no such line) and ``world_size`` fill the hardware line; ``clock_line``
    (a replay run's train_clock line) goes before the first step, as train_gpt.py logs it.
    """
    train_time_ms = steps * step_avg if train_time_ms is None else train_time_ms
    total_bytes = quant_bytes + code_bytes if total_bytes is None else total_bytes
    lines = [PREAMBLE, "=" * 100, "Running Python 3.11.7", "Running PyTorch 2.13.0+cu128", f"seed:{seed}"]
    if device is not None:
        lines.append(f"device:{device} world_size:{world_size} grad_accum_steps:{max(8 // world_size, 1)} "
                     "attention_backend:fa3 compile:1")
    if flags:
        lines += [f"ttt_enabled:{int(ttt is not None)}", f"eval_stride:{stride if sliding else 0}"]
    if clock_line is not None:
        lines.append(clock_line)
    lines += _step_lines(steps, iterations, step_avg, train_time_ms)
    if train_time_ms >= 600_000:
        lines.append(f"stopping_early: wallclock_cap train_time:{train_time_ms:.0f}ms step:{steps}/{iterations}")
    lines += [
        "peak memory allocated: 21000 MiB reserved: 22000 MiB",
        f"DIAGNOSTIC post_ema val_loss:{1.14 / RATIO:.4f} val_bpb:1.1400 eval_time:2000ms",
        "Serialized model: 106000000 bytes",
        f"Code size: {code_bytes} bytes",
        f"Serialized model int6+lzma: {quant_bytes} bytes",
        f"Total submission size int6+lzma: {total_bytes} bytes",
    ]
    if over_limit:
        lines.append(f"OVER_LIMIT total_bytes:{total_bytes} cap:16000000")
    lines += _result_lines("final_int6_roundtrip", roundtrip)
    if sliding:
        lines += _result_lines("final_int6_sliding_window", sliding, f" stride:{stride}")
    if ttt:
        lines += _result_lines("legal_ttt", ttt)
    lines += list(extra_lines)
    kept = [ln for ln in lines if not any(ln.startswith(d + " ") for d in drop)]
    path.write_text("\n".join(kept) + "\n", encoding="utf-8")
    return path


def _step_lines(steps: int, iterations: int, step_avg: float, train_time_ms: float) -> list[str]:
    """Train lines every 1000 steps (with an extra field), val lines at 0 and at the end."""
    out = [f"step:0/{iterations} val_loss:6.9300 val_bpb:4.1000 train_time:0ms step_avg:0.01ms"]
    for s in range(1000, steps, 1000):
        loss = 2.0 + 1.0 / s
        out.append(
            f"step:{s}/{iterations} train_loss:{loss:.4f} train_time:{s * step_avg:.0f}ms "
            f"step_avg:{step_avg:.2f}ms data_wait_ms:0.12"
        )
    out.append(
        f"step:{steps}/{iterations} train_loss:1.9800 train_time:{train_time_ms:.0f}ms step_avg:{step_avg:.2f}ms"
    )
    out.append(
        f"step:{steps}/{iterations} val_loss:{1.15 / RATIO:.4f} val_bpb:1.1500 "
        f"train_time:{train_time_ms:.0f}ms step_avg:{step_avg:.2f}ms"
    )
    return out


def _result_lines(prefix: str, result: tuple[float, float], extra: str = "") -> list[str]:
    bpb, eval_ms = result
    loss = bpb / RATIO
    return [
        f"{prefix} val_loss:{loss:.4f} val_bpb:{bpb:.4f}{extra} eval_time:{eval_ms:.0f}ms",
        f"{prefix}_exact val_loss:{loss:.8f} val_bpb:{bpb:.8f}",
    ]


# Three seeds with round numbers so the table can be checked by hand:
# TTT bpb 1.1160/1.1170/1.1180 -> mean 1.1170, std 0.0010; sliding is 0.0030
# higher each; step_avg 85/86/87 ms; steps 7000/6900/6800; TTT 400/410/420 s;
# total submission sizes 15,900,000/15,900,100/15,900,200 bytes.
def _seed(step_avg: float, steps: int, sliding: float, ttt: float, ttt_s: float, total: int) -> dict:
    return dict(step_avg=step_avg, steps=steps, sliding=(sliding, 90_000.0), ttt=(ttt, ttt_s * 1000),
                quant_bytes=total - CODE_BYTES)


SEEDS = {
    1337: _seed(85.0, 7000, 1.1190, 1.1160, 400.0, 15_900_000),
    42: _seed(86.0, 6900, 1.1200, 1.1170, 410.0, 15_900_100),
    2025: _seed(87.0, 6800, 1.1210, 1.1180, 420.0, 15_900_200),
}
META = ["--author", "Jane Doe", "--github-id", "janedoe", "--blurb", "Synthetic test record."]
# A SOTA the three SEEDS beat significantly (p = 0.0099, see test_make_record_significance).
SOTA = ("--sota-bpb", "1.1240")


def make_folder(
    tmp_path: Path,
    track: str = "track_10min_16mb",
    seeds: dict[int, dict] | None = None,
    code: str = VALID_CODE,
    name: str = "2025-11-21_TestRun",
    **common,
) -> Path:
    """A record folder with train_gpt.py and one log per seed (no json/README yet)."""
    folder = tmp_path / "records" / track / name
    folder.mkdir(parents=True)
    (folder / "train_gpt.py").write_text(code, encoding="utf-8")
    for seed, params in (SEEDS if seeds is None else seeds).items():
        kwargs = dict(seed=seed, code_bytes=len(code.encode()), **params)
        kwargs.update(common)
        write_log(folder / f"train_seed{seed}.log", **kwargs)
    return folder


def make_full_record(tmp_path: Path, *extra_args: str, **kwargs) -> Path:
    folder = make_folder(tmp_path, **kwargs)
    assert make_record.main([str(folder), *META, *extra_args]) == 0
    return folder


def run_check(folder: Path, capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = check_record.main([str(folder), *args])
    return rc, capsys.readouterr().out


def load_json(folder: Path) -> dict:
    return json.loads((folder / "submission.json").read_text())


def set_json(folder: Path, **changes) -> None:
    data = load_json(folder)
    data.update(changes)
    (folder / "submission.json").write_text(json.dumps(data))


# ---------------------------------------------------------------------------
# Parsing


def test_parser_skips_source_preamble_and_reads_all_lines(tmp_path):
    log = rl.parse_log(write_log(tmp_path / "a.log", seed=7, steps=3500, step_avg=80.0))
    assert log.seed == 7
    assert [s.step for s in log.train_steps] == [1000, 2000, 3000, 3500]
    assert [s.step for s in log.val_steps] == [0, 3500]
    assert log.last_step.step == 3500 and log.last_step.step_avg_ms == 80.0
    assert log.train_time_ms == 280_000
    assert log.eval_time_ms == 8_000 + 90_000 + 400_000
    assert log.code_bytes == CODE_BYTES
    assert log.quant_model_bytes == 15_850_000
    assert log.total_bytes == 15_850_000 + CODE_BYTES
    assert log.over_limit is None and not log.stopped_early
    assert log.peak_mem_mib == (21000, 22000)
    assert log.post_ema.val_bpb == 1.14
    assert log.ttt_flag is True and log.eval_stride == 64
    assert log.short["sliding"].stride == 64
    assert log.score("legal_ttt").val_bpb == 1.1165
    assert log.score("roundtrip").val_loss == pytest.approx(1.1420 / RATIO, abs=1e-8)
    assert rl.missing_final_lines(log) == []


def test_parser_allows_trailing_fields_and_ignores_unrelated_lines():
    text = "\n".join([
        "step:10/100 train_loss:2.5000 train_time:1000ms step_avg:100.00ms data_wait_ms:1.50 lr:0.02",
        "some warning: step:5/100 train_loss:9.0 train_time:1ms step_avg:1.00ms",
        "step:x/100 train_loss:2.5000 train_time:1000ms step_avg:100.00ms",
        "final_int6_roundtrip_exact val_loss:1.90000000 val_bpb:1.12500000 extra:1",
        "legal_ttt_exact val_loss:{ttt_loss:.8f} val_bpb:{ttt_bpb:.8f}",
        "step:20/100 train_loss:nan train_time:2000ms step_avg:100.00ms",
    ])
    log = rl.parse_log_text(text)
    assert [s.step for s in log.steps] == [10, 20]
    assert math.isnan(log.steps[-1].loss)
    assert log.score("roundtrip").val_bpb == 1.125
    assert log.score("legal_ttt") is None


def test_stopping_early_and_over_limit_are_parsed(tmp_path):
    log = rl.parse_log(write_log(tmp_path / "a.log", train_time_ms=600_100, over_limit=True, total_bytes=16_000_500))
    assert log.stopped_early
    assert log.over_limit == (16_000_500, 16_000_000)


def test_optional_evals_required_from_flags_or_lines(tmp_path):
    off = rl.parse_log(write_log(tmp_path / "off.log", sliding=None, ttt=None))
    assert rl.enabled_evals(off) == set()
    assert rl.missing_final_lines(off) == []
    # ttt_enabled:1 logged but the run died before TTT finished.
    crashed = rl.parse_log(write_log(tmp_path / "c.log", drop=("legal_ttt", "legal_ttt_exact")))
    assert rl.missing_final_lines(crashed) == ["legal_ttt", "legal_ttt_exact"]
    # Short line present without its _exact line, and no config lines at all.
    half = rl.parse_log(write_log(tmp_path / "h.log", flags=False, drop=("final_int6_sliding_window_exact",)))
    assert rl.missing_final_lines(half) == ["final_int6_sliding_window_exact"]


def test_parser_reads_hardware_and_integrity_evidence(tmp_path):
    """One run per file: the source preamble's templates (a separator, then
    'Running Python {sys.version}', a device template) count for nothing."""
    log = rl.parse_log(write_log(tmp_path / "a.log"))
    assert (log.device, log.world_size) == ("cuda:0", 8)
    assert log.run_headers == 1 and log.step_backwards is None and not log.truncated
    assert log.once_counts and set(log.once_counts.values()) == {1}
    assert rl.multiple_runs_evidence(log) is None and rl.integrity_problems(log) == []
    cpu = rl.parse_log(write_log(tmp_path / "cpu.log", device="cpu", world_size=1))
    assert (cpu.device, cpu.world_size) == ("cpu", 1)
    assert rl.parse_log(write_log(tmp_path / "none.log", device=None)).device is None


def _two_runs_full(first: str, second: str) -> str:
    """A crashed first run (cut after its training), then a complete rerun."""
    return first[: first.index("peak memory")] + second


def _two_runs_results_only(first: str, second: str) -> str:
    """Final lines appended again without a header (e.g. an eval-only rerun)."""
    return first + second[second.index("Serialized model:"):]


def _two_runs_steps_only(first: str, second: str) -> str:
    """A second run's step lines appended without any other line."""
    return first + "\n".join(ln for ln in second.splitlines() if ln.startswith("step:0/")) + "\n"


@pytest.mark.parametrize("join, evidence", [
    (_two_runs_full, "2 run headers ('Running Python ...' after the '=' separator)"),
    (_two_runs_results_only, "'Code size' line logged 2 times (and "),
    (_two_runs_steps_only, "step numbers go back from step:6900 to step:0"),
])
def test_parser_detects_two_runs_in_one_log(tmp_path, join, evidence):
    first = write_log(tmp_path / "a.log", seed=42, **SEEDS[42]).read_text()
    second = write_log(tmp_path / "b.log", seed=42, **SEEDS[1337]).read_text()
    log = rl.parse_log_text(join(first, second), "train_seed42.log")
    assert rl.multiple_runs_evidence(log).startswith(evidence)


# ---------------------------------------------------------------------------
# Statistics


def test_student_t_cdf_known_values():
    # df=2 has a closed form: F(t) = 1/2 (1 + t / sqrt(2 + t^2)).
    assert rl.student_t_cdf(-3.0, 2) == pytest.approx(0.5 * (1 - 3 / math.sqrt(11)), abs=1e-12)
    assert rl.student_t_cdf(-3.0, 2) == pytest.approx(0.04773, abs=1e-4)
    # One-sided 1% critical values from t tables.
    assert rl.student_t_cdf(-3.747, 4) == pytest.approx(0.01, abs=1e-4)
    assert rl.student_t_cdf(-2.821, 9) == pytest.approx(0.01, abs=1e-4)
    assert rl.student_t_cdf(-2.228, 10) == pytest.approx(0.025, abs=1e-4)
    # df=1 is the Cauchy distribution: F(t) = 1/2 + atan(t)/pi.
    for t in (-10.0, -1.0, 0.3, 4.0):
        assert rl.student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
    # Symmetry, centre, and the normal limit (Phi(-1.96) = 0.0249979).
    assert rl.student_t_cdf(0.0, 5) == 0.5
    assert rl.student_t_cdf(1.3, 7) + rl.student_t_cdf(-1.3, 7) == pytest.approx(1.0, abs=1e-14)
    assert rl.student_t_cdf(-1.96, 1e7) == pytest.approx(0.0249979, abs=1e-6)
    assert rl.student_t_cdf(-math.inf, 3) == 0.0 and rl.student_t_cdf(math.inf, 3) == 1.0


def test_student_t_cdf_at_welch_degrees_of_freedom_equals_the_integrated_density():
    """Welch's df is not an integer: the CDF against Simpson's rule on the t density (1e-6), and against the
    df=1 and df=2 closed forms at nearby non-integer df (continuity)."""
    for df in (1.5, 2.7, 3.9010554829023127):
        c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

        def density(x, df=df, c=c):
            return c * (1 + x * x / df) ** (-(df + 1) / 2)

        for t in (-3.4261944925361987, -1.0, 0.5):
            n, a = 20000, 0.0  # F(t) = 1/2 + integral from 0 to t
            h = (t - a) / n
            simpson = density(a) + density(t) + sum((4 if i % 2 else 2) * density(a + i * h) for i in range(1, n))
            assert rl.student_t_cdf(t, df) == pytest.approx(0.5 + simpson * h / 3, abs=1e-6), (df, t)
    assert rl.student_t_cdf(0.0, 3.9) == 0.5
    assert rl.student_t_cdf(-2.0, 1.000001) == pytest.approx(0.5 + math.atan(-2.0) / math.pi, abs=1e-6)
    assert rl.student_t_cdf(-2.0, 2.000001) == pytest.approx(0.5 * (1 - 2 / math.sqrt(6)), abs=1e-6)


# Per-seed val_bpb of the audited leaderboard's top two rows (SPEC-FRONTIER 19-20; the rows' submission.json).
ROW_2014 = [1.05740567, 1.05730104, 1.05807084]  # #2014, seeds 42, 314, 0
ROW_2135 = [1.05679341, 1.05610947, 1.05662016]  # #2135, seeds 0, 42, 314
FRONTIER = REPO.parent / "shared" / "anchors" / "frontier"


def test_welch_by_hand_and_2135_against_2014_is_p_0014():
    """t = (m1 - m2) / sqrt(v1 + v2), v = s^2/n; Welch-Satterthwaite df; p = P(T_df <= t). #2135 was accepted
    'under grace policy (p=0.014 vs PR #2014)' (SPEC-FRONTIER 20): its seeds against #2014's give p = 0.014."""
    w = rl.welch_test(ROW_2135, ROW_2014)
    v1, v2 = (sum((x - sum(r) / 3) ** 2 for x in r) / 2 / 3 for r in (ROW_2135, ROW_2014))
    assert w.t == pytest.approx((sum(ROW_2135) - sum(ROW_2014)) / 3 / math.sqrt(v1 + v2), rel=1e-9)
    assert w.df == pytest.approx((v1 + v2) ** 2 / (v1 ** 2 / 2 + v2 ** 2 / 2), rel=1e-9)
    assert round(w.p, 3) == 0.014 and w.significant and w.alpha == 0.25
    assert w.p == pytest.approx(rl.student_t_cdf(w.t, w.df), abs=0)
    back = rl.welch_test(ROW_2014, ROW_2135)  # the other way round: p = 1 - 0.014, not accepted
    assert back.p == pytest.approx(1 - w.p, abs=1e-12) and not back.significant
    assert rl.welch_test([1.1], ROW_2014).p is None  # one seed: no test
    assert rl.welch_test([1.0, 1.0], [1.1, 1.1]).p == 0.0 and rl.welch_test([1.1, 1.1], [1.0, 1.0]).p == 1.0


def test_row_scores_from_numbers_and_from_the_rows_own_submission_json():
    assert rl.row_scores("1.05740567, 1.05730104,1.05807084") == ROW_2014
    with pytest.raises(rl.RecordError, match="not a folder, a submission.json or comma-separated numbers"):
        rl.row_scores("no/such/row")
    if not FRONTIER.is_dir():
        pytest.skip(f"{FRONTIER} (the records' files) is not here")
    assert sorted(rl.row_scores(str(FRONTIER / "record_0430"))) == sorted(ROW_2014)
    assert sorted(rl.row_scores(str(FRONTIER / "record_0501" / "submission.json"))) == sorted(ROW_2135)
    w = rl.welch_test(rl.row_scores(str(FRONTIER / "record_0501")), rl.row_scores(str(FRONTIER / "record_0430")))
    assert round(w.p, 3) == 0.014


def test_significance_three_seeds_by_hand():
    """values [1.10, 1.11, 1.12] against SOTA X = 1.13, bpb per nat = 0.5.

    margin = 0.005 nats * 0.5 = 0.0025 bpb, threshold = 1.13 - 0.0025 = 1.1275
    mean = 1.11, s = sqrt((0.01^2 + 0 + 0.01^2) / 2) = 0.01
    se = 0.01 / sqrt(3) = 0.00577350
    t = (1.11 - 1.1275) / 0.00577350 = -0.0175 / 0.00577350 = -3.03109
    df = 2, p = 1/2 (1 + t / sqrt(2 + t^2)) = 1/2 (1 - 3.03109 / 3.34477)
      = 1/2 (1 - 0.906216) = 0.046892  ->  not significant at 0.01.
    """
    sig = rl.significance_test([1.10, 1.11, 1.12], 1.13, 0.5)
    assert sig.n == 3 and sig.df == 2
    assert sig.mean == pytest.approx(1.11, abs=1e-12)
    assert sig.std == pytest.approx(0.01, abs=1e-12)
    assert sig.margin_bpb == pytest.approx(0.0025, abs=1e-12)
    assert sig.threshold_bpb == pytest.approx(1.1275, abs=1e-12)
    assert sig.t == pytest.approx(-3.03109, abs=1e-4)
    assert sig.p == pytest.approx(0.046892, abs=1e-4)
    assert not sig.significant and sig.verdict.startswith("NOT SIGNIFICANT")


def test_significance_five_seeds_by_hand():
    """values 1.100 .. 1.104 (step 0.001) against X = 1.13, bpb per nat = 0.5.

    mean = 1.102, s = sqrt((4+1+0+1+4) e-6 / 4) = sqrt(2.5e-6) = 0.00158114
    se = 0.00158114 / sqrt(5) = 0.000707107
    t = (1.102 - 1.1275) / 0.000707107 = -36.0624, df = 4, p << 0.01.
    """
    sig = rl.significance_test([1.100, 1.101, 1.102, 1.103, 1.104], 1.13, 0.5)
    assert sig.std == pytest.approx(0.00158114, abs=1e-8)
    assert sig.t == pytest.approx(-36.0624, abs=1e-3)
    assert sig.df == 4 and sig.p < 1e-5
    assert sig.significant and sig.verdict.startswith("SIGNIFICANT")


def test_significance_needs_two_seeds():
    sig = rl.significance_test([1.10], 1.13, 0.5)
    assert sig.t is None and sig.p is None and not sig.significant
    assert "cannot run" in sig.verdict


def test_significance_zero_spread():
    assert rl.significance_test([1.1, 1.1], 1.13, 0.5).p == 0.0
    assert rl.significance_test([1.2, 1.2], 1.13, 0.5).p == 1.0


# ---------------------------------------------------------------------------
# make_record


def test_make_record_table_and_submission(tmp_path, capsys):
    folder = make_full_record(tmp_path)
    out = capsys.readouterr().out
    rows = [
        "| 42 | 86.00 | 6900 | 1.1200 | 1.1170 | 0.0030 | 410.0 | 15900100 |",
        "| 1337 | 85.00 | 7000 | 1.1190 | 1.1160 | 0.0030 | 400.0 | 15900000 |",
        "| 2025 | 87.00 | 6800 | 1.1210 | 1.1180 | 0.0030 | 420.0 | 15900200 |",
        "| mean | 86.00 | 6900 | 1.1200 | 1.1170 | 0.0030 | 410.0 | 15900100 |",
        "| std | 1.00 | 100 | 0.0010 | 0.0010 | 0.0000 | 10.0 | 100 |",
    ]
    readme = (folder / "README.md").read_text()
    header = "| seed | step_avg (ms) | steps | pre-TTT bpb | post-TTT bpb | TTT gain | TTT time (s) | artifact bytes |"
    for text in (out, readme):
        assert header in text
        for row in rows:
            assert row in text
    assert readme.startswith("# TestRun\n")
    assert readme.count(rl.RESULTS_START) == 1 and readme.count(rl.RESULTS_END) == 1

    sub = load_json(folder)
    assert sub["val_bpb"] == pytest.approx(1.117, abs=1e-9)
    assert sub["val_bpb_std"] == pytest.approx(0.001, abs=1e-9)
    assert sub["val_bpb_metric"] == "legal_ttt"
    assert sub["bytes_total"] == 15_900_200
    assert sub["seeds"] == [42, 1337, 2025]
    assert [e["val_bpb"] for e in sub["per_seed"]] == [1.117, 1.116, 1.118]
    assert sub["name"] == "TestRun" and sub["date"] == "2025-11-21"
    assert (sub["author"], sub["github_id"], sub["blurb"]) == ("Jane Doe", "janedoe", "Synthetic test record.")
    assert "significance" not in sub


def test_make_record_falls_back_to_sliding_then_roundtrip(tmp_path, capsys):
    folder = make_full_record(tmp_path, ttt=None)
    assert load_json(folder)["val_bpb_metric"] == "sliding"
    assert load_json(folder)["val_bpb"] == pytest.approx(1.12, abs=1e-9)
    assert "| 1337 | 85.00 | 7000 | 1.1190 | – | – | – | 15900000 |" in capsys.readouterr().out

    folder = make_full_record(tmp_path / "b", ttt=None, sliding=None)
    sub = load_json(folder)
    assert sub["val_bpb_metric"] == "roundtrip" and sub["val_bpb"] == pytest.approx(1.142, abs=1e-9)
    assert "| 1337 | 85.00 | 7000 | 1.1420 | – | – | – | 15900000 |" in capsys.readouterr().out


def test_make_record_mixed_ttt_uses_common_metric(tmp_path):
    seeds = {1337: SEEDS[1337], 42: dict(SEEDS[42], ttt=None)}
    folder = make_folder(tmp_path, seeds=seeds)
    assert make_record.main([str(folder), *META]) == 0
    assert load_json(folder)["val_bpb_metric"] == "sliding"


def test_make_record_metric_option(tmp_path, capsys):
    folder = make_full_record(tmp_path, "--metric", "roundtrip")
    sub = load_json(folder)
    assert sub["val_bpb_metric"] == "roundtrip" and sub["val_bpb"] == pytest.approx(1.142, abs=1e-9)
    assert check_record.main([str(folder), "--sota-bpb", "1.2"]) == 0

    bare = make_folder(tmp_path / "b", ttt=None)
    assert make_record.main([str(bare), *META, "--metric", "legal_ttt"]) == 2
    assert "no legal_ttt_exact line" in capsys.readouterr().err


def test_make_record_keeps_handwritten_readme_and_json_keys(tmp_path):
    folder = make_folder(tmp_path)
    (folder / "README.md").write_text(
        f"# My record\n\nIntro text.\n\n{rl.RESULTS_START}\nold table\n{rl.RESULTS_END}\n\n## Notes\nKeep me.\n"
    )
    old = {"author": "Old Author", "github_id": "old", "hardware": "8xH100"}
    (folder / "submission.json").write_text(json.dumps(old))
    for _ in range(2):  # idempotent
        assert make_record.main([str(folder), "--blurb", "b", "--date", "2025-12-01"]) == 0
    readme = (folder / "README.md").read_text()
    assert readme.startswith("# My record\n\nIntro text.\n\n" + rl.RESULTS_START)
    assert readme.endswith(rl.RESULTS_END + "\n\n## Notes\nKeep me.\n")
    assert "old table" not in readme and readme.count(rl.RESULTS_START) == 1
    sub = load_json(folder)
    assert {k: sub[k] for k in old} == old and sub["date"] == "2025-12-01"


def test_make_record_appends_results_to_readme_without_markers(tmp_path):
    folder = make_folder(tmp_path)
    (folder / "README.md").write_text("# Title\n\nHand-written.")
    assert make_record.main([str(folder), *META]) == 0
    readme = (folder / "README.md").read_text()
    assert readme.startswith("# Title\n\nHand-written.\n\n## Results\n\n" + rl.RESULTS_START)


def test_make_record_significance(tmp_path, capsys):
    """Logs: TTT bpb 1.116/1.117/1.118, bpb per nat RATIO = 0.5925.

    margin = 0.005 * 0.5925 = 0.0029625 bpb; against X = 1.1240 the threshold
    is 1.1210375; t = (1.117 - 1.1210375) / (0.001 / sqrt 3) = -6.9932, df = 2,
    p = 1/2 (1 - 6.9932 / sqrt(2 + 48.905)) = 0.0099 < 0.01.
    """
    folder = make_full_record(tmp_path, "--sota-bpb", "1.1240")
    out = capsys.readouterr().out
    sig = load_json(folder)["significance"]
    assert sig["n"] == 3 and sig["df"] == 2
    assert sig["margin_bpb"] == pytest.approx(0.0029625, abs=1e-7)
    assert sig["t"] == pytest.approx(-6.9932, abs=1e-3)
    assert sig["p"] == pytest.approx(0.0099, abs=1e-4)
    assert sig["significant"] is True
    assert "Student t-test" in out and "verdict: SIGNIFICANT" in out and "df=2" in out
    assert "verdict: SIGNIFICANT" in (folder / "README.md").read_text()

    # A weaker record claim fails the test; a rerun without --sota-bpb drops it.
    assert make_record.main([str(folder), "--sota-bpb", "1.1205"]) == 0
    assert load_json(folder)["significance"]["significant"] is False
    assert make_record.main([str(folder)]) == 0
    assert "significance" not in load_json(folder)


def test_make_record_single_seed_cannot_test(tmp_path, capsys):
    folder = make_full_record(tmp_path, "--sota-bpb", "1.2", seeds={1337: SEEDS[1337]})
    assert "cannot run the t-test" in capsys.readouterr().out
    sub = load_json(folder)
    assert sub["val_bpb_std"] is None and sub["significance"]["p"] is None


def test_make_record_without_logs(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert make_record.main([str(tmp_path / "empty")]) == 2
    assert "no train_seed*.log files" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# check_record


def test_check_happy_path(tmp_path, capsys):
    folder = make_full_record(tmp_path)
    rc, out = run_check(folder, capsys, *SOTA)
    assert rc == 0, out
    assert out.startswith("OK: ") and "3 seed(s)" in out and "1.11700000" in out and "FAIL" not in out
    assert out.splitlines()[1].startswith("RECORD: mean val_bpb 1.11700000 over 3 seed(s) beats SOTA 1.124")


def test_check_happy_path_as_subprocess(tmp_path):
    folder = make_full_record(tmp_path)
    cmd = [sys.executable, str(SCRIPTS / "record" / "check_record.py"), str(folder), *SOTA]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("OK: ")
    (folder / "README.md").unlink()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stdout == f"FAIL: {folder / 'README.md'}: file is missing\n"


def test_check_missing_final_line(tmp_path, capsys):
    folder = make_full_record(tmp_path, "--metric", "sliding")
    write_log(folder / "train_seed42.log", seed=42, **dict(SEEDS[42], drop=("legal_ttt_exact",)))
    rc, out = run_check(folder, capsys)
    assert rc == 1
    assert f"FAIL: {folder / 'train_seed42.log'}: missing final line 'legal_ttt_exact'" in out.splitlines()


def test_check_log_without_ttt_when_other_seeds_ran_it(tmp_path, capsys):
    seeds = {1337: SEEDS[1337], 42: dict(SEEDS[42], ttt=None, flags=False)}
    folder = make_full_record(tmp_path, seeds=seeds)
    rc, out = run_check(folder, capsys)
    assert rc == 1
    assert f"{folder / 'train_seed42.log'}: missing final line 'legal_ttt'" in out
    assert f"{folder / 'train_seed42.log'}: missing final line 'legal_ttt_exact'" in out


def test_check_missing_total_size_line(tmp_path, capsys):
    folder = make_full_record(tmp_path)
    write_log(folder / "train_seed42.log", seed=42, **dict(SEEDS[42], drop=("Total submission size int6+lzma:",)))
    rc, out = run_check(folder, capsys)
    assert rc == 1 and "missing final line 'Total submission size int6+lzma'" in out


def test_check_over_size(tmp_path, capsys):
    folder = make_full_record(tmp_path, seeds={1337: dict(SEEDS[1337], quant_bytes=16_000_001 - CODE_BYTES)})
    rc, out = run_check(folder, capsys)
    assert rc == 1
    log = folder / "train_seed1337.log"
    assert out.strip() == f"FAIL: {log}: total submission size 16000001 bytes exceeds 16000000"


def test_check_over_limit_line(tmp_path, capsys):
    folder = make_full_record(tmp_path, seeds={1337: dict(SEEDS[1337], over_limit=True)})
    rc, out = run_check(folder, capsys)
    assert rc == 1
    log = folder / "train_seed1337.log"
    assert out.strip() == f"FAIL: {log}: OVER_LIMIT line: total_bytes 15900000 over cap 16000000"


def test_check_train_time_over_cap_only_on_10min_track(tmp_path, capsys):
    seeds = {1337: dict(SEEDS[1337], train_time_ms=600_500)}
    folder = make_full_record(tmp_path, seeds=seeds)
    rc, out = run_check(folder, capsys)
    assert rc == 1
    assert out.strip() == f"FAIL: {folder / 'train_seed1337.log'}: training time 600500 ms exceeds 600000 ms"
    assert run_check(folder, capsys, "--track", "non-record")[0] == 0

    other = make_full_record(tmp_path / "b", seeds=seeds, track="track_non_record_16mb")
    rc, out = run_check(other, capsys)
    assert rc == 0 and "(non-record track)" in out
    assert run_check(other, capsys, "--track", "10min")[0] == 1


def test_check_eval_time_over_cap(tmp_path, capsys):
    seeds = {1337: dict(SEEDS[1337], ttt=(1.1160, 502_001.0))}  # 8 + 90 + 502.001 s
    folder = make_full_record(tmp_path, seeds=seeds)
    rc, out = run_check(folder, capsys)
    assert rc == 1
    assert out.strip() == f"FAIL: {folder / 'train_seed1337.log'}: evaluation time 600001 ms exceeds 600000 ms"
    assert run_check(folder, capsys, "--track", "non-record")[0] == 0


def test_check_code_not_python310(tmp_path, capsys):
    code = VALID_CODE + "type Alias = int\n"  # PEP 695: Python 3.12+
    with pytest.raises(SyntaxError):
        ast.parse(code, feature_version=(3, 10))
    folder = make_full_record(tmp_path, code=code)
    rc, out = run_check(folder, capsys)
    assert rc == 1
    assert out.startswith(f"FAIL: {folder / 'train_gpt.py'}: does not parse as Python 3.10:")
    assert len(out.splitlines()) == 1


def test_check_code_size_mismatch(tmp_path, capsys):
    folder = make_full_record(tmp_path, seeds={1337: SEEDS[1337]})
    with open(folder / "train_gpt.py", "a") as f:
        f.write("# edited after the run\n")
    rc, out = run_check(folder, capsys)
    assert rc == 1
    size = CODE_BYTES
    assert out.strip() == (
        f"FAIL: {folder / 'train_seed1337.log'}: Code size {size} bytes logged but train_gpt.py is {size + 23} bytes"
    )


def test_check_missing_train_gpt(tmp_path, capsys):
    folder = make_full_record(tmp_path)
    (folder / "train_gpt.py").unlink()
    rc, out = run_check(folder, capsys)
    assert rc == 1 and out.strip() == f"FAIL: {folder / 'train_gpt.py'}: file is missing"


def test_check_val_bpb_mismatch(tmp_path, capsys):
    folder = make_full_record(tmp_path)
    set_json(folder, val_bpb=1.1171)
    rc, out = run_check(folder, capsys)
    assert rc == 1
    assert out.strip() == (
        f"FAIL: {folder / 'submission.json'}: val_bpb 1.1171 != mean legal_ttt_exact of the logs 1.11700000"
    )
    set_json(folder, val_bpb=1.117 + 5e-7)  # within the 1e-6 tolerance
    assert run_check(folder, capsys, *SOTA)[0] == 0


def test_check_bytes_total_mismatch(tmp_path, capsys):
    folder = make_full_record(tmp_path)
    set_json(folder, bytes_total=15_900_000)
    rc, out = run_check(folder, capsys)
    assert rc == 1
    assert out.strip() == (
        f"FAIL: {folder / 'submission.json'}: bytes_total 15900000 != max logged total submission size 15900200"
    )


def test_check_missing_submission_json(tmp_path, capsys):
    folder = make_full_record(tmp_path)
    (folder / "submission.json").unlink()
    rc, out = run_check(folder, capsys)
    assert rc == 1 and out.strip() == f"FAIL: {folder / 'submission.json'}: file is missing"


def test_check_submission_json_types(tmp_path, capsys):
    folder = make_full_record(tmp_path)
    data = load_json(folder)
    del data["author"]
    data.update(val_bpb=True, bytes_total="15900254", date="21/11/2025", github_id="")
    (folder / "submission.json").write_text(json.dumps(data))
    rc, out = run_check(folder, capsys)
    assert rc == 1
    for msg in (
        "missing field 'author'",
        "field 'val_bpb' must be a positive number",
        "field 'bytes_total' must be a positive integer",
        "field 'date' must be YYYY-MM-DD",
        "field 'github_id' must be a non-empty string",
    ):
        assert f"FAIL: {folder / 'submission.json'}: {msg}" in out
    (folder / "submission.json").write_text("{not json")
    rc, out = run_check(folder, capsys)
    assert rc == 1 and "submission.json: not valid JSON" in out


def test_check_seed_line_mismatch(tmp_path, capsys):
    folder = make_full_record(tmp_path)
    text = (folder / "train_seed42.log").read_text().replace("\nseed:42\n", "\nseed:43\n")
    (folder / "train_seed42.log").write_text(text)
    rc, out = run_check(folder, capsys)
    assert rc == 1 and "log says seed:43 but the file name says seed 42" in out


def test_check_no_logs(tmp_path, capsys):
    folder = make_full_record(tmp_path)
    for log in folder.glob("train_seed*.log"):
        log.unlink()
    rc, out = run_check(folder, capsys)
    assert rc == 1
    assert out.strip() == f"FAIL: {folder}: no train_seed*.log files"


def test_check_not_a_folder(tmp_path, capsys):
    rc, out = run_check(tmp_path / "nope", capsys)
    assert rc == 1 and "not a directory" in out


def test_check_refuses_log_holding_two_runs(tmp_path, capsys):
    """A rerun with the same RUN_ID appended to the old log: make_record scores
    the last run in the file, so the folder looked consistent and passed."""
    folder = make_folder(tmp_path, track="track_non_record_16mb")
    log = folder / "train_seed42.log"
    crashed = log.read_text()
    rerun = write_log(tmp_path / "rerun.log", seed=42, **dict(SEEDS[42], ttt=(1.1100, 400_000.0))).read_text()
    log.write_text(_two_runs_full(crashed, rerun))
    assert make_record.main([str(folder), *META]) == 0
    rc, out = run_check(folder, capsys)
    assert rc == 1
    assert out.splitlines() == [
        f"FAIL: {log}: holds more than one run: 2 run headers ('Running Python ...' after the '=' separator);"
        " a rerun appended to an old log? Keep exactly one run per log"
    ]
    # Results appended twice, without a second header, are refused as well.
    log.write_text(_two_runs_results_only(crashed, rerun))
    rc, out = run_check(folder, capsys)
    assert rc == 1 and len(out.splitlines()) == 1
    assert out.startswith(f"FAIL: {log}: holds more than one run: 'Code size' line logged 2 times")


def test_check_refuses_truncated_log(tmp_path, capsys):
    """Cut inside its last number, a log says legal_ttt_exact val_bpb:1.1
    instead of 1.11700000; that score must not pass."""
    folder = make_folder(tmp_path, track="track_non_record_16mb")
    log = folder / "train_seed42.log"
    text = log.read_text()
    assert text.endswith("val_bpb:1.11700000\n")
    log.write_text(text[: -len("1700000\n")])
    assert make_record.main([str(folder), *META]) == 0
    assert load_json(folder)["per_seed"][0]["val_bpb"] == 1.1
    rc, out = run_check(folder, capsys)
    assert rc == 1
    assert out.splitlines() == [
        f"FAIL: {log}: does not end with a newline: the log looks truncated (cut off mid-line)"
    ]


BAD_SUBMISSIONS = [
    # (file text, or a dict of changes to a good submission; expected lines after "FAIL: <path>: ")
    ("[]", ["top level must be a JSON object, got an array"]),
    ("null", ["top level must be a JSON object, got null"]),
    ("NaN", ["top level must be a JSON object, got NaN"]),
    ('"x"', ['top level must be a JSON object, got string "x"']),
    ("", ["not valid JSON: Expecting value: line 1 column 1 (char 0)"]),
    ('{"name": ', ["not valid JSON: Expecting value: line 1 column 10 (char 9)"]),
    ("[" * 100_000, ["not valid JSON: nested too deeply"]),
    (dict(val_bpb="1.117"), ["field 'val_bpb' must be a positive number, got string \"1.117\""]),
    (dict(val_bpb=True), ["field 'val_bpb' must be a positive number, got true"]),
    (dict(val_bpb=None), ["field 'val_bpb' must be a positive number, got null"]),
    (dict(val_bpb=math.nan), ["field 'val_bpb' must be a positive number, got NaN"]),
    (dict(val_bpb=-math.inf), ["field 'val_bpb' must be a positive number, got -Infinity"]),
    (dict(val_bpb=[1.117]), ["field 'val_bpb' must be a positive number, got an array"]),
    (dict(val_bpb=10**400), ["field 'val_bpb' must be a positive number, got number " + "1" + "0" * 36 + "..."]),
    (dict(bytes_total=15_900_200.0), ["field 'bytes_total' must be a positive integer, got number 15900200.0"]),
    (dict(bytes_total=False), ["field 'bytes_total' must be a positive integer, got false"]),
    (dict(name=5, blurb={"a": 1}), ["field 'name' must be a non-empty string, got number 5",
                                    "field 'blurb' must be a non-empty string, got an object"]),
    (dict(date=20251121), ["field 'date' must be YYYY-MM-DD, got number 20251121"]),
    (dict(val_bpb_metric=["legal_ttt"]),
     ["field 'val_bpb_metric' must be one of legal_ttt, sliding, roundtrip, got an array"]),
    (dict(val_bpb_metric=None), ["field 'val_bpb_metric' must be one of legal_ttt, sliding, roundtrip, got null"]),
    (dict(val_bpb_std="0.001"), ["field 'val_bpb_std' must be a non-negative number or null, got string \"0.001\""]),
    (dict(seeds=42), ["field 'seeds' must be an array of integers, got number 42"]),
    (dict(seeds=[42, "1337", True]), ["field 'seeds[1]' must be a non-negative integer, got string \"1337\"",
                                      "field 'seeds[2]' must be a non-negative integer, got true"]),
    (dict(per_seed={"seed": 42}), ["field 'per_seed' must be an array of objects, got an object"]),
    (dict(per_seed=[1, None]), ["field 'per_seed[0]' must be an object, got number 1",
                                "field 'per_seed[1]' must be an object, got null"]),
    (dict(per_seed=[{"seed": "42", "val_bpb": None, "steps": 1.5}]),
     ["field 'per_seed[0].seed' must be a non-negative integer, got string \"42\"",
      "field 'per_seed[0].val_bpb' must be a positive number, got null",
      "field 'per_seed[0].steps' must be a non-negative integer or null, got number 1.5"]),
    (dict(per_seed=[{"val_bpb": 1.117}]), ["missing field 'per_seed[0].seed'"]),
    (dict(significance="yes"), ["field 'significance' must be an object, got string \"yes\""]),
    (dict(significance={"sota_bpb": "1.12", "significant": 1, "p": 2}),
     ["field 'significance.sota_bpb' must be a positive number, got string \"1.12\"",
      "field 'significance.significant' must be true or false, got number 1",
      "field 'significance.p' must be a number in [0, 1] or null, got number 2"]),
]


@pytest.mark.parametrize("bad, expected", BAD_SUBMISSIONS, ids=range(len(BAD_SUBMISSIONS)))
def test_check_malformed_submission_json_one_line_each(tmp_path, capsys, bad, expected):
    """Never a traceback: every malformed submission.json gives one FAIL line per problem."""
    folder = make_full_record(tmp_path)
    if isinstance(bad, dict):
        set_json(folder, **bad)
    else:
        (folder / "submission.json").write_text(bad)
    rc, out = run_check(folder, capsys, "--track", "non-record")
    assert rc == 1
    assert out.splitlines() == [f"FAIL: {folder / 'submission.json'}: {msg}" for msg in expected]


def test_check_malformed_submission_json_in_a_subprocess(tmp_path):
    folder = make_full_record(tmp_path)
    cmd = [sys.executable, str(SCRIPTS / "record" / "check_record.py"), str(folder), "--track", "non-record"]
    for text in (b"\xff\xfe{}", b'{"val_bpb": ' + b"9" * 5000 + b"}", json.dumps({"a": [None]}).encode()):
        (folder / "submission.json").write_bytes(text)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 1 and proc.stderr == "", proc.stderr
        assert proc.stdout and all(ln.startswith("FAIL: ") for ln in proc.stdout.splitlines())
    (folder / "submission.json").unlink()
    (folder / "submission.json").mkdir()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr == ""
    assert proc.stdout.startswith(f"FAIL: {folder / 'submission.json'}: cannot read the file")


def test_check_per_seed_and_std_must_match_the_logs(tmp_path, capsys):
    folder = make_full_record(tmp_path)
    data = load_json(folder)
    data["per_seed"][1]["val_bpb"] = 1.1150
    data["val_bpb_std"] = 0.002
    (folder / "submission.json").write_text(json.dumps(data))
    rc, out = run_check(folder, capsys, "--track", "non-record")
    path = folder / "submission.json"
    assert rc == 1
    assert out.splitlines() == [
        f"FAIL: {path}: val_bpb_std 0.002 != sample std of legal_ttt_exact over the logs 0.00100000",
        f"FAIL: {path}: per_seed[1].val_bpb 1.115 != legal_ttt_exact 1.11600000 of seed 1337's log",
    ]


# ---------------------------------------------------------------------------
# check_record: the 10-minute track's SOTA verdict and hardware


def test_check_10min_track_without_sota_is_not_ok(tmp_path, capsys):
    folder = make_full_record(tmp_path)
    rc, out = run_check(folder, capsys)
    assert rc == 1
    lines = out.splitlines()
    assert len(lines) == 2 and not any(ln.startswith("OK") for ln in lines)
    assert lines[0].startswith(f"WELL-FORMED: {folder} (10min track): 3 seed(s)")
    assert lines[1] == (
        "NOT CHECKED: whether it beats the current SOTA; a 10-minute record must beat it by >= 0.005 nats"
        " at p < 0.01: pass --sota-bpb X (the current record's val_bpb), or --against ROW for the leaderboard's"
        " rule (one-sided Welch p < 0.25 against that row's seeds)"
    )


def test_check_10min_track_sota_verdict(tmp_path, capsys):
    """Same numbers as test_make_record_significance: vs 1.1240, t = -6.9932,
    p = 1/2 (1 - 6.9932 / 7.13478) = 0.009921 < 0.01; vs 1.1205 the threshold
    1.1175375 is only 0.0005 above the mean 1.117 (t = -0.93), not significant."""
    folder = make_full_record(tmp_path)
    rc, out = run_check(folder, capsys, *SOTA)
    assert rc == 0
    assert out.splitlines()[1] == (
        "RECORD: mean val_bpb 1.11700000 over 3 seed(s) beats SOTA 1.124 by >= 0.005 nats (0.00296 bpb)"
        " at p < 0.01 (t=-6.993, df=2, p=0.009921; threshold 1.12103750)"
        " [README rule: beat --sota-bpb by >= 0.005 nats at p < 0.01]"
    )
    rc, out = run_check(folder, capsys, "--sota-bpb", "1.1205")
    assert rc == 1
    lines = out.splitlines()
    assert lines[0].startswith("WELL-FORMED: ") and len(lines) == 2
    assert lines[1].startswith(
        "NOT A RECORD: mean val_bpb 1.11700000 over 3 seed(s) does not beat SOTA 1.1205 by >= 0.005 nats"
    )
    # Worse than SOTA outright, and a single seed (no t-test possible).
    assert run_check(folder, capsys, "--sota-bpb", "1.11")[0] == 1
    one = make_full_record(tmp_path / "one", seeds={1337: SEEDS[1337]})
    rc, out = run_check(one, capsys, "--sota-bpb", "1.2")
    assert rc == 1 and out.splitlines()[1].startswith(
        "NOT A RECORD: mean val_bpb 1.11600000 over 1 seed(s): cannot run the t-test with n=1 seed(s)"
    )


def test_check_against_a_row_applies_the_leaderboards_welch_rule(tmp_path, capsys):
    """--against: the folder's seeds (1.116, 1.117, 1.118) against a row's, one-sided Welch p < 0.25, which then
    decides the exit status; the README's rule with --sota-bpb becomes information; each line names its rule."""
    folder = make_full_record(tmp_path)
    mine = [1.116, 1.117, 1.118]
    for row, accepted in (("1.1180,1.1190,1.1170", True), ("1.1170,1.1175,1.1168", False)):
        rc, out = run_check(folder, capsys, "--against", row)
        want = rl.welch_test(mine, [float(x) for x in row.split(",")])
        lines = out.splitlines()
        assert rc == (0 if accepted else 1) and len(lines) == 2, out
        assert lines[0].startswith("OK: " if accepted else "WELL-FORMED: ")
        assert lines[1].startswith("RECORD: " if accepted else "NOT A RECORD: ")
        assert f"p={want.p:.4g}" in lines[1] and lines[1].endswith(f"[{rl.WELCH_RULE}]")
    assert 0.1 < rl.welch_test(mine, [1.1180, 1.1190, 1.1170]).p < 0.25  # accepted, though far from p < 0.01
    # Both rules: --against decides (exit 0 here although the README's rule fails against 1.1205).
    rc, out = run_check(folder, capsys, "--against", "1.1180,1.1190,1.1170", "--sota-bpb", "1.1205")
    assert rc == 0 and out.splitlines()[2].startswith("INFO (not deciding: --against applies the leaderboard's")
    assert out.splitlines()[2].endswith(f"[{rl.README_RULE}]")
    # A row folder: its submission.json's per-seed scores (make_record's per_seed).
    row = make_full_record(tmp_path / "row")
    rc, out = run_check(folder, capsys, "--against", str(row))
    assert rc == 1 and f"over 3 seed(s) against the row's 1.11700000 over 3 ({row})" in out and "p=0.5)" in out
    rc, out = run_check(folder, capsys, "--against", str(tmp_path / "missing"))
    assert rc == 1 and out.startswith("FAIL: ") and "comma-separated numbers" in out and len(out.splitlines()) == 1


def test_check_non_record_track_sota_is_information(tmp_path, capsys):
    folder = make_full_record(tmp_path, track="track_non_record_16mb")
    rc, out = run_check(folder, capsys)
    assert rc == 0 and len(out.splitlines()) == 1 and out.startswith("OK: ")
    rc, out = run_check(folder, capsys, "--sota-bpb", "1.1205")
    assert rc == 0 and out.startswith("OK: ")
    assert out.splitlines()[1].startswith("INFO (non-record track, not required): NOT A RECORD: ")


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-1", "0"])
def test_check_sota_bpb_must_be_a_positive_number(tmp_path, capsys, value):
    folder = make_full_record(tmp_path)
    with pytest.raises(SystemExit) as exc:
        check_record.main([str(folder), "--sota-bpb", value])
    assert exc.value.code == 2 and "--sota-bpb: must be" in capsys.readouterr().err


def test_check_10min_track_needs_8_gpus(tmp_path, capsys):
    """The measured case: a CPU folder at 3.8 bpb printed a bare OK."""
    cpu = dict(device="cpu", world_size=1, ttt=(3.8, 400_000.0))
    folder = make_full_record(tmp_path, seeds={s: dict(SEEDS[s], **cpu) for s in SEEDS})
    rc, out = run_check(folder, capsys)
    assert rc == 1
    assert out.splitlines() == [
        f"FAIL: {folder / name}: ran on device:cpu world_size:1, but the 10-minute track requires 8xH100"
        " (device:cuda world_size:8)"
        for name in ("train_seed42.log", "train_seed1337.log", "train_seed2025.log")
    ]
    assert run_check(folder, capsys, "--track", "non-record")[0] == 0

    seeds = {1337: SEEDS[1337], 42: dict(SEEDS[42], world_size=4), 2025: dict(SEEDS[2025], device=None)}
    folder = make_full_record(tmp_path / "b", seeds=seeds)
    rc, out = run_check(folder, capsys)
    assert rc == 1
    assert out.splitlines() == [
        f"FAIL: {folder / 'train_seed42.log'}: ran on device:cuda:0 world_size:4, but the 10-minute track"
        " requires 8xH100 (device:cuda world_size:8)",
        f"FAIL: {folder / 'train_seed2025.log'}: no 'device:... world_size:N' line; cannot tell the hardware,"
        " and the 10-minute track requires 8xH100 (device:cuda world_size:8)",
    ]


def test_check_worked_example_folder(capsys):
    folder = REPO / "records" / "track_non_record_16mb" / "2026-11-21_CPU_SampleData_6L128"
    if not folder.is_dir():
        pytest.skip("worked example folder not present")
    rc, out = run_check(folder, capsys)
    assert rc == 0 and out.startswith("OK: ") and "(non-record track)" in out


# ---------------------------------------------------------------------------
# Replay runs (issue 40): the train_clock line, the 10-minute refusal, the reproduction check

# Both forms of the line: train_gpt.py's today (the clock's text, the replayed and the real world sizes, micro-batches
# per rank, maybe a note) and the first one (TRAIN_CLOCK=ms:X alone), each with what the parser must read from it.
CLOCK_LINES = [
    ("train_clock:record(record_0427 seed 42) replay_world_size:8 world_size:1 grad_accum:8 (every time-based"
     " decision reads the replayed time; train_time is the real time)", ("record(record_0427 seed 42)", 8, 1, 8)),
    ("train_clock:ms:50 replay_world_size:2 world_size:2 grad_accum:4 (every time-based decision reads the replayed"
     " time; train_time is the real time)", ("ms:50", 2, 2, 4)),
    ("train_clock:wall replay_world_size:8 world_size:1 grad_accum:8 (virtual ranks: each rank computes the"
     " micro-batches of 8 ranks)", ("wall", 8, 1, 8)),
    ("train_clock:log(/home/u/logs/my run.txt) replay_world_size:8 world_size:2 grad_accum:4",
     ("log(/home/u/logs/my run.txt)", 8, 2, 4)),
    # a path holding the fields' own text: the clock ends at the line's last replay_world_size field
    ("train_clock:log(/tmp/x replay_world_size:3 world_size:3 grad_accum:1 (y).txt) replay_world_size:8 world_size:1"
     " grad_accum:8 (a note)", ("log(/tmp/x replay_world_size:3 world_size:3 grad_accum:1 (y).txt)", 8, 1, 8)),
    ("train_clock:ms:50 (every time-based decision reads step x 50 ms; train_time is the real time)",
     ("ms:50", None, None, None)),
    ("train_clock:ms:12.5", ("ms:12.5", None, None, None)),
]
RECORD_CLOCK = CLOCK_LINES[0][0]
RECORD_CLOCK_TEXT = ("trained on a replay clock (train_clock:record(record_0427 seed 42)), replaying 8 ranks on 1"
                     " (replay_world_size:8 world_size:1 grad_accum:8)")
ROW = "1.1160,1.1170,1.1180"  # mean 1.117, s = 0.001, as SEEDS' TTT scores


@pytest.mark.parametrize("line, want", CLOCK_LINES)
def test_parser_reads_both_forms_of_the_train_clock_line(tmp_path, line, want):
    log = rl.parse_log(write_log(tmp_path / "a.log", clock_line=line))
    assert (log.train_clock, log.replay_world_size, log.real_world_size, log.grad_accum) == want
    assert log.replayed and (log.device, log.world_size) == ("cuda:0", 8)  # the device line's world_size stays
    assert rl.integrity_problems(log) == [] and log.once_counts["train_clock"] == 1
    clock, replayed, real, accum = want
    note = rl.replayed_note(log)
    assert "\n" not in note and note.endswith(": a reproduction, not a run timed by the wall clock on its own ranks,"
                                              " so this log is not a valid 10-minute-track record run")
    if clock == "wall":
        assert note.startswith("trained on the wall clock, replaying ") and "train_clock:" not in note
    else:
        assert note.startswith(f"trained on a replay clock (train_clock:{clock})")
    worlds = f", replaying {replayed} ranks on {real} (replay_world_size:{replayed} world_size:{real} grad_accum:{accum})"
    assert (worlds in note) == (replayed is not None) and (note.count("replay_world_size:") == 0) == (replayed is None)


def test_a_log_without_a_train_clock_line_is_no_replay_and_two_lines_are_two_runs(tmp_path):
    """The preamble's train_clock templates (source text) are no line; the line is logged once per run."""
    log = rl.parse_log(write_log(tmp_path / "a.log"))
    assert not log.replayed and log.train_clock is None and log.replay_world_size is None
    assert rl.replayed_note(log) is None
    twice = rl.parse_log(write_log(tmp_path / "b.log", clock_line=RECORD_CLOCK, extra_lines=(RECORD_CLOCK,)))
    assert rl.multiple_runs_evidence(twice) == "'train_clock' line logged 2 times"


def test_stop_step_from_our_logs_and_from_the_records_own_form():
    ours = rl.parse_log_text("step:6/100000 train_loss:2.0000 train_time:310ms step_avg:51.67ms replayed_time:300ms\n"
                             "stopping_early: wallclock_cap train_time:310ms step:6/100000 replayed_time:300ms\n")
    theirs = rl.parse_log_text("5000/20000 train_loss: 2.4398 train_time: 10.0m tok/s: 6559111\n"
                               "stopping_early: wallclock_cap train_time: 599672ms step: 5001/20000\n")
    assert (ours.final_step, ours.stopped_early) == (6, True) and (theirs.final_step, theirs.stopped_early) == (5001, True)
    assert rl.parse_log_text("step:7/9 train_loss:2.0000 train_time:7ms step_avg:1.00ms\n").final_step == 7
    assert rl.parse_log_text("seed:1\n").final_step is None
    if (FRONTIER / "record_0501").is_dir():
        assert rl.row_stop_steps(str(FRONTIER / "record_0501")) == [(42, 5001)]


def t4_two_sided_p(t: float) -> float:
    """P(|T| >= |t|) for Student's t with 4 degrees of freedom, in closed form (not by recordlib):
    F(t) = 1/2 + u/2 (1 + 2/(4 + t^2)) with u = t / sqrt(4 + t^2), so the two tails are 1 - u (1 + 2/(4 + t^2))."""
    u = abs(t) / math.sqrt(4 + t * t)
    return 1 - u * (1 + 2 / (4 + t * t))


def test_welch_two_sided_against_closed_forms_and_t_tables():
    """Two samples of 3 with the same spread (s = 0.001): the Welch df is exactly 4, and t = d / sqrt(2 s^2 / 3)."""
    row = [1.1160, 1.1170, 1.1180]
    se = math.sqrt(2 * 0.001 ** 2 / 3)
    for shift in (0.0002, -0.0007, 0.004):
        w = rl.welch_two_sided([x + shift for x in row], row)
        assert (w.n, w.row_n, w.missing) == (3, 3, None)
        assert w.mean == pytest.approx(1.117 + shift, abs=1e-12) and w.row_mean == pytest.approx(1.117, abs=1e-12)
        assert w.difference == pytest.approx(shift, abs=1e-12)
        assert w.t == pytest.approx(shift / se, rel=1e-6) and w.df == pytest.approx(4, rel=1e-6)
        assert w.p == pytest.approx(t4_two_sided_p(shift / se), abs=1e-9)
        assert w.reproduces == (w.p >= 0.05)
    # t tables, df = 4: the two-sided 5% and 1% critical values are 2.776445 and 4.604095.
    for t_crit, p in ((2.776445, 0.05), (4.604095, 0.01)):
        assert rl.welch_two_sided([x + t_crit * se for x in row], row).p == pytest.approx(p, abs=1e-6)
        assert rl.welch_two_sided([x - t_crit * se for x in row], row).p == pytest.approx(p, abs=1e-6)
    assert rl.welch_two_sided(row, row).p == 1.0 and rl.welch_two_sided(row, row).reproduces
    # Unequal spreads (non-integer df): twice the smaller tail of the one-sided test, the same either way round.
    w, one = rl.welch_two_sided(ROW_2135, ROW_2014), rl.welch_test(ROW_2135, ROW_2014)
    assert (w.t, w.df) == (one.t, one.df) and w.p == pytest.approx(2 * min(one.p, 1 - one.p), abs=1e-12)
    assert round(w.p, 3) == 0.028 and not w.reproduces
    assert rl.welch_two_sided(ROW_2014, ROW_2135).p == pytest.approx(w.p, abs=1e-12)


def test_welch_two_sided_says_what_it_lacks():
    one_seed = rl.welch_two_sided([1.1], [1.1, 1.2])
    assert one_seed.p is None and not one_seed.reproduces
    assert one_seed.missing == "the Welch t-test needs at least 2 seeds on each side, and the reproduction has 1"
    assert rl.welch_two_sided([1.1, 1.2], [1.1]).missing.endswith("and the row has 1")
    assert rl.welch_two_sided([], [1.1]).missing.endswith("and the reproduction has 0 and the row has 1")
    flat = rl.welch_two_sided([1.1, 1.1], [1.1, 1.1, 1.1])
    assert flat.p is None and flat.missing.startswith("every seed on each side has the same score")
    assert rl.welch_two_sided([1.1, 1.1], [1.1, 1.2]).p is not None  # spread on one side is enough
    assert rl.welch_two_sided([1.1, math.nan], [1.1, 1.2]).missing == "a score is not a finite number"


def replay_folder(tmp_path: Path, ttt: tuple[float, ...], steps: tuple[int, ...] = (7000, 6900, 6800),
                  clock: str | None = RECORD_CLOCK, name: str = "2025-11-22_Replay") -> Path:
    """A non-record folder of replay runs (seeds 1337, 42, 2025 in turn, as many as ``ttt`` scores), with make_record
    run on it."""
    seeds = {seed: dict(SEEDS[seed], ttt=(bpb, 400_000.0), steps=n, clock_line=clock)
             for seed, bpb, n in zip(SEEDS, ttt, steps)}
    return make_full_record(tmp_path, track="track_non_record_16mb", seeds=seeds, name=name)


def test_check_refuses_a_replay_run_on_the_10min_track(tmp_path, capsys):
    """Virtual ranks and a replayed clock: each log is one FAIL line naming both, even with --against."""
    made = make_full_record(tmp_path, track="track_non_record_16mb",
                            seeds={s: dict(SEEDS[s], clock_line=RECORD_CLOCK) for s in SEEDS})
    folder = tmp_path / "records" / "track_10min_16mb" / made.name  # moved there by hand, make_record refusing it
    folder.parent.mkdir(parents=True)
    made.rename(folder)
    note = f"{RECORD_CLOCK_TEXT}: a reproduction, not a run timed by the wall clock on its own ranks, so this log is" \
           " not a valid 10-minute-track record run"
    for args in ((), ("--against", ROW)):
        rc, out = run_check(folder, capsys, *args)
        assert rc == 1 and out.splitlines() == [
            f"FAIL: {folder / name}: {note}" for name in ("train_seed42.log", "train_seed1337.log", "train_seed2025.log")
        ]
    # elsewhere the same folder is well-formed, and without --against checked as any non-record folder
    rc, out = run_check(folder, capsys, "--track", "non-record")
    assert rc == 0 and len(out.splitlines()) == 1 and out.startswith(f"OK: {folder} (non-record track): 3 seed(s)")


def test_make_record_warns_naming_the_clock_and_the_worlds(tmp_path, capsys):
    folder = replay_folder(tmp_path, (1.1160, 1.1170, 1.1180))
    err = capsys.readouterr().err
    for name in ("train_seed42.log", "train_seed1337.log", "train_seed2025.log"):
        assert f"warning: {folder / name}: {RECORD_CLOCK_TEXT}: a reproduction" in err
    make_full_record(tmp_path / "plain")
    assert "reproduction" not in capsys.readouterr().err


def test_make_record_refuses_a_replay_as_a_record(tmp_path, capsys):
    """A replay in a 10-minute-track folder, or with --sota-bpb (a record's claim): one error line naming the log
    and what to do, exit 2, nothing written; a non-record folder of the same logs is made (the warning above)."""
    seeds = {s: dict(SEEDS[s], clock_line=RECORD_CLOCK) for s in SEEDS}
    for track, extra in (("track_10min_16mb", ()), ("track_non_record_16mb", ("--sota-bpb", "1.1194"))):
        folder = make_folder(tmp_path / track, track=track, seeds=seeds)
        capsys.readouterr()
        assert make_record.main([str(folder), *META, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        where = "--sota-bpb" if extra else "a folder under track_10min_16mb"
        assert err.startswith(f"error: {folder / 'train_seed42.log'}: {RECORD_CLOCK_TEXT}: a reproduction") and \
            err.endswith(f"not a valid 10-minute-track record run; {where} claims a record: put a reproduction under "
                         "track_non_record_16mb and compare it with check_record.py --against"), err
        assert not (folder / "submission.json").exists() and not (folder / "README.md").exists()


def test_check_a_reproduction_that_reproduces_the_row(tmp_path, capsys):
    """Seeds 0.0002 above the row's, same spread: t = 0.2449, df = 4, two-sided p = 0.8185 by the closed form."""
    folder = replay_folder(tmp_path, (1.1162, 1.1172, 1.1182))
    rc, out = run_check(folder, capsys, "--against", ROW)
    p = t4_two_sided_p(0.0002 / math.sqrt(2e-6 / 3))
    assert round(p, 4) == 0.8185
    assert rc == 0 and out.splitlines() == [
        out.splitlines()[0],
        f"REPRODUCES: mean 1.11720000 over 3 seed(s) vs the row's 1.11700000 over 3 seed(s) ({ROW}), difference"
        f" +0.00020000 (t=0.2449, df=4, two-sided p={p:.4g} >= 0.05) [{rl.REPRODUCTION_RULE}]",
    ]
    assert out.startswith(f"OK: {folder} (non-record track): 3 seed(s)")
    assert rl.REPRODUCTION_RULE == "reproduction rule: two-sided Welch t-test at p < 0.05"


def test_check_a_reproduction_that_does_not_reproduce_the_row(tmp_path, capsys):
    """Seeds 0.004 above the row's, same spread: t = 4.899, df = 4, two-sided p = 0.00805 by the closed form."""
    folder = replay_folder(tmp_path, (1.1200, 1.1210, 1.1220))
    rc, out = run_check(folder, capsys, "--against", ROW, "--sota-bpb", "1.2")
    p = t4_two_sided_p(0.004 / math.sqrt(2e-6 / 3))
    assert round(p, 5) == 0.00805
    lines = out.splitlines()
    assert rc == 1 and len(lines) == 3 and lines[0].startswith(f"WELL-FORMED: {folder} (non-record track)")
    assert lines[1] == (f"DOES NOT REPRODUCE: mean 1.12100000 over 3 seed(s) vs the row's 1.11700000 over 3 seed(s)"
                        f" ({ROW}), difference +0.00400000 (t=4.899, df=4, two-sided p={p:.4g} < 0.05)"
                        f" [{rl.REPRODUCTION_RULE}]")
    assert lines[2].startswith("INFO (non-record track, not required): RECORD: ")  # --sota-bpb stays information
    # Below the row by as much: two-sided, so it does not reproduce either (the one-sided rule would accept it).
    lower = replay_folder(tmp_path / "lower", (1.1120, 1.1130, 1.1140))
    rc, out = run_check(lower, capsys, "--against", ROW)
    assert rc == 1 and out.splitlines()[1].startswith("DOES NOT REPRODUCE: ") and "difference -0.00400000" in out
    # A folder that is no replay keeps the leaderboard's one-sided rule as information with --against.
    plain = make_full_record(tmp_path / "plain", track="track_non_record_16mb")
    rc, out = run_check(plain, capsys, "--against", "1.1200,1.1210,1.1220")
    assert rc == 0 and out.splitlines()[1].startswith("INFO (non-record track, not required): RECORD: ")


def test_check_a_reproduction_reports_the_stop_steps_against_a_row_folder(tmp_path, capsys):
    """ROW a record folder: its submission.json's scores, and its logs' stop steps beside each seed's."""
    row = make_full_record(tmp_path / "row")  # steps 7000, 6900, 6800 for seeds 1337, 42, 2025
    folder = replay_folder(tmp_path, (1.1160, 1.1170, 1.1180), steps=(7000, 6900, 6790))
    rc, out = run_check(folder, capsys, "--against", str(row))
    lines = out.splitlines()
    assert rc == 0 and lines[1].startswith("REPRODUCES: ") and "two-sided p=1 >= 0.05" in lines[1]
    assert lines[2:] == [
        "INFO: seed 42 stopped at step 6900 (the row's seed 42: 6900, the same step)",
        "INFO: seed 1337 stopped at step 7000 (the row's seed 1337: 7000, the same step)",
        "INFO: seed 2025 stopped at step 6790 (the row's seed 2025: 6800, 10 step(s) earlier)",
    ]
    other = make_full_record(tmp_path / "other", seeds={7: SEEDS[42], 8: SEEDS[2025]})
    rc, out = run_check(folder, capsys, "--against", str(other))
    assert out.splitlines()[2] == "INFO: seed 42 stopped at step 6900 (the row's logs: 6900 (seed 7), 6800 (seed 8))"
    rc, out = run_check(folder, capsys, "--against", ROW)  # numbers: no logs, no stop steps
    assert len(out.splitlines()) == 2


def test_check_a_reproduction_that_cannot_be_tested_is_one_line(tmp_path, capsys):
    one = replay_folder(tmp_path, (1.1160,))
    rc, out = run_check(one, capsys, "--against", ROW)
    assert rc == 1 and out.splitlines()[1:] == [
        f"NOT CHECKED: whether it reproduces the row: mean 1.11600000 over 1 seed(s) vs the row's 1.11700000 over 3"
        f" seed(s) ({ROW}), difference -0.00100000: the Welch t-test needs at least 2 seeds on each side, and the"
        f" reproduction has 1 [{rl.REPRODUCTION_RULE}]"
    ]
    three = replay_folder(tmp_path / "three", (1.1160, 1.1170, 1.1180))
    rc, out = run_check(three, capsys, "--against", "1.1170")
    assert rc == 1 and len(out.splitlines()) == 2 and out.splitlines()[1].startswith("NOT CHECKED: ")
    assert "and the row has 1 [" in out
    flat = replay_folder(tmp_path / "flat", (1.1170, 1.1170, 1.1170))
    rc, out = run_check(flat, capsys, "--against", "1.1170,1.1170")
    assert rc == 1 and len(out.splitlines()) == 2 and "every seed on each side has the same score" in out
    rc, out = run_check(three, capsys, "--against", str(tmp_path / "missing"))
    assert rc == 1 and len(out.splitlines()) == 1 and out.startswith("FAIL: ")
    exact = ("final_int6_roundtrip_exact", "final_int6_sliding_window_exact", "legal_ttt_exact")
    unscored = make_folder(tmp_path / "unscored", drop=exact)  # a row whose logs have no score
    rc, out = run_check(three, capsys, "--against", str(unscored))
    assert rc == 1 and out == (f"FAIL: {three}: {unscored}: cannot score its logs: some logs have no"
                               " final_int6_roundtrip_exact line; nothing to score\n")


def test_check_a_folder_mixing_replays_and_runs_is_one_fail_line(tmp_path, capsys):
    seeds = {1337: dict(SEEDS[1337], clock_line=CLOCK_LINES[5][0]), 42: SEEDS[42], 2025: SEEDS[2025]}
    folder = make_full_record(tmp_path, track="track_non_record_16mb", seeds=seeds)
    mix = (f"FAIL: {folder}: mixes replay runs (train_seed1337.log: a train_clock line) with runs on the wall clock"
           " (train_seed42.log, train_seed2025.log); the seeds of a folder are all a reproduction or all a run")
    for args in ((), ("--against", ROW)):
        rc, out = run_check(folder, capsys, *args)
        assert rc == 1 and out.splitlines() == [mix]
    ten = tmp_path / "ten" / "records" / "track_10min_16mb" / folder.name  # by hand: make_record refuses it there
    ten.parent.mkdir(parents=True)
    folder.rename(ten)
    rc, out = run_check(ten, capsys)
    assert rc == 1 and out.splitlines()[-1] == mix.replace(str(folder), str(ten))
    assert out.splitlines()[0].startswith(f"FAIL: {ten / 'train_seed1337.log'}: trained on a replay clock")


# ---------------------------------------------------------------------------
# plot_logs


def test_plot_logs_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = write_log(tmp_path / "a.log", seed=1)
    b = write_log(tmp_path / "b.log", seed=2, step_avg=90.0)
    out = tmp_path / "plots" / "curves.png"
    assert plot_logs.main([str(a), str(b), "-o", str(out), "--labels", "base,new"]) == 0
    data = out.read_bytes()
    assert len(data) > 1000 and data.startswith(b"\x89PNG\r\n\x1a\n")


def test_plot_logs_errors(tmp_path, capsys):
    empty = tmp_path / "empty.log"
    empty.write_text(PREAMBLE)
    with pytest.raises(SystemExit) as exc:
        plot_logs.main([str(empty), "-o", str(tmp_path / "x.png")])
    assert exc.value.code == 2 and "empty.log: no 'step:N/M" in capsys.readouterr().err
    good = write_log(tmp_path / "a.log")
    with pytest.raises(SystemExit):
        plot_logs.main([str(good), "--labels", "a,b"])
    assert "--labels has 2 labels for 1 logs" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# run_seeds.sh, with a fake torchrun that writes the log and artifact train_gpt.py would


FAKE_TORCHRUN = """#!/usr/bin/env bash
echo "$@" > "args_$SEED.txt"
[[ "${FAIL_SEED:-}" == "$SEED" ]] && exit 3
[[ "${NOLOG_SEED:-}" == "$SEED" ]] && exit 0
mkdir -p logs
{ cat train_gpt.py; echo "seed:$SEED"; echo "run_id:$RUN_ID"; echo "inherited:${CALLER_VAR:-}"; } > "logs/$RUN_ID.txt"
[[ "${NOARTIFACT_SEED:-}" == "$SEED" ]] && exit 0
mkdir -p "runs/$RUN_ID"
echo "artifact of seed $SEED" > "runs/$RUN_ID/final_model.int6.ptz"
"""


@pytest.fixture
def fake_repo(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("bash not available")
    repo = tmp_path / "repo"
    (repo / "scripts" / "run").mkdir(parents=True)
    shutil.copy(SCRIPTS / "run" / "run_seeds.sh", repo / "scripts" / "run" / "run_seeds.sh")
    (repo / "train_gpt.py").write_text(VALID_CODE)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text(FAKE_TORCHRUN)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", CALLER_VAR="hello", NPROC_PER_NODE="2")
    return repo, env


def run_seeds(repo: Path, env: dict, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "scripts" / "run" / "run_seeds.sh"), *args], cwd=cwd or repo, env=env,
                          capture_output=True, text=True)


def test_run_seeds_collects_logs(fake_repo, tmp_path):
    repo, env = fake_repo
    env["TORCHRUN_ARGS"] = "--max-restarts 0"
    proc = run_seeds(repo, env, "records/track_10min_16mb/2025-11-21_X", "1337", "42", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    folder = tmp_path / "records/track_10min_16mb/2025-11-21_X"  # relative to the caller's directory
    assert (folder / "train_gpt.py").read_text() == VALID_CODE
    log = (folder / "train_seed42.log").read_text()
    assert "seed:42\nrun_id:2025-11-21_X_seed42\ninherited:hello\n" in log
    assert (folder / "train_seed1337.log").exists()
    args = (repo / "args_1337.txt").read_text().split()
    assert args == ["--standalone", "--nproc_per_node=2", "--max-restarts", "0", "train_gpt.py"]
    for seed in ("1337", "42"):  # one artifact per seed, each where its run wrote it (issue 47)
        artifact = repo / "runs" / f"2025-11-21_X_seed{seed}" / "final_model.int6.ptz"
        assert artifact.read_text() == f"artifact of seed {seed}\n"
        assert f"the artifact is {artifact}" in proc.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["train_gpt.py", "train_seed1337.log", "train_seed42.log"]


def test_run_seeds_failures(fake_repo, tmp_path):
    repo, env = fake_repo
    proc = run_seeds(repo, env, "out")
    assert proc.returncode == 2 and "usage:" in proc.stderr
    proc = run_seeds(repo, dict(env, FAIL_SEED="42"), str(tmp_path / "out"), "1", "42", "7")
    assert proc.returncode == 1 and "run for seed 42 failed with exit status 3" in proc.stderr
    assert (tmp_path / "out" / "train_seed1.log").exists() and not (tmp_path / "out" / "train_seed7.log").exists()
    proc = run_seeds(repo, dict(env, NOLOG_SEED="5"), str(tmp_path / "out"), "5")
    assert proc.returncode == 1 and "logs/out_seed5.txt is missing" in proc.stderr
    proc = run_seeds(repo, env, str(tmp_path / "out"), "abc")
    assert proc.returncode == 1 and "not a non-negative integer" in proc.stderr
    proc = run_seeds(repo, dict(env, NOARTIFACT_SEED="6"), str(tmp_path / "out"), "6")
    assert proc.returncode == 1 and "runs/out_seed6/final_model.int6.ptz is missing" in proc.stderr


def test_run_seeds_refuses_a_finished_seed_before_any_run(fake_repo, tmp_path):
    """Seed 1 finished: rerunning it stops the script before any run (seed 3's neither), its log and artifact
    untouched; with OVERWRITE_RUN=1 both seeds run."""
    repo, env = fake_repo
    out = str(tmp_path / "out")
    assert run_seeds(repo, env, out, "1").returncode == 0
    log, artifact = repo / "logs" / "out_seed1.txt", repo / "runs" / "out_seed1" / "final_model.int6.ptz"
    before = log.read_bytes(), artifact.read_bytes()
    (repo / "args_1.txt").unlink()
    proc = run_seeds(repo, env, out, "3", "1")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (f"run_seeds: error: seed 1 already finished ({artifact} exists): leave it out, "
                                   "choose another FOLDER name, or set OVERWRITE_RUN=1 to rerun it")
    assert not (repo / "args_3.txt").exists() and not (repo / "args_1.txt").exists()
    assert (log.read_bytes(), artifact.read_bytes()) == before and not log.with_suffix(".txt.prev").exists()
    proc = run_seeds(repo, dict(env, OVERWRITE_RUN="1"), out, "3", "1")
    assert proc.returncode == 0, proc.stderr
    assert (repo / "args_3.txt").exists() and (repo / "args_1.txt").exists()


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["record/recordlib.py", "record/make_record.py", "record/check_record.py",
                                  "run/plot_logs.py"])
def test_scripts_parse_as_python310(name):
    ast.parse((SCRIPTS / name).read_text(), feature_version=(3, 10))
