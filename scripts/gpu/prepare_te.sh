#!/usr/bin/env bash
# Usage: scripts/gpu/prepare_te.sh [PART_MB]      (PART_MB < 60, default 42: the tree (17 MB) travels beside each part, 64 MiB in all)
# Downloads, on this machine, Transformer Engine 2.20.2 for the device (cp312, x86_64, CUDA 13):
# the core wheel transformer-engine-cu13 (~277 MB), the transformer-engine metapackage,
# nvdlfw-inspect, nvidia-cudnn-frontend (headers for the build) and the transformer-engine-torch
# sdist (built on the device by te_install.sh). Their tar is split into parts under the git-ignored
# .te/part0 .. .te/partN, one folder per device call (a call carries 64 MiB at most, the repo included),
# each with SHA256SUMS, the manifest te_receive.sh and te_install.sh check.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PY:-python3}
part_mb=${1:-42}
[[ "$part_mb" =~ ^[0-9]+$ && "$part_mb" -lt 60 && "$part_mb" -gt 0 ]] || { echo "usage: $0 [PART_MB < 60]" >&2; exit 2; }
te="$root/.te"
dl="$te/dl"
mkdir -p "$dl"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any -d "$dl" \
  transformer-engine-cu13==2.20.2 transformer-engine==2.20.2 nvdlfw-inspect==0.2.2 nvidia-cudnn-frontend==1.32.0
"$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$dl" transformer-engine-torch==2.20.2
rm -rf "$te"/part* "$te/payload.tar"
(cd "$dl" && ls -1 && sha256sum -- * > "$te/files.sha256")
tar cf "$te/payload.tar" -C "$dl" .
split -b "$((part_mb * 1000000))" -d -a 1 "$te/payload.tar" "$te/te.part"
(cd "$te" && sha256sum payload.tar te.part* > SHA256SUMS)
for f in "$te"/te.part*; do
  k=${f##*te.part}
  mkdir -p "$te/part$k"
  mv "$f" "$te/part$k/"
  cp "$te/SHA256SUMS" "$te/files.sha256" "$te/part$k/"
done
rm "$te/payload.tar"
du -b "$te"/part*/te.part* | awk '{printf "%s  %d bytes (%.1f MiB)\n", $2, $1, $1 / 1048576}'
echo "parts: $(ls -d "$te"/part* | wc -l); carry one folder per device call: .te/part0 ... (scripts/gpu/te_receive.sh K)"
