#!/usr/bin/env bash
# Usage (on the device, carrying .te/partK): scripts/gpu/te_receive.sh K
# Checks the carried part against its SHA256SUMS and copies it to /tmp/te-parts/ (TE_PARTS), where
# it waits for te_install.sh. The machine forgets /tmp once it goes back (30 s idle): send the parts
# and the install call back to back.
set -euo pipefail
[[ $# -eq 1 && "$1" =~ ^[0-9]+$ ]] || { echo "usage: $0 PART_NUMBER" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
src="$root/.te/part$1"
dst=${TE_PARTS:-/tmp/te-parts}
[[ -f "$src/te.part$1" ]] || { echo "$src/te.part$1 missing: name .te/part$1 in carry" >&2; exit 1; }
(cd "$src" && grep " te.part$1\$" SHA256SUMS | sha256sum -c --quiet)
mkdir -p "$dst"
cp "$src/te.part$1" "$dst/"
cp "$src/SHA256SUMS" "$src/files.sha256" "$dst/"
want=$(grep -c ' te.part' "$dst/SHA256SUMS")
have=$(ls "$dst"/te.part* | wc -l)
echo "part $1 received ($(du -b "$dst/te.part$1" | cut -f1) bytes); $have of $want parts in $dst"
