#!/usr/bin/env bash
# Moved to scripts/bench/device_checks.sh (scripts/README.md, "Moved"): this old path forwards to it.
echo "note: scripts/device_checks.sh moved to scripts/bench/device_checks.sh; running it from there" >&2
exec bash "$(dirname "$0")/bench/device_checks.sh" "$@"
