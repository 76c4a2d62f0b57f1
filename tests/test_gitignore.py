"""What git leaves out of a commit: the checkout's virtualenv and downloaded
tools, whether a directory or a link to another checkout's (a worktree links
the shared virtualenv, tests/README.md). A link committed by mistake is not
just noise: checking the commit out where the real directory is replaces
that directory with the link (git treats ignored files as its to replace),
and the environment every checkout shares is gone."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LOCAL = (".venv", ".tools")  # made by `make setup` in each checkout, never committed


@pytest.mark.parametrize("name", LOCAL)
@pytest.mark.parametrize("kind", ["directory", "link"])
def test_a_checkouts_own_environment_is_never_committed(tmp_path: Path, name: str,
                                                       kind: str) -> None:
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    shutil.copy(REPO / ".gitignore", repo / ".gitignore")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if kind == "directory":
        (repo / name).mkdir()
        (repo / name / "marker").write_text("x")
    else:
        (repo / name).symlink_to(elsewhere)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    staged = subprocess.run(["git", "-C", str(repo), "diff", "--cached", "--name-only"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert not [p for p in staged if p == name or p.startswith(name + "/")], (
        f"`git add -A` stages the {kind} {name}: .gitignore must leave it out whether it "
        f"is a directory or a link (got {staged})")
