#!/usr/bin/env python3
"""Moved to scripts/bench/bench_varlen.py (scripts/README.md, "Moved"): this old path forwards to it."""
if __name__ == "__main__":
    import _moved
    _moved.forward("bench/bench_varlen.py")
