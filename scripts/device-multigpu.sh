#!/usr/bin/env bash
# On a two-GPU machine (through `device`, carrying a copy of this tree with
# .whl/ and .device/tools.tar.xz made as scripts/device-bundle.sh makes
# them): the multi-GPU rows of bench/frameworks.py (FRAMEWORKS, MIGRATIONS:
# 2 by default, a heartbeat before them), each against an uninterrupted run
# in the same call; THROUGHPUT=1 first measures DDP's steps/s with no smr, with
# the cooperative library and over sockets only. Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T=/tmp/smr-tools; mkdir -p $T && tar -C $T -xJf .device/tools.tar.xz || exit 1
L=$T/usr/lib/x86_64-linux-gnu
printf '#!/bin/sh\nexec %s/ld-linux-x86-64.so.2 --library-path %s %s/usr/sbin/criu "$@"\n' \
  "$L" "$L" "$T" > $T/criu && chmod +x $T/criu
export SMR_CRIU=$T/criu SMR_CRIU_ROOT=$T SMR_NATS_SERVER=$T/usr/sbin/nats-server
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m | head -4
  uname -r; cat /proc/sys/kernel/io_uring_disabled 2>/dev/null
  python3 -c 'import torch, jax, sys; print(sys.version.split()[0], "torch", torch.__version__, "jax", jax.__version__)'
  echo always > /sys/kernel/mm/transparent_hugepage/enabled
} 2>&1 | tee "$OUT/env.txt"
python3 bench/frameworks.py --only ${FRAMEWORKS:-jax-2gpu ddp-nccl ddp-nccl-net} \
  --migrations ${MIGRATIONS:-2} ${THROUGHPUT:+--throughput} --out "$OUT" 2>&1 | tee "$OUT/frameworks.log"
