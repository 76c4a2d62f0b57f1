"""The GPU checks that need no GPU: room for a checkpoint before the job freezes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from smr.contract.errors import PermanentError
from smr.gpu import gpuinfo

GIB = 1 << 30
GPU = {"used_bytes": GIB}


def test_a_dump_into_a_tmpfs_needs_the_ram_twice(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    if not Path("/dev/shm").is_dir() or not gpuinfo.on_tmpfs(Path("/dev/shm")):
        pytest.skip("no /dev/shm tmpfs here")
    # Room for the driver's copy (1.1 GiB), not for the images in RAM as well.
    monkeypatch.setattr(gpuinfo, "_mem_available", lambda: int(1.5 * GIB))
    shm = Path("/dev/shm") / f"smr-test-{tmp_path.name}"
    try:
        with pytest.raises(gpuinfo.NoRoom) as e:
            gpuinfo.check_room_for_checkpoint(GPU, shm)
        assert "tmpfs" in e.value.message and "SMR_WORK_DIR" in (e.value.hint or "")
    finally:
        shm.rmdir()
    if gpuinfo.on_tmpfs(tmp_path):
        pytest.skip("the test's own directory is on a tmpfs too")
    gpuinfo.check_room_for_checkpoint(GPU, tmp_path / "work")  # a disk: RAM for the copy only


def test_on_tmpfs_follows_the_deepest_mount(tmp_path: Path) -> None:
    assert gpuinfo.on_tmpfs(Path("/proc")) is False
    if gpuinfo.on_tmpfs(Path("/dev/shm")):
        assert gpuinfo.on_tmpfs(Path("/dev/shm/not/yet/made")) is True


def test_the_room_check_counts_the_jobs_host_memory_too(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The image is the GPU memory in use plus the job's own memory: a disk
    with room for the first alone is refused before the lock, saying so."""
    import subprocess
    import sys
    import time

    job = subprocess.Popen([sys.executable, "-c",
                            "b = bytearray(256 << 20)\nimport time\ntime.sleep(60)"])
    try:
        for _ in range(100):  # until its 256 MiB are resident
            if gpuinfo.host_bytes([job.pid]) >= 256 << 20:
                break
            time.sleep(0.05)
        monkeypatch.setattr(gpuinfo, "job_gpus", lambda pids: {
            "model": "H100", "count": 1, "used_bytes": 64 << 20})
        monkeypatch.setattr(gpuinfo.shutil, "disk_usage",
                            lambda p: type("U", (), {"free": 128 << 20})())
        with pytest.raises(gpuinfo.NoRoom) as e:
            gpuinfo.for_checkpoint([job.pid], tmp_path / "work")
        assert "64 MiB of GPU memory" in e.value.message, e.value.message
        assert "of host memory" in e.value.message, e.value.message
    finally:
        job.kill()
        job.wait()


