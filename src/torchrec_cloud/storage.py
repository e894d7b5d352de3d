"""One way to read and write files, whether they live on local disk or in a bucket.

Data shards, manifests and checkpoints go through these functions, so every caller gets
the same URL handling and the same errors::

    from torchrec_cloud import storage

    storage.write_bytes("s3://bucket/run/manifest.json", b"{}")
    storage.read_bytes("gs://bucket/shards/part-00000.bin", start=0, end=160)
    storage.listdir("az://container/shards")        # names, sorted
    with storage.open("/data/criteo/day_0.gz", "rb") as f: ...

Local paths go through ``os``/``pathlib``. ``s3://``, ``gs://`` (``gcs://``), ``az://``
and ``abfs://`` URLs go through fsspec with s3fs, gcsfs and adlfs, imported only when such
a URL is used (``pip install -e '.[cloud]'``). Credentials come only from each
cloud's usual environment and identity chain, never from flags or files of this project:

- S3: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, the instance or pod
  role; ``AWS_ENDPOINT_URL`` points at an S3-compatible service (MinIO, moto).
- GCS: Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, workload
  identity); ``STORAGE_EMULATOR_HOST`` points at an emulator.
- Azure: ``AZURE_STORAGE_CONNECTION_STRING``, or ``AZURE_STORAGE_ACCOUNT_NAME`` with a key,
  SAS token or a managed/workload identity.

fsspec's own ``FSSPEC_<PROTOCOL>_<OPTION>`` variables (``FSSPEC_GCS_TOKEN=anon``) pass
options through as well.

Every failure is a :class:`StorageError` (a missing path is :class:`StorageNotFoundError`,
refused credentials :class:`StoragePermissionError`, a service that does not answer
:class:`StorageUnreachableError`) naming the URL and chained ``from`` the cause.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import IO, Any, Iterator, Optional

from torchrec_cloud import install_extra
from torchrec_cloud.errors import CommandError


class StorageError(OSError, CommandError):
    """A storage operation failed; ``path`` is the local path or URL it was about."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message

    def __reduce__(self) -> Any:  # crosses process boundaries intact
        return (type(self), (self.path, self.message))


class StorageNotFoundError(StorageError):
    """The path, bucket or container does not exist."""


class StoragePermissionError(StorageError):
    """The credentials found in the environment were refused."""


class StorageUnreachableError(StorageError):
    """The storage service did not answer (wrong endpoint, no network)."""


@dataclass(frozen=True)
class Backend:
    """How one URL scheme is served: the fsspec package and where its credentials come from."""

    module: str
    protocol: str
    credentials: str
    env: tuple[str, ...] = ()
    """Variables that select the endpoint or credentials (a change means a new client)."""


# Cloud specifics are data: one entry per URL scheme.
BACKENDS: dict[str, Backend] = {
    "s3": Backend(
        "s3fs",
        "s3",
        "AWS credentials from the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
        "AWS_PROFILE) or the instance/pod role; AWS_ENDPOINT_URL for S3-compatible services",
        ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"),
    ),
    "gs": Backend(
        "gcsfs",
        "gs",
        "Google Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS, workload "
        "identity); STORAGE_EMULATOR_HOST for an emulator",
        ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"),
    ),
    "gcs": Backend(
        "gcsfs", "gs", "Google Application Default Credentials",
        ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"),
    ),
    "az": Backend(
        "adlfs",
        "az",
        "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with a key, SAS "
        "token or managed identity",
        ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY"),
    ),
    "abfs": Backend(
        "adlfs", "abfs", "as for az://",
        ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY"),
    ),
}


def scheme(path: str) -> Optional[str]:
    """The URL scheme of ``path`` (``"s3"``, ``"gs"``, ...), or None for a local path."""
    head, sep, _ = str(path).partition("://")
    if not sep:
        return None
    if head == "file":
        return None
    if head not in BACKENDS:
        raise StorageError(
            path, f"unsupported URL scheme {head}://; use a local path or one of "
            + ", ".join(f"{s}://" for s in BACKENDS)
        )
    return head


def is_url(path: str) -> bool:
    """True for a bucket URL (``s3://``, ``gs://``, ``az://``, ...), False for a local path."""
    return scheme(path) is not None


