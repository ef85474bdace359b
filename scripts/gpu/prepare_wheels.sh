#!/usr/bin/env bash
# Usage: scripts/gpu/prepare_wheels.sh [--with-base]
# Downloads, on this machine, the wheel kit that real Megatron-Bridge pretrain() needs on the device
# machine (Python 3.12, x86_64, no network; /work/shared/gpu/README.md) into the git-ignored .whl/ at
# the repository root, and prints its size: the kit travels in a device call's `carry` (64 MiB in all,
# the working tree included). --with-base adds wrapt and packaging (the device image has both).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PY:-python3}
dest="$root/.whl"
case "${1:-}" in ""|--with-base) ;; *) echo "usage: $0 [--with-base]" >&2; exit 2 ;; esac
mkdir -p "$dest"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_39_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
binary=(megatron-core==0.19.2 megatron-bridge==0.6.2 nvidia-modelopt==0.47.0 pydantic==2.14.3
        pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 nvidia-resiliency-ext==0.6.0
        defusedxml==0.7.1 omegaconf==2.3.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
        emerging-optimizers==0.3.0 absl-py==2.5.1)  # the last two: Muon (bench_offload.py --muon)
[[ "${1:-}" == --with-base ]] && binary+=(wrapt==2.5.0 packaging==25.0)
"$PY" -m pip download -q --no-deps "${plat[@]}" -d "$dest" "${binary[@]}"
# antlr4-python3-runtime 4.9.3 is only an sdist on the registry: build its (pure-Python) wheel here
ls "$dest"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 ||
  "$PY" -m pip wheel -q --no-deps -w "$dest" antlr4-python3-runtime==4.9.3
ls -1 "$dest"
echo "kit: $(ls "$dest"/*.whl | wc -l) wheels, $(du -cb "$dest"/*.whl | tail -1 | cut -f1) bytes ($(du -ch "$dest"/*.whl | tail -1 | cut -f1))"
