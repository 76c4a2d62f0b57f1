#!/usr/bin/env bash
# On the GPU machine (through `device`, carrying .whl and .device, made by
# scripts/device-bundle.sh): unpack CRIU, nats-server, containerd and the
# wheels, then run the GPU tests, local jobs and pod containers (GPU_TESTS
# picks others, none for none; the GPU bench with BENCH=1, the warm-start
# bench with WARMSTART=1). Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# moto's S3 server, rclone and aioboto3 (scripts/device-s3-bundle.sh), for
# bench/warmstart.py: carried here, or unpacked into /tmp/site by an earlier
# call on this machine (scripts/device-s3-stage.sh: it does not fit beside the rest).
[ -f .device/s3.tar.xz ] && { tar -C /tmp/site -xJf .device/s3.tar.xz || exit 1; }
[ -x /tmp/site/smr-rclone/rclone ] && export PATH=/tmp/site/smr-rclone:$PATH
T=/tmp/smr-tools; mkdir -p $T && tar -C $T -xJf .device/tools.tar.xz || exit 1
L=$T/usr/lib/x86_64-linux-gnu
printf '#!/bin/sh\nexec %s/ld-linux-x86-64.so.2 --library-path %s %s/usr/sbin/criu "$@"\n' \
  "$L" "$L" "$T" > $T/criu && chmod +x $T/criu
export SMR_CRIU=$T/criu SMR_CRIU_ROOT=$T SMR_NATS_SERVER=$T/usr/sbin/nats-server
# The agent's GPU pod tests: containerd, runc, busybox on PATH; smr-init,
# smr-runtime and CRIU's preloads where the agent and the tests look for them.
C=/tmp/smr-ctd-bin; mkdir -p $C && tar -C $C -xJf .device/containerd.tar.xz || exit 1
mkdir -p .tools/bin && cp $C/bin/smr-init $C/bin/smr-runtime .tools/bin/
mkdir -p .tools/lib && cp $C/smrlib/*.so .tools/lib/ || exit 1
ldconfig -p | grep -q libseccomp.so.2 || export LD_LIBRARY_PATH=$C/lib
export PATH=$C/bin:$PATH SMR_TEST_STORAGE=local
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  uname -r; nproc; free -g | head -2
  $SMR_CRIU check 2>&1 | tail -1
  python3 -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__)'
  # Measured: THP `always` makes the driver's checkpoint ~1.8x faster (docs/gpu.md).
  echo always > /sys/kernel/mm/transparent_hugepage/enabled
  cat /sys/kernel/mm/transparent_hugepage/enabled
} 2>&1 | tee "$OUT/env.txt"
if [ "${GPU_TESTS:-}" != none ]; then
  # Split into words, not globbed: a node id's [param] (test.py::test[torch-compile]).
  set -f
  python3 -m pytest ${GPU_TESTS:-tests/test_gpu.py tests/agent/test_gpu_pods.py} ${TESTS:-} \
    -v -s -rs -p no:cacheprovider 2>&1 | tee "$OUT/test_gpu.log"
  set +f
fi
for f in /tmp/pytest-of-*/pytest-current/*/gpu-*.log; do
  [ -f "$f" ] && { echo "== $f"; tail -n 5 "$f"; }
done > "$OUT/job_logs.txt" 2>&1
if [ -n "${WARMSTART:-}" ]; then
  python3 bench/warmstart.py ${WARMSTART_ARGS:-} 2>&1 | tee "$OUT/warmstart.txt"
fi
if [ -n "${BENCH:-}" ]; then
  python3 bench/gpu.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_gpu.txt"
fi
