"""A checkpoint's image and a container's are compared by digest, whatever
repository or runtime wording their imageIDs carry (services/restorer/imageref)."""

from __future__ import annotations

import pytest

from services.restorer.imageref import same_image

D = "sha256:" + "4588e731ce936f4cafe0d755a85f6a45cd18de28d18d2f7bd9bfab6b06e9352a"
E = "sha256:" + "0" * 64


@pytest.mark.parametrize(("saved", "running", "same"), [
    (f"docker.io/library/nginx@{D}", f"mirror.gcr.io/library/nginx@{D}", True),
    (f"docker.io/library/nginx@{D}", f"docker-pullable://nginx@{D}", True),
    (f"registry.example/team/app:1@{D}", f"registry.example/team/app@{D}", True),
    (D, f"docker://{D}", True),
    (f"docker.io/library/nginx@{D}", f"docker.io/library/nginx@{E}", False),
    (f"docker.io/library/nginx@{D}", "docker.io/library/nginx:1.25", False),
    ("docker.io/library/nginx:1.25", "docker.io/library/nginx:1.25", True),
])
def test_images_are_the_same_when_their_digests_are(saved: str, running: str,
                                                     same: bool) -> None:
    assert same_image(saved, running) is same