def local_path(path: str) -> str:
    """The file system path of a local ``path`` (``file://`` stripped)."""
    return path[len("file://"):] if str(path).startswith("file://") else str(path)


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a local path or a URL (URLs always use ``/``)."""
    if is_url(base):
        out = base.rstrip("/")
        for p in parts:
            out += "/" + p.strip("/")
        return out
    return os.path.join(local_path(base), *parts)


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem serving ``url`` and the path inside it (for fsspec-aware code,
    e.g. ``torch.distributed.checkpoint``'s fsspec writer). Local paths get fsspec's local
    filesystem."""
    sch = scheme(url)
    if sch is None:
        import fsspec

        return fsspec.filesystem("file"), os.path.abspath(local_path(url))
    backend = BACKENDS[sch]
    if backend.module == "gcsfs":
        # gcsfs' experimental hierarchical-namespace probing breaks against emulators and
        # buckets without it; it must be off before gcsfs is imported.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    try:
        __import__(backend.module)
        import fsspec
    except ImportError as e:
        raise StorageError(
            url,
            f"{sch}:// URLs need the '{backend.module}' package: {install_extra('cloud')}",
        ) from e
    options: dict[str, Any] = {}
    if backend.module == "gcsfs" and os.environ.get("STORAGE_EMULATOR_HOST"):
        # An emulator takes no credentials; without this gcsfs would probe the GCE
        # metadata server.
        options["token"] = "anon"
    # One client per process and per endpoint/credential settings: fsspec's own cache
    # would keep serving a client made for variables that have changed since.
    key = (backend.protocol, os.getpid(), tuple(os.environ.get(k) for k in backend.env))
    fs = _clients.get(key)
    if fs is None:
        try:
            fs = fsspec.filesystem(backend.protocol, skip_instance_cache=True, **options)
        except Exception as e:  # noqa: BLE001 - any backend failure to build a client
            raise _translate(url, e, "cannot create a client") from e
        _clients[key] = fs
    return fs, url.split("://", 1)[1]


_clients: dict[tuple, Any] = {}


def _translate(path: str, e: BaseException, doing: str) -> StorageError:
    """A typed StorageError for an exception raised by os or an fsspec backend."""
    if isinstance(e, StorageError):
        return e
    sch = scheme(path) if "://" in str(path) else None
    hint = f" (credentials: {BACKENDS[sch].credentials})" if sch else ""
    text = f"{type(e).__name__}: {e}".strip()
    name = type(e).__name__
    lowered = text.lower()
    if isinstance(e, FileNotFoundError) or "nosuchbucket" in lowered or "containernotfound" in lowered:
        return StorageNotFoundError(path, f"{doing}: not found ({text})")
    if isinstance(e, PermissionError) or any(
        s in lowered for s in ("accessdenied", "forbidden", "403", "401", "invalidaccesskeyid",
                               "signaturedoesnotmatch", "authenticationfailed", "authorization")
    ):
        return StoragePermissionError(path, f"{doing}: access denied{hint} ({text})")
    if isinstance(e, (ConnectionError, TimeoutError)) or any(
        s in name for s in ("EndpointConnectionError", "ClientConnectorError", "ServiceRequestError",
                            "ConnectTimeout", "ConnectionError", "ServerDisconnected")
    ) or "connect" in lowered:
        return StorageUnreachableError(path, f"{doing}: storage service unreachable{hint} ({text})")
    return StorageError(path, f"{doing}: {text}")


@contextlib.contextmanager
def _errors(path: str, doing: str) -> Iterator[None]:
    try:
        yield
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - every backend failure becomes a StorageError
        raise _translate(str(path), e, doing) from e


def open(path: str, mode: str = "rb") -> IO[Any]:  # noqa: A001 - mirrors builtins.open
    """Open a file for reading or writing (binary or text modes). Cloud writes appear
    only when the file is closed."""
    with _errors(path, f"cannot open ({mode})"):
        if not is_url(path):
            if any(c in mode for c in "wax"):
                os.makedirs(os.path.dirname(os.path.abspath(local_path(path))), exist_ok=True)
            return builtins.open(local_path(path), mode)
        fs, p = filesystem(path)
        return fs.open(p, mode)


