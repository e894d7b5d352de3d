"""Every command our docs and help texts show, found and checked against the real parsers.

Used by ``tests/test_doc_examples.py``. What is found (:func:`examples`):

- in Markdown (README.md, docs/*.md, the cloud and quickstart READMEs): every line of a
  ```bash / ```sh / ```shell block, ``$ ``-prompted lines of a plain ``` block, and inline
  code spans that start with a program we check (``torchrec-cloud ...``, ``torchrun ...``,
  ``python ...``, ``bash ...``, ``make ...``, ``pip install ...``, ``docker ...``,
  ``kubectl apply ...``);
- in the ``--help`` of every sub-command (description and epilog) and in the headers of the
  scripts we ship (the cloud scripts' docstrings, ``train_dlrm_*.sh``'s comments, the
  Dockerfiles'): every line that starts with such a program, and inline spans.

A line ending in ``\\`` continues on the next. ``a && b``, ``a | b``, ``a; b`` are checked
as separate commands; ``> FILE`` is noted (a later ``kubectl apply -f FILE`` may apply it).

What is checked (:class:`Checker`), by program: ``torchrec-cloud`` (and ``python -m
torchrec_cloud``, the entry scripts) through the real ``cli`` parser, then what the command
would do before it starts (the trainer's config, a render's job spec, submit's refusal of
example values); ``torchrun`` through torch's own parser, with the command it starts, and
c10d rendezvous (``--standalone`` or ``--rdzv_backend=c10d``: docs/checkpoints.md says why);
the cloud scripts through their own parsers; ``bash SCRIPT`` with its variables (scripts
that submit are run with a stand-in ``torchrec-cloud`` and what it was given is checked);
``make`` targets; ``docker run`` through the image's entrypoint; ``kubectl apply -f`` of a
file we ship or that an earlier command of the same doc wrote; ``pip install`` of this
checkout's extras. Light commands are run: ``--help``, ``render``, ``submit --dry-run``,
``plan``, and ``checkpoint`` and ``data`` where their paths exist in the scratch folder.
Other programs (aws, az, gcloud, kubectl get, helm, ...) are other tools' and are not
checked; a program neither ours nor in :data:`OTHER_TOOLS` is reported.

Placeholders stand for a value the reader supplies: an upper-case word (``N``, ``IMG``,
``RUN_DIR``), a shell variable (``"$IMAGE"``, ``$(aws ...)``) or a value with ``...``; where
a flag needs a number or a choice, a placeholder passes as one. A trailing ``...`` word means
"more flags". An inline span holding ``[``, ``|`` or ``...`` is a synopsis: its program,
sub-command and flags must exist.

A command the test cannot check (it needs a cluster, say) ends with the comment
``# doc-test: skip REASON``; keep these few (DEVELOPERS.md).
"""

from __future__ import annotations

import ast
import argparse
import contextlib
import dataclasses
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
            "quickstart/README.md", "aws/README.md", "azure/README.md", "gcp/README.md"]
# Files whose header (a Python module's docstring, a shell script's or Dockerfile's leading
# comments) is the --help a user reads.
SCRIPT_HEADERS = ["train_dlrm.py", "quickstart/train_torchrec_quickstart.py", "azure/azure_ml_training.py",
                  "gcp/vertex_ai_training.py", "aws/cloud_component.py", "azure/cloud_component.py",
                  "gcp/cloud_component.py", "aws/train_dlrm_aws.sh", "azure/train_dlrm_azure.sh",
                  "gcp/train_dlrm_gcp.sh", "docker/entrypoint.sh", "docker/Dockerfile.cuda", "docker/Dockerfile.cpu",
                  "quickstart/Dockerfile"]
SKIP = "# doc-test: skip"

# Programs of other tools: their commands are not checked.
OTHER_TOOLS = {
    "aws", "az", "gcloud", "eksctl", "helm", "curl", "tensorboard", "torchx", "torch-model-archiver", "torchserve",
    "azcopy", "export", "source", "echo", "sed", "grep", "cat", "ls", "tail", "head", "jq", "git", "nvidia-smi",
    "fi_info", "ibstat", "kind", "kubectl", "docker", "pytest", "sudo", "watch", "./efa_installer.sh",
}
# Programs whose commands are checked; inline spans starting with one of them are examples.
OURS = {"torchrec-cloud", ".venv/bin/torchrec-cloud", "torchrun", "python", "python3", ".venv/bin/python", "bash",
        "make", "pip", ".venv/bin/pip"}
