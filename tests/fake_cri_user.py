"""The FAKE CRI's part that ctr 1.6 cannot play: the user of a container's
processes (a pod's ``securityContext.runAsUser``/``runAsGroup``).

The real kubelet hands the user to containerd's CRI plugin, which writes it
into the container's OCI spec (``process.user``) before the runtime sees the
bundle, and runs every exec (probes, preStop hooks) as that user too.
``ctr run`` 1.6 has no ``--user`` and its ``--config`` takes no image, so
tests/fake_kubelet.py runs such a container through this program, in front of
the handler's runtime binary (runc, or smr-runtime for RuntimeClass ``smr``,
which then sees the bundle as containerd's CRI plugin would have written it):

    fake_cri_user.py USERS_DIR REAL_RUNTIME [runc's arguments...]

``USERS_DIR/<container id>`` holds what the kubelet asked for:
``{"uid": N, "gid": N or null, "groups": [N, ...]}``. On ``create`` the
user is resolved the way CRI does it (containerd's ``oci.WithUser`` and the
CRI plugin's ``WithAdditionalGIDs``/``WithSupplementalGroups``): no runAsGroup,
the uid's group in the image's /etc/passwd, else 0; additionalGids: the
primary group, the image's /etc/group memberships of that user, then the
pod's supplementalGroups. On ``exec`` the process file gets the same user.
Every other call goes to the real runtime untouched.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def _option(args: list[str], *names: str) -> str | None:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a[len(n) + 1:]
    return None


def _entries(path: Path) -> list[list[str]]:
    """The colon-separated lines of an image's passwd or group file."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def resolve(want: dict[str, Any], rootfs: Path) -> dict[str, Any]:
    uid = int(want["uid"])
    users = [e for e in _entries(rootfs / "etc/passwd") if len(e) > 3 and e[2] == str(uid)]
    gid = want.get("gid")
    if gid is None:
        gid = int(users[0][3]) if users and users[0][3].isdigit() else 0
    gids = [int(gid)]
    if users:
        name = users[0][0]
        for g in _entries(rootfs / "etc/group"):
            if len(g) > 3 and g[0] != name and name in g[3].split(",") and g[2].isdigit():
                gids.append(int(g[2]))
    gids += [int(g) for g in want.get("groups") or []]
    return {"uid": uid, "gid": int(gid), "additionalGids": list(dict.fromkeys(gids))}


def patch(path: Path, user: dict[str, Any], *, spec: bool) -> None:
    doc = json.loads(path.read_text())
    process = doc.setdefault("process", {}) if spec else doc
    process["user"] = {**(process.get("user") or {}), **user}
    path.write_text(json.dumps(doc))


def main(argv: list[str]) -> None:
    users, real, args = Path(argv[1]), argv[2], argv[3:]
    cmd = next((a for a in args if a in ("create", "run", "exec")), None)
    cid = args[-1] if args else ""
    record = users / cid
    if cmd and cid and "/" not in cid and record.is_file():
        want = json.loads(record.read_text())
        if cmd in ("create", "run"):
            bundle = Path(_option(args, "--bundle", "-b") or ".")
            user = resolve(want, bundle / "rootfs")
            patch(bundle / "config.json", user, spec=True)
            record.write_text(json.dumps({**want, "resolved": user}))  # for its execs
        elif (process := _option(args, "--process", "-p")) and "resolved" in want:
            patch(Path(process), want["resolved"], spec=False)
    os.execvp(real, [real, *args])


if __name__ == "__main__":
    main(sys.argv)
