"""How settings are shown: masked for `smr config` (whose output ends up in
issues and pod logs), and docs/configuration.md, written from the table in
smr/config.py so that the page cannot drift from the code."""

from __future__ import annotations

from typing import Any

from smr.config import ELSEWHERE, PREFIX, SETTINGS, Setting


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def _cell(text: str) -> str:
    """Table-safe: ``|`` would end the cell, ``<x>`` would read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "\\<")


def without_credentials(url: str) -> str:
    """``url`` (or a comma-separated list of them) with any user, password or
    token replaced by ``***``: the embedded NATS's token rides in its URL."""
    shown = []
    for one in url.split(","):
        scheme, sep, rest = one.rpartition("://")
        if "@" in rest:
            rest = "***@" + rest.rsplit("@", 1)[1]
        shown.append(f"{scheme}{sep}{rest}")
    return ",".join(shown)


def shown(setting: Setting, value: Any) -> str:
    """``value`` as it may be printed: secrets masked, URLs without credentials."""
    if setting.secret and value:
        return "***"
    if setting.name == "NATS_URL" and value:
        return without_credentials(str(value))
    return str(value)


def markdown() -> str:
    """docs/configuration.md: ``smr config --markdown`` writes it, and a test
    checks the file is exactly this, so the doc cannot drift from the code."""
    out = [
        "# Configuration",
        "",
        "<!-- Generated from smr/config.py by `smr config --markdown > docs/configuration.md`;",
        "     edit the descriptions there. tests/test_docs.py fails when this file differs. -->",
        "",
        "Every smr program reads its settings from environment variables prefixed `SMR_`, or",
        "from a TOML file named by `SMR_CONFIG` (keys: the names without the prefix, lower-case).",
        "The environment wins over the file, the file over the default. An invalid value stops",
        "the program at start, naming the setting and the fix. `smr config` prints the values",
        "in force.",
        "",
        "## Settings",
        "",
        "| variable | default | meaning |",
        "|---|---|---|",
    ]
    for s in SETTINGS:
        default = _shown(s.default)
        out.append(f"| `{PREFIX}{s.name}` | {f'`{default}`' if default else '(empty)'} "
                   f"| {_cell(s.doc)} |")
    out += [
        "",
        "## Other environment variables",
        "",
        "Read by another program (smr-init and smr-runtime on the node), from a pod's",
        "container, or by a library, rather than as settings of every smr program.",
        "",
        "| variable | read by | meaning |",
        "|---|---|---|",
    ]
    for e in ELSEWHERE:
        out.append(f"| `{e.name}` | {_cell(e.read_by)} | {_cell(e.doc)} |")
    return "\n".join(out) + "\n"
