"""Shared fixtures: storage services started once per session on 127.0.0.1.

``s3_service``, ``gcs_service`` and ``azure_service`` yield a running service from
:mod:`services` (``.url``: a URL prefix inside a fresh bucket; ``.env``: what a process
needs to reach it) and stop it at the end of the session. While a test uses one, its
variables are also set in this process, so :mod:`torchrec_cloud.storage` reaches it.
``storage_root`` runs a test once per backend: local folder, S3, GCS and Azure.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from services import AzuriteService, GCSService, S3Service  # noqa: E402


def _session_service(cls):
    service = cls()
    service.start()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="session")
def s3_service():
    yield from _session_service(S3Service)


@pytest.fixture(scope="session")
def gcs_service():
    yield from _session_service(GCSService)


@pytest.fixture(scope="session")
def azure_service():
    yield from _session_service(AzuriteService)


_SERVICES = {"s3": "s3_service", "gs": "gcs_service", "az": "azure_service"}


@pytest.fixture(params=["local", "s3", "gs", "az"])
def storage_root(request, tmp_path, monkeypatch):
    """A fresh folder or bucket prefix on each backend; the service's env is set here."""
    if request.param == "local":
        yield str(tmp_path / "store")
        return
    service = request.getfixturevalue(_SERVICES[request.param])
    for key, value in service.env.items():
        monkeypatch.setenv(key, value)
    yield f"{service.url}/{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["C kernel", "torch ops"])
def cpu_kernel_path(request):
    """Run a test both ways the CPU step can run: with the C kernels (speedups/native.py), and
    on torch ops as where they cannot be built (``--no-cpu_kernels``)."""
    from torchrec_cloud.speedups import native

    native.set_enabled(request.param == "C kernel")
    assert (native.library() is not None) == (request.param == "C kernel")
    yield request.param
    native.set_enabled(True)


@pytest.fixture(scope="session")
def tiny_run_folder(tmp_path_factory):
    """A folder as the docs' examples find it: a finished tiny run in ``runs/q`` (its
    ``--output_dir``) with checkpoints in ``runs/q/ckpt`` at steps 10 and 20, written with
    relative paths from this folder; and a small Criteo ``train.txt``. Read only: copy what
    a test changes."""
    import subprocess

    from helpers import env_for_subprocess
    from torchrec_cloud.data.criteo_gen import write_criteo_tsv

    folder = tmp_path_factory.mktemp("tiny_run_folder")
    tiny = ["--num_embeddings", "100", "--embedding_dim", "8", "--dense_arch_layer_sizes", "32,8",
            "--over_arch_layer_sizes", "32,1", "--batch_size", "64", "--num_batches_per_epoch", "20",
            "--num_eval_batches", "2", "--no-progress", "--no-tensorboard"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "torchrec_cloud", "train", *tiny, "--output_dir", "runs/q",
                           "--checkpoint_path", "runs/q/ckpt", "--checkpoint_interval", "10"],
                          cwd=folder, env=env_for_subprocess(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    write_criteo_tsv(str(folder / "train.txt"), rows=700, seed=0, vocab=50)
    return folder


def pytest_configure(config):
    """Plans that render/submit make (torchrec_cloud.plan) go to a folder of this session's,
    shared by its subprocesses: every session plans afresh, and nothing lands in ~/.cache."""
    import os
    import tempfile

    if "TORCHREC_CLOUD_PLAN_CACHE" not in os.environ:
        folder = tempfile.mkdtemp(prefix="torchrec-cloud-plans-")
        os.environ["TORCHREC_CLOUD_PLAN_CACHE"] = folder
        config._plan_cache = folder


def pytest_unconfigure(config):
    import shutil

    folder = getattr(config, "_plan_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