INLINE_STARTS = OURS | {"docker", "kubectl"}
# The image's entry scripts (docker/entrypoint.sh runs them from /workspace) and what they run.
# submit's targets that build a cloud service's job rather than Kubernetes manifests.
MANAGED_TARGETS = ("azureml", "vertex")
ENTRY_SCRIPTS = {"train_torchrec_quickstart.py": ["train", "--preset", "quickstart"],
                 "train_dlrm.py": ["train", "--preset", "criteo-1tb"]}
DOCKER_VALUE_OPTIONS = {"--gpus", "--shm-size", "-e", "--env", "-v", "--volume", "--name", "-p", "--publish",
                        "--network", "-w", "--workdir", "-u", "--user", "--entrypoint", "-f", "--file", "-t", "--tag",
                        "--platform", "--mount"}


@dataclasses.dataclass
class Example:
    """One command as written: where (``source:line``), its text, and how to check it."""

    source: str
    line: int
    text: str
    kind: str  # "block": a command to check whole; "inline": a span in prose (maybe a synopsis)
    block: int = 0  # commands of one fenced block share it (a `cd` lasts to the block's end)
    folder: str = ""  # the folder its relative paths start from (a `cd` before it)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


# -- finding them --------------------------------------------------------------------------


def logical_lines(lines: list[str], first: int) -> Iterator[tuple[int, str]]:
    """(line number, text) of each command in ``lines`` (numbered from ``first``), a
    trailing backslash joining a line to the next."""
    pending, start = "", first
    for n, line in enumerate(lines, first):
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.strip()[:-1].strip() + " "
            continue
        text = (pending + line.strip()).strip()
        pending = ""
        if text:
            yield start, text


def _spans(text: str) -> Iterator[str]:
    """Single-backquoted code spans of a Markdown or help line."""
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        yield m.group(1).replace("\\|", "|")


def _starts_ours(text: str, starts: set[str]) -> bool:
    words = text.split()
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value before the program
        words = words[1:]
    if words == ["\\"] or not words and text.rstrip().endswith("\\"):
        return True  # VAR=value ... \ : the program is on the next line
    return bool(words) and words[0] in starts


def markdown_examples(rel: str) -> list[Example]:
    lines = (ROOT / rel).read_text().splitlines()
    out: list[Example] = []
    fence: Optional[str] = None
    block: list[str] = []
    block_start = 0
    for n, line in enumerate(lines, 1):
        m = re.match(r"^\s*```(\S*)", line)
        if m and fence is None:
            fence, block, block_start = m.group(1), [], n + 1
            continue
        if m and fence is not None:
            if fence in ("bash", "sh", "shell"):
                out += [Example(rel, k, t, "block", block_start) for k, t in logical_lines(block, block_start)]
            elif fence in ("", "console"):
                prompted = [ln[2:] if ln.startswith("$ ") else "" for ln in block]
                out += [Example(rel, k, t, "block", block_start) for k, t in logical_lines(prompted, block_start)]
            fence = None
            continue
        if fence is not None:
            block.append(line)
            continue
        out += [Example(rel, n, s, "inline") for s in _spans(line) if _starts_ours(s, INLINE_STARTS)]
    return out


def text_examples(source: str, text: str, first: int = 1) -> list[Example]:
    """Commands in a help text or a script's header: indented lines (after a comment's ``#``)
    that start with a program of ours, and inline spans."""
    lines = text.splitlines()
    out: list[Example] = []
    commands = []
    for line in lines:
        body = re.sub(r"^\s*# ?", "", line) if line.lstrip().startswith("#") else line
        stripped = re.sub(r"^\s*(\$ )?", "", body)
        example = body[:1].isspace() and _starts_ours(stripped, OURS | {"docker"})
        commands.append(stripped if example or commands and commands[-1].rstrip().endswith("\\") else "")
    out += [Example(source, k, t, "block") for k, t in logical_lines(commands, first)]
    for n, line in enumerate(lines, first):
        out += [Example(source, n, s, "inline") for s in _spans(line) if _starts_ours(s, INLINE_STARTS)]
    return out


def help_texts() -> dict[str, str]:
    """``torchrec-cloud CMD [SUB] --help`` -> its text, for every command and sub-command."""
    from torchrec_cloud.cli import COMMANDS, build_parser

    texts = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        texts[name] = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    if sub_name != "--" and not (name == "torchrec-cloud" and sub_name != command):
                        walk(sub, f"{name} {sub_name}")

    for command in COMMANDS:
        parser = build_parser([command])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
        if command == "launch":  # its --help is its own, not argparse's
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                sub.get_default("func")(argparse.Namespace(torchrun_args=["--help"]))
            texts[f"torchrec-cloud {command}"] = out.getvalue()
        else:
            walk(sub, f"torchrec-cloud {command}")
    return texts


