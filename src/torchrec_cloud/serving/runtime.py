"""The one loader of an exported model's scoring module, for ``serve``, ``predict`` and tests::

    from torchrec_cloud.serving.runtime import load_scorer

    scorer = load_scorer("models/q")                        # runtime="auto"
    scorer = load_scorer("s3://bucket/models/q", runtime="torchscript")
    scorer.runtime                                          # "pt2" or "torchscript": what loaded
    logits = scorer.logits_of_bags(dense, values, lengths)  # [B] float32, KJT layout (see scorer.py)
    probabilities = scorer.probabilities(dense, values, lengths)

``runtime`` (``serve --runtime``):

- ``"auto"``: the AOTInductor package (``scorer.pt2``, or ``scorer.cuda.pt2`` with
  ``device="cuda"``) when the folder has one compiled by this torch for this device,
  TorchScript (``scorer.pt``) otherwise: a folder exported elsewhere still serves;
- ``"pt2"``: the package, or a ServingError saying why not (none, another torch, another device);
- ``"torchscript"``: ``scorer.pt``.

Both runtimes take the same inputs (``dense`` [B, num_dense] float32, ``values`` [N] and
``lengths`` [F * B] int64, cast here), answer a batch of 1 and bags of no ids, and give the
same logits (``export`` checked them against TorchRec's). A loaded scorer keeps no state
from one call to the next.

``map_tables=True`` (``serve``): the TorchScript scorer's tables are replaced by the folder's
``tables.pt`` mapped read-only (``torch.load(..., mmap=True)``, no copy), so every process that
serves the folder shares one copy of them in the page cache; ``scorer.mapped`` says whether
they were (an export without ``tables.pt``, or the pt2 runtime: each process holds its copy,
docs/serving.md). From a bucket, ``tables.pt`` is copied once to a local file named by its
digest, which every process serving that version maps. The files are code (a TorchScript
archive, a shared library): a model folder must come from a trusted writer (docs/security.md);
each is read no further than the size ``model_config.json`` records. The folder torch extracts
a package into is removed once the package is loaded (``_load_aoti_package``): a process that
ends abruptly leaves no copy of the model behind.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
from typing import Any, Optional

import torch

from torchrec_cloud import storage
from torchrec_cloud.serving import CONFIG_FILE, PT2_FILES, SCORER_FILE, TABLES_FILE, ServingError, read_model_config
from torchrec_cloud.serving.scorer import TABLE_BUFFERS
from torchrec_cloud.untrusted import UntrustedInputError, read_capped

RUNTIMES = ("auto", "pt2", "torchscript")


class LoadedScorer:
    """A model folder's scorer, whichever runtime loaded it; ``runtime`` says which."""

    def __init__(self, module: Any, runtime: str, path: str, device: str = "cpu") -> None:
        self.module, self.runtime, self.path, self.device = module, runtime, path, device
        self.mapped: Optional[str] = None  # the tables file mapped in place of the module's own tables
        self._run: Any = None
        if runtime == "pt2":
            self._run = _flat_call(module)

    def _pt2(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if self._run is None:
            return self.module(dense, values, lengths)
        run, unflatten, out_spec = self._run
        return unflatten(run([dense, values, lengths]), out_spec)

    def logits_of_bags(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Click logits ``[B]`` (on the CPU) of multi-hot bags in TorchRec's
        KeyedJaggedTensor layout, the inputs on any device."""
        d = self.device
        dense, values, lengths = dense.to(d, torch.float32), values.to(d, torch.int64), lengths.to(d, torch.int64)
        with torch.no_grad():
            if self.runtime == "torchscript":
                return self.module.logits_of_bags(dense, values, lengths).cpu()
            return self._pt2(dense, values, lengths).cpu()

    def probabilities(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Click probabilities ``[B]``."""
        return torch.sigmoid(self.logits_of_bags(dense, values, lengths))


def _flat_call(module: Any) -> Optional[tuple[Any, Any, Any]]:
    """The package's loader called with the three tensors as they are, and its output's
    structure: what torch's ``AOTICompiledModel.__call__`` does at each call after reading the
    call's structure again from the package (torch/export/pt2_archive/_package.py), a cost of
    every batch. None (call the module) unless the package takes exactly three positional
    tensors, as export makes it."""
    from torch.utils import _pytree as pytree

    loader = getattr(module, "loader", None)
    try:
        in_spec, out_spec = loader.get_call_spec()  # type: ignore[union-attr]
        if pytree.treespec_loads(in_spec) != pytree.tree_structure(((0, 0, 0), {})):
            return None
        return loader.boxed_run, pytree.tree_unflatten, pytree.treespec_loads(out_spec)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - another torch's loader: the module's own call
        return None


def pt2_unusable(config: dict[str, Any], device: str) -> Optional[str]:
    """Why the folder's package for ``device`` cannot load here (None when it can): an
    AOTInductor package is compiled code for one torch build and one device."""
    name = PT2_FILES[device]
    if name not in config["files"]:
        return f"it has no {name} (export it with --format pt2{' on a GPU' if device == 'cuda' else ''})"
    built = (config.get("pt2") or {}).get("torch")
    if built != torch.__version__:
        return f"its {name} was compiled by torch {built}, this is torch {torch.__version__} (export it again)"
    if device == "cuda" and not torch.cuda.is_available():
        return f"its {name} needs CUDA, which this machine lacks"
    return None


def load_scorer(
    model_dir: str, runtime: str = "auto", device: str = "cpu", config: Optional[dict[str, Any]] = None,
    map_tables: bool = False,
) -> LoadedScorer:
    """The scorer of the model folder ``model_dir`` (a folder or bucket URL), by ``runtime``
    (see the module's docstring). ``config``: its model_config.json when already read and
    checked (:func:`~torchrec_cloud.serving.read_model_config`); ``map_tables``: see the module's
    docstring."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if device not in PT2_FILES:
        raise ValueError(f"device must be one of {', '.join(PT2_FILES)}, got {device!r}")
    if config is None:
        config = read_model_config(model_dir)
    why_not = pt2_unusable(config, device)
    if runtime == "pt2" and why_not:
        raise ServingError(f"{model_dir}: cannot score with pt2: {why_not}")
    if runtime == "pt2" or (runtime == "auto" and why_not is None):
        return _load_pt2(model_dir, PT2_FILES[device], config["files"][PT2_FILES[device]], device)
    if SCORER_FILE not in config["files"]:
        raise ServingError(f"{model_dir} has no {SCORER_FILE} (exported with --format pt2 alone) and pt2 "
                           f"cannot load here: {why_not}")  # fmt: skip
    module = _read_torchscript(model_dir, config["files"][SCORER_FILE])
    if device == "cuda":
        module = module.to("cuda")
    scorer = LoadedScorer(module, "torchscript", storage.join(model_dir, SCORER_FILE), device)
    if map_tables and device == "cpu" and TABLES_FILE in config["files"]:
        _map_tables(scorer, model_dir, config)
    return scorer


def _map_tables(scorer: LoadedScorer, model_dir: str, config: dict[str, Any]) -> None:
    """Replace the TorchScript module's tables by ``tables.pt`` mapped (see the module's
    docstring). The file is untrusted input: opened without following a link, its size the
    one model_config.json records, read as tensors only (``weights_only``), and each tensor
    must have the dtype and shape of the table it replaces and the same first and last row."""
    path = storage.join(model_dir, TABLES_FILE)
    size = config["files"][TABLES_FILE]
    local = _local_copy(path, size) if storage.is_url(model_dir) else storage.local_path(path)
    if local is None:
        return
    try:
        fd = os.open(local, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ServingError(f"{path}: cannot open it ({e.strerror}), though its {CONFIG_FILE} lists it: export again") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise ServingError(f"{path} holds {info.st_size} bytes, its {CONFIG_FILE} says {size} (altered or "
                               "truncated): export again")  # fmt: skip
        try:  # the descriptor checked above, by a name no one can swap (mmap needs a file name)
            mapped = torch.load(f"/proc/self/fd/{fd}", map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 - a damaged archive fails in many ways
            raise ServingError(f"{path} is not a loadable tables file ({type(e).__name__}: "
                               f"{' '.join(str(e).split())[:200]})") from None  # fmt: skip
    finally:
        os.close(fd)  # the mapping keeps the file
    tables = scorer.module.tables
    if not isinstance(mapped, dict) or sorted(mapped) != sorted(TABLE_BUFFERS):
        raise ServingError(f"{path} does not hold the tables {', '.join(TABLE_BUFFERS)}: export again")
    for name in TABLE_BUFFERS:
        own, new = getattr(tables, name), mapped[name]
        if not isinstance(new, torch.Tensor) or new.dtype != own.dtype or new.shape != own.shape:
            what = f"{new.dtype} {tuple(new.shape)}" if isinstance(new, torch.Tensor) else type(new).__name__
            raise ServingError(f"{path}: {name} is {what}, the scorer's {own.dtype} {tuple(own.shape)}: export again")
        if len(own) and not (torch.equal(own[:1], new[:1]) and torch.equal(own[-1:], new[-1:])):
            raise ServingError(f"{path}: {name} holds other values than the scorer's: not this model's tables")
    for name in TABLE_BUFFERS:
        setattr(tables, name, mapped[name])
    assert tables.weight.data_ptr() == mapped["weight"].data_ptr()  # the module reads the mapping, no copy
    scorer.mapped = local


# Copies of tables.pt from buckets kept on this machine: the current version's and the one
# before (a swap's old version may still be mapped; deleting a mapped file is safe anyway:
# the mapping keeps it until unmapped).
_KEPT_COPIES = 2


def _local_copy(url: str, size: int) -> Optional[str]:
    """A local file with the bytes of ``url`` (read no further than ``size``), named by their
    digest in a folder of this user's, so that every worker process serving the same version
    maps the same file: the page cache holds one copy, as for a local folder. None, with a
    note, where no such file can be kept (the tables then stay in each process, as before)."""
    data = _read(url, size)
    folder = os.path.join(tempfile.gettempdir(), f"torchrec-cloud-tables-{os.getuid()}")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            # another user's folder (or a link) could hand this process other tables
            print(f"torchrec-cloud serve: note: {folder} is not a private folder of this user: {url} is not "
                  "shared between workers", file=sys.stderr, flush=True)  # fmt: skip
            return None
        target = os.path.join(folder, hashlib.sha256(data).hexdigest() + ".pt")
        if not os.path.isfile(target) or os.path.getsize(target) != len(data):
            storage.write_bytes(target, data)  # whole or absent: workers racing write the same bytes
        os.utime(target)
    except OSError as e:  # a read-only or full temporary directory (storage's errors are OSErrors too)
        print(f"torchrec-cloud serve: note: {url} is not shared between workers (no local copy in {folder}: "
              f"{e.strerror or e})", file=sys.stderr, flush=True)  # fmt: skip
        return None
    try:  # the tidy-up; another worker's, at the same time, may remove a file first
        # (not a copy another worker is writing: storage.write_bytes's temporary name)
        copies = sorted((e for e in os.scandir(folder) if e.name.endswith(".pt") and not e.name.startswith(".tmp-")),
                        key=lambda e: e.stat().st_mtime)  # fmt: skip
        for old in copies[:-_KEPT_COPIES]:
            if old.path != target:
                os.unlink(old.path)
    except FileNotFoundError:
        pass
    return target


def _read(path: str, size: int) -> bytes:
    try:
        data = read_capped(path, size, expected=size)
    except UntrustedInputError as e:
        raise ServingError(f"{e}; its {CONFIG_FILE} says {size} bytes: export again") from None
    except storage.StorageNotFoundError:
        raise ServingError(f"{path} not found, though its {CONFIG_FILE} lists it: export again") from None
    return data


def _read_torchscript(model_dir: str, size: int) -> torch.jit.ScriptModule:
    path = storage.join(model_dir, SCORER_FILE)
    data = _read(path, size)
    try:
        return torch.jit.load(io.BytesIO(data), map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a damaged archive fails in many ways
        raise ServingError(f"{path} is not a loadable TorchScript module ({type(e).__name__})") from None


def _load_pt2(model_dir: str, name: str, size: int, device: str) -> LoadedScorer:
    path = storage.join(model_dir, name)
    data = _read(path, size)
    # The loader wants a file: the checked bytes go to a private one, never the folder's own
    # (which could change between the check and the load).
    with tempfile.TemporaryDirectory(prefix="torchrec-cloud-pt2-") as tmp:
        local = os.path.join(tmp, name)
        with open(local, "wb") as f:
            f.write(data)
        try:
            module = _load_aoti_package(local, device)
        except Exception as e:  # noqa: BLE001 - a damaged archive or library fails in many ways
            raise ServingError(f"{path} is not a loadable AOTInductor package ({type(e).__name__}: "
                               f"{' '.join(str(e).split())[:200]})") from None  # fmt: skip
    return LoadedScorer(module, "pt2", path, device)


# Why the folder torch extracts a package into is removed here. torch's loader
# (torch/csrc/inductor/aoti_package/model_package_loader.cpp, read in the GerHobbelt/pytorch
# mirror at f339b428, whose "aotinductor_" and "Shared model directory" strings torch 2.13.0's
# libtorch_cpu.so holds; pytorch/pytorch at 43292dd, older, has the same destructor) extracts
# into c10::make_tempdir("aotinductor_"): $TMPDIR/aotinductor_XXXXXX ($TMP, $TEMP, $TEMPDIR,
# else /tmp: c10/util/tempfile.cpp), removed only in ~AOTIModelPackageLoader. A process that
# ends without collecting the loader (a daemon thread holding the model, os._exit, SIGKILL, a
# worker replaced) leaves it: the library with the weights baked in, once per load, in a pod's
# ephemeral storage until the kubelet evicts the pod. Loaded, the library is mapped and a CPU
# package reads nothing more there. A CUDA package reads each kernel's cubin from the folder at
# its first launch (torch/_inductor/codegen/cpp_wrapper_gpu.py, generate_load_kernel): there
# only the mapped library (the bulk) goes, and the destructor removes the rest as before. The
# folder is found in this process's own mappings, so another process's or another load's in the
# same directory is never touched (a listing of the directory could not promise that); without
# /proc/self/maps (macOS) torch's behaviour is left as it is. A load that fails maps nothing:
# its folder, and the one torch's first of two attempts left (torch/_inductor/package/package.py,
# load_package), stay as before (versions.py does not load a refused version again).
_AOTI_PREFIX = "aotinductor_"
_AOTI_FOLDER = re.compile(r"aotinductor_[A-Za-z0-9]{6}")  # mkdtemp's XXXXXX
_AOTI_LOCK = threading.Lock()  # loads one at a time: the mappings a load adds are its own


def _load_aoti_package(path: str, device: str) -> Any:
    """``aoti_load_package(path)`` for ``device``, the folder torch extracted it into removed
    (see above)."""
    from torch._inductor import aoti_load_package

    with _AOTI_LOCK:
        before = _mapped_files()
        try:
            return aoti_load_package(path, device_index=0 if device == "cuda" else -1)
        finally:
            if before is not None:
                _remove_extracted(_mapped_files() or {}, before, whole_folder=device != "cuda")


def _mapped_files() -> Optional[dict[tuple[str, str], str]]:
    """This process's mapped files, by (device, inode), or None where no /proc/self/maps tells."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path, which may hold spaces]
        if len(fields) == 6 and fields[5].startswith("/") and _AOTI_PREFIX in fields[5]:
            out[(fields[3], fields[4])] = fields[5]
    return out


def _aoti_root() -> str:
    """The folder torch's loader makes its folders in (c10/util/tempfile.cpp), as the kernel
    names it in the mappings."""
    return os.path.realpath(next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if v in os.environ), "/tmp"))


