# Moved to scripts/run/sample_env.sh (scripts/README.md, "Moved"): this old path sources it from there.
echo "note: scripts/sample_env.sh moved to scripts/run/sample_env.sh; sourcing it from there" >&2
source "$(dirname "${BASH_SOURCE[0]}")/run/sample_env.sh"
