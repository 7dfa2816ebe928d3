#!/usr/bin/env bash
# The wheels the GPU image lacks, for its Python 3.12 on x86-64, into .whl/ (git-ignored), for a device call to carry
# (run tool: carry [".whl"]); scripts/bench/device_checks.sh installs them there. brotli for COMPRESSOR=brotli and the
# per-group artifact, zpaq for COMPRESSOR=pergroup and packed code: zpaq 0.3.7 publishes only manylinux_2_34 wheels.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "brotli==${BROTLI_VERSION:-1.2.1}" "zpaq==${ZPAQ_VERSION:-0.3.7}"
ls -l .whl
