#!/usr/bin/env python3
"""Re-measure the packed train_gpt.py and rewrite every place that quotes its size, the guard included.

    python3 scripts/update_packed_size.py [--check] [--date YYYY-MM-DD]

Measures the readable train_gpt.py and its packed form (scripts/pack_code.py: minified, ZPAQ_METHOD, 7 bits a byte),
sets the guard of tests/test_pack_code.py to the packed size plus 200 bytes rounded up to a multiple of 100, and
rewrites the current numbers in QUOTES (docs/submitting.md, docs/log_format.md, tests/test_pack_code.py); the dated
history paragraphs of docs/submitting.md are left as they were. Each quote must be found exactly once (else one line
naming it and exit 1). --check writes nothing and exits 1 when a quote is stale. Prints what it measured and each
file it changed.
"""
from __future__ import annotations

import argparse
import datetime
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD_MODEL_MAX = 15_900_548  # the 2026-03-23 record's largest compressed model (tests/test_trust.py)

# file -> [(pattern with one group per quoted number, what each group becomes from the measurements)]
QUOTES = {
    "docs/submitting.md": [
        (r"the readable script is\s+([\d,]+) bytes \(([\d-]+)\)\. `scripts/pack_code\.py` writes the same program as a "
         r"self-extracting file of ([\d,]+)\s+bytes \(([\d.]+)%\)", ("readable", "date", "packed", "percent")),
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
    sys.path.insert(0, str(REPO / "scripts"))
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a quote is stale")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    args = ap.parse_args(argv)
    readable, packed = measure()
    numbers = values(readable, packed, args.date)
    print(f"train_gpt.py: readable {numbers['readable']} bytes, packed {numbers['packed']} bytes "
          f"({numbers['percent']}%), guard {numbers['guard']}")
    stale = []
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
        print(f"stale: {', '.join(stale)} (python3 scripts/update_packed_size.py rewrites them)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
