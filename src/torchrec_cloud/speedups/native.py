"""The speed-ups' C kernels (``cpu_kernels.c``), compiled for this machine and loaded with ctypes.

    python -m torchrec_cloud.speedups.native   # build now (scripts/install.sh does), print the library

The library is built once per source, compiler flags, compiler and CPU (``-march=native``:
a copy built on another machine is never loaded) into ``$TORCHREC_CLOUD_KERNEL_CACHE``
(default ``~/.cache/torchrec-cloud/kernels``), written to a temporary name and renamed, so
ranks that start together never load half a file. Without a C compiler, or switched off
(``--no-cpu_kernels``, which the speed-ups layer passes to :func:`set_enabled`),
:func:`library` returns None (after one warning where it could not be built) and callers
use their torch-op path: same arithmetic, slower. The kernels: the dot interaction and the
MLP layers' bias and ReLU (arches.py), the tables' lookup and row-wise Adagrad update
(rowwise_adagrad.py), and the signals of the shared-memory collectives (shm_group.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


class NativeBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded here."""


def compiler() -> Optional[str]:
    """``$CC``, else ``cc`` or ``gcc`` on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    configured = os.environ.get("TORCHREC_CLOUD_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torchrec-cloud" / "kernels"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the architecture and the CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {flags.strip()}"


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build() -> Path:
    """Compile the kernels for this machine unless an identical build is cached; its path."""
    cc = compiler()
    if cc is None:
        raise NativeBuildError("no C compiler found (set CC, or install gcc)")
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), _compiler_version(cc), _cpu_signature()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise NativeBuildError(f"{cc} failed on {SOURCE} (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.dot_interaction_forward.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.dot_interaction_forward.restype = None
    lib.dot_interaction_backward.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.dot_interaction_backward.restype = None
    lib.bias_relu_forward.argtypes = [ptr, ptr, i64, i64]
    lib.bias_relu_forward.restype = None
    lib.relu_bias_backward.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64]
    lib.relu_bias_backward.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.rowwise_adagrad_update.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, f32, f32]
    lib.rowwise_adagrad_update.restype = ctypes.c_int
    lib.bag_rows.argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr]
    lib.bag_rows.restype = ctypes.c_int
    lib.pooled_lookup.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ctypes.c_int, ptr]
    lib.pooled_lookup.restype = ctypes.c_int
    i32 = ctypes.c_int32
    lib.shm_publish.argtypes = [ptr, i32]
    lib.shm_publish.restype = ctypes.c_int
    lib.shm_wait.argtypes = [ptr, i32, i64]
    lib.shm_wait.restype = ctypes.c_int
    return lib


_enabled = True


def set_enabled(enabled: bool) -> None:
    """Use the kernels (the default) or not (``--no-cpu_kernels``): for this whole process, as
    they are loaded into it once."""
    global _enabled
    _enabled = enabled
    library.cache_clear()


@functools.lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None where they are switched off or cannot be built (one warning)."""
    if not _enabled:
        return None
    # torch first: the kernels' libgomp.so.1 then resolves to torch's copy (one thread pool).
    import torch  # noqa: F401

    try:
        return _declare(ctypes.CDLL(str(build())))
    except (NativeBuildError, OSError) as e:
        warnings.warn(
            f"torchrec-cloud: CPU kernels unavailable ({e}); the dot interaction uses torch ops "
            "(same results, slower). Install a C compiler (gcc) to use them.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def main() -> int:
    try:
        print(build())
    except NativeBuildError as e:
        print(f"torchrec-cloud: CPU kernels not built: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
