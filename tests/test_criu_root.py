"""criu-root.so (native/criu-root.c), preloaded into a program as the node
agent preloads it into CRIU: once it has taken the mount namespace's root,
every way libc has to run a program is refused, and CRIU's kernel-feature
cache, /run/criu.kdat, is read from the agent's descriptor and never from,
or into, that root. Without SMR_CRIU_ENTER_ROOT it changes nothing.

Real: the library `make setup` builds, loaded by the dynamic loader into a
small C program that calls each entry (root: setns needs CAP_SYS_ADMIN).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from services.containers import kdat
from smr.config import load

LIBRARY = load().criu_root_switch()

# Each libc entry that runs a program, then the cache's reads, writes and
# removal; one line per call: its name and what it returned (errno's name).
PROGRAM = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
extern char **environ;
static void said(const char *what, int ok) {
    printf("%s %s\n", what, ok ? "ran" : strerrorname_np(errno));
    fflush(stdout);
}
int main(int argc, char **argv) {
    const char *marker = argv[1];
    char cmd[512];
    snprintf(cmd, sizeof cmd, "echo ran >> %s", marker);
    char *sh[] = {"sh", "-c", cmd, NULL};
    pid_t p;
    int rc;
    if (fork() == 0) { execvp("sh", sh); said("execvp", 0); _exit(0); }
    wait(NULL);
    if (fork() == 0) { execv("/bin/sh", sh); said("execv", 0); _exit(0); }
    wait(NULL);
    if (fork() == 0) { execve("/bin/sh", sh, environ); said("execve", 0); _exit(0); }
    wait(NULL);
    if (fork() == 0) { execvpe("sh", sh, environ); said("execvpe", 0); _exit(0); }
    wait(NULL);
    if (fork() == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL); said("execl", 0); _exit(0);
    }
    wait(NULL);
    if (fork() == 0) { execlp("sh", "sh", "-c", cmd, (char *)NULL); said("execlp", 0); _exit(0); }
    wait(NULL);
    if (fork() == 0) {
        execle("/bin/sh", "sh", "-c", cmd, (char *)NULL, environ); said("execle", 0); _exit(0);
    }
    wait(NULL);
    if (fork() == 0) {
        int fd = open("/bin/sh", O_RDONLY | O_CLOEXEC);
        fexecve(fd, sh, environ); said("fexecve", 0); _exit(0);
    }
    wait(NULL);
    if (fork() == 0) {
        execveat(AT_FDCWD, "/bin/sh", sh, environ, 0); said("execveat", 0); _exit(0);
    }
    wait(NULL);
    rc = posix_spawn(&p, "/bin/sh", NULL, NULL, sh, environ);
    errno = rc; said("posix_spawn", rc == 0); if (rc == 0) waitpid(p, NULL, 0);
    rc = posix_spawnp(&p, "sh", NULL, NULL, sh, environ);
    errno = rc; said("posix_spawnp", rc == 0); if (rc == 0) waitpid(p, NULL, 0);
    rc = system(cmd); said("system", rc == 0);
    FILE *f = popen(cmd, "r"); said("popen", f != NULL); if (f) pclose(f);

    char buf[4096] = "";
    int fd = open("/run/criu.kdat", O_RDONLY);
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
    if (n >= 0) { buf[n] = 0; printf("kdat read %s\n", buf); } else said("kdat read", 0);
    fd = openat(AT_FDCWD, "/run/criu.kdat", O_RDONLY);
    n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
    if (n >= 0) { buf[n] = 0; printf("kdat reread %s\n", buf); } else said("kdat reread", 0);
    said("kdat write", open("/run/criu.kdat.tmp", O_CREAT | O_EXCL | O_WRONLY, 0600) >= 0);
    said("kdat rewrite", open("/run/criu.kdat", O_WRONLY | O_TRUNC) >= 0);
    said("kdat unlink", unlink("/run/criu.kdat") == 0);
    said("kdat rename", rename("/run/criu.kdat.tmp", "/run/criu.kdat") == 0);
    return 0;
}
"""
ENTRIES = ("execvp", "execv", "execve", "execvpe", "execl", "execlp", "execle", "fexecve",
           "execveat", "posix_spawn", "posix_spawnp", "system", "popen")

