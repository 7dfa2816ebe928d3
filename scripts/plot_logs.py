#!/usr/bin/env python3
"""Moved to scripts/run/plot_logs.py (scripts/README.md, "Moved"): this old path forwards to it."""
if __name__ == "__main__":
    import _moved
    _moved.forward("run/plot_logs.py")
