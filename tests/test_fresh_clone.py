"""A newcomer's first commands on a fresh clone, as README.md gives them:
`make demo`, and every line of the README's one-machine section in order.
Each must succeed and print no traceback and no log line at the default level.

What is fresh: a `git clone` of this checkout's HEAD (what is committed, as a
newcomer gets it), its Makefile, its C parts built by its `make setup`, and
its Python code (the shared virtualenv is installed editable from another
checkout: PYTHONPATH points it at the clone's code). What is reused, as the
suite can afford: the virtualenv and the tools `make setup` downloads (CRIU,
nats-server; `.tools/`), linked, their make steps taken as done (`make -o`).
The data directory is the test's own (the default one is the machine's user's)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The steps of `make setup` reused rather than run again (they download and install).
REUSED = ("-o", ".venv/.smr-installed", "-o", ".tools/.installed-v3")
# What `make setup` builds from the clone's own sources (the Makefile's gcc lines).
BUILT = {"bin": {"smr-init", "smr-runtime"}, "lib": {"criu-limits.so", "criu-root.so"}}
# A log line as smrctl.cli's logging formats it.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+ [A-Z]+ ", re.MULTILINE)


def _link_tools(tools: Path, into: Path) -> None:
    """The downloaded tools linked; what the Makefile builds left to it."""
    into.mkdir()
    for entry in tools.iterdir():
        if entry.name in BUILT:
            (into / entry.name).mkdir()
            for f in entry.iterdir():
                if f.name not in BUILT[entry.name]:
                    (into / entry.name / f.name).symlink_to(f)
        else:
            (into / entry.name).symlink_to(entry)


@pytest.fixture
def clone(tmp_path: Path, criu_binary: str) -> Path:
    where = tmp_path / "smr"
    subprocess.run(["git", "clone", "-q", str(REPO), str(where)], check=True, timeout=300)
    (where / ".venv").symlink_to((REPO / ".venv").resolve())
    _link_tools((REPO / ".tools").resolve(), where / ".tools")
    return where


@pytest.fixture
def env(tmp_path: Path, clone: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMR_")}
    # A node name of its own: the host paths a node keeps under /run are by name.
    env.update({"PYTHONPATH": str(clone), "SMR_DATA_DIR": str(tmp_path / "data"),
                "SMR_METRICS_PORT": "0", "SMR_NODE_NAME": f"newcomer-{uuid.uuid4().hex[:8]}"})
    return env


def _clean(what: str, said: str) -> None:
    assert "Traceback" not in said, f"{what}:\n{said}"
    assert not LOG_LINE.search(said), f"{what} logged at the default level:\n{said}"


def _runs_the_clones_code(clone: Path, env: dict[str, str]) -> None:
    where = subprocess.run(
        ["bash", "-c", ". .venv/bin/activate && python -c 'import smrctl; print(smrctl.__file__)'"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert where.stdout.startswith(str(clone)), where.stdout


@pytest.mark.criu
def test_make_demo_on_a_fresh_clone_passes_quietly_with_its_tools_built(
        clone: Path, env: dict[str, str]) -> None:
    _runs_the_clones_code(clone, env)
    r = subprocess.run(["make", *REUSED, "demo"], cwd=clone, env=env, capture_output=True,
                       text=True, timeout=600, stdin=subprocess.DEVNULL)
    said = r.stdout + r.stderr
    assert r.returncode == 0, f"`make demo` exited {r.returncode}:\n{said}"
    _clean("`make demo`", said)
    assert "demo passed" in r.stdout, said
    for kind, names in BUILT.items():
        for name in names:
            assert not (clone / ".tools" / kind / name).is_symlink(), f"{name} was not built"


def one_machine_commands(readme: str) -> list[str]:
    """The README's one-machine block: the ```sh block that starts `smr up &`,
    found by that command wherever the section sits and whatever its heading."""
    blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)
    found = [b for b in blocks if re.search(r"^smr up &", b, re.M)]
    assert len(found) == 1, f"README.md has {len(found)} sh blocks that start `smr up &`"
    return [ln for ln in found[0].splitlines() if ln.strip() and not ln.startswith("#")]


# The section's programs, which a checkout has not: a job that counts, in little memory.
STAND_IN = ("import runpy, sys\nsys.argv[1:] = ['--mib', '16']\n"
            "runpy.run_module('smrctl.demo_counter', run_name='__main__')\n")


def _has_gpu() -> bool:
    return subprocess.run(["sh", "-c", "nvidia-smi -L"], capture_output=True).returncode == 0


@pytest.mark.criu
def test_the_readme_one_machine_section_runs_as_written_on_a_fresh_clone(
        clone: Path, env: dict[str, str], tmp_path: Path) -> None:
    """Each line run by bash in the clone's root, in order, after the lines
    before it that set the shell up (`. .venv/bin/activate`); the line that
    ends in `&` is started and left running, as the shell would."""
    setup = subprocess.run(["make", *REUSED, "setup"], cwd=clone, env=env, capture_output=True,
                           text=True, timeout=600)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    _runs_the_clones_code(clone, env)
    for name in ("train.py", "serve.py"):
        (clone / name).write_text(STAND_IN)
    jobs: list[str] = []
    shell: list[str] = []  # the lines that set the shell up, run before each command
    up: subprocess.Popen[bytes] | None = None
    up_out = tmp_path / "up.out"
    gpu = _has_gpu()
    try:
        for line in one_machine_commands((clone / "README.md").read_text()):
            argv = shlex.split(line, comments=True)
            if argv[0] in (".", "source", "export", "cd"):
                shell.append(line)
                continue
            if "--gpu" in argv and not gpu:
                continue  # a CUDA job needs a GPU (tests/test_gpu.py runs them where one is)
            if argv[-1] == "&":
                # Its own output apart, as the README advises: `smr up` logs what it does.
                started = "exec " + shlex.join(argv[:-1])  # the `&` is this Popen
                with open(up_out, "wb") as out:
                    up = subprocess.Popen(["bash", "-c", "\n".join([*shell, started])], cwd=clone,
                                          env=env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
                continue
            if argv[:2] == ["smr", "exec"]:
                jobs.append(argv[argv.index("-i") + 1])
            if "--as" in argv:
                jobs.append(argv[argv.index("--as") + 1])
            r = subprocess.run(["bash", "-c", "\n".join([*shell, line])], cwd=clone, env=env,
                               capture_output=True, text=True, timeout=300,
                               stdin=subprocess.DEVNULL)
            said = r.stdout + r.stderr
            assert r.returncode == 0, f"`{line}` exited {r.returncode}:\n{said}"
            _clean(f"`{line}`", said)
        assert up is not None, "the section starts no `smr up &`"
    except BaseException:
        # What `smr up` and the jobs said, for the failure's report (pytest shows it).
        for log in [up_out, *sorted((tmp_path / "data" / "logs").glob("*.log"))]:
            if log.is_file():
                print(f"--- {log.name}:\n{log.read_text(errors='replace')[-4000:]}")
        raise
    finally:
        # Every job recorded (a restore records its own), before `smr up` stops: a kill needs it.
        ps = subprocess.run(["bash", "-c", "\n".join([*shell, "smr ps"])], cwd=clone, env=env,
                            capture_output=True, text=True, timeout=120)
        for job in {*jobs, *(ln.split()[0] for ln in ps.stdout.splitlines()[1:] if ln.strip())}:
            subprocess.run(["bash", "-c", "\n".join([*shell, f"smr kill {shlex.quote(job)}"])],
                           cwd=clone, env=env, capture_output=True, timeout=120)
        if up is not None:
            os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
    text = up_out.read_text(errors="replace")
    assert up.returncode == 0, f"`smr up` exited {up.returncode}:\n{text}"
    assert "Traceback" not in text and not re.search(r" (ERROR|CRITICAL) ", text), text
