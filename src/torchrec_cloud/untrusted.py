"""Files someone else may have written, read as input: checked before anything is read or
allocated from them.

A checkpoint, a dataset manifest or a model folder in a bucket may be damaged or crafted by
whoever can write there. Everything we read from one goes through this module (docs/security.md):

- names of files: relative, inside their folder: no absolute path, ``..``, backslash, URL
  scheme, control character, and no separator unless the format has sub-folders
  (:func:`check_name`);
- numbers and strings: of the type and in the range the format allows, with one line naming
  the file and the field otherwise (:class:`Fields`);
- sizes: a whole-file read stops past a cap, or past the size its writer recorded
  (:func:`read_capped`, :func:`read_json`, :func:`read_yaml`), an input line past
  :data:`MAX_LINE_BYTES` is an error (:func:`read_line`), whatever the file claims;
- text shown to a user: control characters escaped (:func:`shown`), so no escape code reaches
  a terminal.

Only JSON and YAML (PyYAML's safe loader, on libyaml where installed: plain data, no tags that
build objects, no key given twice) are parsed here; nothing is unpickled (a checkpoint's ``.metadata``: :mod:`~torchrec_cloud.checkpoint.safe_load`).

Every failure is an :class:`UntrustedInputError` (a ``ValueError`` and a
:class:`~torchrec_cloud.errors.CommandError`) whose text is one line, ``FILE: FIELD: what is
wrong`` (``FILE is ...`` for the file as a whole): ``cli.main`` prints it as it is (exit 1),
or a caller turns it into its own error type (a flag's ``ConfigError``, exit 2). No torch
needed::

    doc = Fields(read_json(url, 1 << 20), url)
    rows = doc.int("rows", hi=MAX_ROWS)
    for i, shard in enumerate(doc.list("shards", 1 << 20)):
        entry = doc.at(f"shards[{i}]", shard)
        path = entry.name("path", parts=2)
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any, Iterator, Optional, Sequence

from torchrec_cloud import storage
from torchrec_cloud.errors import CommandError

MAX_LINE_BYTES = 1 << 20
"""Longest input line read (a Criteo line is a few hundred bytes): a file without newlines
is an error after this many bytes, not a line held in memory whole."""
MAX_INT = 2**53
"""Largest integer a field may hold unless it says otherwise (what JSON keeps exactly)."""
MAX_ROWS = 2**48
"""Largest row count of a file or dataset (a Criteo 1TB day holds about 2^28 rows)."""
MAX_FILE_BYTES = 2**50
"""Largest size a file's record may claim (1 PiB)."""

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class UntrustedInputError(CommandError, ValueError):
    """A file read as input is not what its format allows: ``file``, ``field`` and what is wrong."""

    def __init__(self, file: str, field: str, problem: str) -> None:
        super().__init__(f"{shown(file, 300)}: {field}: {problem}" if field else f"{shown(file, 300)} {problem}")
        self.file, self.field, self.problem = file, field, problem

    def __reduce__(self) -> Any:  # crosses process boundaries (DCP gathers ranks' errors) intact
        return (type(self), (self.file, self.field, self.problem))


def shown(value: Any, limit: int = 80) -> str:
    """``value`` as text safe to print: control characters (escape codes, newlines) escaped,
    at most ``limit`` characters."""
    text = value if isinstance(value, str) else repr(value)
    text = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_name(value: Any, file: str, field: str, parts: int = 1) -> str:
    """``value`` if it is a relative name inside its folder: ``parts`` path components at most,
    separated by ``/``, none empty, ``.`` or ``..``, no backslash, scheme or control character."""
    if not isinstance(value, str) or not value:
        raise UntrustedInputError(file, field, f"must be a file name, got {shown(value)}")
    pieces = value.split("/")
    why = ""
    if value.startswith("/") or os.path.isabs(value):
        why = "an absolute path"
    elif _SCHEME.match(value):
        why = "a URL"
    elif "\\" in value or _CONTROL.search(value):
        why = "a backslash or control character"
    elif any(p in ("", ".", "..") for p in pieces):
        why = "an empty, '.' or '..' component"
    elif len(pieces) > parts:
        why = "a path separator" if parts == 1 else f"more than {parts} path components"
    elif len(value) > 255 * parts:
        why = "too long"
    if why:
        raise UntrustedInputError(file, field, f"{shown(value)} is not a name inside its folder ({why})")
    return value


