"""Checks for what we read back from a folder or a bucket: a dataset's manifest, schema and
vocabularies, a model folder's config. Such files may be damaged or crafted, so each value
is checked for its type and range before it is used, a file name may only name a file in
its own folder, and a whole file is read only after its size is known to be bounded::

    manifest = trust.load_json(url, trust.MAX_MANIFEST_BYTES)
    rows = trust.integer(manifest.get("rows"), url, "rows", hi=trust.MAX_ROWS)
    path = trust.name(entry.get("path"), url, "shards[3].path", folders=("shards",))

A violation is a :class:`TrustError`: one line naming the file and the field. Only JSON and
YAML (``yaml.safe_load``) are parsed here; nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable, Optional

from torchrec_cloud import storage
from torchrec_cloud.errors import CommandError

MAX_MANIFEST_BYTES = 64 << 20
"""A manifest, a model config, a schema: small files, read whole."""
MAX_VOCAB_BYTES = 2 << 30
"""One vocabulary file (its size is also recorded in the manifest and checked first)."""
MAX_ROWS = 1 << 44
"""Rows a dataset or a shard may claim: far above any real one, far below int64's end."""

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,199}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class TrustError(CommandError, ValueError):
    """A file read back breaks its format; the message names the file and the field."""

    def __init__(self, where: str, field: str, problem: str) -> None:
        super().__init__(f"{where}: {field}: {problem}" if field else f"{where} {problem}")
        self.where, self.field, self.problem = where, field, problem

    def __reduce__(self) -> Any:  # crosses process boundaries intact
        return (TrustError, (self.where, self.field, self.problem))


def shown(value: Any, limit: int = 80) -> str:
    """``value`` as safe to print: control characters (terminal escapes) escaped, cut short."""
    text = value if isinstance(value, str) else repr(value)
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_capped(url: str, limit: int, expected: Optional[int] = None) -> bytes:
    """The whole file at ``url``, once its size is known to be at most ``limit`` bytes (and
    ``expected`` bytes, where the writer recorded it)."""
    size = storage.size(url)
    if expected is not None and size != expected:
        raise TrustError(url, "", f"has {size} bytes, its record says {expected} (altered or truncated)")
    if size > limit:
        raise TrustError(url, "", f"is {size} bytes, more than the {limit} this file may have")
    data = storage.read_bytes(url)
    if len(data) != size:  # it changed under us, or a special file that lies about its size
        raise TrustError(url, "", f"gave {len(data)} bytes where its size said {size}")
    return data


def load_json(url: str, limit: int = MAX_MANIFEST_BYTES, expected: Optional[int] = None) -> Any:
    """A JSON file, size-capped, parsed (never unpickled)."""
    data = read_capped(url, limit, expected)
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise TrustError(url, "", f"is not valid JSON ({shown(str(e), 120)})") from None


def parse_yaml(text: str, where: str) -> Any:
    """YAML through ``yaml.safe_load`` (plain data only: no tags that build objects)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TrustError(where, "", f"is not valid YAML ({shown(' '.join(str(e).split()), 160)})") from None


def mapping(value: Any, where: str, field: str) -> dict:
    if not isinstance(value, dict):
        raise TrustError(where, field, f"must be a mapping, got {type(value).__name__}")
    return value


def sequence(value: Any, where: str, field: str, max_len: int = 1 << 24) -> list:
    if not isinstance(value, list):
        raise TrustError(where, field, f"must be a list, got {type(value).__name__}")
    if len(value) > max_len:
        raise TrustError(where, field, f"has {len(value)} entries, more than {max_len}")
    return value


def integer(value: Any, where: str, field: str, lo: int = 0, hi: int = MAX_ROWS) -> int:
    """An integer in ``[lo, hi]`` (a bool or a float is not one)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TrustError(where, field, f"must be an integer, got {shown(value)}")
    if not lo <= value <= hi:
        raise TrustError(where, field, f"must be in {lo}..{hi}, got {value}")
    return value


def number(value: Any, where: str, field: str) -> float:
    """A finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TrustError(where, field, f"must be a finite number, got {shown(value)}")
    return float(value)


def text(value: Any, where: str, field: str, max_len: int = 200) -> str:
    """A short string without control characters."""
    if not isinstance(value, str):
        raise TrustError(where, field, f"must be a string, got {shown(value)}")
    if len(value) > max_len or _CONTROL.search(value):
        raise TrustError(where, field, f"must be at most {max_len} printable characters, got {shown(value)}")
    return value


def choice(value: Any, where: str, field: str, allowed: Iterable[str]) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise TrustError(where, field, f"must be one of {', '.join(allowed)}, got {shown(value)}")
    return value


def name(value: Any, where: str, field: str, folders: Iterable[str] = ()) -> str:
    """A file name relative to its folder: one plain name, or ``FOLDER/NAME`` with FOLDER one of
    ``folders``. No absolute path, no ``..``, no other separator, no URL scheme."""
    if not isinstance(value, str):
        raise TrustError(where, field, f"must be a file name, got {shown(value)}")
    parts = value.split("/")
    folder_ok = len(parts) == 1 or (len(parts) == 2 and parts[0] in tuple(folders))
    if not folder_ok or not _NAME.match(parts[-1]) or "\\" in value or ":" in value or parts[-1] in (".", ".."):
        inside = f" or {'|'.join(folders)}/NAME" if folders else ""
        raise TrustError(where, field, f"must name a file in its folder (NAME{inside}), got {shown(value)}")
    return value
