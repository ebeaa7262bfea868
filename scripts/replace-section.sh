#!/usr/bin/env bash
# Usage: scripts/replace-section.sh DOC NAME RESULTS
# Replaces what stands between the lines <!-- NAME:begin --> and <!-- NAME:end --> of the markdown file DOC by the
# contents of the file RESULTS (the generated sections of docs/fidelity.md and docs/e2e.md).
set -euo pipefail
doc=$1 name=$2 results=$3
grep -q "<!-- $name:begin -->" "$doc" && grep -q "<!-- $name:end -->" "$doc" || {
  echo "replace-section: $doc lacks the markers <!-- $name:begin --> and <!-- $name:end -->" >&2
  exit 1
}
awk -v results="$results" -v begin="<!-- $name:begin -->" -v end="<!-- $name:end -->" '
  $0 == begin { print; while ((getline line < results) > 0) print line; skipping = 1; next }
  $0 == end { skipping = 0 }
  !skipping { print }
' "$doc" > "$doc.new" && mv "$doc.new" "$doc"
