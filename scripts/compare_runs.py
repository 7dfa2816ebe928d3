#!/usr/bin/env python3
"""Moved to scripts/run/compare_runs.py (scripts/README.md, "Moved"): this old path forwards to it."""
if __name__ == "__main__":
    import _moved
    _moved.forward("run/compare_runs.py")
