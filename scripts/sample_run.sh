#!/usr/bin/env bash
# Moved to scripts/run/sample_run.sh (scripts/README.md, "Moved"): this old path forwards to it.
echo "note: scripts/sample_run.sh moved to scripts/run/sample_run.sh; running it from there" >&2
exec bash "$(dirname "$0")/run/sample_run.sh" "$@"
