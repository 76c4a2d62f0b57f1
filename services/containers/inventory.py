"""Every path the node agent, smr-runtime and smr-init touch inside or for a
container: who owns it, how it is opened, what is done with it, and by which
functions. One list; docs/security.md's inventory table is rendered from it
(``python -m services.containers.inventory --write docs/security.md``).

A path cannot be added without an entry, by two checks in tests/test_inventory.py:

- every function of the container-facing code (services/containers, agent,
  checkpointer, restorer, smr/process/linkremap.py, and the C of smr-runtime,
  smr-init and native/) that calls an opener (``Root.of_pid``,
  ``Shim.confined``, ``open_regular_at``, ``reopen``, ``CriuBundle.inside``,
  ``os.fwalk``, anything with ``dir_fd=``, a ``/proc/`` path; in C open,
  openat, fopen, mkdir, unlink, rename, mount, exec...) is named by an entry's
  ``by`` or in ``NOT_FOR_A_CONTAINER`` with the reason; and every function
  named here exists;
- the hostile-file matrix (tests/agent/test_hostile_files.py) records every
  path the agent opens through a container's root while it runs the real
  steps, and each must match an entry's pattern.

Owners: ``tenant`` (the container's: any file may be there, planted by the
workload), ``agent`` (the node agent's own, out of the container's reach),
``runtime`` (smr-runtime's or the container runtime's, on the host),
``kernel`` (made by the kernel: /proc, cgroupfs; its content may still be
the tenant's to choose).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

# How the agent opens a tenant's file (services/containers/confined): each
# path from the container's root held open, openat2 RESOLVE_IN_ROOT |
# RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS (or component by component,
# O_NOFOLLOW, where openat2 is missing).
CONFINED = "openat2 in the container's root, no link followed"
READ = (f"{CONFINED}; O_PATH, fstat: a regular file of 64 KiB at most, else refused; "
        "reopened O_RDONLY|O_NONBLOCK through /proc/self/fd")
REPLACED = (f"{CONFINED} to its directory; a new file (O_CREAT|O_EXCL|O_NOFOLLOW) renamed "
            "over the name; a directory there refused")


@dataclass(frozen=True)
class Entry:
    key: str
    path: str  # a pattern: <container> one name, <pid> a number, * one name, ** any path
    owner: str  # tenant | agent | runtime | kernel
    opened: str
    done: str
    by: tuple[str, ...]  # "module:qualname" (Python) or "file.c:function"
    plant: bool = False  # a tenant can put any file there: the matrix plants each kind
    names: bool = False  # a list of names is read there: the matrix plants 100 MB of names
    runs: bool = False  # a program runs with it: the matrix plants the code-loading files


SMR = "/smr/<container>"

ENTRIES: tuple[Entry, ...] = (
    Entry("status", f"{SMR}/status", "tenant", READ,
          "smr-init's state line, split (waiting, running PID, ...); a refused one is "
          "not read again on the next scans",
          ("services.containers.host:Shim.status", "services.containers.host:Shim.workload",
           "services.agent.starts:_statuses", "smr-init.c:put", "smr-init.c:get"),
          plant=True),
    Entry("signal.lock", f"{SMR}/signal.lock", "tenant",
          f"{CONFINED}; O_PATH, fstat: a regular file, else refused; made O_EXCL where "
          "missing; reopened through /proc/self/fd",
          "flocked for 0.5 s at most, so smr-init forwards no signal while the hold is taken",
          ("services.containers.host:_locked", "services.containers.host:Shim.hold",
           "smr-init.c:forward_pending"), plant=True),
    Entry("signalled", f"{SMR}/signalled", "tenant", READ,
          "the signal smr-init already forwarded, read under the lock",
          ("services.containers.host:_signal_in", "smr-init.c:note", "smr-init.c:main"),
          plant=True),
    Entry("hold", f"{SMR}/hold", "tenant",
          f"{CONFINED} to its directory; lstat there: a regular file is unlinked and made "
          "again O_CREAT|O_EXCL|O_NOFOLLOW, anything else refused; refreshed through an "
          "O_PATH descriptor (utime of /proc/self/fd), never reopened",
          "made while a checkpoint holds the container, touched every 15 s, removed after",
          ("services.containers.host:Shim.hold", "services.containers.host:Shim.refresh_hold",
           "services.checkpointer.pod:_keep_holding", "smr-init.c:held"), plant=True),
    Entry("decision", f"{SMR}/decision", "tenant", REPLACED,
          "the agent's answer to smr-init (fresh, restoring, restored PID ...)",
          ("services.containers.host:Shim.decide", "services.agent.starts:StartRestores._answer",
           "services.restorer.pod:_decide_restored"), plant=True),
    Entry("decision.tmp", f"{SMR}/.decision.smr-tmp", "tenant",
          f"{CONFINED} to its directory; unlinked (a file or link, never followed), then "
          "made O_CREAT|O_EXCL|O_NOFOLLOW",
          "the new file renamed over decision, restored or final (.NAME.smr-tmp each)",
          ("services.containers.confined:Root.replace",), plant=True),
    Entry("unanswered", f"{SMR}/unanswered", "tenant", READ,
          "smr-init started the workload fresh for want of an agent's answer: only the "
          "file's presence counts (the Warning Event's words are the agent's own), and "
          "not for a start an agent restored (its step is recorded)",
          ("services.containers.host:Shim.unanswered", "smr-init.c:put"), plant=True),
    Entry("restored", f"{SMR}/restored", "tenant", REPLACED,
          "the note a restored workload may read (what it was restored from); removed by "
          "the directory's descriptor",
          ("services.containers.host:Shim.restored",), plant=True),
    Entry("final", f"{SMR}/final", "tenant", REPLACED,
          "the final checkpoint's outcome, for the preStop hook (smr-init --wait-final)",
          ("services.containers.host:Shim.final", "smr-init.c:wait_final"), plant=True),
    Entry("waiter", f"{SMR}/waiter", "tenant", READ,
          "whether a preStop hook waits (read, with final and hold, to find one waiting); "
          "one refused counts as not waiting",
          ("services.agent.prestop:_waiting", "smr-init.c:wait_final", "smr-init.c:unput"),
          plant=True),
    Entry("smr-dir", "/smr/<container>", "tenant",
          f"{CONFINED}; O_PATH|O_DIRECTORY", "the directory of the names above; made by "
          "smr-init (mkdir), the parent of every *at call",
          ("services.containers.confined:Root.dir", "services.containers.host:Shim.dir",
           "smr-init.c:mkdirs"), plant=True),
    Entry("dev-shm", "/dev/shm", "tenant",
          f"{CONFINED}; O_RDONLY|O_DIRECTORY (it is listed)",
          "listed and walked with os.fwalk (each directory opened from its parent's "
          "descriptor, checked to be the one listed); counted for the admission",
          ("services.containers.rootfs:_capture_shm", "services.containers.rootfs:saved_bytes",
           "services.containers.rootfs:_walked_bytes",
           "services.checkpointer.pod_dump:_note_link_names",
           "services.restorer.pod:_point_link_names"), plant=True, names=True),
    Entry("dev-shm-file", "/dev/shm/**", "tenant",
          "from its directory's descriptor: stat without following, then O_PATH|O_NOFOLLOW, "
          "fstat: only a regular file reopened O_RDONLY through /proc/self/fd",
          "saved into devshm.tar: holes recorded (SEEK_DATA/SEEK_HOLE), within the capture's "
          "budget (capture-too-large over it); a link saved as a link, a device never opened",
          ("services.containers.rootfs:_add", "services.containers.rootfs:_capture_shm",
           "services.containers.confined:open_regular_at"), plant=True),
    Entry("link-remap", "/dev/shm/link_remap.<n>", "tenant",
          "from /dev/shm's descriptor: stat or O_PATH|O_NOFOLLOW; only a regular file of "
          "CRIU's name used",
          "CRIU's link for a deleted, still-linked file (a semaphore): its other names noted "
          "at the dump, removed from a container that runs on, its names pointed at it after "
          "a restore (hard links made by descriptors)",
          ("services.checkpointer.pod_dump:_note_link_names",
           "services.checkpointer.pod_dump:_drop_link_remaps",
           "services.restorer.pod:_point_link_names", "smr.process.linkremap:other_names",
           "smr.process.linkremap:point_name"), plant=True),
    Entry("layer", "<upperdir>/**", "tenant",
          "the overlay upperdir found in smr-init's mountinfo, opened O_DIRECTORY|O_NOFOLLOW; "
          "walked with os.fwalk; each file as in /dev/shm (O_PATH first)",
          "saved into rootfs.tar (smr's own files, /dev, /proc, /sys, hosts skipped), holes "
          "recorded, within the budget; counted for the admission",
          ("services.containers.rootfs:_capture", "services.containers.rootfs:capture",
           "services.containers.rootfs:_add", "services.containers.rootfs:saved_bytes",
           "services.containers.rootfs:_walked_bytes"), plant=True, names=True),
    Entry("restore-target", "/** (each member of the saved layer, in the new container)",
          "tenant",
          f"{CONFINED} to the member's directory; whatever is there removed by descriptors "
          "(unlink, or shutil.rmtree from the directory's descriptor), then made "
          "O_CREAT|O_EXCL|O_NOFOLLOW (files), mkdir or symlink",
          "the writable layer and /dev/shm put back: numeric owners (fchown), modes, holes "
          "left holes; hard links, devices and FIFOs never made",
          ("services.containers.rootfs:_apply", "services.containers.rootfs:_apply_to",
           "services.containers.rootfs:_apply_member", "services.containers.rootfs:_remove",
           "services.containers.rootfs:_write_sparse"), plant=True),
    Entry("gpu-node", "/dev/nvidia<minor>", "tenant", f"{CONFINED}; O_PATH|O_NOFOLLOW, fstat",
          "checked to be the character device of the GPU the container was granted; never "
          "opened",
          ("services.containers.gpus:_check_node",), plant=True),
    Entry("criu-in-container", "/ of the container, as CRIU's root (the tree's files, "
          "/etc/criu/default.conf, /usr/lib/criu/*.so, /etc/ld.so.preload, NSS modules, the "
          "programs CRIU runs by name: sh, iptables, ip, tar; its cache /run/criu.kdat)",
          "tenant",
          "CRIU starts in the container's namespaces with the agent's root (nsenter --root=/): "
          "the loader, libraries and CRIU are the agent's, through its descriptors; only "
          "then criu-root.so takes the container's root as /, and from then on refuses every "
          "exec entry of libc (EACCES) and answers reads of /run/criu.kdat from the agent's "
          "own cache (a sealed memfd), refusing its writes and removal",
          "dump and restore of the tree; no configuration read (--no-default-config), plugins "
          "only from an empty directory of the agent's (-L), an environment built from "
          "nothing, no program run, no kernel probe (the cache is made outside every "
          "container: services.containers.kdat); NSS: CRIU makes no lookup",
          ("services.containers.incontainer:CriuBundle.inside",
           "services.containers.pods:PodStep.criu_in",
           "services.checkpointer.pod:PodCheckpointStep._run",
           "services.restorer.pod:PodRestoreStep._restore_verified",
           "criu-root.c:enter_container_root", "criu-root.c:kdat_open", "criu-root.c:refuse"),
          plant=True, runs=True),
    Entry("workload", "the container's command (process.args)", "tenant",
          "execvp by smr-init, in the container, as the container's user",
          "the workload: smr-init's child, started fresh or replaced by a restored tree",
          ("smr-init.c:start", "smr-init.c:run_local")),
    Entry("set-last-pid", "/proc/sys/kernel/ns_last_pid (the container's PID namespace)",
          "kernel",
          "nsenter -p only (the agent's mount namespace): the agent's own smr-init writes it",
          "the container's next PIDs start after the restored tree's",
          ("services.containers.incontainer:set_last_pid", "smr-init.c:main")),
    Entry("proc-root", "/proc/<pid>/root", "kernel", "O_PATH|O_DIRECTORY",
          "the container's root held open: every path above is opened from it",
          ("services.containers.confined:Root.of_pid", "services.containers.host:Shim.confined",
           "services.containers.host:Shim.root")),
    Entry("proc-identity", "/proc/<pid>/{cgroup,cmdline,environ,stat,status,ns/pid,ns/user,"
          "task/*/children,task/*/stat}", "kernel",
          "read bounded (smr.process.procfs: a command line 64 KiB at most, argv[0] up to "
          "its end; an environment 8 MiB; readlink), status and SMR_CONTAINER once a "
          "process; their content partly the tenant's",
          "which container a process is in (cgroup path), a shim (argv[0] is smr-init and "
          "its namespace PID 1), SMR_CONTAINER (one name, else refused), the tree, who "
          "there may hold CAP_SYS_PTRACE (refused), whether a workload that is a zombie "
          "still has a thread running (one neither exiting nor killed)",
          ("services.containers.host:container_id_of", "services.containers.host:all_pids",
           "services.containers.host:children", "services.containers.host:Shim.of",
           "services.containers.host:is_shim", "services.containers.gpus:_parent",
           "services.containers.gpus:_uid", "services.containers.gpus:_pidns",
           "services.restorer.pod:_find_ns_pid", "services.containers.host:_nspids",
           "services.containers.host:_fixed", "smr.process.procfs:read",
           "smr.process.procfs:ended",
           "smr.process.procfs:thread_runs",
           "services.containers.incontainer:container_capabilities",
           "services.containers.incontainer:refuse_ptracers",
           "services.containers.incontainer:_ptracer")),
    Entry("proc-ns-mnt", "/proc/<smr-init>/ns/mnt", "kernel",
          "opened O_RDONLY, NS_GET_USERNS, fstat of the owner",
          "a shim whose mount namespace is not owned by the agent's user namespace (made by "
          "the tenant) is refused before its mounts are read or CRIU joins it",
          ("services.containers.host:check_mount_namespace",)),
    Entry("proc-mountinfo", "/proc/<smr-init>/mountinfo", "kernel", "read whole",
          "the writable layer (overlay upperdir of /): smr-init's, which the workload cannot "
          "change", ("services.containers.host:upperdir",)),
    Entry("proc-fds", "/proc/<pid>/fd/*", "kernel",
          "readlink; a restore opens smr-init's fds 0-2 through them",
          "the dumped tree's stdio pipes (given to the restore), whether a GPU is held",
          ("services.containers.host:stdio", "services.containers.host:holds_gpu",
           "services.restorer.pod:PodRestoreStep._restore_verified")),
    Entry("proc-maps", "/proc/<pid>/maps, statm, limits", "kernel", "read",
          "System V shared memory mapped (CRIU's IPC namespace choice), resident memory "
          "(admission), CRIU's rlimits (criu-limits.so)",
          ("services.containers.host:maps_sysv_memory",
           "services.checkpointer.admission:resident_bytes", "criu-limits.c:from_proc")),
    Entry("cgroup-procs", "/sys/fs/cgroup/<container's cgroup>/cgroup.procs", "kernel",
          "the path from smr-init's /proc/<pid>/cgroup; written with a PID",
          "a restored tree (and the restoring CRIU, by a shell) joins the container's cgroups",
          ("services.containers.host:cgroup_procs", "services.containers.host:move_to_cgroups_of",
           "services.restorer.pod:PodRestoreStep._restore_verified")),
    Entry("runtime-spec", "<containerd shim's cwd>/../<id>/config.json", "runtime",
          "the shim's (root's, another PID namespace) cwd, O_PATH; config.json "
          "O_NOFOLLOW|O_NONBLOCK; used only if a regular file of root's, not group or world "
          "writable, 1 MiB at most", "the container's GPUs (its devices and env)",
          ("services.containers.gpus:runtime_spec",)),
    Entry("bundle-config", "<bundle>/config.json", "runtime",
          "read (fopen), written as a new file renamed over it",
          "smr-runtime wraps an opted-in container: /smr and smr-init mounted, smr-init first",
          ("smr-runtime.c:read_file", "smr-runtime.c:write_file", "smr-runtime.c:wrap")),
    Entry("smr-tmpfs", "$STATE/<id> (/run/smr/containers/<id>)", "runtime",
          "made by smr-runtime; a tmpfs of its own mounted on it, nodev,nosuid,noexec, SIZE; "
          "bind-mounted rw at /smr (its content then the tenant's)",
          "detached on delete, then the mount point removed by descriptors (O_NOFOLLOW, "
          "unlinkat, no device crossed)",
          ("smr-runtime.c:wrap", "smr-runtime.c:mkdirs", "smr-runtime.c:unmount_state",
           "smr-runtime.c:remove_state", "smr-runtime.c:remove_at")),
    Entry("runtime-settings", "/etc/smr/smr-runtime.env, its log", "runtime",
          "fopen (the host's, written by the installer)", "STATE, SIZE, RUNTIME, the log path",
          ("smr-runtime.c:load_settings", "smr-runtime.c:say", "smr-runtime.c:main")),
    Entry("work", "$SMR_WORK_DIR/<request>/ (images, rootfs.tar, devshm.tar)", "agent",
          "made 0700 and held open O_PATH; CRIU reaches it through /proc/self/fd/N",
          "CRIU's images and the captures, out of the workload's reach; uploaded, downloaded",
          ("services.containers.pods:PodStep.open_work", "services.containers.rootfs:_writing")),
    Entry("criu-files", "$SMR_CRIU_ROOT (criu, its loader and libraries), criu-root.so, "
          "criu-limits.so, $SMR_WORK_DIR/.criu-plugins", "agent",
          "opened by the agent, passed to CRIU as descriptors; the plugin directory refused "
          "unless an empty directory of the agent's", "what CRIU runs and loads",
          ("services.containers.incontainer:CriuBundle.fds",
           "services.containers.incontainer:_empty_dir")),
)

# Functions the checks find that touch no path of a container, and why.
NOT_FOR_A_CONTAINER: dict[str, str] = {
    "services.agent.install:install": "the host's containerd config and /usr/local/bin",
    "services.restorer.stream:scratch_for": "the agent's own memory (/proc/meminfo)",
    "services.restorer.stream:memory_headroom": "the agent's own cgroup",
    "smr.process.linkremap:capture": "a local job's /dev/shm (smr up), not a container's",
    "smr.process.linkremap:_link_one": "a local job's /dev/shm (smr up), not a container's",
    "smr.process.linkremap:_unlink_if": "a local job's /dev/shm (smr up), not a container's",
}


def by_key() -> dict[str, Entry]:
    return {e.key: e for e in ENTRIES}


def pattern(e: Entry) -> re.Pattern[str]:
    """``e.path`` as a regular expression of a container path (for the
    matrix's check of every path opened)."""
    out = ""
    for part in re.split(r"(<[^>]+>|\*\*|\*)", e.path.split(" ")[0]):
        if part == "**":
            out += ".*"
        elif part == "*" or part.startswith("<"):
            out += "[^/]+"
        else:
            out += re.escape(part)
    return re.compile(out)


def matches(path: str) -> list[Entry]:
    """The entries of a path the agent opened inside a container."""
    path = "/" + path.lstrip("/")
    return [e for e in ENTRIES if e.owner == "tenant" and pattern(e).fullmatch(path)]


BEGIN = "<!-- inventory: generated by `python -m services.containers.inventory`; "\
    "do not edit -->"
END = "<!-- inventory: end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    rows = ["| Path | Owner | Opened | What is done | By | Planted by the matrix |",
            "|---|---|---|---|---|---|"]
    for e in ENTRIES:
        kinds = [k for k, on in (("file kinds", e.plant), ("100 MB of names", e.names),
                                 ("code-loading files", e.runs)) if on]
        rows.append(" | ".join([
            f"| `{_cell(e.path)}`", e.owner, _cell(e.opened), _cell(e.done),
            ", ".join(f"`{b}`" for b in e.by), ", ".join(kinds) or "no (not the tenant's)"])
            + " |")
    return "\n".join([BEGIN, *rows, END]) + "\n"


def render_into(doc: str) -> str:
    """``doc`` with its inventory section (between the markers) rendered anew."""
    start, end = doc.index(BEGIN), doc.index(END) + len(END) + 1
    return doc[:start] + markdown() + doc[end:]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--write"] and len(argv) == 2:
        doc = Path(argv[1])
        doc.write_text(render_into(doc.read_text()))
        return 0
    if argv:
        print("usage: python -m services.containers.inventory [--write docs/security.md]",
              file=sys.stderr)
        return 64
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
