#!/usr/bin/env bash
# One command for a capture: the venv of venv.sh, then capture.py with the given arguments, e.g.
#   tools/capture/run.sh --out /tmp/gpl3.kvscap --tokens 2048 --layers 3,15
#   tools/capture/run.sh --out /tmp/passkey.kvscap --passkey 68413
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=$("$here/venv.sh")
exec "$python" "$here/capture.py" "$@"
