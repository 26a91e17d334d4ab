#!/usr/bin/env bash
# llama.cpp's own llama-server, compiled for this kind of machine: the strongest peer a user of it would run,
# and beside it (same sources, same flags) llama-quantize (bench/harness/ggufs.py: Q4_0 and Q4_K_M files) and
# llama-perplexity (bench/engine/kl_text.py: llama.cpp's KL divergence figure).
#
#     bash bench/harness/build_llama_server.sh [DIR]    # default .bench/llama.cpp; prints llama-server's path (the other two beside it)
#
# The sources come from PyPI, inside the llama-cpp-python sdist (vendor/llama.cpp), so no git clone and
# no network beyond pip. The instruction sets are named, not detected: GGML_NATIVE=ON crashed at thread-pool
# start on the Intel machine (it lists AMX, which its VM does not let a process use), so AVX-512 with
# VNNI, VBMI and BF16 are on and AMX off where the CPU lists all four (/proc/cpuinfo), else the AVX2 variant
# (an AVX-512 build dies with SIGILL on, e.g., AMD Zen 3). LLAMA_AVX512=1 or 0 forces one.
# The build (~5-10 minutes on 2 cores) is cached: a second run only prints the path. DIR holds a
# .gitignore of "*", so nothing in it is ever committed.
set -euo pipefail
dir="${1:-.bench/llama.cpp}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
cpu_has_avx512() {
    local flag
    for flag in avx512f avx512_vnni avx512vbmi avx512_bf16; do
        grep -q -w "$flag" /proc/cpuinfo 2>/dev/null || return 1
    done
}
if [ -n "${LLAMA_AVX512:-}" ]; then
    avx512="$LLAMA_AVX512"
elif cpu_has_avx512; then
    avx512=1
else
    avx512=0
fi
binary="$dir/build-avx512-$avx512/bin/llama-server"
targets=(llama-server llama-quantize llama-perplexity)
if [ -x "$binary" ] && [ -x "$(dirname "$binary")/llama-quantize" ] && [ -x "$(dirname "$binary")/llama-perplexity" ]; then
    echo "$binary"
    exit 0
fi
mkdir -p "$dir"
[ -f "$dir/.gitignore" ] || echo '*' > "$dir/.gitignore"
python="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[ -x "$python" ] || python=python3
if [ ! -d "$dir/llama_cpp_python-$version" ]; then
    "$python" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$dir" >&2
    tar xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"
fi
source_dir="$dir/llama_cpp_python-$version/vendor/llama.cpp"
isa=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
if [ "$avx512" = 1 ]; then
    isa+=(-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON)
fi
cmake -S "$source_dir" -B "$dir/build-avx512-$avx512" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF "${isa[@]}" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
cmake --build "$dir/build-avx512-$avx512" --target "${targets[@]}" -j "$(nproc)" >&2
echo "$binary"
