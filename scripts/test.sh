#!/usr/bin/env bash
# Sets up (scripts/setup.sh, then the test extras of scripts/setup_dev.sh) and runs the test
# suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_dev.sh
python -m pytest -q tests "$@"
