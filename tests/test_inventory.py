"""The inventory of container paths (services/containers/inventory) is
complete and is what docs/security.md shows: every function of the
container-facing code that opens, lists, writes or runs anything is named
by an entry (or said to touch no container), every function named exists,
and the doc's table is the generator's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from services.containers import inventory

REPO = Path(__file__).resolve().parent.parent
SECURITY = REPO / "docs" / "security.md"
PY = [*sorted(p for d in ("services/containers", "services/agent", "services/checkpointer",
                         "services/restorer") for p in (REPO / d).glob("*.py")),
      REPO / "smr" / "process" / "linkremap.py", REPO / "smr" / "process" / "procfs.py"]
C = [*sorted((REPO / "services/agent/init").glob("*.c")), *sorted((REPO / "native").glob("*.c"))]
# Calls that reach a container's files, or run something near one.
OPENERS = {"of_pid", "confined", "open_regular_at", "reopen", "inside", "fwalk",
           "set_last_pid", "_openat2", "_walk"}
C_CALLS = re.compile(r"\b(open|openat|fopen|opendir|fdopendir|mkdir|mkdirat|unlink|unlinkat|"
                     r"rename|renameat|mount|umount2|chown|fchownat|mknod|symlink|execvp|"
                     r"execve|flock|access|setns)\(")
# Python functions that are the openers themselves (confined.py): the paths
# they open are their callers', listed there.
OPENER_ITSELF = {"services.containers.confined:" + n for n in (
    "_openat2", "_walk", "Root.open", "Root.file", "Root.read", "Root.write_new",
    "Root.touch", "Root.unlink", "reopen", "_through_proc", "_unlink")}


def _module(p: Path) -> str:
    return ".".join(p.relative_to(REPO).with_suffix("").parts)


def _functions(tree: ast.Module) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                out[f"{prefix}{child.name}"] = child
                visit(child, f"{prefix}{child.name}.<locals>.")

    visit(tree, "")
    return out


def _touches(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in OPENERS or any(k.arg == "dir_fd" for k in node.keywords):
                return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("/proc/"):
            return True
        if isinstance(node, ast.Name) and node.id == "PROC":
            return True
    return False


def python_call_sites() -> set[str]:
    found = set()
    for p in PY:
        mod = _module(p)
        for qual, fn in _functions(ast.parse(p.read_text())).items():
            if "<locals>" not in qual and _touches(fn):
                found.add(f"{mod}:{qual}")
    return found - OPENER_ITSELF


def c_functions(p: Path) -> dict[str, str]:
    """Each top-level function of a C file, with its body."""
    out, name, body = {}, None, []
    for line in p.read_text().splitlines():
        line = re.sub(r"^__attribute__\(\([^)]*\)\)\s*", "", line)
        m = re.match(r"^[A-Za-z_][\w \*]*?\b(\w+)\([^;]*\)\s*\{\s*$", line)
        if m and name is None:
            name, body = m.group(1), []
        elif name is not None:
            if line.startswith("}"):
                out[name] = "\n".join(body)
                name = None
            else:
                body.append(line)
    return out


def c_call_sites() -> set[str]:
    return {f"{p.name}:{fn}" for p in C for fn, body in c_functions(p).items()
            if C_CALLS.search(body)}


def _named() -> set[str]:
    return {b for e in inventory.ENTRIES for b in e.by} | set(inventory.NOT_FOR_A_CONTAINER)


def test_every_function_that_touches_a_container_path_has_an_entry() -> None:
    missing = sorted((python_call_sites() | c_call_sites()) - _named())
    assert not missing, (
        "these functions open, list, write or run something for a container and no entry of "
        f"services/containers/inventory.py names them: {missing}; add the path they touch "
        "(or, if none is a container's, NOT_FOR_A_CONTAINER with why)")


def test_every_function_the_inventory_names_exists() -> None:
    py = {f"{_module(p)}:{q}" for p in PY for q in _functions(ast.parse(p.read_text()))}
    py |= {f"{_module(p)}:{q}" for p in [REPO / "services/containers/confined.py"]
           for q in _functions(ast.parse(p.read_text()))}
    c = {f"{p.name}:{fn}" for p in C for fn in c_functions(p)}
    gone = sorted(_named() - py - c)
    assert not gone, f"the inventory names functions that do not exist: {gone}"


def test_the_call_site_check_sees_a_new_opener(tmp_path: Path) -> None:
    """The check itself: a function that opens a tenant's file through the
    container's root, or a C function that opens a path, is found."""
    src = ("def peek(shim):\n    with shim.confined() as root:\n"
           "        return root.read('/smr/main/new-file')\n")
    fns = _functions(ast.parse(src))
    assert _touches(fns["peek"])
    c = tmp_path / "x.c"
    c.write_text("static int peek(const char *p) {\n    return open(p, O_RDONLY);\n}\n")
    assert "peek" in c_functions(c) and C_CALLS.search(c_functions(c)["peek"])


def test_docs_security_inventory_is_what_the_generator_writes() -> None:
    text = SECURITY.read_text()
    assert inventory.BEGIN in text, "docs/security.md has no inventory section"
    assert inventory.render_into(text) == text, (
        "docs/security.md's inventory is stale: "
        "`python -m services.containers.inventory --write docs/security.md`")


def test_patterns_match_the_paths_they_name() -> None:
    def keys(path: str) -> set[str]:
        return {e.key for e in inventory.matches(path)} - {"restore-target"}

    assert keys("/smr/main/status") == {"status"}
    assert keys("smr/main/.decision.smr-tmp") == {"decision.tmp"}
    assert keys("/dev/shm/a/b") == {"dev-shm-file"}
    assert keys("/dev/shm") == {"dev-shm"}
    assert keys("/smr/main/status/x") == set()
    assert keys("/etc/passwd") == set()
