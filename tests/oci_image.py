"""Builds small OCI image tarballs locally (no registry can be reached here),
for `ctr images import`: one layer with static busybox and the files given."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

BUSYBOX_APPLETS = ["sh", "sleep", "cat", "echo", "ls", "seq", "true", "mkdir", "rm", "test"]


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    tar.addfile(info, io.BytesIO(data))


def _dir(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    tar.addfile(info)


def _blob(blobs: dict[str, bytes], data: bytes, media: str) -> dict[str, object]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media, "digest": digest, "size": len(data)}


def host_program(path: str) -> dict[str, bytes]:
    """A dynamically linked program of this machine with every library ``ldd``
    names, at the same paths: the files of an image that runs it."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
    libs = re.findall(r"(?:=> )?(/\S+) \(0x", out)
    return {p: Path(p).resolve().read_bytes() for p in [path, *libs]}


def build(out: Path, ref: str, *, files: dict[str, bytes] | None = None,
          label: str = "", entrypoint: list[str] | None = None,
          cmd: list[str] | None = None, links: dict[str, str] | None = None) -> Path:
    """Write an OCI image tarball named ``ref`` to ``out``; ``label`` makes a
    different image (digest) with the same content."""
    busybox = shutil.which("busybox")
    if busybox is None:
        raise RuntimeError("busybox is needed to build test images: apt-get install "
                           "busybox-static (make setup does)")
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for d in ("bin", "data", "tmp", "proc", "sys", "dev", "etc", "smr"):
            _dir(tar, d)
        _add(tar, "bin/busybox", Path(busybox).read_bytes(), 0o755)
        for applet in BUSYBOX_APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        made = {"bin", "data", "tmp", "proc", "sys", "dev", "etc", "smr"}
        for name, data in (files or {}).items():
            parts = name.strip("/").split("/")
            for i in range(1, len(parts)):
                if (d := "/".join(parts[:i])) not in made:
                    made.add(d)
                    _dir(tar, d)
            _add(tar, name.lstrip("/"), data, 0o755)
    layer_bytes = layer.getvalue()
    blobs: dict[str, bytes] = {}
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    layer_desc = _blob(blobs, layer_bytes, "application/vnd.oci.image.layer.v1.tar")
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": ["PATH=/bin"], "Cmd": cmd or ["/bin/sh"],
                         "Labels": {"smr.test": label},
                         **({"Entrypoint": entrypoint} if entrypoint else {})},
              "rootfs": {"type": "layers", "diff_ids": [diff_id]},
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(0))}
    config_desc = _blob(blobs, json.dumps(config).encode(),
                        "application/vnd.oci.image.config.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config_desc, "layers": [layer_desc]}
    manifest_desc = _blob(blobs, json.dumps(manifest).encode(),
                          "application/vnd.oci.image.manifest.v1+json")
    manifest_desc["annotations"] = {"org.opencontainers.image.ref.name": ref,
                                    "io.containerd.image.name": ref}
    index = {"schemaVersion": 2, "manifests": [manifest_desc]}
    with tarfile.open(out, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add(tar, "index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            _add(tar, f"blobs/sha256/{digest.split(':')[1]}", data)
    return out


def ref_of(tar: Path) -> str:
    """The name an image tarball of build() carries (its index's ref.name)."""
    with tarfile.open(tar) as t:
        f = t.extractfile("index.json")
        assert f is not None, f"{tar}: no index.json"
        index = json.loads(f.read())
    return str(index["manifests"][0]["annotations"]["io.containerd.image.name"])
