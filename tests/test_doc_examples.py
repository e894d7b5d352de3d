"""Every command in our docs and help texts, against the real program: flags exist, values
parse, the command would be accepted, and the light ones run (tests/doc_examples.py says how
commands are found and checked, and how a command the test cannot check is marked)."""

from __future__ import annotations

import pytest

from doc_examples import HELP, SOURCES, Checker, Example, examples_of, help_texts


@pytest.mark.parametrize("source", SOURCES)
def test_every_example_runs_as_shown(source, tiny_run_folder):
    checker = Checker(tiny_run_folder)
    for example in examples_of(source):
        checker.check(example)
    assert not checker.problems, f"{len(checker.problems)} example(s) in {source} drift from the program:\n" + (
        "\n".join(checker.problems))


def test_commands_are_found_in_every_kind_of_source():
    """The extractor sees what it must: fenced blocks with continuations, prompted output
    blocks, inline spans, --help texts and script headers."""
    readme = examples_of("README.md")
    assert any(e.text.startswith("torchrec-cloud launch --nnodes=2") and "--checkpoint_path s3://bucket/ckpt/" in e.text
               for e in readme)  # three lines joined
    assert any(e.kind == "inline" and e.text.startswith("torchrec-cloud plan") for e in readme)
    assert "torchrec-cloud checkpoint ls runs/q/ckpt" in [e.text for e in examples_of("docs/checkpoints.md")]  # `$ `
    helps = examples_of(HELP)
    assert any(e.source == "torchrec-cloud render --help" and e.text.startswith("torchrec-cloud render --cloud aws")
               for e in helps)
    assert "torchrec-cloud checkpoint --help" in {e.source for e in helps}
    assert {"torchrec-cloud data preprocess", "torchrec-cloud checkpoint verify"} <= set(help_texts())  # sub-commands
    assert any("bash aws/train_dlrm_aws.sh" in e.text for e in examples_of("aws/train_dlrm_aws.sh"))


@pytest.mark.parametrize("text, needle", [
    ("torchrec-cloud train --batch 4096", "--batch"),  # an abbreviation
    ("torchrec-cloud train --batch_size -3", "--batch_size"),  # a value the config refuses
    ("torchrec-cloud render --cloud aws --nodes 2 --spot", "--checkpoint_url"),  # what render refuses
    ("torchrec-cloud submit --target kubernetes --cloud aws --nodes 2 --image IMG", "--identity"),  # example values
    ("torchrun --nproc_per_node=2 -m torchrec_cloud train", "c10d"),
    ("torchrun --standalone --nproc_per_node=2 -m torchrec_cloud train --nope", "--nope"),  # the command it starts
    ("kubectl apply -f job.yaml", "job.yaml"),  # applied, never rendered
    ("pip install 'torchrec-cloud[cloud]'", "pip install -e"),
    ("python azure/azure_ml_training.py --nodes 2 --project P", "--project"),  # the other cloud's flag
    ("bash aws/train_dlrm_aws.sh", "--image"),  # submit refuses the job the script hands it
    ("make tests", "tests"),
    ("torchrec_cloud train", "unknown program"),
])
def test_a_drifted_example_is_reported_with_its_place(text, needle, tiny_run_folder):
    checker = Checker(tiny_run_folder)
    checker.check(Example("docs/x.md", 7, text, "block"))
    assert len(checker.problems) >= 1 and all(p.startswith("docs/x.md:7: ") for p in checker.problems), checker.problems
    assert any(needle in p for p in checker.problems), checker.problems


def test_skip_marker_needs_a_reason(tiny_run_folder):
    checker = Checker(tiny_run_folder)
    checker.check(Example("docs/x.md", 3, "torchrec-cloud train --nope  # doc-test: skip needs a GPU", "block"))
    assert not checker.problems and checker.skipped == ["docs/x.md:3: needs a GPU"]
    checker.check(Example("docs/x.md", 4, "torchrec-cloud train --nope  # doc-test: skip", "block"))
    assert checker.problems and "needs a reason" in checker.problems[0]
