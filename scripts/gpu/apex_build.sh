#!/usr/bin/env bash
# Usage (on the device): scripts/gpu/apex_build.sh [SRC] [DIR]
# Builds apex's amp_C (the multi-tensor kernels apex's FusedAdam and Megatron-Core's grad clipping call)
# for sm_90 with the machine's nvcc and ninja, from an NVIDIA/apex source tree SRC (default .apex:
# `git archive <commit> apex csrc | tar x -C .apex`, git-ignored, carried), into DIR (default
# /tmp/apex) beside a copy of the apex Python package. No other apex extension is built: Megatron-Core
# needs none for its FusedAdam. Afterwards: run_kit.sh --apex DIR. About three minutes on 16 cores.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
src=$(cd "${1:-$root/.apex}" && pwd)
dir=${2:-/tmp/apex}
[[ -d "$src/apex" && -f "$src/csrc/amp_C_frontend.cpp" ]] || { echo "$src holds no apex/ and csrc/: see the usage" >&2; exit 2; }
rm -rf "$dir" && mkdir -p "$dir/build"
cp -r "$src/apex" "$dir/apex"
cd "$src"
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} python3 - "$dir" <<'PY'
import shutil
import sys

import torch.utils.cpp_extension as ext

out = sys.argv[1]
# the sources and flags of apex's setup.py (--cuda_ext) for amp_C
kernels = ["sgd_kernel", "scale_kernel", "axpby_kernel", "l2norm_kernel", "l2norm_kernel_mp", "l2norm_scale_kernel",
           "lamb_stage_1", "lamb_stage_2", "adam", "adagrad", "novograd", "lamb", "lamb_mp"]
sources = ["csrc/amp_C_frontend.cpp", *(f"csrc/multi_tensor_{k}.cu" for k in kernels), "csrc/update_scale_hysteresis.cu"]
path = ext.load(name="amp_C", sources=sources, extra_cflags=["-O3"],
                extra_cuda_cflags=["-lineinfo", "-O3", "--use_fast_math"], build_directory=f"{out}/build",
                is_python_module=True, verbose=False).__file__
shutil.copy(path, f"{out}/amp_C.so")
print("amp_C built:", path)
PY
cd / && PYTHONPATH="$dir" python3 -c 'import apex.optimizers, amp_C; print("apex and amp_C import from", apex.__file__)'
