"""smr.gpu.gpugate's refusals before the GPU lock, on real processes: what they
map (a file named as XLA's or NCCL's library, mapped for real), their
environment, the io_uring a real kernel gives them. The GPUs each process
holds are NVML's answer, given here as the dict NVML's reading makes (no
GPU here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from smr.gpu import gpugate
from smr.process import procfs

A = "GPU-00112233-4455-6677-8899-aabbccddeeff"
B = "GPU-ffeeddcc-bbaa-9988-7766-554433221100"
# NCCL over sockets: the one setting of NCCL's known to come back.
OFF = gpugate.OFF
OFF_ENV = dict(v.split("=") for v in OFF.split())

MAPS = """
import mmap, os, sys, time
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 4096)
for change in os.environ.pop("CHANGE_ENV", "").split():  # as a job script does
    name, _, value = change.partition("=")
    if value == "-":
        del os.environ[name]
    else:
        os.environ[name] = value
if len(sys.argv) > 2:
    import ctypes
    ctypes.CDLL(None, use_errno=True).syscall(425, 8, ctypes.create_string_buffer(120))
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    made: list[subprocess.Popen[str]] = []
    yield made
    for p in made:
        p.kill()
        p.wait()


def mapping(procs: list[subprocess.Popen[str]], path: Path, env: dict[str, str] | None = None,
            ring: bool = False) -> int:
    """A process that maps ``path`` (and makes an io_uring if ``ring``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(4096))
    p = subprocess.Popen([sys.executable, "-c", MAPS, str(path), *(["ring"] if ring else [])],
                         stdout=subprocess.PIPE, text=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
                         | (env or {}))
    procs.append(p)
    assert p.stdout and p.stdout.readline().strip() == "ready"
    return p.pid


def test_a_process_on_two_gpus_is_refused_naming_it_its_gpus_and_xla(
        procs: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    pid = mapping(procs, tmp_path / "site-packages/jaxlib/xla_extension.so")
    with pytest.raises(gpugate.GateRefused) as refused:
        gpugate.check_peers({pid: [A, B]})
    e = refused.value
    assert e.code == "gpu-peer-access"
    assert f"process {pid} (python" in e.message and A in e.message and B in e.message
    assert "XLA enables peer access" in e.message and "runs on" in e.message
    assert "--gpus 1" in e.hint and "SMR_GPU_ALLOW=peer-access" in e.hint
    gpugate.check_peers({pid: [A]})  # one GPU: let through
    gpugate.check_peers({pid: [A, B]}, allow=("peer-access",))  # lifted by the node


def test_nccl_ranks_on_two_gpus_with_p2p_on_are_refused(
        procs: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    lib = tmp_path / "nvidia/nccl/lib/libnccl.so.2"
    r0, r1 = mapping(procs, lib), mapping(procs, lib)
    with pytest.raises(gpugate.GateRefused) as refused:
        gpugate.check_peers({r0: [A], r1: [B]})
    assert refused.value.code == "nccl-p2p"
    assert str(r0) in refused.value.message and str(r1) in refused.value.message
    assert "NCCL_P2P_DISABLE=1" in refused.value.hint
    gpugate.check_peers({r0: [A], r1: [A]})  # one GPU: no P2P between them
    gpugate.check_peers({r0: [A], r1: [B]}, allow=("nccl-p2p",))
    off = OFF_ENV
    s0, s1 = mapping(procs, lib, off), mapping(procs, lib, off)
    gpugate.check_peers({s0: [A], s1: [B]})  # sockets only: let through


@pytest.mark.parametrize(("value", "disabled"), [
    ("1", True), ("01", True), ("0x1", True), (" 1", True),
    ("true", False), ("TRUE", False), ("yes", False), ("0", False), ("2", False),
    ("4294967297", True), ("-1", False),  # cut to a 32-bit int, as NCCL cuts it
])
def test_nccl_p2p_disable_is_read_as_nccl_reads_it(
        procs: list[subprocess.Popen[str]], tmp_path: Path, value: str, disabled: bool) -> None:
    """NCCL disables P2P only where (int) strtol(value, NULL, 0) == 1: a rank
    started with NCCL_P2P_DISABLE=true keeps P2P, and is refused."""
    lib = tmp_path / "nvidia/nccl/lib/libnccl.so.2"
    env = {"NCCL_P2P_DISABLE": value, "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    r0, r1 = mapping(procs, lib, env), mapping(procs, lib, env)
    if disabled:
        gpugate.check_peers({r0: [A], r1: [B]})
    else:
        with pytest.raises(gpugate.GateRefused):
            gpugate.check_peers({r0: [A], r1: [B]})


@pytest.mark.parametrize(("value", "disabled"), [
    ("1", True), ("01", True), ("0x1", True), (" 1", True),
    ("4294967297", False),  # kept whole: NCCL reads it as an int64_t
    ("99999999999999999999", False),  # out of range: NCCL keeps its default, on
    ("true", False), ("", False), ("0", False),
])
def test_nccl_shm_disable_is_read_as_nccl_reads_it(
        procs: list[subprocess.Popen[str]], tmp_path: Path, value: str, disabled: bool) -> None:
    """With P2P off, NCCL's ranks on one host share host memory (its SHM
    transport), which driver 580 does not restore either: NCCL turns it off
    only where strtoll(value, NULL, 0) == 1."""
    lib = tmp_path / "nvidia/nccl/lib/libnccl.so.2"
    env = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": value, "NCCL_NVLS_ENABLE": "0"}
    r0, r1 = mapping(procs, lib, env), mapping(procs, lib, env)
    if disabled:
        gpugate.check_peers({r0: [A], r1: [B]})
    else:
        with pytest.raises(gpugate.GateRefused) as refused:
            gpugate.check_peers({r0: [A], r1: [B]})
        assert f"NCCL_SHM_DISABLE={value!r} when it started" in refused.value.message


def test_only_nccl_over_sockets_is_let_through() -> None:
    """The one setting measured to come back (bench/nccl_probe.py, net)."""
    assert OFF_ENV == {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}


@pytest.mark.parametrize(("value", "off"), [
    ("0", True), ("00", True), ("0x0", True), ("no", True),  # strtoll reads no digit: 0
    ("", False),  # empty: NCCL keeps its default, 2 (on where the GPUs multicast)
    ("1", False), ("2", False), ("99999999999999999999", False),
])
def test_nccl_nvls_enable_is_read_as_nccl_reads_it(
        procs: list[subprocess.Popen[str]], tmp_path: Path, value: str, off: bool) -> None:
    """NVLink SHARP binds multicast objects to every rank's GPU memory, and
    is not known to come back: NCCL turns it off only where strtoll reads 0,
    and unset it is on wherever an NVSwitch lets the GPUs multicast."""
    lib = tmp_path / "nvidia/nccl/lib/libnccl.so.2"
    env = OFF_ENV | {"NCCL_NVLS_ENABLE": value}
    r0, r1 = mapping(procs, lib, env), mapping(procs, lib, env)
    if off:
        gpugate.check_peers({r0: [A], r1: [B]})
    else:
        with pytest.raises(gpugate.GateRefused) as refused:
            gpugate.check_peers({r0: [A], r1: [B]})
        assert f"NCCL_NVLS_ENABLE={value!r} when it started" in refused.value.message
    unset = {k: v for k, v in OFF_ENV.items() if k != "NCCL_NVLS_ENABLE"}
    u0, u1 = mapping(procs, lib, unset), mapping(procs, lib, unset)
    with pytest.raises(gpugate.GateRefused, match="NCCL_NVLS_ENABLE unset when it started"):
        gpugate.check_peers({u0: [A], u1: [B]})


@pytest.mark.parametrize(("started", "change", "said"), [
    (OFF, "NCCL_P2P_DISABLE=0", "NCCL_P2P_DISABLE='0' now"),
    (OFF, "NCCL_P2P_DISABLE=-", "NCCL_P2P_DISABLE unset now"),
    (OFF, "NCCL_SHM_DISABLE=0", "NCCL_SHM_DISABLE='0' now"),
    # Variables added first move the C library's environment to the heap.
    (OFF, " ".join(f"ADDED{i}={'x' * i}" for i in range(40)) + " NCCL_P2P_DISABLE=true",
     "NCCL_P2P_DISABLE='true' now"),
    ("", OFF, "NCCL_P2P_DISABLE unset when it started"),
])
def test_nccl_ranks_that_change_the_variables_from_inside_are_refused(
        procs: list[subprocess.Popen[str]], tmp_path: Path, started: str, change: str,
        said: str) -> None:
    """NCCL reads its variables with getenv() when it starts, after the job
    script may have changed os.environ: a rank started with P2P and SHM off
    that turns one back on is refused (its /proc/PID/environ still says 1),
    and so is one that turns them off only from inside, since which of the
    two NCCL saw cannot be told from outside."""
    lib = tmp_path / "nvidia/nccl/lib/libnccl.so.2"
    env = {"CHANGE_ENV": change} | dict(v.split("=") for v in started.split())
    r0, r1 = mapping(procs, lib, env), mapping(procs, lib, env)
    with pytest.raises(gpugate.GateRefused) as refused:
        gpugate.check_peers({r0: [A], r1: [B]})
    assert refused.value.code == "nccl-p2p"
    assert f"{r0} ({gpugate.comm(r0)}: {said})" in refused.value.message
    # Left as it started, or added to beside it, the same ranks pass.
    keep = OFF_ENV | {"CHANGE_ENV": "ADDED=1 OTHER=2"}
    k0, k1 = mapping(procs, lib, keep), mapping(procs, lib, keep)
    gpugate.check_peers({k0: [A], k1: [B]})


def test_a_rank_whose_live_environment_cannot_be_read_is_refused(
        procs: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A statically linked rank leaves no list of its loaded objects to find
    its C library's environment by: what NCCL read is unknown, so it is
    refused, however it started."""
    off = OFF_ENV
    static = shutil.which("busybox")
    assert static, "busybox (make setup) is the statically linked program here"
    ranks = [subprocess.Popen([static, "sleep", "60"], env=off, text=True) for _ in range(2)]
    procs.extend(ranks)
    while any(procfs.env_value(p.pid, "NCCL_P2P_DISABLE") is None for p in ranks):
        time.sleep(0.01)  # exec done
    # busybox maps no libnccl: here it stands for a rank NCCL is linked into.
    monkeypatch.setattr(gpugate, "_maps_nccl", lambda pid: True)
    with pytest.raises(gpugate.GateRefused) as refused:
        gpugate.check_peers({ranks[0].pid: [A], ranks[1].pid: [B]})
    assert "cannot be read" in refused.value.message
    assert "statically linked" in refused.value.message