def _remove_extracted(after: dict[tuple[str, str], str], before: dict[tuple[str, str], str],
                      whole_folder: bool) -> None:
    """Remove what the files mapped since ``before`` were extracted into: their whole
    aotinductor_XXXXXX folder, or (``whole_folder`` False) the mapped files alone. Only a
    folder of torch's name, right under its temporary directory, a directory (not a link) of
    this user's that no mapping of before this load was in. A tidy-up: what cannot be removed
    stays, as torch would have left it."""
    root = _aoti_root()
    under = os.path.join(root, "")  # "/tmp/", or "/" itself
    # folders mapped before (a model serving now, whose CUDA kernels may map more of them)
    earlier = {os.path.relpath(p, root).split(os.sep)[0] for p in before.values() if p.startswith(under)}
    for key, mapped in after.items():
        if key in before or mapped.endswith(" (deleted)") or not mapped.startswith(under):
            continue
        name = os.path.relpath(mapped, root).split(os.sep)[0]
        folder = os.path.join(root, name)
        if not _AOTI_FOLDER.fullmatch(name) or name in earlier:
            continue
        try:
            info = os.lstat(folder)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            if whole_folder:
                shutil.rmtree(folder)
            elif stat.S_ISREG(os.lstat(mapped).st_mode):
                os.unlink(mapped)  # the mapping keeps the library until the model is collected
        except OSError:
            pass
