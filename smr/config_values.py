"""How the text of a setting is read: each parser takes the variable's value
and returns what the program uses, or raises ValueError saying what was
expected (smr/config.py adds the setting's name)."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable


def boolean(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


def pos_int(v: str) -> int:
    n = int(v)
    if n < 1:
        raise ValueError("expected an integer >= 1")
    return n


def count(v: str) -> int:
    n = int(v)
    if n < 0:
        raise ValueError("expected an integer >= 0")
    return n


def replicas(v: str) -> int:
    n = int(v)
    if not 1 <= n <= 5:
        raise ValueError("expected 1 to 5 (JetStream keeps at most 5 replicas)")
    return n


def seconds(v: str) -> float:
    x = float(v)
    if x < 0:
        raise ValueError("expected a number of seconds >= 0")
    return x


def zstd_level(v: str) -> int:
    n = int(v)
    if not 0 <= n <= 22:
        raise ValueError("expected 0 (no compression) to 22")
    return n


def pos_float(v: str) -> float:
    x = float(v)
    if x <= 0:
        raise ValueError("expected a number > 0")
    return x


def label_prefix(v: str) -> str:
    if not re.fullmatch(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?", v):
        raise ValueError("expected a DNS subdomain such as smr.dev")
    return v


def names(v: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in v.split(",") if x.strip())


def pairs(v: str) -> dict[str, str]:
    """``a=b,c=d`` → {"a": "b", "c": "d"}."""
    out = {}
    for item in names(v):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{item!r} is not NAME=VALUE")
        out[key.strip()] = value.strip()
    return out


# The kubelet's quantity suffixes (resource.Quantity), for its eviction thresholds.
_QUANTITY = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def eviction_hard(v: str) -> dict[str, tuple[float, int]]:
    """The kubelet's ``--eviction-hard`` form, ``nodefs.available<10%,
    imagefs.available<2Gi`` → {signal: (fraction of the file system, bytes)},
    one of the two 0. Signals other than file system space are left out."""
    out = {}
    for item in names(v):
        m = re.fullmatch(r"([a-z]+fs\.available)<(?:(\d+(?:\.\d+)?)%|(\d+)([kMGT]i?|)?)", item)
        if not m:
            if re.fullmatch(r"[a-zA-Z.]+<\S+", item) and \
                    not item.split("<")[0].endswith("fs.available"):
                continue  # memory.available, nodefs.inodesFree, pid.available: not space
            raise ValueError(f"{item!r} is not SIGNAL<PERCENT% or SIGNAL<QUANTITY "
                             "(the kubelet's --eviction-hard, e.g. nodefs.available<10%)")
        signal, pct, n, unit = m.groups()
        if pct is not None and not 0 <= float(pct) < 100:
            raise ValueError(f"{item!r}: expected a percentage below 100")
        out[signal] = (float(pct) / 100, 0) if pct is not None else \
            (0.0, int(n) * _QUANTITY[unit or ""])
    return out


def eviction_hard_text(v: str) -> str:
    eviction_hard(v)  # checked at start; kept as written, as the kubelet's flag reads
    return v


def aes_key(v: str) -> str:
    """Empty, or a base64-encoded 32-byte key: checked where every setting
    is, not first by `smr up` after its nats-server has started."""
    if v:
        try:
            key = base64.b64decode(v, validate=True)
        except binascii.Error:
            key = b""
        if len(key) != 32:
            raise ValueError("expected a base64-encoded 32-byte key "
                             "(make one with: head -c 32 /dev/urandom | base64)")
    return v


def choice(*opts: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        if v not in opts:
            raise ValueError(f"expected one of {', '.join(opts)}")
        return v

    return parse
