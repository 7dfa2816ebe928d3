#!/usr/bin/env bash
# Moved to scripts/run/run_seeds.sh (scripts/README.md, "Moved"): this old path forwards to it.
echo "note: scripts/run_seeds.sh moved to scripts/run/run_seeds.sh; running it from there" >&2
exec bash "$(dirname "$0")/run/run_seeds.sh" "$@"
