"""The docs tell the truth about the code: every setting documented, every
link and repository path there, the README's commands parse with the CLI's own
parser, the README's demo sample has the shape `smr demo` prints, and the
message contract lists every phase the code times."""

from __future__ import annotations

import ast
import difflib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from smr import config, config_docs, metrics
from smrctl import args

REPO = Path(__file__).resolve().parent.parent
CONFIG_DOC = REPO / "docs" / "configuration.md"
# The docs whose links and paths are checked: what a user reads.
DOCS = [REPO / "README.md", REPO / "schemas" / "README.md", REPO / "tests" / "README.md",
        *sorted((REPO / "docs").glob("*.md"))]
TOP = ("smr", "smrctl", "services", "tests", "deploy", "docs", "schemas", "scripts", "bench")
CODE = [p for d in ("smr", "services", "smrctl") for p in (REPO / d).rglob("*.py")]


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else p.name


# -- settings ---------------------------------------------------------------------------

def test_every_setting_is_in_docs_configuration() -> None:
    assert CONFIG_DOC.is_file(), "docs/configuration.md is missing: " \
        "`smr config --markdown > docs/configuration.md`"
    text = CONFIG_DOC.read_text()
    missing = [f"{config.PREFIX}{s.name}" for s in config.SETTINGS
               if f"`{config.PREFIX}{s.name}`" not in text]
    missing += [e.name for e in config.ELSEWHERE if f"`{e.name}`" not in text]
    assert not missing, f"not in docs/configuration.md: {', '.join(missing)}"


def test_docs_configuration_is_what_the_generator_writes() -> None:
    assert CONFIG_DOC.is_file()
    assert CONFIG_DOC.read_text() == config_docs.markdown(), \
        "docs/configuration.md is stale: `smr config --markdown > docs/configuration.md`"


def _env_read_outside_config() -> set[str]:
    """Environment variables the code reads other than through ``config.load``:
    os.environ.get / os.getenv in Python, getenv in the C programs, and the
    keys smr-runtime reads from its smr-runtime.env."""
    names: set[str] = set()
    for p in CODE:
        if p == REPO / "smr" / "config.py":
            continue
        names |= set(re.findall(r"(?:os\.environ\.get|os\.getenv)\(\s*\"([A-Z0-9_]+)\"",
                                p.read_text()))
    for p in (REPO / "services" / "agent" / "init").glob("*.c"):
        text = p.read_text()
        names |= set(re.findall(r"getenv\(\"([A-Z0-9_]+)\"\)", text))
        names |= set(re.findall(r"strcmp\(line, \"([A-Z0-9_]+)\"\)", text))
    return names


def test_every_env_var_read_elsewhere_is_named() -> None:
    read = _env_read_outside_config()
    assert {"SMR_INIT_DIR", "SMR_INIT_TIMEOUT", "RUNTIME", "OTEL_SERVICE_NAME"} <= read, \
        "the scan for environment reads found too little"
    named = {e.name for e in config.ELSEWHERE} | {config.PREFIX + s.name for s in config.SETTINGS}
    assert read - named == set(), "read but not in smr/config.py's ELSEWHERE: " \
        f"{sorted(read - named)}"


# -- links and paths --------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`]+)`")  # a span may go on over a line break
FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.S | re.M)


def _broken(doc: Path) -> list[str]:
    text = doc.read_text()
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            out.append(f"{_rel(doc)}: link ({target})")
    for span in CODE_SPAN.findall(FENCE.sub("", text)):
        for token in span.split():
            token = token.rstrip(".,:;)")
            if "/" not in token or not token.startswith(tuple(t + "/" for t in TOP)) \
                    or any(c in token for c in "*{<…$"):
                continue
            path, _, test = token.partition("::")
            if not (REPO / path).exists():
                out.append(f"{_rel(doc)}: path `{token}`")
            elif test and not re.search(rf"def {re.escape(test)}\b", (REPO / path).read_text()):
                out.append(f"{_rel(doc)}: no test `{token}`")
    return out


def test_links_and_repository_paths_exist() -> None:
    # Docs other helpers add (security, kubernetes) are checked once they exist.
    broken = [b for doc in DOCS for b in _broken(doc)]
    assert not broken, "missing:\n" + "\n".join(broken)


