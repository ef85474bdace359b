#!/usr/bin/env bash
# Usage (on the device, after te_receive.sh for every part):
#   scripts/gpu/te_install.sh [TORCH_WHEEL_OR_DIR]
# Reassembles /tmp/te-parts (TE_PARTS), checks it, installs the core, the metapackage, nvdlfw-inspect
# and nvidia-cudnn-frontend with --no-deps into /tmp/te (TE_DIR), then the torch extension: from
# TORCH_WHEEL_OR_DIR if given (a transformer_engine_torch wheel, or the te_torch_wheel folder of pieces
# an earlier call sent back), else built here from the sdist for sm_90 (about two minutes); installed
# into /tmp/te-torch, copied over /tmp/te. A built wheel goes to $OUT/te_torch_wheel (15 MiB pieces).
# Afterwards: PYTHONPATH=/tmp/te (run_kit.sh --te /tmp/te).
set -euo pipefail
[[ $# -le 1 && "${1:-}" != -* ]] || { echo "usage: $0 [TORCH_WHEEL_OR_DIR]" >&2; exit 2; }
parts=${TE_PARTS:-/tmp/te-parts}
dir=${TE_DIR:-/tmp/te}
dir2=${TE_TORCH_DIR:-/tmp/te-torch}
kit=$(mktemp -d /tmp/te-kit.XXXX)
trap 'rm -rf "$kit"' EXIT
PY=${PY:-python3}
prebuilt=${1:+$(cd "$(dirname "$1")" && pwd)/$(basename "$1")}
cd "$parts"
for p in $(awk '/ te.part/ {print $2}' SHA256SUMS); do [[ -f "$p" ]] || { echo "$parts/$p missing: te_receive.sh it first" >&2; exit 1; }; done
sha256sum -c --quiet <(grep ' te.part' SHA256SUMS)
cat $(awk '/ te.part/ {print $2}' SHA256SUMS | sort -V) > "$kit/payload.tar"
(cd "$kit" && grep ' payload.tar$' "$parts/SHA256SUMS" | sha256sum -c --quiet)
tar xf "$kit/payload.tar" -C "$kit" && rm "$kit/payload.tar"
(cd "$kit" && sha256sum -c --quiet "$parts/files.sha256")
echo "payload checked: $(ls "$kit"/*.whl "$kit"/*.tar.gz | xargs -n1 basename | tr '\n' ' ')"
rm -rf "$dir" "$dir2"
"$PY" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --target "$dir" "$kit"/*.whl
if [[ -n "$prebuilt" ]]; then
  if [[ -d "$prebuilt" ]]; then  # what an earlier call sent back: piece.0, piece.1, ... and SHA256SUMS
    (cd "$prebuilt" && grep ' piece\.[0-9]*$' SHA256SUMS | sha256sum -c --quiet)
    whl_name=$(awk '/\.whl$/ {print $2}' "$prebuilt/SHA256SUMS")
    cat $(ls "$prebuilt"/piece.* | sort -V) > "$kit/$whl_name"
    (cd "$kit" && grep " $whl_name\$" "$prebuilt/SHA256SUMS" | sha256sum -c --quiet)
    whl="$kit/$whl_name"
  else
    whl=$prebuilt
  fi
else
  mkdir -p "$kit/src" "$kit/wheel"
  tar xzf "$kit"/transformer_engine_torch-*.tar.gz -C "$kit/src"
  # pip wheel, then install that wheel: the build pip install --target would do, with the wheel kept
  (cd "$kit"/src/transformer_engine_torch-* &&
   PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90 \
   NVTE_FRAMEWORK=pytorch MAX_JOBS=16 "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$kit/wheel" .)
  whl=$(ls "$kit"/wheel/transformer_engine_torch-*.whl)
  if [[ -n "${OUT:-}" ]]; then  # $OUT/te_torch_wheel: pieces of 15 MiB (16 MiB a file comes back)
    name=$(basename "$whl")
    mkdir -p "$OUT/te_torch_wheel" && split -b 15M -d -a 1 "$whl" "$OUT/te_torch_wheel/piece."
    (cd "$kit/wheel" && sha256sum "$name" > "$OUT/te_torch_wheel/SHA256SUMS")
    (cd "$OUT/te_torch_wheel" && sha256sum piece.* >> SHA256SUMS)
    echo "built wheel sent back in $OUT/te_torch_wheel: $name ($(stat -c %s "$whl") bytes)"
  fi
fi
"$PY" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --target "$dir2" "$whl"
cp -a "$dir2"/. "$dir"/
echo "Transformer Engine in $dir ($(du -sm "$dir" | cut -f1) MB): run_kit.sh --te $dir ... (it checks the import)"