def read_bytes(path: str, start: Optional[int] = None, end: Optional[int] = None) -> bytes:
    """The bytes of a file, or of its range ``[start, end)``."""
    with _errors(path, "cannot read"):
        if not is_url(path):
            with builtins.open(local_path(path), "rb") as f:
                if start:
                    f.seek(start)
                if end is None:
                    return f.read()
                # In pieces: read(n) sets n bytes aside first, and a cap (2 GiB for a
                # vocabulary) is far more than most files hold.
                left, parts = end - (start or 0), []
                while left > 0:
                    piece = f.read(min(left, 64 << 20))
                    if not piece:
                        break
                    parts.append(piece)
                    left -= len(piece)
                return b"".join(parts)
        fs, p = filesystem(path)
        return fs.cat_file(p, start=start, end=end)


def write_bytes(path: str, data: bytes) -> None:
    """Write a whole file. Readers never see it half-written: local files are written to a
    temporary name and renamed; object stores publish an object when its upload completes.
    Local files get the mode the umask gives (0644 under the usual 0022)."""
    with _errors(path, "cannot write"):
        if not is_url(path):
            local = local_path(path)
            parent = os.path.dirname(os.path.abspath(local))
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, f".tmp-{uuid.uuid4().hex[:12]}-{os.path.basename(local)}")
            # Not tempfile.mkstemp: its files are 0600 whatever the umask, and a renamed one
            # keeps that mode; a file made here gets the umask's mode, as DCP's own files do.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, local)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            return
        fs, p = filesystem(path)
        fs.pipe_file(p, data)


def exists(path: str) -> bool:
    """Whether a file or folder exists. A missing bucket is an error, not False."""
    with _errors(path, "cannot check"):
        if not is_url(path):
            return os.path.exists(local_path(path))
        fs, p = filesystem(path)
        return fs.exists(p)


def size(path: str) -> int:
    """Size of a file in bytes."""
    with _errors(path, "cannot stat"):
        if not is_url(path):
            return os.path.getsize(local_path(path))
        fs, p = filesystem(path)
        return int(fs.size(p))


def listdir(path: str) -> list[str]:
    """Names (not paths) of the entries directly under a folder, sorted; [] if it is empty.
    A folder that does not exist raises :class:`StorageNotFoundError`."""
    with _errors(path, "cannot list"):
        if not is_url(path):
            return sorted(os.listdir(local_path(path)))
        fs, p = filesystem(path)
        entries = fs.ls(p.rstrip("/"), detail=False, refresh=True)
        names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries}
        names.discard("")
        return sorted(names)


def list_sizes(path: str) -> dict[str, int]:
    """``{name: size}`` of the files directly under a folder, in one listing (a few requests
    for a bucket, however many files). A folder that does not exist raises
    :class:`StorageNotFoundError`."""
    with _errors(path, "cannot list"):
        if not is_url(path):
            with os.scandir(local_path(path)) as entries:
                return {e.name: e.stat().st_size for e in entries if e.is_file()}
        fs, p = filesystem(path)
        entries = fs.ls(p.rstrip("/"), detail=True, refresh=True)
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"]) for e in entries if e.get("type") == "file"
        }


def makedirs(path: str) -> None:
    """Create a folder and its parents. Object stores have no folders; for them this only
    checks that the bucket is there and reachable."""
    if is_url(path):
        check_access(path)  # not fs.exists: it answers False for an unreachable service too
        return
    with _errors(path, "cannot create folder"):
        os.makedirs(local_path(path), exist_ok=True)


def remove(path: str, recursive: bool = False) -> None:
    """Delete a file (or, with ``recursive``, a folder and everything under it). Deleting
    something that is not there is not an error."""
    with _errors(path, "cannot remove"):
        if not is_url(path):
            local = local_path(path)
            if os.path.isdir(local) and not os.path.islink(local):
                if recursive:
                    shutil.rmtree(local)
                else:
                    os.rmdir(local)
            elif os.path.lexists(local):
                os.unlink(local)
            return
        fs, p = filesystem(path)
        try:
            fs.rm(p, recursive=recursive)
        except FileNotFoundError:
            pass


def check_access(path: str) -> None:
    """Fail early, with a clear :class:`StorageError`, when the bucket or folder that
    ``path`` lives in cannot be reached with the credentials at hand."""
    with _errors(path, "cannot access"):
        if not is_url(path):
            return  # the OS reports local problems precisely when the path is used
        fs, p = filesystem(path)
        bucket = p.split("/", 1)[0]
        fs.ls(bucket, detail=False, refresh=True)
