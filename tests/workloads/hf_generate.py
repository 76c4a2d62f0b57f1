"""A Hugging Face generation server for the GPU frameworks matrix
(docs/compatibility.md):
a Llama-shaped causal LM built with ``from_config`` (random weights, fixed
seed, no download; about 1.4 GiB in bf16), saved once with
``save_pretrained`` (safetensors) and loaded back with ``from_pretrained``
from local disk as a server would, serving greedy generation over HTTP with
the KV cache. Its answers before a heartbeat, between a heartbeat and a
migration and after the restore must be token-identical to those of an
uninterrupted server (bench/frameworks.py ``hf-generate``).

    python -m tests.workloads.hf_generate --dir /tmp/hf-model --port 8731

POST /generate {"ids": [int, ...], "new": N} -> {"tokens": [int, ...]}
GET /health -> "ok". Prints ``ready port=P`` once it serves. ``ask`` is its
client and ``PROMPTS`` the prompts the checks send (bench/frameworks.py,
tests/agent/test_gpu_frameworks_pods.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

SEED = 20261126
# Nine prompts of 13 token ids: three for each phase a check asks in.
PROMPTS = [[1, *(100 + 37 * i + 11 * k for k in range(12))] for i in range(9)]
NEW = 32  # tokens generated per answer


def ask(port: int, ids: list[int], new: int = NEW,
        connect: Callable[[], socket.socket] | None = None, timeout: float = 120) -> list[int]:
    """The server's greedy answer to ``ids`` (the generated tokens alone).
    ``connect``: a socket already connected to it (in a pod's network
    namespace); else 127.0.0.1:``port``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    if connect:
        conn.sock = connect()
        conn.sock.settimeout(timeout)  # a restored server's first answer can be slow
    try:
        conn.request("POST", "/generate", body=json.dumps({"ids": ids, "new": new}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"the server answered {resp.status}: {body[:200]!r}")
        return json.loads(body)["tokens"]  # type: ignore[no-any-return]
    finally:
        conn.close()


def build(directory: Path) -> None:
    """The random model, saved once (safetensors): the same bytes every time."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (directory / "config.json").exists():
        return
    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504,
                      num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--port", type=int, default=8731)
    a = ap.parse_args()
    # Deterministic cuBLAS (set before its first use) for equal answers.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    directory = Path(a.dir)
    build(directory)
    torch.use_deterministic_algorithms(True)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16,
                                                 local_files_only=True).to("cuda").eval()
    size = sum(p.numel() * p.element_size() for p in model.parameters())

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._send(200 if self.path == "/health" else 404, b"ok")

        def do_POST(self) -> None:
            req: dict[str, Any] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = torch.tensor([req["ids"]], device="cuda")
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     do_sample=False, max_new_tokens=int(req["new"]),
                                     use_cache=True, pad_token_id=0)
            self._send(200, json.dumps({"tokens": out[0, ids.shape[1]:].tolist()}).encode())

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", a.port), Handler)
    print(f"ready port={a.port} weights={size / 2**30:.2f}GiB", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
