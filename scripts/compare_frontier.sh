#!/usr/bin/env bash
# Moved to scripts/bench/compare_frontier.sh (scripts/README.md, "Moved"): this old path forwards to it.
echo "note: scripts/compare_frontier.sh moved to scripts/bench/compare_frontier.sh; running it from there" >&2
exec bash "$(dirname "$0")/bench/compare_frontier.sh" "$@"
