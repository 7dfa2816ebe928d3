"""The README and docs/ are what users read: every setting documented in docs/settings.md with the real default,
the test command CI runs is the one the README gives, the quick start installs PyTorch's CPU build first, the
record rule and the FlashAttention 3 route are told one way, and every relative link leads to a file and heading
that exist."""
from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path

import train_gpt as tg
from conftest import REPO, SCRIPT, TINY_ENV

sys.path.insert(0, str(REPO / "scripts" / "record"))
import recordlib as rl  # noqa: E402  (needs the path above)

README = (REPO / "README.md").read_text(encoding="utf-8")
SETTINGS = (REPO / "docs" / "settings.md").read_text(encoding="utf-8")


def env_vars_read_by_script() -> set[str]:
    src = SCRIPT.read_text(encoding="utf-8")
    return set(re.findall(r'_env(?:_int_list)?\("([A-Z0-9_]+)"', src)) - TORCHRUN_VARS


# Set by torchrun, not by users.
TORCHRUN_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def settings_table() -> dict[str, str]:
    rows = {}
    for line in SETTINGS.splitlines():
        m = re.match(r"^\| ([A-Z0-9_ /]+?) \| ([^|]+?) \|", line)
        if m and m.group(1) != "env":
            for name in m.group(1).split(" / "):
                rows[name.strip()] = m.group(2).strip()
    return rows


def test_every_setting_is_documented():
    missing = env_vars_read_by_script() - set(settings_table())
    assert not missing, f"docs/settings.md's table lacks {sorted(missing)}"


def test_documented_numeric_defaults_are_the_real_ones(monkeypatch):
    for k in list(TINY_ENV) + ["RANK", "WORLD_SIZE", "LOCAL_RANK"]:
        monkeypatch.delenv(k, raising=False)
    for k in env_vars_read_by_script():
        monkeypatch.delenv(k, raising=False)
    h = tg.Hyperparameters()
    table = settings_table()
    split_defaults = {"BETA1": "0.9", "BETA2": "0.95", "ADAM_EPS": "1e-8"}
    checked = 0
    for name in env_vars_read_by_script():
        doc = split_defaults.get(name, table.get(name, ""))
        try:
            documented = float(doc)
        except ValueError:
            continue  # prose defaults ("random uuid4", "cuda if available, else cpu")
        actual = getattr(h, tg.Hyperparameters._attr(name))
        assert float(actual) == documented, (name, doc, actual)
        checked += 1
    assert checked > 50


