#!/usr/bin/env bash
# On the two-GPU machine (nvidia-h200-x2, through `device`, carrying .whl and
# .device): the driver-level probes of issues #26 and #28 — restoring onto
# the other GPU (bench/gpu_pairs_probe.py) and an NCCL job's suspend and
# restore (bench/nccl_probe.py, PROBE_VARIANTS "net p2p" by default, each
# after an uninterrupted reference run). Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_TESTS=none source scripts/device-gpu.sh
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
timeout 200 python3 bench/gpu_pairs_probe.py 2>&1 | tee "$OUT/pairs.log"
for v in ${PROBE_VARIANTS:-net p2p}; do
  timeout 150 python3 bench/nccl_probe.py --variant $v --ref --out "$OUT" 2>&1 | tee -a "$OUT/nccl.log"
  timeout 330 python3 bench/nccl_probe.py --variant $v --out "$OUT" 2>&1 | tee -a "$OUT/nccl.log"
done
