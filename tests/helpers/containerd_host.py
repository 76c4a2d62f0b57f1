"""The machine's REAL containerd binary, put into a directory that stands for
a node's root file system (with the libraries it loads), so that the agent's
``chroot <host> containerd config dump`` runs it there as on a node."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path


def put_containerd(root: Path) -> bool:
    """False where this machine has no containerd (or no root to chroot)."""
    binary = shutil.which("containerd")
    if binary is None or os.geteuid() != 0:
        return False
    libs = re.findall(r"(/\S+) \(0x", subprocess.run(["ldd", binary], capture_output=True,
                                                      text=True).stdout)
    for src in [binary, *libs]:
        dst = root / ("usr/bin/containerd" if src == binary else src.lstrip("/"))
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.realpath(src), dst)
    return True
