#!/usr/bin/env bash
# On the GPU machine, the first of two calls on one warm machine for
# bench/warmstart.py (WARMSTART=1 scripts/device-gpu.sh is the second):
# .device/s3.tar.xz (moto, rclone, aioboto3: scripts/device-s3-bundle.sh) does
# not fit in one call beside .whl and the CRIU and containerd bundles (64 MiB
# a call), so this call carries it (and .whl) alone and unpacks it where the
# second call finds it: /tmp/site, which lasts as long as the machine is
# warm. With WARM_GIB set it also saves the bench's model (bench/warmstart.py
# save_model, into WARM_MODEL_DIR or /var/tmp/smr-warm-model), which the
# bench then finds saved.
#
#   device run, carry [".whl", ".device/s3.tar.xz"]:  WARM_GIB=4 scripts/device-s3-stage.sh
#   device run, carry [".whl", ".device/tools.tar.xz", ".device/containerd.tar.xz"]:
#     GPU_TESTS=none WARMSTART=1 WARMSTART_ARGS='...' scripts/device-gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
tar -C /tmp/site -xJf .device/s3.tar.xz
/tmp/site/smr-rclone/rclone version | head -1
PYTHONPATH=/tmp/site python3 -c 'import moto, aioboto3, boto3; print("moto", moto.__version__)'
if [ -n "${WARM_GIB:-}" ]; then
  PYTHONPATH=/tmp/site:$PWD python3 -c "
import sys, time
from pathlib import Path
from bench.warmstart import save_model
t = time.monotonic()
save_model(Path('${WARM_MODEL_DIR:-/var/tmp/smr-warm-model}'), float(sys.argv[1]))
print(f'model saved in {time.monotonic() - t:.1f}s')" "$WARM_GIB"
fi