def test_a_child_mapping_a_device_without_a_context_is_named(tmp_path: Path) -> None:
    """check_mappings names the process of the tree that maps the device
    file and is not a CUDA process (here /dev/zero stands for /dev/nvidia*,
    which CI has not); the CUDA processes themselves may map it."""
    import subprocess
    import sys

    code = ("import mmap, os, time\nf = os.open('/dev/zero', os.O_RDWR)\n"
            "m = mmap.mmap(f, 4096, mmap.MAP_SHARED)\nprint('mapped', flush=True)\n"
            "time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout and child.stdout.readline().strip() == "mapped"
        me = os.getpid()
        gpuinfo.check_mappings([me, child.pid], [me, child.pid], device="/dev/zero")  # CUDA ones
        with pytest.raises(PermanentError) as e:
            gpuinfo.check_mappings([me, child.pid], [me], device="/dev/zero")
        assert e.value.code == "gpu-forked-mapping"
        assert f"process {child.pid} (python" in e.value.message and "/dev/zero" in e.value.message
        assert "spawn" in (e.value.hint or "")
    finally:
        child.kill()
        child.wait()


def test_a_process_mapping_a_device_criu_cannot_save_is_refused_before_the_lock() -> None:
    """A GPU job's process that maps a device CRIU cannot save (NCCL over
    RDMA maps /dev/infiniband/uverbs*) is refused before the lock, CUDA
    process or not; what CRIU saves under /dev (/dev/zero, /dev/shm files)
    passes. The process runs in a mount namespace of its own with a tmpfs on
    /dev, where a file stands for the device: what is read is /proc/PID/maps,
    as the process's own mounts name it."""
    import shutil
    import subprocess
    import sys

    unshare = shutil.which("unshare")
    assert unshare, "util-linux (make setup) has unshare"
    code = ("import mmap, os, subprocess, time\n"
            "subprocess.run(['mount', '-t', 'tmpfs', 'dev', '/dev'], check=True)\n"
            "os.makedirs('/dev/infiniband'); os.makedirs('/dev/shm')\n"
            "held = []\n"
            "for path in ('/dev/shm/ok', os.environ.get('DEVICE', '/dev/infiniband/uverbs0')):\n"
            "    f = os.open(path, os.O_RDWR | os.O_CREAT); os.ftruncate(f, 4096)\n"
            "    held.append(mmap.mmap(f, 4096, mmap.MAP_SHARED))\n"
            "    if os.environ.get('ONLY_SHM'): break\n"
            "print('mapped', flush=True)\ntime.sleep(60)")
    procs = [subprocess.Popen([unshare, "--mount", "--propagation", "private", sys.executable,
                               "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **extra})
             for extra in ({}, {"ONLY_SHM": "1"}, {"DEVICE": "/dev/zero_uverbs0"},
                           {"DEVICE": "/dev/nvidia-uverbs0"})]
    try:
        for p in procs:
            assert p.stdout and p.stdout.readline().strip() == "mapped"
        rdma, shm, *renamed = (p.pid for p in procs)  # unshare execs the program itself
        for pid in renamed:  # a device under a name that only begins as a saved one does
            with pytest.raises(PermanentError, match="a device's memory") as renamed_e:
                gpuinfo.check_mappings([pid], [pid])
            assert renamed_e.value.code == "device-mapping"
        for cuda in ([rdma], []):
            with pytest.raises(PermanentError) as e:
                gpuinfo.check_mappings([rdma], cuda)
            assert e.value.code == "device-mapping"
            assert f"process {rdma} (python" in e.value.message
            assert "/dev/infiniband/uverbs0" in e.value.message
            assert "NCCL_NET=Socket" in (e.value.hint or "")
        gpuinfo.check_mappings([shm], [shm])
        gpuinfo.check_mappings([shm], [])
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_cuda_process_mapping_another_ones_ipc_file_is_refused() -> None:
    """A CUDA process that maps the driver's IPC file of another process (as
    one that opened another's GPU memory through CUDA IPC does: measured on
    the H100, bench/cuda_ipc_probe.py) is refused before the lock, named; its
    own IPC file (an exporter's) is let through. Real processes mapping real
    files named as the driver names them; no GPU here."""
    import subprocess
    import sys

    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    code = ("import mmap, os, sys, time\nname = sys.argv[1].replace('SELF', '%x' % os.getpid())\n"
            "f = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)\nos.ftruncate(f, 4096)\n"
            "m = mmap.mmap(f, 4096, mmap.MAP_SHARED)\nprint(name, flush=True)\ntime.sleep(60)")
    other = f"{os.getpid() + 1_000_000:x}"  # a PID no process here has
    procs = [subprocess.Popen([sys.executable, "-c", code, f"/dev/shm/cuda.shm.0.{who}.1"],
                              stdout=subprocess.PIPE, text=True) for who in ("SELF", other)]
    names = []
    try:
        for p in procs:
            assert p.stdout
            names.append(p.stdout.readline().strip())
        exporter, importer = procs
        gpuinfo.check_mappings([exporter.pid], [exporter.pid])
        with pytest.raises(PermanentError) as e:
            gpuinfo.check_mappings([exporter.pid, importer.pid], [exporter.pid, importer.pid])
        assert e.value.code == "cuda-ipc-mapping"
        assert f"process {importer.pid} (python" in e.value.message
        assert names[1] in e.value.message and "NCCL_P2P_DISABLE" in (e.value.hint or "")
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for n in names:
            Path(n).unlink(missing_ok=True)