def header(rel: str) -> tuple[str, int]:
    """The part of a shipped script a user reads as its help, and its first line's number."""
    text = (ROOT / rel).read_text()
    if rel.endswith(".py"):
        tree = ast.parse(text)
        doc = ast.get_docstring(tree, clean=False) or ""
        return doc, tree.body[0].lineno if tree.body else 1
    lines = text.splitlines()
    head = []
    for line in lines:
        if not line.startswith("#"):
            break
        head.append(line)
    return "\n".join(head), 1


HELP = "--help"  # the source name of every sub-command's help texts, together
SOURCES = [*MARKDOWN, HELP, *SCRIPT_HEADERS]


def examples_of(source: str) -> list[Example]:
    """The examples of a Markdown file, of a script's header, or (``HELP``) of every
    sub-command's ``--help`` (each named ``torchrec-cloud CMD --help``)."""
    if source == HELP:
        return [e for name, text in help_texts().items() for e in text_examples(f"{name} --help", text)]
    if source.endswith(".md"):
        return markdown_examples(source)
    text, first = header(source)
    return text_examples(source, text, first)


def examples() -> dict[str, list[Example]]:
    """Every example, by source."""
    return {source: examples_of(source) for source in SOURCES}


# -- reading one command -----------------------------------------------------------------


def _without_subshells(text: str) -> str:
    """``$(...)`` (nested, quoted or not) replaced by the placeholder word ``$SUBSHELL``."""
    out, i = "", 0
    while i < len(text):
        if text.startswith("$(", i):
            depth, j = 0, i + 1
            while j < len(text):
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                if depth == 0:
                    break
                j += 1
            out += "$SUBSHELL"
            i = j + 1
        else:
            out += text[i]
            i += 1
    return out


def split_commands(text: str) -> list[str]:
    """A command line split at ``|``, ``||``, ``&&`` and ``;`` outside quotes."""
    parts, current, quote, i = [], "", None, 0
    while i < len(text):
        c = text[i]
        if quote:
            quote = None if c == quote else quote
            current += c
        elif c in "'\"":
            quote = c
            current += c
        elif c == "#" and (not current or current[-1].isspace()):
            break  # a comment
        elif text.startswith("&&", i) or text.startswith("||", i):
            parts.append(current)
            current, i = "", i + 2
            continue
        elif c in "|;":
            parts.append(current)
            current = ""
        else:
            current += c
        i += 1
    return [p.strip() for p in [*parts, current] if p.strip()]


@dataclasses.dataclass
class Command:
    env: dict[str, str]
    argv: list[str]
    writes: list[str]  # files its `>` redirections write


def parse_command(text: str) -> Command:
    words = shlex.split(text)
    env: dict[str, str] = {}
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    argv, writes = [], []
    i = 0
    while i < len(words):
        w = words[i]
        m = re.match(r"^(\d?)(>>?|<)(&\d)?(.*)$", w)
        if m:
            target = m.group(4) or (words[i + 1] if not m.group(3) and i + 1 < len(words) else "")
            if m.group(2) != "<" and not m.group(3) and target:
                writes.append(target)
            i += 1 if (m.group(4) or m.group(3)) else 2
            continue
        argv.append(w)
        i += 1
    if argv and argv[-1] in ("...", "…"):
        argv.pop()
    return Command(env, argv, writes)


def is_placeholder(word: str) -> bool:
    """A value the reader supplies: ``N``, ``RUN_DIR``, ``$IMAGE``, ``40000000,39060,...``."""
    return (word.startswith("$") or "..." in word or "…" in word or bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", word))
            or bool(re.fullmatch(r"<[^>]+>", word)))


# Flags whose value has a grammar (deploy/spec.py): a placeholder there stands for a value that
# passes it, and is checked and run as this one.
SAMPLES = {"image": "registry.example/torchrec-cloud:0.1.0"}


def holds_placeholder(word: str) -> bool:
    """A placeholder, or a value with one inside (``REGISTRY/PROJECT/torchrec-cloud:0.1.0``)."""
    return is_placeholder(word) or bool(re.search(r"(^|[/:.@-])[A-Z][A-Z0-9_]*($|[/:.@-])", word))


