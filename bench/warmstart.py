"""Warm starts (docs/warm-start.md) against cold starts of one LLM server, on
the GPU machine, through the node agent's pods.

The server: a Hugging Face causal LM built with ``from_config`` (random
weights, bf16, ``--gib`` of them, 4 by default), saved once with
``save_pretrained`` and loaded with ``from_pretrained`` from local disk, as a
server would; it serves greedy generation over HTTP (token ids in, token ids
out) after a warm-up of three requests, then says it is Ready.

In one run, on the two simulated nodes of tests/agent/cluster.py (REAL:
containerd, runc, CRIU, the CUDA driver's checkpoint API, nats-server, the
watcher, the agents, the storage service; S3: moto's server over HTTP,
bench/s3server.py; FAKE: the API server and the kubelets):

  cold      pod ``llm-0`` (labelled snapshot-when-ready) created → its first
            answer; and its process start → first answer
  template  the watcher's leave-running checkpoint of it once Ready: its
            size, stored size, freeze and upload times
  warm      pod ``r0`` (labelled start-from) created → its first answer, on
            the other node (its cache empty: the fetch from S3 included); the
            restore's fetch, CRIU restore and driver restore
  pre-pull  the first node's agent pulls the template into its cache
            (SMR_TEMPLATE_PREPULL) before any replica is created there; then
            pod ``p0`` created there → its first answer, and its breakdown
  4 at once four replicas created together on the first node (pre-pulled):
            each one's pod created → first answer; the node's template cache
            (objects downloaded, hits)
  answers   the same prompts to the cold server and to every replica: token
            ids compared

    python3 bench/warmstart.py [--gib 4] [--replicas 4]
    python3 bench/warmstart.py --fake      # no GPU, no PyTorch: a stand-in
                                           # server, to check the bench itself

Run it on the device machine through scripts/device-gpu.sh (WARMSTART=1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pytest  # noqa: E402

from services.containers import host  # noqa: E402
from services.containers.pods import runtime_id  # noqa: E402
from services.policy import policy_for  # noqa: E402
from services.restorer import pod as pod_restore  # noqa: E402
from services.storage.layout import template_id  # noqa: E402
from smr.contract.messages import derive_request_id, epoch  # noqa: E402
from smr.natsserver import free_port  # noqa: E402
from tests import oci_image  # noqa: E402
from tests.fake_apiserver import pod  # noqa: E402
from tests.helpers.netns import in_netns  # noqa: E402

IMAGE = "smr.test/llm-server:1"
PORT = 8000
PROMPTS = [[1 + 7 * i + j for j in range(24)] for i in range(4)]
NEW_TOKENS = 16
T = TypeVar("T")

SERVER = b'''
import time
T0 = time.time()
import http.server, json, os, sys
FAKE = os.environ.get("FAKE") == "1"
if FAKE:  # a stand-in: a slow start, then a deterministic "model"
    time.sleep(float(os.environ.get("FAKE_LOAD_S", "8")))
    def generate(ids, n):
        out, x = [], sum(ids)
        for _ in range(n):
            x = (x * 1103515245 + 12345) % 32000
            out.append(x)
        return out
else:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.environ["MODEL"], dtype=torch.bfloat16,
                                                 device_map="cuda")
    model.eval()
    def generate(ids, n):
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()
for i in range(3):  # the warm-up
    generate(list(range(3 + i, 27 + i)), 8)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = json.dumps({"ids": generate(body["ids"], body["n"])}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("0.0.0.0", int(os.environ["PORT"])), Handler)
open("/ready", "w").close()
print(f"process-start {T0:.3f} ready-after {time.time() - T0:.2f}", flush=True)
server.serve_forever()
'''




def ask_once(pid: int, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """One request over HTTP to the server in the container of ``pid``."""
    sock = in_netns(pid, lambda: socket.create_connection(("127.0.0.1", PORT), timeout=120))
    conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=120)
    conn.sock = sock
    try:
        body = json.dumps({"ids": ids, "n": n})
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return list(json.loads(resp.read())["ids"])
    finally:
        conn.close()


def shim_pid(cluster: Any, name: str) -> int | None:
    p = cluster.kube.get("pods", name, "default")
    for st in ((p or {}).get("status") or {}).get("containerStatuses") or []:
        if st.get("containerID"):
            shim = host.find_shim(runtime_id(st["containerID"]))
            return shim.pid if shim else None
    return None


async def first_answer(cluster: Any, name: str, since: float, timeout: float = 900
                       ) -> tuple[float, list[int]]:
    """Seconds from ``since`` (time.time()) to the pod's first answer, and the answer."""
    deadline = time.monotonic() + timeout
    while True:
        pid = shim_pid(cluster, name)
        if pid is not None:
            try:
                got = await asyncio.to_thread(ask_once, pid, PROMPTS[0])
                return time.time() - since, got
            except (OSError, http.client.HTTPException):
                pass
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {name} never answered")
        await asyncio.sleep(0.05)


