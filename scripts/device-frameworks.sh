#!/usr/bin/env bash
# On the GPU machine (through `device`, carrying .whl and .device): the GPU
# frameworks matrix of issue #26. PROBE=1 runs bench/jax_probe.py (the steps
# of a GPU job's checkpoint and restore by hand, reporting how the restored
# process ends) in the variants of JAX's memory settings. Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_TESTS=none source scripts/device-gpu.sh
export XLA_FLAGS="--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tee -a "$OUT/env.txt"
if [ -n "${PROBE:-}" ]; then
  for variant in ${PROBE_VARIANTS:-frac012 noprealloc}; do
    case $variant in
      frac012) E="--env XLA_PYTHON_CLIENT_MEM_FRACTION=0.12" ;;
      noprealloc) E="--env XLA_PYTHON_CLIENT_PREALLOCATE=false" ;;
      *) E="" ;;
    esac
    timeout 240 python3 bench/jax_probe.py $E --out /dev/shm/probe-$variant -- \
      --steps ${STEPS:-200} --gib 1 2>&1 | tee "$OUT/probe-$variant.log"
    rm -rf /dev/shm/probe-$variant/images
    dmesg 2>/dev/null | tail -n 20 > "$OUT/dmesg-$variant.txt"
  done
fi