def test_the_path_check_sees_a_missing_path(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("see `tests/no_such_test.py`, `tests/test_docs.py::test_gone` and "
                   "[this](no-such.md), but `aws/{a,b}`, `tests/test_docs.py::test_the_path_"
                   "check_sees_a_missing_path` and [ok](x.md) are fine\n")
    assert _broken(doc) == ["x.md: link (no-such.md)", "x.md: path `tests/no_such_test.py`",
                            "x.md: no test `tests/test_docs.py::test_gone`"]



def test_the_tests_map_names_every_test_file() -> None:
    """tests/README.md maps each area to its files: a test file, or its
    folder, is named there (a new file goes into its area's row)."""
    text = (REPO / "tests" / "README.md").read_text()
    named = set(re.findall(r"`(tests/[\w/.]+)`", text))
    files = sorted(_rel(p) for p in (REPO / "tests").rglob("test_*.py")
                   if "__pycache__" not in p.parts)
    missing = [f for f in files
               if f not in named and not any(f.startswith(d) for d in named if d.endswith("/"))]
    assert not missing, "not in tests/README.md's map of areas:\n" + "\n".join(missing)

# -- metrics ----------------------------------------------------------------------------
METRIC = re.compile(r"\bsmr_[a-z0-9_]+\b")
SERIES = ("", "_total", "_bucket", "_sum", "_count")  # a family's series names


def _unknown_metrics(paths: list[Path]) -> list[str]:
    """Every ``smr_*`` name in ``paths`` that smr's registry does not export."""
    exported = {f.name + s for f in metrics.REGISTRY.collect() for s in SERIES}
    return [f"{_rel(p)}: {name}" for p in paths
            for name in sorted(set(METRIC.findall(p.read_text()))) if name not in exported]


def test_every_metric_the_docs_and_alerts_name_is_exported() -> None:
    """A metric that smr does not export is a query that is always empty: an
    alert that never fires, a panel that stays blank, a tuning hint that shows
    nothing. The docs, the alert rules and the dashboard name only real ones."""
    shipped = sorted(p for p in (REPO / "deploy" / "observability").iterdir()
                     if p.suffix in (".yaml", ".json"))
    unknown = _unknown_metrics(DOCS + shipped)
    assert not unknown, "named but not exported by smr/metrics.py:\n" + "\n".join(unknown)


# -- the README's commands ---------------------------------------------------------------

def _shell_commands(doc: Path) -> list[str]:
    """Every `smr …` line of a page's shell blocks."""
    cmds = []
    for block in re.findall(r"^```sh\n(.*?)^```", doc.read_text(), re.S | re.M):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).rstrip(" &")
            if line.startswith("smr "):
                cmds.append(line)
    return cmds


def _inline_commands(doc: Path) -> list[str]:
    text = FENCE.sub("", doc.read_text())
    return [s for s in CODE_SPAN.findall(text) if s.startswith("smr ")]


def test_docs_shell_commands_parse_with_the_cli() -> None:
    """The README's quick start and every page's shell blocks (what moved
    out of the README is checked where it now lives)."""
    assert len(_shell_commands(REPO / "README.md")) >= 10, "the README's quick start is gone"
    cmds = [c for doc in DOCS for c in _shell_commands(doc)]
    p = args.parser()
    bad = []
    for cmd in cmds:
        try:
            p.parse_args(shlex.split(cmd)[1:])
        except SystemExit:
            bad.append(cmd)
    assert not bad, f"the CLI rejects: {bad}"


def test_docs_inline_commands_name_real_subcommands_and_flags() -> None:
    """Inline mentions are fragments (`smr exec --tcp close`), in the README
    and every page: each names a subcommand that exists and only flags that
    subcommand has."""
    subs = next(a for a in args.parser()._actions if a.dest == "command").choices
    top = {o for a in args.parser()._actions for o in a.option_strings}
    bad = []
    assert len(_inline_commands(REPO / "README.md")) >= 5, "the README names no commands"
    spans = [s for doc in DOCS for s in _inline_commands(doc)]
    for span in spans:
        words = shlex.split(span)
        while len(words) > 1 and words[1] in top:  # `smr -v ps`: smr's own flags first
            del words[1]
        sub = subs.get(words[1]) if len(words) > 1 else None
        if sub is None:
            bad.append(span)
            continue
        flags = {o for a in sub._actions for o in a.option_strings}
        bad += [f"{span}: {w}" for w in words[2:] if w.startswith("-") and w != "--"
                and w not in flags]
    assert not bad, f"not what the CLI accepts: {bad}"