def runnable(args: list[str]) -> list[str]:
    """``args`` as a command may run them: placeholders as plain words (``plain_value``), or
    as a ``SAMPLES`` value after a flag that has one."""
    out: list[str] = []
    for i, word in enumerate(args):
        flag, eq, value = word.partition("=")
        if eq and flag.startswith("--") and flag[2:] in SAMPLES and holds_placeholder(value):
            out.append(f"{flag}={SAMPLES[flag[2:]]}")
        elif i and args[i - 1].startswith("--") and args[i - 1][2:] in SAMPLES and holds_placeholder(word):
            out.append(SAMPLES[args[i - 1][2:]])
        else:
            out.append(plain_value(word))
    return out


def _sample(kind: Optional[Callable], choices) -> object:
    if choices:
        return next(iter(choices))
    if kind is int:
        return 2
    if kind is float:
        return 1.0
    if kind is not None and getattr(kind, "__name__", "") == "_int_list":
        return [1]
    return "PLACEHOLDER"


def lenient(parser: argparse.ArgumentParser, substituted: Optional[set[str]] = None) -> argparse.ArgumentParser:
    """``parser`` (and its sub-commands' parsers), taking a placeholder wherever a flag needs a
    number or one of its choices; the flags given one are added to ``substituted``."""
    substituted = set() if substituted is None else substituted
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                lenient(sub, substituted)
        elif action.type is not None or action.choices is not None or action.dest in SAMPLES:
            kind, choices, dest = action.type, action.choices, action.dest

            def typed(word, kind=kind, choices=choices, dest=dest):
                if dest in SAMPLES and holds_placeholder(word):
                    return SAMPLES[dest]
                if is_placeholder(word) and (choices is not None or kind not in (None, str)):
                    substituted.add(dest)
                    return _sample(kind, choices)
                return kind(word) if kind is not None else word

            typed.__name__ = getattr(kind, "__name__", "value")
            action.type = typed
    return parser


def plain_value(word: str) -> str:
    """A placeholder as a value a command may run with: ``$IMAGE`` -> ``IMAGE``."""
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)[^}]*\}|\$([A-Za-z_][A-Za-z0-9_]*)",
                  lambda m: m.group(1) or m.group(2), word)


@contextlib.contextmanager
def captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


def _error_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["(no message)"])[-1].strip()


# -- checking ----------------------------------------------------------------------------


