#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m pytest -q tests "$@"