def integer(value: Any, file: str, field: str, lo: int = 0, hi: int = MAX_INT) -> int:
    """``value`` if it is an integer (not a bool, not a float) in ``[lo, hi]``."""
    if type(value) is not int or not lo <= value <= hi:
        raise UntrustedInputError(file, field, f"must be an integer in {lo}..{hi}, got {shown(value)}")
    return value


def number(value: Any, file: str, field: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    """``value`` if it is a finite number (int or float, not a bool) in ``[lo, hi]``."""
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise UntrustedInputError(file, field, f"must be a finite number in [{lo}, {hi}], got {shown(value)}")
    return float(value)


def text(value: Any, file: str, field: str, max_len: int = 256, choices: Optional[Sequence[str]] = None) -> str:
    """``value`` if it is a string of printable characters, at most ``max_len`` of them (one
    of ``choices`` when given)."""
    if not isinstance(value, str) or len(value) > max_len or _CONTROL.search(value):
        raise UntrustedInputError(file, field, f"must be printable text of at most {max_len} characters, "
                                  f"got {shown(value)}")  # fmt: skip
    if choices is not None and value not in choices:
        raise UntrustedInputError(file, field, f"must be one of {', '.join(map(repr, choices))}, got {shown(value)}")
    return value


_MISSING = object()


class Fields:
    """Typed reads of one JSON object from a file: each names ``file`` and the field's path
    when the value is missing or not what the format allows."""

    def __init__(self, data: Any, file: str, path: str = "") -> None:
        if not isinstance(data, dict):
            raise UntrustedInputError(file, path, f"must be an object (names and values), got {shown(type(data).__name__)}")
        self.data, self.file, self.path = data, file, path

    def field(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, optional: bool = False) -> Any:
        """The raw value (None when absent and ``optional``)."""
        value = self.data.get(key, _MISSING)
        if value is _MISSING or (value is None and optional):
            if optional:
                return None
            raise UntrustedInputError(self.file, self.field(key), "is missing")
        return value

    def int(self, key: str, lo: int = 0, hi: int = MAX_INT, optional: bool = False) -> Optional[int]:
        value = self.get(key, optional)
        return None if value is None else integer(value, self.file, self.field(key), lo, hi)

    def number(self, key: str, lo: float = -math.inf, hi: float = math.inf, optional: bool = False) -> Optional[float]:
        value = self.get(key, optional)
        return None if value is None else number(value, self.file, self.field(key), lo, hi)

    def text(self, key: str, max_len: int = 256, choices: Optional[Sequence[str]] = None,
             optional: bool = False) -> Optional[str]:  # fmt: skip
        value = self.get(key, optional)
        return None if value is None else text(value, self.file, self.field(key), max_len, choices)

    def bool(self, key: str, optional: bool = False) -> Optional[bool]:
        value = self.get(key, optional)
        if value is not None and type(value) is not bool:
            raise UntrustedInputError(self.file, self.field(key), f"must be true or false, got {shown(value)}")
        return value

    def name(self, key: str, parts: int = 1, optional: bool = False) -> Optional[str]:
        value = self.get(key, optional)
        return None if value is None else check_name(value, self.file, self.field(key), parts)

    def list(self, key: str, max_items: int, optional: bool = False) -> Optional[list]:
        value = self.get(key, optional)
        if value is None:
            return None
        if not isinstance(value, list) or len(value) > max_items:
            raise UntrustedInputError(self.file, self.field(key), f"must be a list of at most {max_items} items, "
                                      f"got {shown(type(value).__name__)} of {_length(value)}")  # fmt: skip
        return value

    def ints(self, key: str, max_items: int, lo: int = 0, hi: int = MAX_INT, optional: bool = False) -> Optional[list[int]]:
        values = self.list(key, max_items, optional)
        if values is None:
            return None
        return [integer(v, self.file, f"{self.field(key)}[{i}]", lo, hi) for i, v in enumerate(values)]

    def obj(self, key: str, optional: bool = False) -> Optional["Fields"]:
        """The nested object ``key`` as Fields."""
        value = self.get(key, optional)
        return None if value is None else Fields(value, self.file, self.field(key))

    def mapping(self, key: str, max_items: int, optional: bool = False) -> Optional[dict]:
        """The nested object ``key`` as a plain dict of at most ``max_items`` entries."""
        value = self.get(key, optional)
        if value is None:
            return None
        if not isinstance(value, dict) or len(value) > max_items:
            raise UntrustedInputError(self.file, self.field(key), f"must be an object of at most {max_items} entries, "
                                      f"got {shown(type(value).__name__)} of {_length(value)}")  # fmt: skip
        return value

    def at(self, key: str, value: Any) -> "Fields":
        """``value`` (an item of one of this object's lists or maps) as Fields named ``key``."""
        return Fields(value, self.file, self.field(key))


def _length(value: Any) -> str:
    return f"{len(value)} items" if isinstance(value, (list, dict, str)) else "no length"


def read_capped(path: str, limit: int, expected: Optional[int] = None) -> bytes:
    """A whole file (local or URL), or an :class:`UntrustedInputError` when it holds more than
    ``limit`` bytes, or other than the ``expected`` bytes its writer recorded: no more than
    ``min(limit, expected) + 1`` bytes are ever read, whatever its size says (``/dev/zero``
    says 0)."""
    cap = limit if expected is None else min(limit, expected)
    data = storage.read_bytes(path, start=0, end=cap + 1)
    if expected is not None and len(data) != expected:
        got = f"more than {cap}" if len(data) > cap else str(len(data))
        raise UntrustedInputError(path, "", f"holds {got} bytes, its record says {expected} (altered or truncated)")
    if len(data) > limit:
        raise UntrustedInputError(path, "", f"holds more than {limit} bytes")
    return data


def read_json(path: str, limit: int, expected: Optional[int] = None) -> Any:
    """The JSON value of a whole file of at most ``limit`` bytes (``expected``: see
    :func:`read_capped`); not JSON is an error."""
    return parse_json(read_capped(path, limit, expected), path)


def parse_json(data: bytes, file: str) -> Any:
    """``data`` (the bytes of ``file``, already read under a cap) as JSON."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise UntrustedInputError(file, "", f"is not valid JSON ({shown(str(e), 120)})") from None


def read_yaml(path: str, limit: int) -> Any:
    """The YAML (or JSON) document of a whole UTF-8 file of at most ``limit`` bytes, as plain
    data (:func:`parse_yaml`)."""
    try:
        text = read_capped(path, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise UntrustedInputError(path, "", "is not UTF-8 text") from None
    return parse_yaml(text, path)


def parse_yaml(text: str, file: str) -> Any:
    """``text`` as plain data: mappings, lists, strings, numbers, booleans and null (no tag
    builds an object; a date stays its text, as written), through libyaml's C parser where
    PyYAML has it (the pure-Python one is tens of times slower on a large file). A key given
    twice in one mapping is an error (YAML keeps the last one silently, so a second
    ``label:`` would win); so is anything that is not YAML, naming ``file``."""
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeConstructor subclass
    except yaml.MarkedYAMLError as e:
        where = f" at line {e.problem_mark.line + 1}" if e.problem_mark is not None else ""
        raise UntrustedInputError(file, "", f"is not valid YAML{where} ({shown(' '.join(str(e.problem or e).split()), 160)})") from None
    except (yaml.YAMLError, RecursionError) as e:
        raise UntrustedInputError(file, "", f"is not valid YAML ({shown(' '.join(str(e).split()), 160)})") from None
    except (ValueError, TypeError, KeyError, OverflowError) as e:  # a tagged value that does not convert (!!int of 5,000 digits, !!bool x)
        raise UntrustedInputError(file, "", f"holds a value its tag or type cannot convert ({shown(' '.join(str(e).split()), 160)})") from None


_LOADER: Any = None


def _yaml_loader() -> Any:
    """The safe loader on libyaml's parser when installed (``yaml.CSafeLoader``), else the
    pure one, with implicit timestamps kept as text and duplicate keys refused."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Loader(base):  # type: ignore[misc, valid-type]
        yaml_implicit_resolvers = {
            first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
            for first, resolvers in base.yaml_implicit_resolvers.items()
        }

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        duplicate = key in seen
                        seen.add(key)
                    except TypeError:  # an unhashable key: the base class names it
                        continue
                    if duplicate:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"the key {shown(key)} is given twice in one mapping", key_node.start_mark)
            return super().construct_mapping(node, deep)

    Loader.yaml_constructors = dict(base.yaml_constructors)
    _LOADER = Loader
    return Loader