def test_nccl_ranks_that_released_their_communicators_pass_and_others_are_refused(
        procs: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    """The cooperative path: NCCL ranks that dropped their communicators on
    smr's request hold no peer memory and pass, beside torchrun's agent
    (which maps libnccl too); ranks that did not release are still refused."""
    lib = tmp_path / "nvidia/nccl/lib/libnccl.so.2"
    r0, r1 = mapping(procs, lib), mapping(procs, lib)
    gpus = {r0: [A], r1: [B]}
    gpugate.check_peers(gpus, released=[r0, r1])
    with pytest.raises(gpugate.GateRefused) as refused:
        gpugate.check_peers(gpus, released=[])
    assert refused.value.code == "nccl-p2p"
    # torchrun's agent loads torch, and with it libnccl, and never registers.
    agent = mapping(procs, lib)
    gpugate.check_peers({**gpus, agent: [A]}, released=[r0, r1])


def test_a_process_holding_an_io_uring_is_refused_naming_it(
        procs: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    plain = mapping(procs, tmp_path / "plain")
    gpugate.check_io_uring([plain])
    ring = mapping(procs, tmp_path / "ring", ring=True)
    assert (gpugate.io_uring_held(ring) or "").startswith("descriptor ")
    with pytest.raises(gpugate.GateRefused) as refused:
        gpugate.check_io_uring([plain, ring])
    assert refused.value.code == "io-uring" and f"process {ring} (" in refused.value.message


def test_a_restore_is_explained_by_the_gpus_recorded_at_checkpoint_time() -> None:
    assert gpugate.restore_cause(None) == ""
    assert gpugate.restore_cause({"model": "H100", "processes": {"7": [A]}}) == ""
    why = gpugate.restore_cause({"processes": {"7": [A, B], "8": [A]}})
    assert why.startswith("process 7 held CUDA contexts on two GPUs") and "peer access" in why
    assert "IPC" not in why


def test_gpus_by_pid_reads_nvml_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML's per-GPU process lists (a **stand-in** for its reading) turned per process."""
    from smr.gpu import gpuinfo
    monkeypatch.setattr(gpuinfo, "devices", lambda: [
        {"uuid": A, "processes": {7: 1, 8: 1, 9: 1}}, {"uuid": B, "processes": {7: 1}}])
    assert gpuinfo.gpus_by_pid([7, 8]) == {7: [A, B], 8: [A]}


def test_criu_failing_on_a_gpu_device_mapping_is_explained(tmp_path: Path) -> None:
    """CRIU's words when a process maps /dev/nvidia* outside a CUDA context
    (criu/proc_parse.c, handle_vma_plugin; its errno is stale) are told as
    gpu-forked-mapping, naming the process it was collecting."""
    from smr.process.criu_log import explain

    log = tmp_path / "dump.log"
    log.write_text("(00.010) Collect mappings (pid: 4711)\n"
                   "(00.011) Error (criu/proc_parse.c:119): handle_device_vma plugin failed: "
                   "No such file or directory\n")
    what, code, hint = explain(log) or ("", "", "")
    assert code == "gpu-forked-mapping"
    assert what.startswith("process 4711 maps a device file without a CUDA context")
    assert "TORCHINDUCTOR_COMPILE_THREADS=1" in hint