class Checker:
    """Checks the examples of one source; ``problems`` collects ``source:line: text: what``."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.problems: list[str] = []
        self.skipped: list[str] = []
        self.written: set[str] = set()  # files earlier commands of this source wrote
        self.folder = ""  # where a `cd` earlier in this block went
        self.block = 0

    # entry point
    def check(self, example: Example) -> None:
        if example.block != self.block:
            self.block, self.folder = example.block, ""
        example.folder = example.folder or self.folder
        if SKIP in example.text:
            reason = example.text.split(SKIP, 1)[1].strip()
            if not reason:
                self.fail(example, f"'{SKIP}' needs a reason after it")
            self.skipped.append(f"{example.where}: {reason}")
            return
        synopsis = example.kind == "inline" and re.search(r"\[|\||\.\.\.|…", example.text)
        if synopsis:
            self.check_synopsis(example)
            return
        try:
            commands = [parse_command(_without_subshells(c)) for c in split_commands(example.text)]
        except ValueError as e:  # unbalanced quotes
            self.fail(example, f"not a shell command ({e})")
            return
        for command in commands:
            if command.argv:
                self.check_command(example, command)
            self.written.update(command.writes)

    def fail(self, example: Example, what: str) -> None:
        self.problems.append(f"{example.where}: `{example.text}`: {what}")

    def check_command(self, ex: Example, cmd: Command) -> None:
        program, args = cmd.argv[0], cmd.argv[1:]
        if program in ("torchrec-cloud", ".venv/bin/torchrec-cloud"):
            self.cli(ex, args)
        elif program in ("python", "python3", ".venv/bin/python"):
            self.python(ex, args)
        elif program == "torchrun":
            self.torchrun(ex, args)
        elif program == "bash" or program.startswith("./") and program.endswith(".sh") and program != "./efa_installer.sh":
            self.bash(ex, args if program == "bash" else [program, *args], cmd.env)
        elif program == "cd":
            self.cd(ex, args)
        elif program == "make":
            self.make(ex, args)
        elif program in ("pip", ".venv/bin/pip"):
            self.pip(ex, args)
        elif program == "docker":
            self.docker(ex, args)
        elif program == "kubectl":
            self.kubectl(ex, args)
        elif program not in OTHER_TOOLS and not is_placeholder(program):
            self.fail(ex, f"unknown program {program!r}: if it is another tool's, add it to OTHER_TOOLS in "
                          "tests/doc_examples.py")  # fmt: skip

    # -- torchrec-cloud ----------------------------------------------------------------------

    def cli(self, ex: Example, args: list[str]) -> None:
        from torchrec_cloud.cli import build_parser

        if not args:
            return
        if args[0] == "launch":
            self.torchrun(ex, args[1:], launcher="torchrec-cloud launch")
            return
        parser = build_parser(args)
        if ex.kind == "inline" and self.names_commands(ex, parser, args):
            return
        if ex.kind == "inline":  # prose may name a flag without its value: the flags must exist
            self.check_synopsis(ex)
            ns = self.parse(ex, parser, args, quiet=True)
        else:
            ns = self.parse(ex, parser, args)
        if ns is None:
            return
        self.accepted(ex, ns, args)

    def names_commands(self, ex: Example, parser: argparse.ArgumentParser, args: list[str]) -> bool:
        """Whether ``args`` only name a command (`torchrec-cloud data preprocess` in prose);
        an unknown first word is reported."""
        for i, word in enumerate(args):
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if not subs or word not in subs[0].choices:
                if i == 0:
                    self.fail(ex, f"no command {word!r}")
                    return True
                return False
            parser = subs[0].choices[word]
        return True

    def parse(self, ex: Example, parser: argparse.ArgumentParser, args: list[str],
              quiet: bool = False) -> Optional[argparse.Namespace]:  # fmt: skip
        """The namespace ``parser`` makes of ``args``, without the flags given a placeholder
        (what they mean is the reader's: the command is checked with their defaults); None
        for a refusal (reported unless ``quiet``) or a --help."""
        substituted: set[str] = set()
        with captured() as (out, err):
            try:
                ns = lenient(parser, substituted).parse_args(args)
            except SystemExit as e:
                if e.code not in (0, None) and not quiet:
                    self.fail(ex, f"refused: {_error_line(err.getvalue())}")
                return None  # --help printed
        for dest in substituted:
            if hasattr(ns, dest) and dest not in ("command", "action", "preset"):
                delattr(ns, dest)
        return ns

    def accepted(self, ex: Example, ns: argparse.Namespace, args: list[str]) -> None:
        """What the command checks before it starts, and the light ones run."""
        from torchrec_cloud.config import ConfigError, config_from_args
        from torchrec_cloud.storage import StorageError

        command = args[0]
        try:
            if command in ("train", "plan"):
                config_from_args(ns)
            elif command == "bench":
                from torchrec_cloud.config import parse_job_config

                parse_job_config([plain_value(a) for a in ns.train_args])
            elif command in ("render", "submit"):
                self.deploy(ex, ns, args)
        except (ConfigError, StorageError) as e:
            self.fail(ex, f"refused: {' '.join(str(e).split())}")
            return
        if command in ("render", "plan") or command == "submit" and ns.target == "kubernetes":
            run = runnable(args)
            self.run_in_process(ex, run[:1] + (["--dry-run"] if command == "submit" and not ns.dry_run else []) + run[1:])
        elif command == "checkpoint" and self.local_paths_exist(ns, args):
            self.run_in_process(ex, args, codes=(0, 1))  # 1: what it found incomplete or damaged
        elif command == "data" and self.local_paths_exist(ns, args):
            self.run_process(ex, args)  # preprocessing forks its workers: from a process of its own

    def deploy(self, ex: Example, ns: argparse.Namespace, args: list[str]) -> None:
        from torchrec_cloud.deploy import submit
        from torchrec_cloud.deploy.spec import spec_from_args

        spec = spec_from_args(ns)
        if args[0] == "submit" and ns.target in MANAGED_TARGETS:
            # The service's own job, as --dry-run builds it: its checkpoint destinations
            # (azureml:// becomes a mounted output), its refusals, the training flags it passes.
            build = {"azureml": submit.submit_azureml, "vertex": submit.submit_vertex}[ns.target]
            options = argparse.Namespace(compute=getattr(ns, "compute", None), dry_run=True,
                                         staging_bucket=getattr(ns, "staging_bucket", None))
            with captured():
                build(spec, options)
        elif spec.job == "train":  # (a preprocessing job's flags were checked as the spec was made)
            spec.trainer_args("/runs")  # the training flags after '--', as the trainer takes them
        if args[0] == "submit" and not ns.dry_run:
            for problem in submit.placeholders(spec, ns.target):
                self.fail(ex, f"submit would refuse it: {problem}")

    def run_in_process(self, ex: Example, args: list[str], codes: tuple[int, ...] = (0,)) -> None:
        from torchrec_cloud.cli import main

        here = os.getcwd()
        os.chdir(self.scratch)
        try:
            with captured() as (out, err):
                try:
                    code = main(args)
                except SystemExit as e:
                    code = e.code
        finally:
            os.chdir(here)
        if (code or 0) not in codes:
            self.fail(ex, f"ran `torchrec-cloud {shlex.join(args)}`: exit {code}: {_error_line(err.getvalue())}")

    def local_paths_exist(self, ns: argparse.Namespace, args: list[str]) -> bool:
        """A `checkpoint` or `data` command runs when every path it names is here (the scratch
        folder holds a tiny run under runs/q and a tiny train.txt; absolute paths the docs
        name, /data/kaggle say, are taken under it)."""
        paths = [getattr(ns, k) for k in ("path", "input", "output") if getattr(ns, k, None)]
        paths = [p for v in paths for p in (v if isinstance(v, list) else [v])]
        if not paths or any("://" in p or is_placeholder(p) for p in paths):
            return False
        inputs = [p for k in ("path", "input") for p in ([getattr(ns, k)] if isinstance(getattr(ns, k, None), str)
                                                           else getattr(ns, k, None) or [])]  # fmt: skip
        return all((self.scratch / self.local(p)).exists() for p in inputs)

    def local(self, path: str) -> str:
        return path.lstrip("/") if path.startswith("/") else path

    def run_process(self, ex: Example, args: list[str]) -> None:
        args = [self.local(a) if a.startswith("/") else a for a in args]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-m", "torchrec_cloud", *args], cwd=self.scratch, env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        if done.returncode not in (0, 1) or "Traceback" in done.stderr:
            self.fail(ex, f"ran `torchrec-cloud {shlex.join(args)}` in {self.scratch}: exit {done.returncode}: "
                          f"{_error_line(done.stderr)}")  # fmt: skip

    # -- synopses (inline spans with [ | ...) ------------------------------------------------

    def check_synopsis(self, ex: Example) -> None:
        from torchrec_cloud.cli import COMMANDS, build_parser

        words = [w.strip("[]") for w in ex.text.replace("|", " | ").split()]
        words = [w for w in words if w and w != "|"]
        env_free = [w for w in words if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w)]
        if not env_free or env_free[0] not in ("torchrec-cloud", "torchrun"):
            return
        if env_free[0] == "torchrun" or env_free[1:2] == ["launch"]:
            parser = torchrun_parser(launch=env_free[0] != "torchrun")
            flags = set(parser._option_string_actions)
        else:
            command = env_free[1] if len(env_free) > 1 else None
            if command not in COMMANDS:
                self.fail(ex, f"no command {command!r}")
                return
            parser = build_parser([command])
            flags = set()
            stack = [parser]
            while stack:
                p = stack.pop()
                flags |= set(p._option_string_actions)
                stack += [s for a in p._actions if isinstance(a, argparse._SubParsersAction) for s in a.choices.values()]
            flags |= spec_train_flags() if command in ("render", "submit", "rehearse", "bench") else set()
        for word in env_free:
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and flag != "--" and flag.replace("-", "_") not in {f.replace("-", "_") for f in flags}:
                self.fail(ex, f"no flag {flag}")

    # -- torchrun ------------------------------------------------------------------------------

    def torchrun(self, ex: Example, args: list[str], launcher: str = "torchrun", image: bool = False) -> None:
        if ex.kind == "inline":  # `torchrun --max_restarts=N` in prose: its flags must exist
            self.check_synopsis(ex)
            return
        parser = torchrun_parser(launch=launcher == "torchrec-cloud launch")
        with captured() as (out, err):
            try:
                ns = lenient(parser).parse_args(args)
            except SystemExit as e:
                if e.code not in (0, None):
                    self.fail(ex, f"{launcher} refuses it: {_error_line(err.getvalue())}")
                return
        if not (ns.standalone or ns.rdzv_backend == "c10d"):
            self.fail(ex, f"{launcher} without c10d rendezvous: add --standalone (one machine) or "
                          "--rdzv_backend=c10d --rdzv_endpoint=HOST:PORT (docs/checkpoints.md, 'torchrun restarts')")
        script, script_args = ns.training_script, list(ns.training_script_args)
        if ns.module and script == "torchrec_cloud":
            self.cli(ex, script_args)
        elif not ns.module and not ns.no_python:
            self.python(ex, [script, *script_args], image=image)

    # -- python --------------------------------------------------------------------------------

    def python(self, ex: Example, args: list[str], image: bool = False) -> None:
        if not args or args[0] == "-c":
            return
        if args[0] == "-m":
            module, rest = (args[1] if len(args) > 1 else ""), args[2:]
            if module == "torchrec_cloud":
                self.cli(ex, rest)
            elif module in ("torch.distributed.run", "torch.distributed.launch"):
                self.torchrun(ex, rest, launcher=f"python -m {module}", image=image)
            elif module.startswith("torchrec_cloud."):
                path = ROOT / "src" / (module.replace(".", "/") + ".py")
                self.flags_in_source(ex, path, rest)
            return
        script, rest = args[0], args[1:]
        name = Path(script).name
        if name in ENTRY_SCRIPTS and (image or self.find(ex, script) is not None):
            self.cli(ex, [*ENTRY_SCRIPTS[name], *rest])
            return
        path = self.find(ex, script)
        if path is None:
            self.fail(ex, f"no file {script} (from the repository root{f' or {ex.folder}/' if ex.folder else ''})")
            return
        module = load_script(path)
        if hasattr(module, "TARGET") and hasattr(module, "arguments"):  # a cloud script: submit --target
            self.cloud_script(ex, path, module, rest)
        elif hasattr(module, "trainer") and path.name == "cloud_component.py":
            self.torchx_component(ex, module, rest)
        else:
            self.flags_in_source(ex, path, rest)

    def cloud_script(self, ex: Example, path: Path, module, args: list[str]) -> None:
        from torchrec_cloud.config import ConfigError
        from torchrec_cloud.deploy import submit

        parser = submit.script_parser(module.TARGET, prog=f"python {path.relative_to(ROOT)}", description=module.__doc__)
        ns = self.parse(ex, parser, module.arguments(args))
        if ns is None:
            return
        try:
            self.deploy(ex, ns, ["submit"])
        except ConfigError as e:
            self.fail(ex, f"refused: {' '.join(str(e).split())}")

    def torchx_component(self, ex: Example, module, args: list[str]) -> None:
        from torchrec_cloud.deploy.torchx_component import main

        with captured() as (out, err):
            # --dry-run before a '--': what follows it is the training flags
            code = main(module.trainer, ["--dry-run", *runnable([a for a in args if a != "--dry-run"])])
        if code != 0:
            self.fail(ex, f"refused: {_error_line(err.getvalue())}")

    def flags_in_source(self, ex: Example, path: Path, args: list[str]) -> None:
        """A script of ours without a parser to reach: it exists and names every flag given."""
        if not path.is_file():
            self.fail(ex, f"no file {path.relative_to(ROOT)}")
            return
        source = path.read_text()
        for word in args:
            if word == "--":
                break
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and not re.search(rf"""["']{re.escape(flag)}["']""", source):
                self.fail(ex, f"{path.relative_to(ROOT)} has no flag {flag}")

    def find(self, ex: Example, script: str) -> Optional[Path]:
        folders = [ex.folder, str(Path(ex.source).parent) if (ROOT / ex.source).exists() else "", ""]
        for folder in folders:
            path = ROOT / folder / script
            if path.is_file():
                return path
        return None

    # -- bash, cd, make, pip, docker, kubectl ------------------------------------------------------

    def bash(self, ex: Example, args: list[str], env: dict[str, str]) -> None:
        if not args or args[0].startswith("-"):
            return
        path = self.find(ex, args[0])
        if path is None:
            self.fail(ex, f"no script {args[0]}")
            return
        source = path.read_text()
        for name in env:
            if not re.search(rf"\$\{{?{name}\b", source):
                self.fail(ex, f"{path.relative_to(ROOT)} does not read {name}")
        if "torchrec-cloud submit" in source:
            self.submitting_script(ex, path, args[1:], env)

    def submitting_script(self, ex: Example, path: Path, args: list[str], env: dict[str, str]) -> None:
        """Run the script with a stand-in torchrec-cloud that records what it is given, and
        check that command."""
        with tempfile.TemporaryDirectory() as tmp:
            shim = Path(tmp, "torchrec-cloud")
            record = Path(tmp, "argv")
            shim.write_text(f"#!/bin/sh\nfor a in \"$@\"; do printf '%s\\0' \"$a\"; done > {shlex.quote(str(record))}\n")
            shim.chmod(0o755)
            run_env = {"PATH": f"{tmp}{os.pathsep}{os.environ['PATH']}", "HOME": os.environ.get("HOME", tmp), **env}
            done = subprocess.run(["bash", str(path), *args], env=run_env, capture_output=True, text=True, timeout=60)
            if done.returncode != 0 or not record.exists():
                self.fail(ex, f"{path.relative_to(ROOT)} failed: {_error_line(done.stderr)}")
                return
            argv = record.read_text().split("\0")[:-1]
        self.cli(dataclasses.replace(ex, text=f"{ex.text}  (runs: torchrec-cloud {shlex.join(argv)})"), argv)

    def cd(self, ex: Example, args: list[str]) -> None:
        target = (Path(ex.folder) / args[0]) if args else Path("")
        if args and not (ROOT / target).is_dir():
            self.fail(ex, f"no folder {target}")
        self.folder = ex.folder = str(target)

    def make(self, ex: Example, args: list[str]) -> None:
        makefile = (ROOT / "Makefile").read_text()
        for target in [a for a in args if "=" not in a and not a.startswith("-")]:
            if not re.search(rf"^{re.escape(target)}:", makefile, re.M):
                self.fail(ex, f"the Makefile has no target {target!r}")

    def pip(self, ex: Example, args: list[str]) -> None:
        import tomllib

        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for word in args[1:] if args[:1] == ["install"] else []:
            if word.split("[")[0] in ("torchrec-cloud", "torchrec_cloud"):
                self.fail(ex, "torchrec-cloud is not on a package index: pip install -e '.[EXTRA]' in the checkout")
            m = re.fullmatch(r"\.\[([\w,]+)\]", word)
            for extra in (m.group(1).split(",") if m else []):
                if extra not in extras:
                    self.fail(ex, f"pyproject.toml has no extra {extra!r}")

    def docker(self, ex: Example, args: list[str]) -> None:
        if not args:
            return
        if args[0] == "build":
            for flag, value in zip(args, args[1:]):
                if flag in ("-f", "--file") and not (ROOT / value).is_file():
                    self.fail(ex, f"no Dockerfile {value}")
            return
        if args[0] != "run":
            return
        i = 1
        while i < len(args) and args[i].startswith("-"):
            i += 2 if args[i] in DOCKER_VALUE_OPTIONS else 1
        rest = args[i + 1:]  # after the image: what docker/entrypoint.sh runs
        if not rest:
            return
        if rest[0].startswith("-") or rest[0].endswith(".py"):
            self.python(ex, rest, image=True)
        else:
            self.check_command(ex, Command({}, rest, []))

    def kubectl(self, ex: Example, args: list[str]) -> None:
        if args[:1] not in (["apply"], ["create"]):
            return
        for flag, value in zip(args, args[1:]):
            if flag in ("-f", "--filename") and value != "-" and "://" not in value:
                if not any((ROOT / d / value).exists() for d in (ex.folder, "")) and value not in self.written:
                    self.fail(ex, f"applies {value}, which is neither a file we ship nor one an earlier command here "
                                  "wrote (render it first: torchrec-cloud render ... > FILE)")  # fmt: skip


def spec_train_flags() -> set[str]:
    """The flags after '--': the trainer's, or `data preprocess`'s (`--job preprocess`)."""
    from torchrec_cloud.deploy.spec import preprocess_flags, trainer_flags

    return trainer_flags() | preprocess_flags()


def torchrun_parser(launch: bool = False) -> argparse.ArgumentParser:
    """torchrun's parser; ``launch``: ``torchrec-cloud launch``'s (torchrun's flags and its own)."""
    if launch:
        from torchrec_cloud.launch import torchrun_parser as launch_parser

        parser = launch_parser()
        parser.prog = "torchrec-cloud launch"
        return parser
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.allow_abbrev = False
    parser.prog = "torchrun"
    return parser


_SCRIPTS: dict[Path, object] = {}


def load_script(path: Path):
    """A shipped Python script as a module (its ``__main__`` block does not run)."""
    import importlib.util

    if path not in _SCRIPTS:
        spec = importlib.util.spec_from_file_location(f"doc_example_{path.stem}_{len(_SCRIPTS)}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception:  # noqa: BLE001 - a script that does more than define things: check its flags only
            module = None
        _SCRIPTS[path] = module
    return _SCRIPTS[path]
