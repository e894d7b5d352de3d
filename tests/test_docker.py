"""The container images, without Docker (no daemon here): the Dockerfiles parse, install
the stack only through scripts/install.sh (one source of versions, the same step as
`make install` and the README), run as non-root, and their entrypoint script works when
run directly with the seed guide's argument forms."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from torchrec_cloud.deploy import layout

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ["docker/Dockerfile.cuda", "docker/Dockerfile.cpu", "quickstart/Dockerfile"]
TINY = ["--num_batches_per_epoch", "3", "--batch_size", "64", "--num_embeddings", "1000", "--embedding_dim", "16",
        "--dense_arch_layer_sizes", "32,16", "--over_arch_layer_sizes", "32,1", "--num_eval_batches", "2",
        "--no-progress"]


def instructions(path: str) -> list[dict]:
    with open(ROOT / path, "rb") as f:
        return [i for i in DockerfileParser(fileobj=f).structure if i["instruction"] != "COMMENT"]


def install_runs(path: str) -> list[str]:
    return [i["value"] for i in instructions(path) if i["instruction"] == "RUN" and "install.sh" in i["value"]]


def documented_install_vars() -> set[str]:
    header = (ROOT / "scripts/install.sh").read_text().split("set -euo pipefail")[0]
    return set(re.findall(r"\b([A-Z][A-Z_]+)=", header))


@pytest.mark.parametrize("path", DOCKERFILES)
def test_dockerfile_installs_only_through_install_sh(path):
    ins = instructions(path)
    assert [i["instruction"] for i in ins].count("FROM") == 1
    (run,) = install_runs(path)
    words = shlex.split(run)
    assert words[-2:] == ["bash", "scripts/install.sh"], run
    env = dict(w.split("=", 1) for w in words[:-2])
    assert set(env) <= documented_install_vars(), env
    assert env["TORCHREC_CLOUD_DEVICE"] in ("cpu", "cuda")
    # The extras it installs exist.
    pyproject = (ROOT / "pyproject.toml").read_text()
    for extra in env["EXTRAS"].split(","):
        assert re.search(rf"^{re.escape(extra)} = \[", pyproject, re.M), extra
    # No second source of versions: nothing else installs packages or pins the stack.
    text = (ROOT / path).read_text()
    body = "\n".join(i["value"] for i in ins)
    assert "pip install" not in body and "conda install" not in body
    for pin in ("torch==", "fbgemm", "torchrec=="):
        assert pin not in body, pin
    assert text == layout.generated_files(ROOT)[path]


def test_cuda_base_image_carries_the_pinned_torch():
    stack = layout.read_stack(ROOT)
    (base,) = [i["value"] for i in instructions("docker/Dockerfile.cuda") if i["instruction"] == "FROM"]
    assert base.startswith(f"pytorch/pytorch:{stack['TORCH_VERSION']}-cuda"), base
    cuda = re.search(r"-cuda(\d+)\.(\d+)-", base)
    (run,) = install_runs("docker/Dockerfile.cuda")
    assert f"TORCH_INDEX_URL=https://download.pytorch.org/whl/cu{cuda.group(1)}{cuda.group(2)}" in run


def test_install_line_equals_makefile_and_readme():
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^install:\n\t@?(.+)$", makefile, re.M).group(1)
    assert shlex.split(recipe)[-2:] == ["bash", "scripts/install.sh"]
    readme = (ROOT / "quickstart/README.md").read_text()
    for path in ("docker/Dockerfile.cuda", "quickstart/Dockerfile"):
        (run,) = install_runs(path)
        assert f"RUN {run}\n" in readme


@pytest.mark.parametrize("path", DOCKERFILES)
def test_image_runs_as_non_root_with_exec_form_entrypoint(path):
    ins = instructions(path)
    users = [i["value"] for i in ins if i["instruction"] == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    last = [i["instruction"] for i in ins][-2:]
    assert last == ["ENTRYPOINT", "CMD"]
    entrypoint = json.loads(ins[-2]["value"])
    assert json.loads(ins[-1]["value"]) == ["train_torchrec_quickstart.py"]
    copies = [i["value"].split() for i in ins if i["instruction"] == "COPY"]
    for *sources, dest in copies:
        for src in sources:
            assert (ROOT / src).exists(), f"{path}: COPY {src} does not exist"
        if dest == entrypoint[0]:
            assert sources == ["docker/entrypoint.sh"]


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def workspace(tmp_path: Path) -> Path:
    """The image's /workspace: the files the Dockerfile copies there."""
    ws = tmp_path / "workspace"
    ws.mkdir()
    for i in instructions("docker/Dockerfile.cuda"):
        if i["instruction"] == "COPY" and i["value"].split()[-1] == "/workspace/":
            for src in i["value"].split()[:-1]:
                shutil.copy(ROOT / src, ws)
    return ws


def run_entrypoint(ws: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(ROOT / "docker/entrypoint.sh"), *args], cwd=ws, env=env, capture_output=True,
                          text=True, timeout=600)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_entrypoint_runs_the_script_form(tmp_path):
    ws = workspace(tmp_path)
    done = run_entrypoint(ws, "train_torchrec_quickstart.py", *TINY, "--output_dir", str(tmp_path / "one"))
    assert done.returncode == 0, done.stderr[-3000:]
    records = metrics(tmp_path / "one")
    assert records[0]["event"] == "start" and records[0]["world_size"] == 1


def test_entrypoint_runs_the_torch_distributed_run_form(tmp_path):
    ws = workspace(tmp_path)
    done = run_entrypoint(ws, "-m", "torch.distributed.run", "--nproc_per_node=2", "train_torchrec_quickstart.py",
                          *TINY, "--output_dir", str(tmp_path / "two"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert metrics(tmp_path / "two")[0]["world_size"] == 2


def test_entrypoint_runs_other_arguments_as_a_command(tmp_path):
    ws = workspace(tmp_path)
    done = run_entrypoint(ws, "bash", "-c", "echo $0 in $PWD", "command-form")
    assert done.returncode == 0 and done.stdout.strip() == f"command-form in {ws}"
    done = run_entrypoint(ws, "-c", "import sys; print(sys.executable)")
    assert done.returncode == 0 and Path(done.stdout.strip()).parent == Path(sys.executable).parent
