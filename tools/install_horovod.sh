#!/usr/bin/env bash
# Build Horovod 0.28.1 for the PyTorch of one Python environment (default: the course's .venv).
#   make horovod                                  on a laptop, a login node, in CI
#   make horovod FORCE=1                          build again (after loading another MPI or CUDA)
#   tools/install_horovod.sh /path/to/env/bin/python   any other environment (inside the container too)
# Horovod's last release is a source package that asks for C++14; torch 2.14 needs C++20. A CMake
# toolchain file (next to this script) remaps the flag, so Horovod's sources stay as released.
# Controllers and operations: gloo always (horovodrun, no MPI needed); MPI when mpicxx is found
# (Debian: apt-get install libopenmpi-dev; clusters: module load OpenMPI); NCCL for GPU tensors when
# CUDA_HOME names a CUDA toolkit (the directory with bin/nvcc) and torch is a CUDA build.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${1:-.venv/bin/python}
[ -x "$python" ] || { echo "No Python at $python: run make setup first (or give a Python as the first argument)"; exit 1; }
bin=$(cd "$(dirname "$python")" && pwd)
version=0.28.1

say() { echo "horovod: $*"; }

export CMAKE_TOOLCHAIN_FILE="$here/horovod-toolchain.cmake"
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=GLOO
if command -v mpicxx >/dev/null 2>&1; then
    export HOROVOD_WITH_MPI=1; say "MPI found ($(command -v mpicxx)): the MPI controller too"
else
    export HOROVOD_WITHOUT_MPI=1; say "no mpicxx: gloo only (for mpirun: apt-get install libopenmpi-dev, then make horovod FORCE=1)"
fi
cuda=$("$python" -c 'import torch; print(torch.version.cuda or "")')
toolkit=""
if [ -n "$cuda" ]; then
    # torch's CUDA build makes Horovod build a CUDA extension, which needs the toolkit itself
    # (include/cuda_runtime.h, lib64/libcudart). torch may find a wrapper nvcc (/usr/local/bin)
    # and take /usr/local for it: look for the real directory.
    nvcc_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /none/bin/nvcc)")")")
    for home in "${CUDA_HOME:-}" /usr/local/cuda "$nvcc_home"; do
        if [ -n "$home" ] && [ -f "$home/include/cuda_runtime.h" ]; then toolkit=$(readlink -f "$home"); break; fi
    done
fi
if [ -n "$toolkit" ]; then
    export CUDA_HOME=$toolkit CUDACXX=$toolkit/bin/nvcc CUDAToolkit_ROOT=$toolkit PATH="$toolkit/bin:$PATH"  # CMake's too
    say "CUDA $cuda, toolkit in $toolkit"
    if [ "${HOROVOD_GPU_OPERATIONS:-}" = NCCL ]; then
        # NCCL for GPU tensors (clusters: make horovod HOROVOD_GPU_OPERATIONS=NCCL): torch's own NCCL
        nccl=$("$python" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
        [ -n "${HOROVOD_NCCL_HOME:-}" ] || [ -z "$nccl" ] || export HOROVOD_NCCL_HOME=$nccl  # else the system NCCL (NVIDIA images)
        say "GPU tensors through NCCL${HOROVOD_NCCL_HOME:+ (from $HOROVOD_NCCL_HOME)}"
    else
        say "GPU tensors go through host memory (for NCCL on GPU nodes: make horovod HOROVOD_GPU_OPERATIONS=NCCL)"
    fi
elif [ -n "$cuda" ] && { [ -n "${CUDA_HOME:-}" ] || command -v nvcc >/dev/null 2>&1 || [ -e /usr/local/cuda ]; }; then
    # torch would take that for a toolkit, and the build would fail later, less clearly
    say "torch is a CUDA $cuda build and an nvcc or CUDA_HOME is here, but no toolkit with include/cuda_runtime.h: module load CUDA, or set CUDA_HOME to the toolkit"
    exit 1
else
    say "no CUDA toolkit: Horovod for CPU tensors${cuda:+ (GPU nodes: module load CUDA, then build again)}"
fi

if "$python" -c 'import horovod' 2>/dev/null; then
    if [ -n "${FORCE:-}" ]; then
        "$python" -m pip uninstall --quiet --yes horovod   # build again, with what is found now
    else
        say "already installed (make horovod FORCE=1 builds it again, e.g. after loading MPI or CUDA)"
        exec "$bin/horovodrun" --check-build
    fi
fi
# Build tools Horovod's setup.py needs, in the environment it builds for: CMake 4 dropped the
# compatibility with cmake_minimum_required(VERSION 3.13) that Horovod's bundled gloo relies on.
"$python" -m pip install --quiet --disable-pip-version-check "cmake>=3.13,<4" wheel "setuptools<81" packaging
export PATH="$bin:$PATH"   # that cmake, first

start=$(date +%s)
say "building $version for torch $("$python" -c 'import torch; print(torch.__version__)') (a few minutes)"
MAKEFLAGS="-j$(nproc)" "$python" -m pip install --disable-pip-version-check --no-build-isolation --no-cache-dir \
    --no-binary horovod "horovod[pytorch]==$version" || {
    echo "horovod: the build failed; the lines above name the first error. Run with  pip install -v  for the whole log"; exit 1; }
say "done in $(( $(date +%s) - start )) s"
"$bin/horovodrun" --check-build
