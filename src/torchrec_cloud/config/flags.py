"""The command-line flags made from the config tree: one flag per leaf field of
:class:`JobConfig`, of the same snake_case name, its help the field's docstring and its
default the preset's; and :class:`FlagParser`, the house's ArgumentParser."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import types
import typing
from typing import Any, Callable, Iterable, Literal, Optional

from torchrec_cloud.config.presets import PRESETS
from torchrec_cloud.config.sections import SECTIONS, JobConfig

def flag_key(option: str) -> str:
    """``--batch-size``, ``--batch_size`` -> ``--batch_size``: the spelling-blind key of a flag."""
    return option[:2] + option[2:].replace("-", "_") if option.startswith("--") else option


class FlagParser(argparse.ArgumentParser):
    """The house's ArgumentParser: no abbreviations (``--batch`` is not ``--batch_size``),
    every long flag accepted with ``_`` or ``-`` between its words (help shows the spelling
    it was added with), and defaults in ``--help``. Words after a lone ``--`` are left alone:
    they belong to another parser."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs["formatter_class"] = _with_defaults(kwargs.get("formatter_class", argparse.HelpFormatter))
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(respelled(args, self._option_string_actions), namespace)


def respelled(args: list[str], options: Iterable[str]) -> list[str]:
    """``args`` with each ``--flag`` (or ``--flag=value``) written as the one of ``options``
    it names with ``_`` or ``-``; other words, and everything after a lone ``--``, as given."""
    known = {flag_key(o): o for o in options}
    out = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        if arg.startswith("--") and arg not in known.values():
            name, eq, value = arg.partition("=")
            arg = known.get(flag_key(name), name) + eq + value
        out.append(arg)
    return out


def _with_defaults(formatter: type) -> type:
    """``formatter`` that appends ``(default: X)`` to a flag's help when it has a default
    worth saying (not None, not a switch's False) and the help does not say it already."""

    class WithDefaults(formatter):  # type: ignore[misc, valid-type]
        def _get_help_string(self, action: argparse.Action) -> str:
            text = action.help or ""
            default = action.default
            if (
                "default" in text.lower()
                or not action.option_strings
                or default in (None, False, argparse.SUPPRESS)
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))
            ):
                return text
            return f"{text} (default: %(default)s)"

    return WithDefaults


@functools.lru_cache(maxsize=None)  # a class's source is read and parsed once, not per parser built
def _field_docs(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal after each field) of a dataclass."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", ",").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _str_list(text: str) -> list[str]:
    return [x for x in text.replace(" ", ",").split(",") if x]


def flag_kwargs(tp: Any) -> dict[str, Any]:
    """argparse keywords for a dataclass field of type ``tp`` (``Optional`` unwrapped):
    bools get --x/--no-x, Literals choices, ``list[int]`` comma or space separated ints."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"choices": list(args)}
    if origin is list and args == (str,):
        return {"type": _str_list, "metavar": "A,B,..."}
    if origin is list:
        return {"type": _int_list, "nargs": "+", "metavar": "N,N,..."}
    return {"type": tp}


def add_config_flags(parser: argparse.ArgumentParser, shown: Optional[Callable[[str, str], bool]] = None) -> None:
    """Add ``--preset`` and one flag per leaf of :class:`JobConfig` (defaults: the preset's).
    With ``shown``, ``--help`` lists only the flags for which ``shown(section, field)`` is
    true; every flag is still accepted."""
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="quickstart",
        help="base configuration that the other flags override (default: quickstart)",
    )
    hints_by_section = {s: typing.get_type_hints(typing.get_type_hints(JobConfig)[s]) for s in SECTIONS}
    presets = {name: make() for name, make in PRESETS.items()}
    for section in SECTIONS:
        cls = typing.get_type_hints(JobConfig)[section]
        docs = _field_docs(cls)
        listed = shown is None or any(shown(section, f.name) for f in dataclasses.fields(cls))
        group = parser.add_argument_group(section, cls.__doc__) if listed else parser
        for f in dataclasses.fields(cls):
            tp = hints_by_section[section][f.name]
            values = {name: getattr(getattr(cfg, section), f.name) for name, cfg in presets.items()}
            text = f"{docs.get(f.name, '')} {_preset_defaults(values)}".replace("%", "%%")
            if shown is not None and not shown(section, f.name):
                text = argparse.SUPPRESS
            kwargs = {"default": argparse.SUPPRESS, "help": text, **flag_kwargs(tp)}
            group.add_argument(f"--{f.name}", **kwargs)


def _preset_defaults(values: dict[str, Any]) -> str:
    """``(default: 8192; criteo-1tb, mlperf-dcnv2: 2048)``: the quickstart preset's value,
    then the other presets' where they differ (long lists shortened)."""

    def show(v: Any) -> str:
        if isinstance(v, list):
            text = ",".join(str(x) for x in v)
            return text if len(text) <= 24 else f"{len(v)} values: {text[:20]}..."
        return "unset" if v is None else str(v)

    base = values["quickstart"]
    others: dict[str, list[str]] = {}
    for name, v in values.items():
        if name != "quickstart" and v != base:
            others.setdefault(show(v), []).append(name)
    parts = [f"default: {show(base)}"] + [f"{', '.join(names)}: {v}" for v, names in others.items()]
    return f"({'; '.join(parts)})"


def config_from_args(ns: argparse.Namespace) -> JobConfig:
    """Build the preset named by ``ns.preset`` and apply the flags present in ``ns``."""
    base = PRESETS[ns.preset]()
    given = vars(ns)
    sections = {}
    for section in SECTIONS:
        current = getattr(base, section)
        overrides = {}
        for f in dataclasses.fields(current):
            if f.name in given:
                value = given[f.name]
                if isinstance(value, list) and value and isinstance(value[0], list):
                    value = [x for part in value for x in part]  # nargs="+" of comma lists
                overrides[f.name] = value
        if section == "model" and "embedding_dim" in overrides and "dense_arch_layer_sizes" not in overrides:
            # The bottom MLP ends at the embedding width: the seeds' `--embedding_dim 256`
            # alone widens its last layer rather than failing.
            overrides["dense_arch_layer_sizes"] = [*current.dense_arch_layer_sizes[:-1], overrides["embedding_dim"]]
        sections[section] = dataclasses.replace(current, **overrides)
    return dataclasses.replace(base, **sections)


def parse_job_config(argv: list[str]) -> JobConfig:
    """Parse training flags (no sub-command) into a :class:`JobConfig`; for tests and tools."""
    parser = FlagParser(prog="torchrec-cloud train")
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv))
