#!/usr/bin/env python3
"""Re-measure the packed train_gpt.py and rewrite every place that quotes its size, the guard included.

    python3 scripts/pack/update_packed_size.py [--check] [--date YYYY-MM-DD] [--script-only]

Measures the readable train_gpt.py and its packed form (scripts/pack/pack_code.py: minified, ZPAQ_METHOD, 7 bits a
byte), sets the guard of tests/test_pack_code.py to the packed size plus 200 bytes rounded up to a multiple of 100, and
rewrites the current numbers in QUOTES (docs/submitting.md, docs/log_format.md, tests/test_pack_code.py); the dated
history paragraphs of docs/submitting.md are left as they were. Each quote must be found exactly once (else one line
naming it and exit 1). --check writes nothing and exits 1 when a quote is stale. Prints what it measured and each
file it changed. It also specialises train_gpt.py to each preset (scripts/pack/specialise.py) and rewrites
docs/submitting.md's table of the specialised files' sizes (beside each record's own code and model), docs/presets.md's
table of their lines and the guards of tests/test_specialise_tools.py (each preset's packed size plus 200 bytes,
rounded up to a multiple of 100): the one command after a change to train_gpt.py, the specialiser or a quoting doc
(--script-only skips the presets).
"""
from __future__ import annotations

import argparse
import datetime
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECORD_MODEL_MAX = 15_900_548  # the 2026-03-23 record's largest compressed model (tests/test_trust.py)

# file -> [(pattern with one group per quoted number, what each group becomes from the measurements)]
QUOTES = {
    "docs/submitting.md": [
        (r"the readable script is\s+([\d,]+) bytes \(([\d-]+)\)\. `scripts/pack/pack_code\.py` writes the same program "
         r"as a self-extracting file of ([\d,]+)\s+bytes \(([\d.]+)%\)", ("readable", "date", "packed", "percent")),
        (r"The `tests/test_pack_code\.py` guard\s+is ([\d,]+)\.", ("guard",)),
    ],
    "docs/log_format.md": [
        (r"The readable `train_gpt\.py` \(([\d,]+) bytes on ([\d-]+)\) beside the 2026-03-23\s+record's largest "
         r"compressed model \(15,900,548 bytes\) would be ([\d,]+) bytes", ("readable", "date", "with_record")),
        (r"\(\[Packed code\]\(submitting\.md#packed-code\): ([\d,]+) bytes the same day\)", ("packed",)),
    ],
    "tests/test_pack_code.py": [
        (r"The guard holds today's ([\d,]+) ", ("packed",)),
        (r"assert len\(packed\.encode\(\"utf-8\"\)\) <= ([\d_]+)\n", ("guard_literal",)),
    ],
}


def measure():
    """{name: text} of the numbers the quotes hold, from the readable and packed train_gpt.py."""
    sys.path.insert(0, str(REPO / "scripts" / "pack"))
    import pack_code
    src = (REPO / "train_gpt.py").read_text(encoding="utf-8")
    return len(src.encode("utf-8")), len(pack_code.pack(src).encode("utf-8"))


def values(readable, packed, date):
    guard = math.ceil((packed + 200) / 100) * 100
    return {"readable": f"{readable:,}", "packed": f"{packed:,}", "date": date, "guard": f"{guard:,}",
            "guard_literal": f"{guard:_}", "percent": f"{100 * packed / readable:.1f}",
            "with_record": f"{readable + RECORD_MODEL_MAX:,}"}


def rewrite(path, text, numbers):
    """text with each quote's numbers replaced; a ValueError names a quote not found exactly once."""
    for pattern, names in QUOTES[path]:
        found = list(re.finditer(pattern, text))
        if len(found) != 1:
            raise ValueError(f"{path}: the quote /{pattern[:60]}.../ is there {len(found)} times, not once")
        m = found[0]
        parts, at = [], m.start()
        for i, name in enumerate(names, 1):
            parts += [text[at:m.start(i)], m[i] if numbers[name] is None else numbers[name]]  # None: kept
            at = m.end(i)
        text = text[:m.start()] + "".join(parts) + text[at:]
    return text


# Each preset's record: its own logged code bytes and model bytes (the log's "Code size" / "Serialized model ..." lines;
# the seed-42 logs of ../shared/anchors/frontier, the 2026-03-23 record's seed-1337 log of ../shared/anchors)
PRESET_RECORDS = {"record_0323": (89_458, 15_887_928, "seed 1337"), "record_0409": (16_630, 15_975_300, "seed 42"),
                  "record_0427": (31_999, 15_865_260, "seed 42"), "record_0430": (38_134, 15_943_811, "seed 42"),
                  "record_0501": (37_155, 15_910_335, "seed 42")}
TABLE_BEGIN = "<!-- specialised sizes: scripts/pack/update_packed_size.py -->\n"
TABLE_END = "<!-- end of specialised sizes -->"
GUARD_LINE = re.compile(r"^SPECIALISED_PACKED_GUARD = \{  # scripts/pack/update_packed_size\.py\n.*?^\}$", re.M | re.S)


def specialised_sizes(texts):
    """{preset: (lines, readable, minified, packed bytes)} of the presets' specialised files, from their readable
    sources {preset: text} (scripts/pack/specialise.py; the default run of each preset)."""
    sys.path.insert(0, str(REPO / "scripts" / "pack"))
    import pack_code
    sizes = {}
    for p, t in texts.items():
        minified = pack_code.minify(t)  # packed from the same minified text: minified once
        sizes[p] = (len(t.splitlines()), len(t.encode()), len(minified.encode()),
                    len(pack_code.pack_minified(minified).encode()))
    return sizes


