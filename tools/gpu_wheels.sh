#!/usr/bin/env bash
# The GPU benchmark's peers, Liger-Kernel and QuACK, with the dependencies that a GPU machine
# without network lacks, for that machine's Python (3.12, x86-64 Linux), packed to travel with
# the working tree (at most 64 MiB a call). From the repository root, with network:
#
#     tools/gpu_wheels.sh          # fills .whl/ and .whl-2/ (both git-ignored); a few minutes
#
# Torch, Triton, einops, cuda-bindings, protobuf and typing-extensions are there already;
# tools/gpu_session.sh reports what is missing. Liger-Kernel is one small wheel, in .whl/.
# QuACK's compiler, nvidia-cutlass-dsl, brings two large binaries (about 237 MB installed: MLIR,
# LLVM and the PTX compiler in one library, the CuTe runtime in another) that no trimming
# shrinks below about 58 MiB compressed, so QuACK cannot come in one call: its packages are
# installed here for the machine's Python into a folder, trimmed of what importing QuACK and
# compiling its norms never loads (console scripts, the profiler package, sources, stubs,
# headers, a static library, and the DLPack add-ons for torch older than 2.10, which torch
# 2.11 does not load), packed as one tar.xz (x86 filter: about 60 MiB) and split in two halves,
# the first in .whl/ and the second in .whl-2/, with the whole file's SHA-256 beside each, for
# two calls that carry one folder each. tools/gpu_session.sh joins, checks and unpacks them
# once both have arrived.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PY_VERSION=${GPU_PYTHON_VERSION:-3.12}
LIGER=liger-kernel==0.8.5
QUACK=(
    quack-kernels==0.6.5
    nvidia-cutlass-dsl==4.8.1
    nvidia-cutlass-dsl-libs-base==4.8.1
    nvidia-cutlass-dsl-libs-core==4.8.1
    nvidia-cutlass-dsl-libs-cu13==4.8.1
    apache-tvm-ffi==0.1.15.post2
    torch-c-dlpack-ext==0.1.5
)
TRIM=(
    bin
    nvidia_cutlass_dsl/dsl_packages/iket
    nvidia_cutlass_dsl/cu13/lib/stubs
    nvidia_cutlass_dsl/cu13/lib/libcuda_dialect_runtime_static.a
    nvidia_cutlass_dsl/cu13/include
    tvm_ffi/3rdparty
    tvm_ffi/src
)
NAME=quack-site-cp${PY_VERSION/./}.tar.xz
TARGET=(--python-version "$PY_VERSION" --implementation cp --only-binary=:all:)
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    TARGET+=(--platform "${p}_x86_64")
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf .whl .whl-2
mkdir -p .whl .whl-2 "$work/wheels"
"$PYTHON" -m pip download -q --no-deps "${TARGET[@]}" -d .whl "$LIGER"
"$PYTHON" -m pip download -q --no-deps "${TARGET[@]}" -d "$work/wheels" "${QUACK[@]}"
"$PYTHON" -m pip install -q --no-deps --no-compile "${TARGET[@]}" --target "$work/site" \
    "$work/wheels"/*.whl
for path in "${TRIM[@]}"; do rm -rf "${work:?}/site/$path"; done
rm -f "$work"/site/torch_c_dlpack_ext/*.so
echo "packing QuACK's site ($(du -sh "$work/site" | cut -f1)) as $NAME: a few minutes"
tar -C "$work/site" --sort=name --owner=0 --group=0 --numeric-owner -cf - . \
    | xz --x86 --lzma2=preset=9e -T1 > "$work/$NAME"
(cd "$work" && sha256sum "$NAME") | tee .whl/"$NAME.sha256" > .whl-2/"$NAME.sha256"
split -n 2 -d "$work/$NAME" "$work/$NAME.part"  # .part00 to .whl/, .part01 to .whl-2/
mv "$work/$NAME.part00" .whl/
mv "$work/$NAME.part01" .whl-2/
du -sh .whl .whl-2