def yaml_parser() -> str:
    """``libyaml`` or ``python``: which parser :func:`parse_yaml` uses here."""
    import yaml

    c_parser = getattr(getattr(yaml, "cyaml", None), "CParser", None)
    return "libyaml" if c_parser is not None and issubclass(_yaml_loader(), c_parser) else "python"


def read_line(stream: Any, limit: int = MAX_LINE_BYTES, where: str = "") -> bytes:
    """The rest of the current line of a seekable binary stream (a local file, or fsspec's,
    whose ``readline`` takes no size), reading at most ``limit + 1`` bytes: a longer line is
    an :class:`UntrustedInputError` (``where`` names the file). The stream is left just after
    the line's newline."""
    start = stream.tell()
    parts: list[bytes] = []
    got = 0
    while got <= limit:
        piece = stream.read(min(64 << 10, limit + 1 - got))
        if not piece:
            break
        cut = piece.find(b"\n")
        if cut >= 0:
            parts.append(piece[: cut + 1])
            stream.seek(start + got + cut + 1)
            return b"".join(parts)
        parts.append(piece)
        got += len(piece)
    if got > limit:
        raise UntrustedInputError(where, "", f"has a line longer than {limit} bytes (no newline): not a text "
                                  "file of this format")  # fmt: skip
    return b"".join(parts)


def capped_lines(stream: Any, limit: int = MAX_LINE_BYTES) -> Iterator[Optional[bytes]]:
    """The lines of a binary stream, each at most ``limit`` bytes: a longer one is yielded as
    None (and skipped to its end, reading in bounded pieces), for readers that pass over it."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while True:
                rest = stream.readline(limit + 1)
                if not rest or rest.endswith(b"\n"):
                    break
            yield None
            continue
        yield line


def local_member(folder: str, name: str, file: str, field: str) -> None:
    """For a local folder: ``folder/name`` is a regular file inside ``folder`` (a symbolic link
    that leads out of it, a device such as ``/dev/zero``, or a pipe is an error). URLs have
    neither links nor devices: nothing to check."""
    if storage.is_url(folder):
        return
    target = os.path.join(folder, name)
    try:
        info = os.stat(target)
    except OSError:
        return  # missing: the caller says so in its own terms
    if not stat.S_ISREG(info.st_mode):
        raise UntrustedInputError(file, field, f"{shown(name)} is not a regular file")
    root = os.path.realpath(folder)
    if os.path.commonpath([root, os.path.realpath(target)]) != root:
        raise UntrustedInputError(file, field, f"{shown(name)} leads out of its folder")
