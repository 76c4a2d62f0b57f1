"""smr.process.liveenv on real processes: C programs built here, which change
their environment as a job does (setenv, unsetenv, variables added until the
C library moves it to the heap) or point their own structures anywhere, as a
hostile tenant may. What is read must be what getenv() in the process says,
or EnvironUnreadable, never a guess and never a hang."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from smr.process import liveenv

PROGRAM = r"""
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef COPY
/* A copy relocation: the executable holds the live environ, not the C library. */
extern char **environ;
char ***held = &environ;
#endif
int main(int argc, char **argv) {
  const char *mode = argv[1];
  char line[128];
  if (!strcmp(mode, "change")) {
    setenv("KEPT", "changed", 1);
    unsetenv("GONE");
    char name[32];
    for (int i = 0; i < 64; i++) {
      snprintf(name, sizeof name, "ADDED%d", i);
      setenv(name, "x", 1);
    }
    setenv("LAST", "=and more=", 1);
  }
  snprintf(line, sizeof line, "%s\n", getenv("KEPT") ? getenv("KEPT") : "-");
  /* What follows breaks the process's own getenv and symbol lookups: it is
     built with every symbol bound at its start (-z now), and only writes
     and sleeps after. */
  if (!strcmp(mode, "circle")) {
    _r_debug.r_map->l_next = _r_debug.r_map;
  }
#ifdef HOSTILE
  if (!strcmp(mode, "endless")) {
    char **many = malloc(sizeof(char *) * 70000);
    for (int i = 0; i < 70000; i++) many[i] = "X=1";
    __environ = many;
  } else if (!strcmp(mode, "wild")) {
    __environ = (char **)16;
  }
#endif
  write(1, line, strlen(line));
  sleep(60);
  return 0;
}
"""


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (make setup installs one) builds the test programs"
    d = tmp_path_factory.mktemp("liveenv")
    (d / "p.c").write_text(PROGRAM)
    built = {}
    # pie: the C library holds the live environ; copy-*: the executable does.
    for name, flags in {"pie": ["-fPIE", "-pie"], "copy-pie": ["-DCOPY", "-fPIE", "-pie"],
                        "copy-nopie": ["-DCOPY", "-fno-pie", "-no-pie"],
                        "hostile": ["-DHOSTILE", "-fPIE", "-pie"]}.items():
        subprocess.run([cc, "-O1", "-Wl,-z,now", *flags, "-o", str(d / name), str(d / "p.c")],
                       check=True)
        built[name] = d / name
    return built


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def start(started: list[subprocess.Popen[str]], program: Path, mode: str) -> int:
    p = subprocess.Popen([str(program), mode], stdout=subprocess.PIPE, text=True,
                         env={"KEPT": "as started", "GONE": "1", "OTHER": "o"})
    started.append(p)
    assert p.stdout is not None
    assert p.stdout.readline()  # its changes are made
    return p.pid


@pytest.mark.parametrize("program", ["pie", "copy-pie", "copy-nopie"])
def test_what_the_process_changed_is_read_as_getenv_finds_it(
        programs: dict[str, Path], started: list[subprocess.Popen[str]], program: str) -> None:
    pid = start(started, programs[program], "change")
    assert liveenv.getenv(pid, "KEPT", "GONE", "OTHER", "LAST", "ADDED63", "NONE") == {
        "KEPT": "changed", "GONE": None, "OTHER": "o", "LAST": "=and more=",
        "ADDED63": "x", "NONE": None}
    # /proc/PID/environ still says what it started with.
    assert b"KEPT=as started" in Path(f"/proc/{pid}/environ").read_bytes()
    untouched = start(started, programs[program], "none")
    assert liveenv.getenv(untouched, "KEPT", "GONE") == {"KEPT": "as started", "GONE": "1"}


@pytest.mark.parametrize(("program", "mode", "said"), [
    ("pie", "circle", "runs in a circle"),  # found past the executable: the list is walked
    ("hostile", "endless", "more than 65536 variables"),
    ("hostile", "wild", "at 0x10"),
])
def test_a_process_that_points_its_own_structures_anywhere_is_unreadable(
        programs: dict[str, Path], started: list[subprocess.Popen[str]], program: str,
        mode: str, said: str) -> None:
    pid = start(started, programs[program], mode)
    with pytest.raises(liveenv.EnvironUnreadable, match=said):
        liveenv.getenv(pid, "KEPT")


def test_a_statically_linked_program_and_a_process_gone_are_unreadable(
        started: list[subprocess.Popen[str]]) -> None:
    busybox = shutil.which("busybox")
    assert busybox, "busybox (make setup) is the statically linked program here"
    p = subprocess.Popen([busybox, "sh", "-c", "echo ready; exec sleep 60"],
                         stdout=subprocess.PIPE, text=True)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    with pytest.raises(liveenv.EnvironUnreadable, match="statically linked"):
        liveenv.getenv(p.pid, "PATH")
    p.kill()
    p.wait()
    with pytest.raises(liveenv.EnvironUnreadable):
        liveenv.getenv(p.pid, "PATH")
