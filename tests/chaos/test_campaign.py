"""The short fault campaign in `make test`: every fault kind once (two rounds),
over the real stack (tests/chaos/campaign.py). The full run is
`python -m tests.chaos --cycles 200`; its table is in bench/results/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.campaign import FAULT_KINDS, run

pytestmark = pytest.mark.criu


async def test_short_campaign_loses_corrupts_and_doubles_nothing(criu_binary: str,
                                                                 tmp_path: Path) -> None:
    report = await run(2 * len(FAULT_KINDS), seed=11, criu=criu_binary, workloads=2,
                       root=tmp_path / "chaos", each_fault=True)
    print("\n" + report.table())
    assert {k: report.faults[k] for k in FAULT_KINDS} == {k: 2 for k in FAULT_KINDS}
    assert sum(report.s3_injected.values()) > 0, "the S3 faults hit nothing"
    for below_the_retries in ("part-fail", "lost-answer", "down"):
        assert report.s3_injected[below_the_retries] > 0, f"{below_the_retries} hit nothing"
    assert report.faults["kill-after-manifest (fired)"] > 0, "no node was killed there"
    assert report.faults["kill-gpu-suspended (fired)"] > 0, "no node was killed there"
    assert report.restores_checked > 0 and report.generations_verified > 0
    assert (report.lost, report.corrupt, report.double_running, report.stuck,
            report.orphans, report.kv_disagreements, report.crashes, report.latest_behind,
            report.dumps_left, report.left_stopped, report.gpu_suspended) == (0,) * 11, \
        report.problems
    assert report.problems == []
