"""What real GPU processes map under /dev, and what smr's gate says of them,
on a machine with an NVIDIA GPU:

    python3 bench/gpu_dev_mappings.py

Starts each framework's small job (PyTorch, torch.compile, JAX,
transformers), prints the /dev paths its processes map (the gate refuses
any but the GPU's own in a CUDA process, /dev/zero, /dev/shm and
/dev/hugepages: smr.gpu.gpuinfo.check_mappings) and whether
smr.gpu.gpugate.before_lock lets it through."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smr.contract.errors import PermanentError
from smr.gpu import gpugate, gpuinfo
from smr.process.tree import process_tree

READY = "print('ready', flush=True); time.sleep(120)"
JOBS = {
    "torch": "import torch, time; x = torch.randn(4096, 4096, device='cuda'); y = x @ x; "
             f"torch.cuda.synchronize(); {READY}",
    "torch-compile": "import torch, time; f = torch.compile(lambda a: (a.sin() + a).sum()); "
                     f"f(torch.randn(1024, device='cuda')); torch.cuda.synchronize(); {READY}",
    "jax": "import jax, jax.numpy as jnp, time; x = jnp.ones((2048, 2048)); "
           f"(x @ x).block_until_ready(); {READY}",
    "hf": "import torch, time, transformers; m = torch.nn.Linear(64, 64).cuda(); " + READY,
}


def main() -> int:
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.1", TORCHINDUCTOR_COMPILE_THREADS="1")
    for name, code in JOBS.items():
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env,
                             start_new_session=True)
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        tree = process_tree(p.pid)
        devs = set()
        for pid in tree:
            for ln in Path(f"/proc/{pid}/maps").read_text().splitlines():
                f = ln.split()
                if len(f) >= 6 and f[5].startswith("/dev/"):
                    devs.add(" ".join(f[5:]))
        print(name, line, "tree", tree, "dev mappings", sorted(devs), flush=True)
        try:
            gpus = gpuinfo.gpus_by_pid(tree)
            gpugate.before_lock(tree, [q for q in tree if q in gpus] or [p.pid], gpus)
            print(name, "gate: lets it through", flush=True)
        except PermanentError as e:
            print(name, "gate: refused", e.code, e.message[:300], flush=True)
        os.killpg(p.pid, 9)
        p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
