"""Shared fixtures: a real nats-server per test session (free port, temporary
store), a connected Bus per test with its own node name, CRIU detection."""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from smr import config
from smr.bus import Bus, BusConfig
from smr.config import REPO_TOOLS
from smr.natsserver import NatsServer, free_port
from tests import moto_s3, nats_auth
from tests.helpers import cpucost, ordering, steplocks
from tests.helpers.lifetime import die_with_parent
from tests.otlp import Processors, Receiver
from tests.otlp import serve as serve_otlp
from tests.test_local_smr import Harness, running


def pytest_configure(config: pytest.Config) -> None:
    cpucost.register(config)
    if not hasattr(config, "workerinput"):
        # The controller: where its workers write down the pod tests' lanes.
        os.environ[ordering.LANES_FILE_ENV] = os.path.join(
            tempfile.gettempdir(), f"smr-test-lanes-{os.getpid()}")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        if path := os.environ.pop(ordering.LANES_FILE_ENV, None):
            Path(path).unlink(missing_ok=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ordering.longest_first(items)
    ordering.write_lanes(config, items)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> ordering.Lanes:
    return ordering.Lanes(config, log)


@pytest.fixture(scope="session")
def settings() -> config.Settings:
    # Only where the binaries are may come from the environment (the GPU
    # machine unpacks them elsewhere), and the GPU gate's lifted refusals (a
    # GPU test of a process on two GPUs); every other setting is the default.
    return config.load({k: v for k, v in os.environ.items()
                        if k in ("SMR_CRIU", "SMR_CRIU_ROOT", "SMR_NATS_SERVER",
                                 "SMR_GPU_ALLOW")})


@pytest.fixture(scope="session", autouse=True)
def step_locks(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Where tests.helpers.steplocks puts each node's step locks: this
    session's own, inherited by the worker processes its tests start."""
    os.environ[steplocks.ENV] = str(tmp_path_factory.mktemp("step-locks"))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory,
                settings: config.Settings) -> Iterator[NatsServer]:
    srv = NatsServer(settings.nats_server_binary(), tmp_path_factory.mktemp("nats"),
                     die_with_parent=True)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server: a separate process, real HTTP."""
    port = free_port()
    proc = subprocess.Popen(
        moto_s3.command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def node() -> str:
    """A fresh node name per test, so consumers and subjects never mix."""
    return f"node-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def bus_config() -> BusConfig:
    return BusConfig(max_deliver=4, ack_wait=2.0, nak_base_delay=0.2, nak_max_delay=1.0)


@pytest.fixture
async def bus(nats_server: NatsServer, bus_config: BusConfig) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_server.url, name="test", config=bus_config)
    yield b
    await b.close()


def _criu_works(binary: str) -> str | None:
    if os.geteuid() != 0:
        return "CRIU needs root"
    try:
        r = subprocess.run([binary, "check"], capture_output=True, text=True, timeout=30)
    except OSError as e:
        return f"cannot run {binary}: {e}"
    if "Looks good" not in r.stdout + r.stderr:
        return f"`criu check` failed: {(r.stdout + r.stderr).strip().splitlines()[-1:]}"
    return None


@pytest.fixture(scope="session")
def criu_binary(settings: config.Settings) -> str:
    binary = settings.criu_binary()
    why = _criu_works(binary)
    if why:
        # CI installs CRIU through `make setup`; there a missing CRIU is a failure.
        if os.environ.get("CI"):
            pytest.fail(f"CRIU unusable in CI: {why}")
        pytest.skip(why)
    return binary


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    return d


def which(name: str) -> str | None:
    return shutil.which(name)


@pytest.fixture(scope="session")
def span_processors() -> Processors:
    """The session's one tracer provider (OpenTelemetry allows one per process);
    a test adds its own span processors to ``.added`` and removes them."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    processors = Processors()
    provider = TracerProvider()
    provider.add_span_processor(processors)
    trace.set_tracer_provider(provider)
    return processors


@pytest.fixture
def otlp(span_processors: Processors) -> Iterator[Receiver]:
    """Spans exported as in production (the SDK's batch processor and OTLP/HTTP
    exporter) to a receiver that decodes them; ``flush()`` sends what is pending."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    with serve_otlp() as receiver:
        processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint),
                                       schedule_delay_millis=200)
        span_processors.added.append(processor)
        receiver.flush = functools.partial(processor.force_flush, 10_000)
        try:
            yield receiver
        finally:
            span_processors.added.remove(processor)
            processor.shutdown()


@pytest.fixture(scope="session")
def shipped_nats_users(kustomize: str) -> nats_auth.Shipped:
    """deploy/kustomize's NATS users and permissions, as the dev overlay renders them."""
    return nats_auth.shipped(kustomize)


@pytest.fixture
def nats_users(shipped_nats_users: nats_auth.Shipped, settings: config.Settings,
               tmp_path: Path, node: str) -> Iterator[nats_auth.SecuredNats]:
    """A nats-server of this test's own, run as a deployed cluster's: the
    shipped users and permissions (tests/nats_auth.py), and ``node``'s user
    for `smr up` on a shared NATS (local-node.conf.template; ``.node_user``
    adds one for any other node the test starts). A test gives
    each service under test its own user (``.connect``) and plays the rest as
    smr-admin. At its end the test fails if the server refused anything: a
    permission the shipped users lack, which a deployed cluster would refuse too."""
    secured = nats_auth.start(settings.nats_server_binary(), tmp_path / "nats-users",
                              shipped_nats_users, nodes={node: uuid.uuid4().hex})
    yield secured
    secured.stop()
    refused = secured.violations()
    assert not refused, ("the server refused a permission the shipped NATS users lack "
                         f"(deploy/kustomize/components/nats-auth): {refused[:5]}")


@pytest.fixture
async def admin_bus(nats_users: nats_auth.SecuredNats, bus_config: BusConfig
                    ) -> AsyncIterator[Bus]:
    """On ``nats_users``: the test itself, playing the services not under
    test and the operator, as smr-admin (it creates the streams and buckets)."""
    b = await nats_users.connect("smr-admin", bus_config)
    yield b
    await b.close()


@pytest.fixture(scope="session")
def kustomize() -> str:
    """The kustomize binary (``make setup`` puts it in .tools/bin): tests
    that render the deploy use it (test_deploy, the NATS users' config)."""
    found = REPO_TOOLS / "kustomize"
    if found.exists():
        return str(found)
    if path := shutil.which("kustomize"):
        return path
    if os.environ.get("CI"):
        pytest.fail("kustomize is not installed: `make setup` installs it")
    pytest.skip("kustomize is not installed (make setup)")


@pytest.fixture
async def h(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
            ) -> AsyncIterator[Harness]:
    """An embedded node (`smr up`'s services, CRIU, nats-server with the
    shipped users, a local store) for the local-job tests."""
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0) as harness:
        yield harness
