"""The storage layer round-trips bytes on local disk and on the S3, GCS and Azure emulators,
and turns failures into typed errors naming the path."""

from __future__ import annotations

import pytest

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
    with pytest.raises(storage.StorageUnreachableError, match="unreachable"):
        storage.check_access("s3://bucket/run")
