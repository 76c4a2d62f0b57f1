"""The GPU: the CUDA driver's checkpoint API (cuda_checkpoint.py over its
ctypes binding, driver.py; the one thread it restores through: frozen.py),
what NVML says (gpuinfo.py), which
GPUs a restore lands on (gpupairs.py), the gate before the lock
(gpugate.py) and smr's side of the cooperative path (coopgate.py,
coopproto.py). Stands on smr.process and smr.contract."""
