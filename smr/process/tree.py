"""A process tree as /proc lists it: a process and its descendants."""

from __future__ import annotations

from pathlib import Path


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants, from /proc's children lists."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:  # a process that exits meanwhile takes its task directory along
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                pass
    return sorted(set(out))
