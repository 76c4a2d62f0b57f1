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
#include <stdint.h>
#ifdef COPY
/* Read in the executable's own code: the linker copies it there
   (R_X86_64_COPY), and the executable holds the live one, not the C library. */
extern char **environ;
#endif
#ifdef HOSTILE
static uint32_t gnu_hash(const char *s) {
  uint32_t h = 5381;
  while (*s) h = h * 33 + (unsigned char)*s++;
  return h;
}
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
#ifdef COPY
  snprintf(line, sizeof line, "%s %p\n", getenv("KEPT") ? getenv("KEPT") : "-", (void *)environ);
#else
  snprintf(line, sizeof line, "%s\n", getenv("KEPT") ? getenv("KEPT") : "-");
#endif
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
  } else if (!strcmp(mode, "chains")) {
    /* The list of loaded objects made 16 objects whose symbol tables hold,
       for each name looked up, a chain of 65535 symbols hashed alike and
       named otherwise: each bound alone, together they multiply. */
    enum { OBJECTS = 16, CHAIN = 65535 };
    const char *names[] = {"__environ", "environ", "_environ"};
    uint32_t h[3], nb = 2;
    for (int i = 0; i < 3; i++) h[i] = gnu_hash(names[i]);
    while (h[0] % nb == h[1] % nb || h[0] % nb == h[2] % nb || h[1] % nb == h[2] % nb) nb++;
    uint32_t *table = calloc(4 + nb + 3 * CHAIN, 4);
    table[0] = nb;  /* symoffset 0, no bloom filter */
    uint32_t *chain = table + 4 + nb;
    uint64_t *syms = calloc(3 * CHAIN, 24);
    for (int n = 0; n < 3; n++) {
      table[4 + h[n] % nb] = n * CHAIN;
      for (int i = 0; i < CHAIN; i++) {
        chain[n * CHAIN + i] = (h[n] & ~1u) | (i == CHAIN - 1);
        char *sym = (char *)syms + 24 * (n * CHAIN + i);
        *(uint32_t *)sym = 1;            /* st_name: "other" */
        *(uint16_t *)(sym + 6) = 1;      /* st_shndx: defined */
        *(uint64_t *)(sym + 8) = 1;      /* st_value */
      }
    }
    static char strtab[] = "\0other";
    static int64_t dyn[8];
    int64_t tags[] = {DT_GNU_HASH, (int64_t)table, DT_SYMTAB, (int64_t)syms,
                      DT_STRTAB, (int64_t)strtab, DT_NULL, 0};
    memcpy(dyn, tags, sizeof tags);
    static uint64_t nodes[OBJECTS][5];
    for (int i = 0; i < OBJECTS; i++) {
      nodes[i][2] = (uint64_t)dyn;
      nodes[i][3] = i + 1 < OBJECTS ? (uint64_t)nodes[i + 1] : 0;
    }
    /* The r_debug the linker keeps (the executable's DT_DEBUG names it): a
       copy of _r_debug in the executable is not it. */
    extern ElfW(Dyn) _DYNAMIC[];
    for (ElfW(Dyn) *d = _DYNAMIC; d->d_tag != DT_NULL; d++)
      if (d->d_tag == DT_DEBUG) ((struct r_debug *)d->d_un.d_ptr)->r_map = (void *)nodes;
  }
#endif
  write(1, line, strlen(line));
  sleep(60);
  return 0;
}
"""


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cc = shutil.which("gcc")
    assert cc, "gcc (make setup) builds the test programs"
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
    readelf = shutil.which("readelf")
    assert readelf, "binutils' readelf (make setup) reads the test programs' relocations"
    relocations = subprocess.run([readelf, "-rW", str(programs[program])], check=True,
                                 capture_output=True, text=True).stdout
    copied = any("R_X86_64_COPY" in r and "environ" in r for r in relocations.splitlines())
    assert copied == program.startswith("copy"), relocations
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
    ("hostile", "chains", "more than 131072 reads"),
])
def test_a_process_that_points_its_own_structures_anywhere_is_unreadable(
        programs: dict[str, Path], started: list[subprocess.Popen[str]], program: str,
        mode: str, said: str) -> None:
    pid = start(started, programs[program], mode)
    with pytest.raises(liveenv.EnvironUnreadable, match=said):
        liveenv.getenv(pid, "KEPT")


def test_an_environ_of_another_object_is_not_the_c_librarys(
        programs: dict[str, Path], started: list[subprocess.Popen[str]],
        tmp_path: Path) -> None:
    """glibc's getenv reads __environ: a library loaded before it that
    exports a variable of its own named environ does not change that."""
    (tmp_path / "o.c").write_text('static char *fake[] = {"KEPT=fake", 0};\n'
                                  "char **environ = fake;\n")
    cc = shutil.which("gcc")
    assert cc, "gcc (make setup) builds the test programs"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "libo.so"),
                    str(tmp_path / "o.c")], check=True)
    p = subprocess.Popen([str(programs["pie"]), "change"], stdout=subprocess.PIPE, text=True,
                         env={"KEPT": "as started", "LD_PRELOAD": str(tmp_path / "libo.so")})
    started.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "changed"
    assert liveenv.getenv(p.pid, "KEPT") == {"KEPT": "changed"}


def test_a_statically_linked_program_and_a_process_gone_are_unreadable(
        started: list[subprocess.Popen[str]]) -> None:
    busybox = shutil.which("busybox")
    assert busybox, "busybox (make setup) is the statically linked program here"
    # The shell itself is read, waiting on its input after it wrote: an
    # exec in its place would race the read (an exec's new auxiliary vector
    # is empty for a moment).
    p = subprocess.Popen([busybox, "sh", "-c", "echo ready; read -r line"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    with pytest.raises(liveenv.EnvironUnreadable, match="statically linked"):
        liveenv.getenv(p.pid, "PATH")
    p.kill()
    p.wait()
    with pytest.raises(liveenv.EnvironUnreadable):
        liveenv.getenv(p.pid, "PATH")
