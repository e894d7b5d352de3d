"""The container images, without Docker (no daemon here): the Dockerfiles parse, install
the stack only through scripts/install.sh (one source of versions, the same step as
`make install` and the README), run as non-root, and their entrypoint script works when
run directly with the seed guide's argument forms."""

from __future__ import annotations

import functools
import io
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


def image_packages(dockerfile: str) -> set[str]:
    """The distributions an image built from ``dockerfile`` (its text) installs: this package's
    dependencies and those of the extras its install.sh step is given, read from pyproject.toml."""
    import tomllib

    (run,) = [i["value"] for i in DockerfileParser(fileobj=io.BytesIO(dockerfile.encode())).structure
              if i["instruction"] == "RUN" and "install.sh" in i["value"]]
    env = dict(w.split("=", 1) for w in shlex.split(run)[:-2])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in env.get("EXTRAS", "").split(","):
        requirements += project["optional-dependencies"].get(extra, [])
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in requirements}


@functools.lru_cache(maxsize=1)
def job_urls() -> dict[str, str]:
    """URL -> where it is, for every bucket URL the trainer of a job is given: the committed
    cloud manifests, and each cloud README's own render (checkpoints and data in the object
    store the README names)."""
    from torchrec_cloud.deploy.manifests import load_documents, render_bundle
    from torchrec_cloud.deploy.profiles import load_profile
    from torchrec_cloud.deploy.spec import DeploySpec

    clouds = ("aws", "azure", "gcp")
    committed = ["quickstart/kubernetes_job.yaml", *(f"{c}/{f}" for c in clouds for f in layout.LAUNCHER_FILES.values())]
    bundles = {rel: (ROOT / rel).read_text() for rel in committed}
    for cloud in clouds:
        store = load_profile(cloud).object_store
        spec = DeploySpec(cloud=cloud, nodes=2, plan=False, spot=True, checkpoint_url=f"{store}/checkpoints",
                          data_url=f"{store}/criteo")
        bundles[f"render --cloud {cloud} --checkpoint_url {store}/checkpoints --data_url {store}/criteo"] = (
            render_bundle(spec))
    urls = {}
    for where, text in bundles.items():
        for doc in load_documents(text):
            for word in re.findall(r"\b[a-z0-9]+://[^\s'\"]+", json.dumps(doc)):
                urls.setdefault(word, where)
    return urls


def missing_filesystems(dockerfile: str, urls: dict[str, str]) -> list[str]:
    """One line for each URL whose filesystem package (fsspec's, by storage.BACKENDS) the
    image does not install."""
    from torchrec_cloud import storage

    installed = image_packages(dockerfile)
    problems = []
    for url, where in urls.items():
        backend = storage.BACKENDS.get(url.split("://")[0])
        if backend is None:  # http(s):// and the like: not a path the trainer opens
            continue
        for package in ("fsspec", backend.module):
            if package not in installed:
                problems.append(f"{where}: {url} needs {package}, which the image does not install")
    return problems


@pytest.mark.parametrize("path", DOCKERFILES)
def test_image_installs_the_filesystem_of_every_url_a_job_is_given(path):
    urls = dict(job_urls())
    assert {u.split("://")[0] for u in urls} >= {"s3", "gs", "az"}, urls  # every cloud's bucket is looked at
    assert missing_filesystems((ROOT / path).read_text(), urls) == []
    # The check sees an image without them: the `deploy` extra alone (what the images had).
    without = (ROOT / path).read_text().replace("EXTRAS=deploy,cloud ", "EXTRAS=deploy ")
    assert any("needs s3fs" in p for p in missing_filesystems(without, urls))


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
