"""What each test costs in CPU, to find where `make test`'s time goes.

Off unless SMR_TEST_CPU_LOG names a file. Then each test appends one line
to it: its node id, its wall seconds, the whole machine's busy CPU seconds
over the test (every process: the agents, CRIU, containerd, nats-server,
moto that it starts), and this pytest process's own. With `make test`'s
default of one process the machine's count is the test's own cost; with
workers it also holds what the others ran meanwhile. At the end the file's
costliest tests are printed, summed by file as well.

    SMR_TEST_CPU_LOG=/tmp/cpu.tsv make test
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

ENV = "SMR_TEST_CPU_LOG"
_TICK = os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    # /proc/stat's first line: user nice system idle iowait irq softirq steal...
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(f) for f in fields]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / _TICK


def _own_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


class CpuCost:
    def __init__(self, path: Path) -> None:
        self.path = path

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        wall, busy, own = time.monotonic(), _machine_busy_s(), _own_s()
        yield
        line = (f"{item.nodeid}\t{time.monotonic() - wall:.2f}\t"
                f"{_machine_busy_s() - busy:.2f}\t{_own_s() - own:.2f}\n")
        with self.path.open("a") as f:
            f.write(line)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        rows = read(self.path)
        if not rows:
            return
        by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        for nodeid, wall, busy, _own in rows:
            f = by_file[nodeid.split("::", 1)[0]]
            f[0] += wall
            f[1] += busy
            f[2] += 1
        write = terminalreporter.write_line
        terminalreporter.section(f"CPU by file (from {self.path})")
        write(f"{'wall s':>8} {'busy s':>8} {'tests':>5}  file")
        for name, (wall, busy, n) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:25]:
            write(f"{wall:8.1f} {busy:8.1f} {n:5d}  {name}")
        write(f"{sum(r[1] for r in rows):8.1f} {sum(r[2] for r in rows):8.1f} "
              f"{len(rows):5d}  all")


def read(path: Path) -> list[tuple[str, float, float, float]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            nodeid, wall, busy, own = line.split("\t")
            rows.append((nodeid, float(wall), float(busy), float(own)))
    return rows


def register(config: pytest.Config) -> None:
    if path := os.environ.get(ENV):
        config.pluginmanager.register(CpuCost(Path(path)), "smr-cpucost")
