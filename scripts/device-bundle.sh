#!/usr/bin/env bash
# Packs what the GPU machine lacks (it reaches no registry) into the two
# git-ignored folders that `device` carries: .whl/ (wheels for its Python
# 3.12) and .device/tools.tar.xz (CRIU 4.2 with its libraries, nats-server,
# from `make setup`'s .tools). scripts/device-gpu.sh unpacks them there.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
rm -rf .whl && mkdir -p .whl .device
for pkg in nats-py orjson tenacity opentelemetry-api opentelemetry-sdk \
    opentelemetry-semantic-conventions importlib-metadata jsonschema \
    jsonschema-specifications referencing rpds-py zstandard cryptography cffi pycparser \
    pytest-asyncio; do
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$pkg"
done
tar -C .tools/root -cJf .device/tools.tar.xz usr/sbin/criu usr/sbin/nats-server \
  usr/lib/x86_64-linux-gnu
du -sh .whl .device/tools.tar.xz
