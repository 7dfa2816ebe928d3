#!/usr/bin/env python3
"""Moved to scripts/pack/update_packed_size.py (scripts/README.md, "Moved"): this old path forwards to it."""
if __name__ == "__main__":
    import _moved
    _moved.forward("pack/update_packed_size.py")
