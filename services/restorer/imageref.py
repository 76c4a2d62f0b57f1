"""Is a container's image the one a checkpoint was taken from? By digest.

A pod's ``status.containerStatuses[].imageID`` names the image the runtime
ran, in the runtime's own words: ``docker.io/library/nginx@sha256:…`` from
containerd and CRI-O (the repository it was pulled from, then the digest),
``docker-pullable://nginx@sha256:…`` from dockershim, a bare ``sha256:…``
for an image with no repository digest. The same bytes pulled through a
mirror, or named by another tag, carry another repository but the same
digest: the same image. Another digest is another image.
"""

from __future__ import annotations

import re

# An OCI digest (algorithm:encoded) at the end of an image reference.
_DIGEST = re.compile(r"(?:^|[@/])([a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]{32,})$")


def digest(image_id: str) -> str | None:
    """The digest ``image_id`` ends with, or None: it names none."""
    m = _DIGEST.search(image_id.removeprefix("docker-pullable://").removeprefix("docker://"))
    return m.group(1) if m else None


def same_image(saved: str, running: str) -> bool:
    """Do two imageIDs name one image? Their digests match (where only one
    names a digest, or neither does, the whole strings must)."""
    a, b = digest(saved), digest(running)
    if a is not None and b is not None:
        return a == b
    return saved == running
