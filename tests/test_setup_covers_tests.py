"""`make setup` installs every program the tests run: a test that execs a
program setup never installs passes on the machine of whoever wrote it and
fails on a new one (a JDK path only an earlier hand install made).

A static check over tests/: the programs a test names (``shutil.which``, the
first word of a command list handed to subprocess or asyncio, an absolute
/usr/bin or /usr/sbin path) against what scripts/install-tools.sh checks for and
installs, what it and the Makefile unpack into .tools/bin, and the few
programs every Debian 12 system has (its essential and required packages).
tests/README.md lists the same, for a reader."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "scripts" / "install-tools.sh"
EXEC = {"run", "Popen", "check_output", "check_call", "call", "create_subprocess_exec",
        "execv", "execvp"}
STRING_EXEC = {"create_subprocess_exec", "execv", "execvp"}  # the program as a string
# The host's /usr: a bare /bin/NAME is a file a test puts into its own image.
ABSOLUTE = re.compile(r"^/usr/s?bin/([\w.+-]+)$")
# On every Debian 12 system (Essential or Priority: required), and python3,
# which `make setup` itself runs on: the check above install-tools.sh's.
BASE = {
    "sh": "dash", "sleep": "coreutils", "test": "coreutils", "true": "coreutils",
    "tail": "coreutils",
    "mount": "mount", "umount": "mount", "fallocate": "util-linux", "setpriv": "util-linux",
    "unshare": "util-linux", "ldconfig": "libc-bin", "ldd": "libc-bin", "tar": "tar",
    "python3": "python3", "bash": "bash",
}


def checked_by_install_tools() -> dict[str, str]:
    """program -> what provides it, from install-tools.sh: the `command -v`
    pairs (program:Debian package) and the tools it unpacks into .tools/bin."""
    text = INSTALL.read_text()
    loop = re.search(r"for pair in (.*?); do", text, re.S)
    assert loop, "scripts/install-tools.sh no longer has its `for pair in ...` check"
    out = dict(p.split(":", 1) for p in loop.group(1).split() if ":" in p)
    out.update((m, "unpacked into .tools/bin") for m in re.findall(r"\$PREFIX/bin/([\w.-]+)", text))
    return out


def built_by_make() -> set[str]:
    return set(re.findall(r"^\.tools/bin/([\w.-]+):", (REPO / "Makefile").read_text(), re.M))


def programs_the_tests_run() -> dict[str, list[str]]:
    """program -> where a test names it (file:line)."""
    found: dict[str, list[str]] = {}

    def add(name: str, f: Path, line: int) -> None:
        found.setdefault(name.rsplit("/", 1)[-1], []).append(f"{f.relative_to(REPO)}:{line}")

    for f in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Call) and node.args:
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                first = node.args[0]
                if name in EXEC and isinstance(first, (ast.List, ast.Tuple)) and first.elts:
                    first = first.elts[0]
                # run(...)/Popen(...) take a list; a string there is another
                # helper's name argument (the agent tests' run("counter", ...)).
                named = name == "which" or name in STRING_EXEC or first is not node.args[0]
                if named and isinstance(first, ast.Constant) and isinstance(first.value, str):
                    add(first.value, f, node.lineno)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and (m := ABSOLUTE.match(node.value)):
                add(m.group(1), f, node.lineno)
    return found


def test_the_scan_sees_the_programs_the_tests_run() -> None:
    """The check below is only as good as its scan: these are run by tests
    today (a JDK, containerd's runtime, a shell, PostgreSQL's setpriv)."""
    used = programs_the_tests_run()
    assert {"java", "javac", "runc", "sh", "setpriv", "redis-server"} <= set(used), sorted(used)


def test_setup_installs_every_program_the_tests_run() -> None:
    provided = {**BASE, **checked_by_install_tools(), **dict.fromkeys(built_by_make(), "make")}
    missing = {p: where[:3] for p, where in programs_the_tests_run().items() if p not in provided}
    # node's Debian name: tests take whichever of the two is on PATH.
    missing.pop("nodejs", None)
    assert not missing, (
        f"tests run programs `make setup` does not install: {missing}; add each to "
        "scripts/install-tools.sh's `command -v` pairs (program:Debian package) and to "
        "tests/README.md, or to BASE here if every Debian 12 system has it")
