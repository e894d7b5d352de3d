"""The command line's habits: a fast ``--help`` and ``--version``, every flag of every command
with ``_`` or ``-``, no abbreviations (also in the training flags after ``render --`` and in
``launch``'s torchrun flags), defaults in ``--help``, ``train --print_config``."""

from __future__ import annotations

import argparse
import json

import pytest

from helpers import PYTHON, run
from torchrec_cloud import __version__
from torchrec_cloud.cli import COMMANDS, SUMMARIES, build_parser, main
from torchrec_cloud.config import respelled


def cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own exits (--help, --version, errors)
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_top_level_help_and_version_load_no_command_and_no_torch():
    # `torchrec-cloud --help` must not wait for torch (seconds): no command module is imported.
    script = (
        "import sys\n"
        "from torchrec_cloud.cli import main\n"
        "for argv in (['--help'], ['--version']):\n"
        "    try: main(argv)\n"
        "    except SystemExit as e: assert e.code == 0, e.code\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] == 'torchrec'\n"
        "                or m in %r)\n"
        "print('LOADED', loaded)\n" % sorted(set(COMMANDS.values()) - {"torchrec_cloud.launch"})
    )  # (launch, light, is where the exit codes live)
    proc = run([PYTHON, "-c", script], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout, proc.stdout
    listed = " ".join(proc.stdout.split())
    for name, summary in SUMMARIES.items():  # every command is listed, saying what it does
        assert f"{name} {summary}" in listed, (name, proc.stdout)
    assert f"torchrec-cloud {__version__} (torch " in proc.stdout


def _long_options(parser: argparse.ArgumentParser):
    """(parser, option) for every --option of ``parser`` and of its sub-commands' parsers."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _long_options(sub)
        yield from ((parser, o) for o in action.option_strings if o.startswith("--"))


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"launch"}))
def test_every_flag_is_accepted_with_underscores_or_dashes(command):
    # (launch hands every word to torchrun, which takes both spellings itself.)
    for parser, option in _long_options(build_parser([command])):
        other = option.replace("_", "-") if "_" in option else "--" + option[2:].replace("-", "_")
        if other == option:
            continue
        # What parse_args reads, and --help shows one spelling only.
        assert respelled([other, "--", other], parser._option_string_actions) == [option, "--", other]
        assert respelled([f"{other}=1"], parser._option_string_actions) == [f"{option}=1"]
        assert other not in parser._option_string_actions, (command, option)


def test_dash_spellings_reach_the_trainer_and_the_manifests(capsys, tmp_path):
    code, out, err = cli(capsys, "train", "--print-config", "--batch-size", "4096", "--no-cpu-kernels",
                         "--embedding-dim=32", "--output-dir", str(tmp_path))  # fmt: skip
    assert code == 0, err
    cfg = json.loads(out)
    assert cfg["data"]["batch_size"] == 4096 and cfg["speedups"]["cpu_kernels"] is False
    # --embedding_dim alone also sets the bottom MLP's last layer (the seeds' form).
    assert cfg["model"]["embedding_dim"] == 32 and cfg["model"]["dense_arch_layer_sizes"][-1] == 32
    assert cfg["output"]["output_dir"] == str(tmp_path)
    code, out, err = cli(capsys, "render", "--cloud", "generic", "--gpus-per-node", "0", "--nodes", "2",
                         "--output", str(tmp_path / "m"), "--", "--batch-size", "4096")  # fmt: skip
    assert code == 0, err
    assert "4096" in "".join(p.read_text() for p in (tmp_path / "m").rglob("*.yaml"))


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--batch", "4096"], "--batch"),
        (["train", "--print_conf"], "--print_conf"),
        (["report", "somewhere", "--out", "x"], "--out"),
        (["checkpoint", "ls", "somewhere", "--js"], "--js"),
        (["render", "--cloud", "generic", "--gpus", "0"], "--gpus"),
        (["render", "--cloud", "generic", "--", "--batch", "4096"], "--batch"),  # the trainer's flags too
    ],
)
def test_abbreviations_are_refused_with_one_line(capsys, tmp_path, argv, needle):
    code, _, err = cli(capsys, *argv[:1], *(["--output", str(tmp_path)] if argv[0] == "render" else []), *argv[1:])
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "error" in lines[0] and needle in lines[0], err
    assert not any(tmp_path.iterdir())


def test_launch_refuses_an_abbreviated_torchrun_flag():
    proc = run([PYTHON, "-m", "torchrec_cloud", "launch", "--nnode=1", "-m", "torchrec_cloud", "train"], timeout=120)
    assert proc.returncode == 2 and "--nnode" in proc.stderr, proc.stderr


def test_help_shows_defaults(capsys):
    code, out, _ = cli(capsys, "train", "--help")
    assert code == 0
    text = " ".join(out.split())
    assert "(default: 8192; criteo-1tb, mlperf-dcnv2: 2048)" in text  # --batch_size, per preset
    assert "--print_config" in text
    code, out, _ = cli(capsys, "rehearse", "--help")
    assert code == 0 and "(default: " in out


def test_help_reads_as_plain_text(capsys):
    """Help without reST markup, examples that are whole, the flags that matter."""
    proc = run([PYTHON, "-m", "torchrec_cloud", "--help"], timeout=60)
    assert proc.returncode == 0 and "``" not in proc.stdout and "::" not in proc.stdout, proc.stdout
    assert set(SUMMARIES) == set(COMMANDS)  # every command says what it does without its module
    for command in ("export", "predict", "plan", "train", "submit"):
        code, out, _ = cli(capsys, command, "--help")
        assert code == 0 and "``" not in out and not any(line.rstrip().endswith("::") for line in out.splitlines())
    code, out, _ = cli(capsys, "export", "--help")
    assert "    torchrec-cloud export runs/q/checkpoints --output models/q" in out  # the example, not "::"
    code, out, _ = cli(capsys, "plan", "--help")
    assert "--embedding_kernel" in out and "--batch_size" in out and "--learning_rate" not in out
    assert cli(capsys, "plan", "--gpus_per_node", "0", "--learning_rate", "0.5", "--help")[0] == 0  # still taken
    code, out, _ = cli(capsys, "bench", "--help")
    assert "--worker {ours,handwritten,bound}" in out  # the flag its example uses is listed
    code, out, _ = cli(capsys, "launch", "--help")
    assert code == 0 and "200  EXIT_PREEMPTED" in out and "`torchrun --help`" in out
    assert "--nproc-per-node" not in out  # torchrun's own help is torchrun's


@pytest.mark.parametrize("script, own, other", [("azure/azure_ml_training.py", "--subscription_id", "--project"),
                                                ("gcp/vertex_ai_training.py", "--staging_bucket", "--workspace")])
def test_cloud_scripts_help_is_their_own(script, own, other):
    from helpers import REPO

    proc = run([PYTHON, script, "--help"], cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python {script}") and own in proc.stdout and other not in proc.stdout
    assert "--launcher" not in proc.stdout  # a managed service runs no Kubernetes objects of ours