pytestmark = [
    pytest.mark.skipif(not LIBRARY, reason="no criu-root.so: run `make setup`"),
    pytest.mark.skipif(os.geteuid() != 0, reason="setns(2) of a mount namespace needs root"),
]


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("criu-root")
    (d / "p.c").write_text(PROGRAM)
    subprocess.run(["gcc", "-O1", "-Wall", "-Werror", "-o", d / "p", d / "p.c"], check=True)
    return d / "p"


# In a mount namespace of its own with a tmpfs on /run, where the tenant's
# cache is: the program, then what is left of that file.
WRAPPER = ('mount -t tmpfs smr-test /run && echo "the tenant\'s" > /run/criu.kdat || exit 125; '
           '"$@"; echo "kdat left $(cat /run/criu.kdat 2>&1)"; '
           'echo "kdat files $(ls -A /run | tr \'\\n\' \' \')"')


def _run(program: Path, marker: Path, env: dict[str, str], pass_fds: tuple[int, ...] = ()
         ) -> dict[str, str]:
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", WRAPPER, "sh",
         "env", f"LD_PRELOAD={LIBRARY}", *(f"{k}={v}" for k, v in env.items()),
         str(program), str(marker)],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
        pass_fds=pass_fds, check=True)
    return {" ".join(ln.split()[:2]) if ln.startswith("kdat") else ln.split()[0]:
            ln.split(maxsplit=2)[-1].strip() for ln in out.stdout.splitlines() if ln.strip()}


def test_a_run_that_took_the_root_runs_no_program_and_keeps_off_the_roots_cache(
        program: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    fd = kdat.descriptor(b"the agent's cache")
    try:
        said = _run(program, marker, {"SMR_CRIU_ENTER_ROOT": "1", "SMR_CRIU_KDAT_FD": str(fd)},
                    (fd,))
    finally:
        os.close(fd)
    assert not marker.exists(), f"a program ran: {marker.read_text()!r}"
    assert {e: said.get(e) for e in ENTRIES} == dict.fromkeys(ENTRIES, "EACCES")
    assert said["kdat read"] == said["kdat reread"] == "the agent's cache", said
    assert [said[f"kdat {w}"] for w in ("write", "rewrite", "unlink", "rename")] == \
        ["EACCES"] * 4, said
    assert (said["kdat left"], said["kdat files"]) == ("the tenant's", "criu.kdat"), (
        f"the root's cache was changed: {said}")


def test_without_the_agents_cache_the_roots_is_not_read(program: Path, tmp_path: Path) -> None:
    said = _run(program, tmp_path / "ran", {"SMR_CRIU_ENTER_ROOT": "1"})
    assert said["kdat read"] == "ENOENT", said  # CRIU then probes, as with none
    assert (said["kdat left"], said["kdat files"]) == ("the tenant's", "criu.kdat"), said


def test_without_the_agents_setting_nothing_changes(program: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    said = _run(program, marker, {})
    # The exec family replaces the process when it works: those print nothing.
    assert {e: said.get(e) for e in ENTRIES} == dict.fromkeys(ENTRIES, None) | {
        e: "ran" for e in ("posix_spawn", "posix_spawnp", "system", "popen")}
    assert len(marker.read_text().splitlines()) == len(ENTRIES)
    assert said["kdat read"] == "the tenant's", said


async def test_an_agents_criu_descriptors_are_closed_when_it_is_done_with_them(
        tmp_path: Path) -> None:
    """A stopped agent leaves none of its CRIU's descriptors open (many
    agents start and stop in one process in the suite), and its bundle
    opens them again if it is used after."""
    from services.containers.incontainer import CriuBundle

    s = load({})
    bundle = CriuBundle(s.criu_root(), s.criu_preload(), s.criu_root_switch(),
                        plugins=tmp_path / "plugins")
    if not bundle.binary.is_file():
        pytest.skip("no CRIU under the tools' prefix: run `make setup`")
    before = set(os.listdir("/proc/self/fd"))
    fds = (*bundle.fds(), await bundle.kdat())
    assert all(str(fd) in os.listdir("/proc/self/fd") for fd in fds if fd is not None)
    bundle.close()
    assert set(os.listdir("/proc/self/fd")) <= before
    assert len(bundle.fds()) == len(fds) - 1
    bundle.close()
