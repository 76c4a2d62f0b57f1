"""What a CRIU log says: the first line that tells why a run failed, and the
failures a user can act on, each in their words with a code and a hint
(smr/process/criu.py quotes them in its errors)."""

from __future__ import annotations

import re
from pathlib import Path

from smr.process import linkremap

# CRIU prints these on every run here (an rlimit call without CAP_SYS_RESOURCE;
# its probe for /dev/net/tun, which a container lacks); they are harmless and
# must not be quoted as the reason for a failure.
_NOISE = re.compile(r"rlimit: Can't setup RLIMIT_NOFILE|tun: Unable to create tun")

# "(00.123456)      1: Error (criu/mount.c:1082): " in front of CRIU's own words.
ERROR_PREFIX = re.compile(r"^\([\d.]+\)\s+(?:\d+:\s+)?Error \([^)]*\):\s*")

# CRIU failures a user can act on: what went wrong in their words, a code, a hint.
_RUNAWAY = re.compile(r"Runaway socket: ino (\d+) peer_ino (\d+).*?name (.*)$", re.M)
_SYSV = re.compile(r"Task (\d+) with SysVIPC shmem map @\w+ doesn't live in IPC ns")
_RLIMIT = re.compile(r"Can't get rlimit \d+: (Operation not permitted)")


# Failures that pass: the step is retried rather than failed.
TEMPORARY = frozenset({"scratch-full", "criu-proc-mountpoint-taken"})


def explain(log: Path, *, stderr: str = "") -> tuple[str, str, str] | None:
    """(what, code, hint) of a failure CRIU's log (or, when the disk was too
    full for the log, its stderr) explains; None otherwise."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    text += "\n" + stderr
    if "No space left on device" in text:
        return ("no space left for its images", "scratch-full",
                f"free space in {log.parent} or give SMR_DATA_DIR a larger disk; the step is "
                "retried")
    if "External socket is used" in text:
        socks = [f"{name.strip() or '(unnamed)'} (inode {ino}, peer inode {peer})"
                 for ino, peer, name in _RUNAWAY.findall(text)] or ["(not named in the log)"]
        return (f"the process holds a unix socket connected to a process outside it: "
                f"{', '.join(dict.fromkeys(socks))}; the other end cannot be saved",
                "external-unix-socket",
                "close that connection before the checkpoint, or run its peer inside the same "
                "process tree (for a pod: the same container, not a sidecar)")
    if "anon_inode:[io_uring]" in text:
        who = _last_pid(text, text.index("anon_inode:[io_uring]"))
        return (f"{who} holds an io_uring (libuv 1.50 and later makes one in every event "
                "loop), which CRIU cannot save", "io-uring",
                "start the job with `smr exec` or in a pod smr injects: their seccomp filter "
                "makes io_uring_setup fail and libuv falls back to epoll (docs/compatibility.md)")
    if (at := text.find("handle_device_vma plugin failed")) >= 0:
        dev = sorted(set(re.findall(r"/dev/nvidia[\w-]*", text))) or ["a device file"]
        return (f"{_last_pid(text, at)} maps {', '.join(dev)} without a CUDA context of its "
                "own (a child forked from a CUDA process, or a compile worker that started "
                "CUDA after smr's check), which CRIU cannot save", "gpu-forked-mapping",
                "start such children with the 'spawn' start method, or before CUDA starts; "
                "torch.compile: TORCHINDUCTOR_COMPILE_THREADS=1 (docs/compatibility.md)")
    if m := _SYSV.search(text):
        return (f"process {m.group(1)} maps System V shared memory (PostgreSQL keeps a "
                "segment), which CRIU saves only with an IPC namespace of the tree's own, "
                "and this tree shares its IPC namespace with CRIU (cr-dump.c, "
                "check_sysvipc_map_dump)", "sysv-ipc-shared-namespace",
                "a local job started by `smr exec` without --gpu has its own, and the node "
                "agent saves a pod container's; a GPU job (`smr exec --gpu`) shares the "
                "host's: detach the memory before the checkpoint (docs/compatibility.md)")
    if m := re.search(re.escape(linkremap.FAILED) + "(.*)", text):
        return (m.group(1), "link-remap-unsupported",
                "the job runs on; see docs/compatibility.md (spawn DataLoader workers)")
    if "Can't create a directory (-17)" in text:
        # The parasite mounts a /proc of the tree's PID namespace at
        # proc.crtools in the tree root's working directory and removes it
        # at once. A local job's root is smr-init --local, which works in /:
        # every local job's dump makes /proc.crtools for a moment, and two at
        # that moment collide (EEXIST; seen under parallel tests). Or a dump
        # was cut short there.
        return ("CRIU could not make its /proc mount point, proc.crtools, in the working "
                "directory of the tree's first process (/ for a local job): it exists; "
                "another dump of a local job on this machine was making it at that moment",
                "criu-proc-mountpoint-taken",
                "the step is retried; if it fails again while no other checkpoint runs on this "
                "machine, remove the empty /proc.crtools (or proc.crtools in the working "
                "directory of the tree's first process)")
    if "can't dump unprivileged task whose /proc" in text:
        return ("the root of the process tree dropped root in a PID namespace whose /proc "
                "is not its own, and cannot mount one for CRIU (criu/pie/parasite.c)",
                "unprivileged-tree-root",
                "start it with `smr exec`, whose init stays root (smr-init --local), rather "
                "than dropping privileges in the tree's first process")
    if m := _RLIMIT.search(text):
        return (f"CRIU cannot read the resource limits of a process of another user "
                f"(prlimit: {m.group(1)}): root here lacks CAP_SYS_RESOURCE",
                "criu-limits-unreadable",
                "run `make setup`, which builds .tools/lib/criu-limits.so for smr to preload "
                "into CRIU (the smr image has it), or give root CAP_SYS_RESOURCE")
    if re.search(r"Can't get \d+:\d+ opt", text):
        return ("this CRIU cannot read the options of a socket the process holds (CRIU older "
                "than 4.2 on Linux 6.16+)", "criu-too-old",
                "install CRIU 4.2 or newer (`make setup`, or the smr image)")
    return None


def _last_pid(text: str, before: int) -> str:
    """The process CRIU worked on last before ``before`` in its log."""
    pids = re.findall(r"\(pid: (\d+)\)", text[:before])
    return f"process {pids[-1]}" if pids else "a process of the tree"


def failing_line(log: Path) -> str:
    """CRIU's first real error line: the one that says why it failed."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        if "Error (" in line and not _NOISE.search(line):
            return line.strip()
    return ""
