#!/usr/bin/env bash
# Download the wheels a GPU machine without internet needs for the peer rows of the benchmarks:
# FlashAttention-3 for JAX and fla-org's NSA Triton kernels. They land in the ignored .whl/ and are
# installed there with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Target: the GPU image's CPython 3.12 on x86-64 Linux.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python_version=${PYTHON_VERSION:-3.12}
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
           manylinux1_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux_2_31_x86_64; do
  platforms+=(--platform "$tag")
done
for package in ${GPU_WHEELS:-flash_attn3_jax fla-core flash-linear-attention}; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp "${platforms[@]}" -d .whl "$package"
done
ls -la .whl