def _documented_commands() -> list[list[str]]:
    """Every `smr …` command the docs show: shell-block lines and inline spans."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M):
            out += [shlex.split(re.sub(r"\s+#.*$", "", ln).rstrip(" &"))
                    for ln in block.splitlines() if ln.startswith("smr ")]
        out += [shlex.split(s) for s in CODE_SPAN.findall(FENCE.sub("", text))
                if s.startswith("smr ")]
    return out


def test_every_cli_command_and_option_is_documented() -> None:
    """Each subcommand, and each of its options, appears in a `smr SUB … --option`
    example in README.md, docs/ or schemas/README.md."""
    shown: dict[str, set[str]] = {}
    for words in _documented_commands():
        if len(words) > 1:
            shown.setdefault(words[1], set()).update(words[2:])
    subs = next(a for a in args.parser()._actions if a.dest == "command").choices
    missing = []
    for name, sub in subs.items():
        if name not in shown:
            missing.append(f"smr {name}")
            continue
        for a in sub._actions:
            opts = [o for o in a.option_strings if o not in ("-h", "--help")]
            if opts and not (set(opts) | {o.replace("--", "--no-") for o in opts}) & shown[name]:
                missing.append(f"smr {name} {opts[-1]}")
    assert not missing, f"undocumented: {missing}"


# -- the demo -----------------------------------------------------------------------------

def _shape(line: str) -> str:
    line = re.sub(r"demo-[0-9a-f]{6}", "demo-ID", line)
    line = re.sub(r"log [/…]\S*", "log PATH", line)
    line = re.sub(r"\b[0-9a-f]{8}\b", "HEX", line)
    return re.sub(r"\d+(\.\d+)?", "N", line).rstrip()


# A log line as smrctl.cli's logging formats it.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+ [A-Z]+ ", re.MULTILINE)


def _readme_demo() -> list[str]:
    m = re.search(r"`make demo` prints[^\n]*\n\n```\n(.*?)```", (REPO / "README.md").read_text(),
                  re.S)
    assert m, "the README's demo sample is gone"
    return m.group(1).splitlines()


@pytest.mark.criu
def test_readme_demo_sample_has_the_shape_of_the_real_demo(criu_binary: str,
                                                            tmp_path: Path) -> None:
    env = {**os.environ, "SMR_DATA_DIR": str(tmp_path), "SMR_NATS_URL": "",
           "SMR_NODE_NAME": f"docs{os.getpid()}", "SMR_METRICS_PORT": "0",
           "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "smrctl.cli", "demo", "--mib", "16"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    # What a new user sees is the demo's own narrative: no traceback, no log line.
    assert "Traceback" not in out.stdout + out.stderr, out.stderr
    assert not LOG_LINE.search(out.stdout + out.stderr), \
        f"logged at the default level:\n{out.stderr}"
    stored = re.search(r"stored (\d+\.\d+)s", out.stdout)
    assert stored and float(stored.group(1)) > 0, f"no time to durable storage:\n{out.stdout}"
    real = [_shape(ln) for ln in out.stdout.splitlines()]
    sample = [_shape(ln) for ln in _readme_demo()]
    assert sample == real, "README sample (-) vs `smr demo` (+), numbers aside:\n" + \
        "\n".join(difflib.unified_diff(sample, real, lineterm="", n=0))


# -- the message contract's phases ---------------------------------------------------------

def _names_durations(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "durations") or \
        (isinstance(node, ast.Attribute) and node.attr == "durations")


def phases_in_code() -> dict[str, str]:
    """Every key the code puts into a result's ``durations``: ``durations[K] =``,
    ``durations = {K: …}``, and the keys of the dicts that functions typed
    ``-> dict[str, float]`` build (what ``durations.update`` merges in)."""
    found: dict[str, str] = {}

    def keys_of(d: ast.Dict, where: str) -> None:
        for k in d.keys:
            if isinstance(k, ast.Constant) and isinstance(k.value, str):
                found.setdefault(k.value, where)

    for p in CODE:
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            where = f"{_rel(p)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Subscript) and _names_durations(node.value) \
                    and isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
                found.setdefault(node.slice.value, where)
            elif isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(_names_durations(t) for t in targets):
                    keys_of(node.value, where)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns \
                    and ast.unparse(node.returns) == "dict[str, float]":
                for inner in ast.walk(node):
                    w = f"{_rel(p)}:{getattr(inner, 'lineno', 0)}"
                    if isinstance(inner, ast.Return) and isinstance(inner.value, ast.Dict):
                        keys_of(inner.value, w)
                    elif isinstance(inner, ast.Subscript) and isinstance(inner.ctx, ast.Store) \
                            and isinstance(inner.slice, ast.Constant):
                        found.setdefault(inner.slice.value, w)
    return found


def contract_phases() -> set[str]:
    common = json.loads((REPO / "schemas" / "common.json").read_text())
    return set(common["$defs"]["durations"].get("properties", {}))


def test_the_contract_lists_every_phase_the_code_times() -> None:
    """schemas/common.json's durations, schemas/README.md's list and the phase
    metric's help each name exactly the phases the code sets."""
    code = phases_in_code()
    assert {"dump", "total", "download", "restore", "cuda_checkpoint"} <= set(code), code
    m = re.search(r"`durations` \(seconds per phase: (.*?)\)",
                  (REPO / "schemas" / "README.md").read_text(), re.S)
    assert m, "schemas/README.md no longer lists the phases"
    helped = re.search(r"by phase: ([\w, ]+)", metrics.PHASE._documentation)
    assert helped, "the phase metric's help no longer lists the phases"
    sources = {
        "schemas/common.json": contract_phases(),
        "schemas/README.md": set(re.findall(r"`(\w+)`", m.group(1))),
        "smr_step_phase_seconds' help": set(re.findall(r"\w+", helped.group(1))),
    }
    wrong = []
    for where, listed in sources.items():
        wrong += [f"{where} lacks {k} (set at {code[k]})" for k in sorted(set(code) - listed)]
        wrong += [f"{where} lists {k}, which nothing sets" for k in sorted(listed - set(code))]
    assert not wrong, "\n".join(wrong)
