#!/usr/bin/env bash
# Installs the Debian packages kvsift builds against, if any is missing.
# Called by `make demo` and `make test`; safe to run again (it only acts when something is missing).
set -euo pipefail

required=(libfmt-dev libgtest-dev libbenchmark-dev cmake g++)
missing=()
for pkg in "${required[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "kvsift: installing missing Debian packages: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  echo "kvsift: cannot install ${missing[*]}: not root and no password-less sudo." >&2
  echo "kvsift: run as root: apt-get update && apt-get install -y ${missing[*]}" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "kvsift: apt-get not found; install these packages (or their equivalents) by hand: ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq || { echo "kvsift: apt-get update failed (no network?)" >&2; exit 1; }
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" \
  || { echo "kvsift: apt-get install ${missing[*]} failed" >&2; exit 1; }
