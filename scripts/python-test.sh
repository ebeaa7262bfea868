#!/usr/bin/env bash
# `make python-test`: the Python package as a user gets it. Creates build/pyenv (pinned numpy and pytest from
# PyPI), `pip install .` into it (the build tools pinned in pyproject.toml, fetched by pip; the CPU backend only
# unless KVSIFT_CUDA is set: the release build already compiles the CUDA code), then runs tests/python.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/build/pyenv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q numpy==2.4.6 pytest==8.4.2
KVSIFT_CUDA="${KVSIFT_CUDA:-OFF}" "$venv/bin/pip" install -q "$root"
cd "$root"
"$venv/bin/python" -m pytest -q tests/python
