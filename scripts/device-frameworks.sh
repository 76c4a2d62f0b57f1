#!/usr/bin/env bash
# On the GPU machine (through `device`, carrying .whl and .device): the GPU
# frameworks matrix of issue #26 (bench/frameworks.py; FRAMEWORKS names some,
# all by default; MIGRATIONS, 3 by default; GPU_TESTS, none by default, runs
# those GPU tests first, as scripts/device-gpu.sh does). PROBE=1 first runs
# bench/jax_probe.py: a GPU job's checkpoint and restore by hand, reporting
# how the restored process ends, in the old order (the driver's restore after
# CRIU resumed it) and as smr does it now (--frozen). Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_TESTS=${GPU_TESTS:-none} source scripts/device-gpu.sh
export XLA_FLAGS="--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tee -a "$OUT/env.txt"
if [ -n "${PROBE:-}" ]; then
  for variant in ${PROBE_VARIANTS:-old frozen}; do
    F=""; case $variant in *frozen*) F=--frozen ;; esac
    W="--env XLA_PYTHON_CLIENT_MEM_FRACTION=0.12"; A="--steps ${STEPS:-200} --gib 1"
    case $variant in torch*) W="--module tests.workloads.gpu_counter"; A="--gib 1" ;; esac
    timeout 240 python3 bench/jax_probe.py $F $W --out /dev/shm/probe-$variant -- $A 2>&1 \
      | tee "$OUT/probe-$variant.log"
    rm -rf /dev/shm/probe-$variant/images
    dmesg 2>/dev/null | grep -v NVRM | tail -n 5 >> "$OUT/probe-$variant.log"
  done
fi
if [ "${FRAMEWORKS:-all}" != none ]; then
  ONLY=""; [ "${FRAMEWORKS:-all}" != all ] && ONLY="--only $FRAMEWORKS"
  python3 bench/frameworks.py $ONLY --migrations ${MIGRATIONS:-3} --out "$OUT" 2>&1 \
    | tee "$OUT/frameworks.log"
fi
