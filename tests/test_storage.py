"""The storage layer round-trips bytes on local disk and on the S3, GCS and Azure emulators,
turns failures into typed errors naming the path, writes files readable as the umask says,
and runs on cloud libraries that match their fsspec."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from importlib.metadata import requires, version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from helpers import env_for_subprocess
from torchrec_cloud import storage


def test_round_trip(storage_root):
    base = storage_root
    storage.makedirs(base)
    path = storage.join(base, "sub", "data.bin")
    payload = bytes(range(256)) * 1000
    storage.write_bytes(path, payload)
    assert storage.exists(path)
    assert storage.size(path) == len(payload)
    assert storage.read_bytes(path) == payload
    assert storage.read_bytes(path, start=10, end=20) == payload[10:20]
    with storage.open(path, "rb") as f:
        f.seek(1000)
        assert f.read(5) == payload[1000:1005]
    with storage.open(storage.join(base, "sub", "text.txt"), "wb") as f:
        f.write(b"hello\n")
    assert storage.listdir(storage.join(base, "sub")) == ["data.bin", "text.txt"]
    storage.remove(path)
    assert not storage.exists(path)
    assert storage.listdir(storage.join(base, "sub")) == ["text.txt"]
    storage.remove(storage.join(base, "sub"), recursive=True)
    assert not storage.exists(storage.join(base, "sub", "text.txt"))


def test_missing_file_is_typed_error(storage_root):
    missing = storage.join(storage_root, "nope", "missing.bin")
    with pytest.raises(storage.StorageNotFoundError) as info:
        storage.read_bytes(missing)
    assert "missing.bin" in str(info.value)
    assert info.value.__cause__ is not None


def test_missing_bucket_is_typed_error(s3_service, monkeypatch):
    for key, value in s3_service.env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(storage.StorageNotFoundError, match="no-such-bucket-xyz"):
        storage.check_access("s3://no-such-bucket-xyz/run")
    with pytest.raises(storage.StorageNotFoundError, match="no-such-bucket-xyz"):
        storage.makedirs("s3://no-such-bucket-xyz/run")


def test_unsupported_scheme_names_the_choices():
    with pytest.raises(storage.StorageError, match="unsupported URL scheme hdfs://.*s3://"):
        storage.read_bytes("hdfs://x/y")


def test_wrong_credentials_are_a_permission_error(azure_service, monkeypatch):
    wrong = azure_service.env["AZURE_STORAGE_CONNECTION_STRING"].replace(
        "AccountKey=Eby8", "AccountKey=AAAA"
    )
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong)
    with pytest.raises(storage.StoragePermissionError, match="access denied.*AZURE_STORAGE_CONNECTION_STRING"):
        storage.write_bytes(f"{azure_service.url}/x.bin", b"1")


def test_unreachable_endpoint_is_typed_error(monkeypatch):
    from services import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries only delay the same error
    with pytest.raises(storage.StorageUnreachableError, match="unreachable"):
        storage.check_access("s3://bucket/run")
    with pytest.raises(storage.StorageUnreachableError, match="unreachable"):  # not "no such bucket"
        storage.makedirs("s3://bucket/run")


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_follow_the_umask(tmp_path, umask):
    """As DCP's own files and metrics.jsonl do: a serving job or a colleague can read what
    a run wrote (tempfile.mkstemp's 0600 used to stick to COMMIT.json, manifests, shards)."""
    old = os.umask(umask)
    try:
        storage.write_bytes(str(tmp_path / "sub" / "COMMIT.json"), b"{}")
        with open(tmp_path / "plain", "wb"):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "sub" / "COMMIT.json").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o666 & ~umask
    assert os.listdir(tmp_path / "sub") == ["COMMIT.json"]  # no temporary file left


# s3fs and gcsfs are released with fsspec, on its calendar, and require the fsspec of their
# release; adlfs has its own calendar and a range of fsspec.
CLOUD_LIBRARIES = {"s3fs": "s3", "gcsfs": "gs", "adlfs": "az"}
FOLLOW_FSSPEC = ("s3fs", "gcsfs")


@pytest.mark.parametrize("library", sorted(CLOUD_LIBRARIES))
def test_cloud_library_is_current_and_matches_fsspec(library):
    """pyproject's `cloud` extra pins one coherent set; this fails where an installed library is
    older than its fsspec (pip once settled on s3fs 0.4.2 of 2020 beside fsspec 2026.9) or
    outside the fsspec versions it declares."""
    fsspec_version, installed = Version(version("fsspec")), Version(version(library))
    assert installed.major >= 2021, f"{library} {installed} is from before 2021 (fsspec warns it is very old)"
    if library in FOLLOW_FSSPEC:
        assert installed.release[:2] >= fsspec_version.release[:2], f"{library} {installed} is older than fsspec {fsspec_version}"
    for line in requires(library) or []:
        req = Requirement(line)
        if req.name == "fsspec" and req.marker is None:
            assert req.specifier.contains(fsspec_version, prereleases=True), f"{library} {installed} needs {req}"


def test_cloud_libraries_import_without_warnings():
    """Imported and looked up through fsspec as a run does, in a fresh process with warnings as
    errors: no "s3fs is very old" (or any other) warning before a user's first real error."""
    code = "import fsspec\n" + "".join(f"import {m}\nfsspec.get_filesystem_class({p!r})\n" for m, p in CLOUD_LIBRARIES.items())
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], env=env_for_subprocess(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
