"""A busybox container run by runc through smr-runtime, as containerd would
run it (ctr 1.6 cannot set a user, and these tests need runc's own handle on
the container): its bundle, and running it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any


def busybox_bundle(top: Path, args: list[str], env: dict[str, str], *,
                   user: tuple[int, int] = (0, 0)) -> Path:
    bundle = top / "bundle"
    rootfs = bundle / "rootfs"
    for d in ("bin", "proc", "dev", "sys", "tmp", "smr"):
        (rootfs / d).mkdir(parents=True)
    busybox = shutil.which("busybox")
    assert busybox, "busybox-static is installed by `make setup`"
    shutil.copy2(busybox, rootfs / "bin" / "busybox")
    for applet in ("sh", "cat", "tr", "echo", "sleep"):
        (rootfs / "bin" / applet).symlink_to("busybox")
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True)
    spec: dict[str, Any] = json.loads((bundle / "config.json").read_text())
    spec["process"].update(terminal=False, user={"uid": user[0], "gid": user[1]}, args=args,
                           env=["PATH=/bin", *(f"{k}={v}" for k, v in env.items())])
    spec["root"]["readonly"] = False
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle
