"""The old flat paths of scripts/, from before its rooms run/, record/, pack/ and bench/ (scripts/README.md, "Moved").

Each old path the docs once told users to run is a stub that calls forward() with the file's new path: one line on
stderr names the move, then the moved file runs as if called by its new path (same arguments, same exit status)."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path


def forward(new: str) -> None:
    """Run scripts/NEW as __main__: sys.argv[0] and sys.path[0] become the moved file's, as when it is run itself."""
    target = Path(__file__).resolve().parent / new
    print(f"note: scripts/{target.name} moved to scripts/{new}; running it from there", file=sys.stderr)
    sys.argv[0] = str(Path(sys.argv[0]).parent / new)
    sys.path[0] = str(target.parent)
    runpy.run_path(sys.argv[0], run_name="__main__")