def quick_start_commands() -> list[str]:
    """The command lines of the README's quick-start block (one line each; comments left out)."""
    block = README.split("\n## Quick start\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def torch_pin() -> str:
    return re.search(r"^torch==(\S+)$", (REPO / "requirements.txt").read_text(encoding="utf-8"), re.M).group(1)


def test_ci_runs_the_readme_test_command():
    commands = quick_start_commands()
    assert len(commands) == 2, commands
    test_command = commands[1]
    assert test_command.startswith("python3 -m pip install -r requirements-dev.txt && ") and "pytest" in test_command
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command in ci.splitlines()
    assert f"python3 -m pip install torch=={torch_pin()}" in ci.splitlines()  # the pin requirements.txt has


def test_readme_command_1_installs_pytorchs_cpu_build_before_the_requirements():
    """On Linux PyPI's torch is the multi-GB CUDA build: command 1 takes the CPU build, at the pinned version, before
    requirements.txt would pull PyPI's."""
    steps = quick_start_commands()[0].split(" && ")
    assert steps == [f"python3 -m pip install torch=={torch_pin()} --index-url https://download.pytorch.org/whl/cpu",
                     "python3 -m pip install -r requirements.txt", "bash scripts/run/sample_run.sh"], steps


def test_the_record_rule_is_the_leaderboards_welch_test():
    """The README's submitting commands ship packed code and check against the top row with --against, and the
    record track's README states that rule (one-sided Welch, p < WELCH_ALPHA), not the older 0.005-nat one."""
    submitting = README.split("\n## Submitting a record\n", 1)[1].split("\n## ", 1)[0]
    assert "PACK_CODE=1 " in submitting and "check_record.py" in submitting and "--against " in submitting
    assert f"Welch t-test p < {rl.WELCH_ALPHA}" in submitting and "--sota-bpb" not in submitting
    track = (REPO / "records" / "track_10min_16mb" / "README.md").read_text(encoding="utf-8")
    assert f"p < {rl.WELCH_ALPHA}" in track and "Welch" in track and "--against" in track
    assert "0.005" not in track and "--sota-bpb" not in track


def test_one_flashattention_3_route():
    """docs/gpu.md says how to install FlashAttention 3, the README's Real use block runs the same build, and no
    other doc or requirements file tells a route of its own (they point to docs/gpu.md)."""
    build = "(cd flash-attention/hopper && python3 -m pip install . --no-build-isolation)"
    files = [*markdown_files(), REPO / "requirements.txt", REPO / "requirements-gpu.txt"]
    texts = {f.relative_to(REPO).as_posix(): f.read_text(encoding="utf-8") for f in files}
    route = r"flash-attention/hopper|hopper/|flash.attention3.wheels|flash_attn_3 --"  # a build, or the records' index
    telling = {name for name, text in texts.items() if re.search(route, text)}
    assert telling == {"README.md", "docs/gpu.md"}, telling
    assert build in texts["README.md"] and build in texts["docs/gpu.md"]
    for name in ("requirements-gpu.txt", "docs/presets.md"):
        assert "gpu.md" in texts[name], name


def test_log_format_documents_the_preflight_and_evaluation_time_lines():
    """docs/log_format.md shows each of these lines as train_gpt.py writes them (the line's fixed start)."""
    src, doc = SCRIPT.read_text(encoding="utf-8"), (REPO / "docs" / "log_format.md").read_text(encoding="utf-8")
    for start in ("evaluation_time: ", "preflight: rehearsal of ", "preflight_eval: ", "preflight: stage ",
                  "preflight: training timed_steps:", "preflight: evaluation slice_targets:",
                  "preflight: artifact model:", "preflight: peak_memory_mib ", "preflight: compile "):
        assert start in src and f"\n{start}" in doc, start


def test_running_md_gives_autos_attention_order():
    """docs/running.md's fallback order is AUTO_ATTENTION's: FlashAttention 3, 2, then PyTorch's varlen kernel."""
    assert tg.AUTO_ATTENTION == ("flash_attn_3", "flash_attn_2", tg.TORCH_VARLEN)
    text = (REPO / "docs" / "running.md").read_text(encoding="utf-8")
    section = text.split("\n## One GPU, or CPU\n", 1)[1].split("\n## ", 1)[0]
    assert "FlashAttention 3 → FlashAttention 2 → PyTorch" in section and f"`{tg.TORCH_VARLEN}`" in section


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose_lines(text: str):
    """The lines outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield line


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text (code spans and link text kept, markup dropped), lowercased,
    every character but letters, digits, marks, `_`, `-` and spaces removed, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    kept = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LMN" or c == "_")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(text):
        m = re.match(r"^#{1,6} +(.+?) *#* *$", line)
        if m:
            a = github_anchor(m.group(1))
            out.add(a if a not in seen else f"{a}-{seen[a]}")
            seen[a] = seen.get(a, 0) + 1
    return out


def relative_links(text: str) -> list[str]:
    """Targets of [text](target) links outside code, except web and mail addresses."""
    targets = []
    for line in prose_lines(text):
        line = re.sub(r"`[^`]*`", "", line)
        targets += [t for t in re.findall(r"\]\(([^)\s]+)\)", line) if not re.match(r"[a-z]+:", t)]
    return targets


def broken_links(files: list[Path]) -> list[str]:
    broken = []
    for md in files:
        for target in relative_links(md.read_text(encoding="utf-8")):
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                broken.append(f"{md.name}: {target}: no such file")
            elif anchor and anchor not in anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{md.name}: {target}: no heading with that anchor")
    return broken


def test_links_resolve():
    assert (REPO / "docs").is_dir()
    assert not broken_links(markdown_files()), broken_links(markdown_files())


def test_links_check_can_fail(tmp_path):
    """The checker itself: a missing file and a missing heading are reported, good links are not."""
    (tmp_path / "a.md").write_text("# Top: `X=1`, the 04-27 record's model\n\n```\n# not a heading\n```\n"
                                   "[ok](#top-x1-the-04-27-records-model) [ok](b.md) [no](b.md#nope) [no](c.md)"
                                   " [no](#not-a-heading) [web](https://example.com/x.md)\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("# B\n", encoding="utf-8")
    assert broken_links([tmp_path / "a.md"]) == [
        "a.md: b.md#nope: no heading with that anchor", "a.md: c.md: no such file",
        "a.md: #not-a-heading: no heading with that anchor"]


def test_every_docs_file_is_linked_from_readme():
    linked = {t.partition("#")[0] for t in relative_links(README)}
    unlinked = [p.relative_to(REPO).as_posix() for p in sorted((REPO / "docs").glob("*.md"))
                if p.relative_to(REPO).as_posix() not in linked]
    assert not unlinked, f"README does not link {unlinked}"


def test_scripts_rooms_are_listed_and_the_old_paths_point_to_them(tmp_path):
    """scripts/ reads as its rooms (issue 69): every file in a room is named in scripts/README.md, the top level holds
    only the rooms, the README, _moved.py and stubs, each stub forwards to a file that exists, and an old path run as a
    user typed it prints one line naming the new place, then does what the moved file does."""
    import subprocess

    scripts = REPO / "scripts"
    listing = (scripts / "README.md").read_text(encoding="utf-8")
    rooms = sorted(p.name for p in scripts.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert rooms == ["bench", "pack", "record", "run"], rooms
    for room in rooms:
        for f in sorted((scripts / room).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                assert f"`{f.relative_to(scripts / room).parts[0]}" in listing, f
    for stub in sorted(p for p in scripts.iterdir() if p.is_file() and p.name not in ("README.md", "_moved.py")):
        target = re.search(r'(?:forward\("|/)((?:run|record|pack|bench)/[\w.]+)', stub.read_text()).group(1)
        assert (scripts / target).name == stub.name and (scripts / target).is_file(), stub
        assert f"| `scripts/{stub.name}` | `scripts/{target}` |" in listing, stub
    for cmd in ([sys.executable, str(scripts / "compare_runs.py"), "--help"],
                ["bash", str(scripts / "run_seeds.sh")]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        name = Path(cmd[1]).name
        room = "run"
        assert proc.stderr.splitlines()[0] == f"note: scripts/{name} moved to scripts/{room}/{name}; running it from there"
        assert "usage" in (proc.stdout + proc.stderr).lower(), proc.stderr
