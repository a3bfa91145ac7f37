#!/usr/bin/env bash
# Download the GPU benchmark's peers, Liger-Kernel and QuACK, with the dependencies that a GPU
# machine without network lacks, as wheels for that machine's Python (3.12, x86-64 Linux), so
# they can travel with the working tree to it. From the repository root:
#
#     tools/gpu_wheels.sh          # fills .whl/ and .whl-2/ (both git-ignored)
#
# Torch, Triton, einops, cuda-bindings, protobuf and typing-extensions are expected there
# already; tools/gpu_session.sh reports what is missing. The CUDA 13 libraries of
# nvidia-cutlass-dsl (QuACK's compiler) are one 92 MB wheel, more than a working tree of at
# most 64 MiB can carry in one go: it is split in two halves, the first in .whl/, the second in
# .whl-2/, with the whole wheel's SHA-256 beside each, for two calls that carry one folder each.
# tools/gpu_session.sh joins and checks them once both have arrived.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PY_VERSION=${GPU_PYTHON_VERSION:-3.12}
WHEELS=(
    liger-kernel==0.8.5
    quack-kernels==0.6.5
    nvidia-cutlass-dsl==4.8.1
    nvidia-cutlass-dsl-libs-base==4.8.1
    nvidia-cutlass-dsl-libs-core==4.8.1
    nvidia-cutlass-dsl-libs-cu13==4.8.1
    apache-tvm-ffi==0.1.15.post2
    torch-c-dlpack-ext==0.1.5
)
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${p}_x86_64")
done

rm -rf .whl .whl-2
mkdir -p .whl .whl-2
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"

big=$(ls .whl/nvidia_cutlass_dsl_libs_cu13-*.whl)
name=$(basename "$big")
(cd .whl && sha256sum "$name" > "$name.sha256")
cp ".whl/$name.sha256" .whl-2/
split -n 2 -d "$big" "$big.part"  # .part00 stays in .whl/, .part01 goes to .whl-2/
mv "$big.part01" .whl-2/
rm "$big"
du -sh .whl .whl-2