def server_pod(name: str, node: str, labels: dict[str, str], model: Path, fake: bool
               ) -> dict[str, Any]:
    env = {"MODEL": str(model), "PORT": str(PORT), "HOME": "/tmp", "PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    if fake:
        env["FAKE"] = "1"
    p = pod(name, node, labels=labels, env=env)
    p.pop("status")
    c = p["spec"]["containers"][0]
    c["image"] = IMAGE
    c["command"] = ["/usr/bin/python3" if fake else sys.executable, "/app/serve.py"]
    c["readinessProbe"] = {"exec": {"command": ["/bin/sh", "-c", "test -f /ready"]},
                           "periodSeconds": 1}
    mounts = [("usr", "/usr")] if fake else [("usr", "/usr"), ("opt", "/opt"),
                                             ("model", str(model))]
    c["volumeMounts"] = [{"name": n, "mountPath": m, "readOnly": True} for n, m in mounts]
    p["spec"]["volumes"] = [{"name": n, "hostPath": {"path": m}} for n, m in mounts]
    if not fake:
        c["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    return p


async def create(cluster: Any, body: dict[str, Any]) -> float:
    """Create the pod through the API (the webhook puts smr-init in front);
    the time it was created."""
    at = time.time()
    await cluster.core.create_namespaced_pod("default", body)
    stored = cluster.kube.get("pods", body["metadata"]["name"], "default")
    assert stored is not None and stored["spec"].get("runtimeClassName") == "smr", \
        "the webhook did not opt the pod in"
    stored["status"] = {"phase": "Pending"}
    cluster.kube.put("pods", stored)
    return at


def save_model(where: Path, gib: float) -> None:
    """A random Llama-shaped model of about ``gib`` GiB in bf16, saved once."""
    if (where / "config.json").is_file():
        return
    code = f"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
h, inter, vocab = 2048, 8192, 32000
per_layer = 4 * h * h + 3 * h * inter
layers = max(1, round(({gib} * 2**30 / 2 - 2 * vocab * h) / per_layer))
cfg = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=16, num_key_value_heads=16, vocab_size=vocab,
                  max_position_embeddings=512, tie_word_embeddings=False)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
n = sum(p.numel() for p in model.parameters())
print(f"model: {{layers}} layers, {{n / 1e9:.2f}}e9 parameters, {{2 * n / 2**30:.2f}} GiB bf16")
model.save_pretrained({str(where)!r})
"""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server over HTTP, its ranged GETs patched (bench/s3server.py)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "s3server.py"), "-H",
                             "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        time.sleep(0.1)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def stats_of(cluster: Any, node: str) -> dict[str, int]:
    cache = cluster.agents[node].cache
    return dict(cache.stats) if cache is not None else {}


async def test_warmstart(cluster: Any, settings: Any, tmp_path: Path) -> None:
    gib, replicas = float(os.environ["WARM_GIB"]), int(os.environ["WARM_REPLICAS"])
    fake = os.environ.get("WARM_FAKE") == "1"
    model = Path(os.environ.get("WARM_MODEL_DIR", "/var/tmp/smr-warm-model"))
    if not fake:
        t = time.monotonic()
        save_model(model, gib)
        print(f"model saved in {time.monotonic() - t:.1f}s "
              f"({sum(f.stat().st_size for f in model.iterdir()) / 2**30:.2f} GiB on disk)")
    tar = oci_image.build(tmp_path / "llm.tar", IMAGE, files={
        "/app/serve.py": SERVER, "/etc/passwd": b"root:x:0:0::/tmp:/bin/sh\n"},
        links={"lib": "usr/lib", "lib64": "usr/lib64"})
    a, b = list(cluster.kubelets)
    for n in (a, b):
        await cluster.kubelets[n].ctd.import_image(n, tar)
    rows: list[tuple[str, str]] = []

    # Cold: the template's own pod.
    created = await create(cluster, server_pod("llm-0", a, {
        "smr.dev/snapshot-when-ready": "llm"}, model, fake))
    cold, first = await first_answer(cluster, "llm-0", created)
    log = cluster.log("llm-0", a)
    started = float(log.split("process-start ", 1)[1].split()[0])
    rows += [("cold: pod created → first answer", f"{cold:.2f} s"),
             ("cold: process start → first answer", f"{created + cold - started:.2f} s")]

    # The template, taken by the watcher once the pod was Ready.
    p0 = cluster.kube.get("pods", "llm-0", "default")
    ckpt = template_id("llm", "main")
    rid = derive_request_id("template", "default", ckpt, p0["metadata"]["uid"], "0")
    done = await cluster.bus.wait_result(rid, "ckpt.requested", timeout=900)
    assert done.status == "succeeded", done.error
    gen = await cluster.store.latest("default", ckpt)
    d = done.durations
    rows += [("template: size", f"{gen.size_bytes / 2**30:.2f} GiB"),
             ("template: stored size", f"{gen.manifest['stored_bytes'] / 2**30:.2f} GiB"),
             ("template: freeze (downtime)", f"{d.get('downtime', 0):.2f} s"),
             ("template: checkpoint total", f"{d.get('total', 0):.2f} s")]
    print("template checkpoint durations:", {k: round(v, 3) for k, v in d.items()})
    reference = [await asyncio.to_thread(ask_once, shim_pid(cluster, "llm-0"), q)
                 for q in PROMPTS]
    assert reference[0] == first, "the cold server answers the same prompt differently"

    async def warm(name: str, node: str) -> tuple[str, float, dict[str, float]]:
        created = await create(cluster, server_pod(name, node, {
            "smr.dev/start-from": "llm", "smr.dev/node-restore": "true"}, model, fake))
        took, _ = await first_answer(cluster, name, created)
        pod_now = cluster.kube.get("pods", name, "default")
        st = pod_now["status"]["containerStatuses"][0]
        restore = await cluster.bus.wait_result(
            derive_request_id("restore", pod_now["metadata"]["uid"], "main",
                              runtime_id(st["containerID"])), "restore.requested", timeout=60)
        assert restore.status == "succeeded" and restore.checkpoint_id == ckpt, restore.error
        assert "process-start" not in cluster.log(name, node), f"{name} started cold"
        # Where the rest of pod created → first answer went: before the
        # restore step started (the container's creation, smr-init asking).
        d = dict(restore.durations)
        if restore.started_at:
            d["before_restore"] = epoch(restore.started_at) - created
        return name, took, d

    def breakdown(label: str, took: float, rd: dict[str, float]) -> None:
        rows.extend([
            (f"warm ({label}): pod created → first answer", f"{took:.2f} s"),
            # Streamed: until CRIU had every byte (overlapping its restore);
            # from the cached files: linking and verifying them, before CRIU.
            (f"warm ({label}): images fetched/decoded/verified", f"{rd.get('download', 0):.2f} s"),
            (f"warm ({label}): CRIU restore", f"{rd.get('restore', 0):.2f} s"),
            (f"warm ({label}): driver restore", f"{rd.get('cuda_restore', 0):.2f} s"),
            (f"warm ({label}): restore total", f"{rd.get('total', 0):.2f} s"),
            (f"warm ({label}): pod created → restore step starts",
             f"{rd.get('before_restore', 0):.2f} s"),
            (f"speed-up, {label} (cold pod → answer / warm)", f"{cold / took:.1f}x")])
        print(f"{label} restore durations:", {k: round(v, 3) for k, v in rd.items()})

    # One replica on the other node: its cache is empty (the fetch from S3 counts).
    name, took, rd = await warm("r0", b)
    breakdown("cache empty", took, rd)

    # The first node pre-pulls the template (SMR_TEMPLATE_PREPULL=default/llm:
    # the agent's own loop, run once here instead of waiting for its next look)
    # before any replica is created on it.
    agent = cluster.agents[a]
    agent.prepull.templates = [("default", "llm")]
    t = time.monotonic()
    pulled = await agent.prepull.once()
    rows.append(("pre-pull to node a's cache (SMR_TEMPLATE_PREPULL), before any replica",
                 f"{time.monotonic() - t:.2f} s ({pulled} objects downloaded and decoded)"))
    name, took, rd = await warm("p0", a)
    breakdown("pre-pulled, CRIU reads the cached files", took, rd)
    # The same, with the images streamed to CRIU from the cache (as before
    # the cached files were handed to CRIU): which way is faster.
    pod_restore.FROM_CACHED_FILES = False
    try:
        name, took, rd = await warm("p1", a)
    finally:
        pod_restore.FROM_CACHED_FILES = True
    breakdown("pre-pulled, images streamed from the cache", took, rd)

    # Replicas at once on the first node, whose cache holds the template now.
    before = stats_of(cluster, a)
    got = await asyncio.gather(*(warm(f"r{i}", a) for i in range(1, replicas + 1)))
    after = stats_of(cluster, a)
    for name, took, rd in got:
        print(f"{name} (4 at once) restore durations:", {k: round(v, 3) for k, v in rd.items()})
        own = [c.checkpoint_id for c in policy_for(
            cluster.kube.get("pods", name, "default"), settings).containers]
        rows.append((f"{replicas} at once (pre-pulled): {name} pod created → first answer",
                     f"{took:.2f} s (restore {rd.get('total', 0):.2f} s; own id {own})"))
    files = len(gen.manifest["files"])
    downloads = after.get("downloads", 0) - before.get("downloads", 0)
    hits = after.get("hits", 0) - before.get("hits", 0)
    rows.append((f"{replicas} at once: node a's cache",
                 f"{downloads} downloads, {hits} hits ({files} objects in the template; "
                 f"pre-pull downloaded {pulled})"))
    got = [("p0", 0.0, {}), ("p1", 0.0, {}), *got]

    # The same prompts: token ids compared with the cold server's.
    same = True
    for name in ["r0", *(g[0] for g in got)]:
        answers = [await asyncio.to_thread(ask_once, shim_pid(cluster, name), q)
                   for q in PROMPTS]
        same = same and answers == reference
        if answers != reference:
            print(f"{name} answered differently: {answers} vs {reference}")
    rows.append(("answers token-identical (cold vs every replica)", str(same)))

    width = max(len(k) for k, _ in rows)
    print(f"\nwarm start vs cold start, {'stand-in server' if fake else f'{gib:g} GiB LLM'}, "
          f"S3: moto over HTTP")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    assert same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--fake", action="store_true", help="a stand-in server: no GPU, no torch")
    a, rest = ap.parse_known_args()
    os.environ.update(WARM_GIB=str(a.gib), WARM_REPLICAS=str(a.replicas),
                      WARM_FAKE="1" if a.fake else "0")
    os.environ.pop("SMR_TEST_STORAGE", None)  # S3 over HTTP, not a directory
    return pytest.main([__file__, "-s", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                        "-p", "tests.agent.conftest", "--rootdir", str(REPO), *rest])


if __name__ == "__main__":
    sys.exit(main())
