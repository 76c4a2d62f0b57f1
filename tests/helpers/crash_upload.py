"""A writer that dies mid-upload, for the storage crash test: it streams a
growing page image into the next generation, prints ``uploading`` once bytes
have gone up, and waits to be SIGKILLed (no abort, no manifest).

    python -m tests.helpers.crash_upload local ROOT SRC
    python -m tests.helpers.crash_upload s3 ENDPOINT BUCKET SRC
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from services.storage.backend import Backend
from services.storage.local import LocalBackend
from services.storage.s3 import S3Backend
from services.storage.store import CheckpointStore
from smr.contract.messages import Target


async def main(argv: list[str]) -> None:
    backend: Backend
    if argv[0] == "local":
        backend, src = LocalBackend(Path(argv[1])), Path(argv[2])
    else:
        backend = S3Backend(argv[2], prefix="ckpt", endpoint_url=argv[1], path_style=True)
        src = Path(argv[3])
    said = asyncio.Event()

    def progress(n: int) -> None:
        if not said.is_set():
            print("uploading", flush=True)
            said.set()

    never_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    meta = {"request_id": "crashing", "node": "n1", "reason": "api",
            "target": Target.job("j").to_dict(), "versions": {"criu": "4.1.1"}}
    await CheckpointStore(backend).commit("local", "ck", src, meta, writer=never_done,
                                          on_bytes=progress)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