def specialise_presets():
    """{preset: specialised readable source} of train_gpt.py for each preset's own settings."""
    sys.path.insert(0, str(REPO / "scripts" / "pack"))
    import specialise
    src = (REPO / "train_gpt.py").read_text(encoding="utf-8")
    return {p: specialise.specialise(src, {"PRESET": p}).text for p in PRESET_RECORDS}


def sizes_table(sizes, date):
    """docs/submitting.md's table of the specialised files beside each record's own code and model."""
    rows = [f"Measured {date} (`python3 scripts/pack/update_packed_size.py`):\n",
            "| preset | lines | readable | minified | packed | record's own code | record's model | packed + model "
            "| room under 16,000,000 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p, (lines, readable, minified, packed) in sizes.items():
        code, model, log = PRESET_RECORDS[p]
        rows.append(f"| `{p}` | {lines:,} | {readable:,} | {minified:,} | {packed:,} | {code:,} | {model:,} ({log}) "
                    f"| {packed + model:,} | {16_000_000 - packed - model:,} |")
    return "\n".join(rows) + "\n"


LINES_BEGIN, LINES_END = "<!-- preset lines: scripts/pack/update_packed_size.py -->\n", "<!-- end of preset lines -->"


def lines_table(sizes, total):
    """docs/presets.md's lines of each preset's specialised file."""
    rows = ["| preset | lines of its specialised file | of the full `train_gpt.py` |", "|---|---:|---:|"]
    rows += [f"| `{p}` | {s[0]:,} | {s[0] / total:.0%} |" for p, s in sizes.items()]
    return "\n".join(rows) + f"\n\nThe full `train_gpt.py`: {total:,} lines.\n"


def guard_line(sizes):
    return ("SPECIALISED_PACKED_GUARD = {  # scripts/pack/update_packed_size.py\n" + "".join(
        f'    "{p}": {math.ceil((s[3] + 200) / 100) * 100:_},\n' for p, s in sizes.items()) + "}")


def rewrite_specialised(docs, test, sizes, date):
    """(docs/submitting.md, tests/test_specialise_tools.py) with the table and the guard replaced."""
    a, b = docs.index(TABLE_BEGIN) + len(TABLE_BEGIN), docs.index(TABLE_END)
    docs = docs[:a] + sizes_table(sizes, date) + docs[b:]
    if len(GUARD_LINE.findall(test)) != 1:
        raise ValueError("tests/test_specialise_tools.py: the SPECIALISED_PACKED_GUARD line is not there exactly once")
    return docs, GUARD_LINE.sub(lambda m: guard_line(sizes), test)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a quote, a table or a guard is stale")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--script-only", action="store_true",
                    help="the full script's quotes alone: skip specialising it to each preset (about 30 s)")
    args = ap.parse_args(argv)
    stale = []
    if not args.script_only:
        sizes = specialised_sizes(specialise_presets())
        for p, (lines, readable, minified, packed) in sizes.items():
            print(f"{p}: specialised {lines:,} lines, readable {readable:,}, minified {minified:,}, packed {packed:,} "
                  f"bytes")
        docs_path, test_path = REPO / "docs" / "submitting.md", REPO / "tests" / "test_specialise_tools.py"
        presets_path = REPO / "docs" / "presets.md"
        old = {path: path.read_text(encoding="utf-8") for path in (docs_path, test_path, presets_path)}
        date = re.search(r"Measured (\S+) ", old[docs_path][old[docs_path].index(TABLE_BEGIN):]).group(1) \
            if args.check else args.date  # --check: stale when a number differs (its date is kept)
        docs, test = rewrite_specialised(old[docs_path], old[test_path], sizes, date)
        presets = old[presets_path]
        a, b = presets.index(LINES_BEGIN) + len(LINES_BEGIN), presets.index(LINES_END)
        total = len((REPO / "train_gpt.py").read_text(encoding="utf-8").splitlines())
        presets = presets[:a] + lines_table(sizes, total) + presets[b:]
        for path, new in ((docs_path, docs), (test_path, test), (presets_path, presets)):
            if new != old[path]:
                stale.append(str(path.relative_to(REPO)))
                if not args.check:
                    path.write_text(new, encoding="utf-8")
                    print(f"updated {path.relative_to(REPO)} (the specialised files' sizes)")
    readable, packed = measure()
    numbers = values(readable, packed, args.date)
    print(f"train_gpt.py: readable {numbers['readable']} bytes, packed {numbers['packed']} bytes "
          f"({numbers['percent']}%), guard {numbers['guard']}")
    for path in QUOTES:
        text = (REPO / path).read_text(encoding="utf-8")
        try:
            # --check: a quote is stale when a number differs (its date is kept)
            new = rewrite(path, text, {**numbers, "date": None} if args.check else numbers)
        except ValueError as e:
            print(f"update_packed_size: {e}", file=sys.stderr)
            return 1
        if new != text:
            stale.append(path)
            if not args.check:
                (REPO / path).write_text(new, encoding="utf-8")
                print(f"updated {path}")
    if args.check and stale:
        print(f"stale: {', '.join(stale)} (python3 scripts/pack/update_packed_size.py rewrites them)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
