#!/usr/bin/env bash
# Packs what the GPU machine lacks (it reaches no registry) into the two
# git-ignored folders that `device` carries: .whl/ (wheels for its Python
# 3.12), .device/tools.tar.xz (CRIU 4.2 with its libraries, nats-server,
# from `make setup`'s .tools) and .device/containerd.tar.xz (containerd, runc,
# busybox, smr-init, smr-runtime, CRIU's preloads). scripts/device-gpu.sh unpacks them there.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
rm -rf .whl && mkdir -p .whl .device
for pkg in nats-py orjson tenacity opentelemetry-api opentelemetry-sdk \
    opentelemetry-semantic-conventions importlib-metadata jsonschema \
    jsonschema-specifications referencing rpds-py zstandard cryptography cffi pycparser \
    pytest-asyncio kubernetes_asyncio opentelemetry-proto protobuf pyyaml; do
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$pkg"
done
tar -C .tools/root -cJf .device/tools.tar.xz usr/sbin/criu usr/sbin/nats-server \
  usr/lib/x86_64-linux-gnu
# The node's container runtime for the agent's GPU pod tests (Debian 12's
# containerd 1.6 and runc, as here), busybox for test images, smr-init and
# smr-runtime, and kustomize: their NATS runs with the users it renders from
# deploy/kustomize (tests/nats_auth.py, with PyYAML above).
C=$(mktemp -d)
mkdir -p "$C/bin" "$C/lib"
cp "$(command -v containerd)" "$(command -v ctr)" "$(command -v containerd-shim-runc-v2)" \
   "$(command -v runc)" "$(command -v busybox)" .tools/bin/smr-init .tools/bin/smr-runtime \
   .tools/bin/kustomize "$C/bin/"
cp -L "$(ldd "$(command -v runc)" | awk '/libseccomp/ {print $3}')" "$C/lib/"
# The libraries the node agent preloads into CRIU (native/): without
# criu-root.so the agent refuses to checkpoint a pod at all.
mkdir -p "$C/smrlib" && cp .tools/lib/criu-root.so .tools/lib/criu-limits.so "$C/smrlib/"
tar -C "$C" -cJf .device/containerd.tar.xz bin lib smrlib
rm -rf "$C"
# moto's S3 server, rclone and aioboto3 for bench/warmstart.py: .device/s3.tar.xz
# (too big to travel beside the rest: scripts/device-s3-stage.sh sends it first).
PIP="$PIP" scripts/device-s3-bundle.sh
du -sh .whl .device/*.tar.xz
