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
from one call to the next. The files are code (a TorchScript
archive, a shared library): a model folder must come from a trusted writer (docs/security.md);
each is read no further than the size ``model_config.json`` records.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any, Optional

import torch

from torchrec_cloud import storage
from torchrec_cloud.serving import CONFIG_FILE, PT2_FILES, SCORER_FILE, ServingError, read_model_config
from torchrec_cloud.untrusted import UntrustedInputError, read_capped

RUNTIMES = ("auto", "pt2", "torchscript")


class LoadedScorer:
    """A model folder's scorer, whichever runtime loaded it; ``runtime`` says which."""

    def __init__(self, module: Any, runtime: str, path: str, device: str = "cpu") -> None:
        self.module, self.runtime, self.path, self.device = module, runtime, path, device

    def logits_of_bags(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Click logits ``[B]`` (on the CPU) of multi-hot bags in TorchRec's
        KeyedJaggedTensor layout, the inputs on any device."""
        d = self.device
        dense, values, lengths = dense.to(d, torch.float32), values.to(d, torch.int64), lengths.to(d, torch.int64)
        with torch.no_grad():
            if self.runtime == "torchscript":
                return self.module.logits_of_bags(dense, values, lengths).cpu()
            return self.module(dense, values, lengths).cpu()

    def probabilities(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Click probabilities ``[B]``."""
        return torch.sigmoid(self.logits_of_bags(dense, values, lengths))


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
    model_dir: str, runtime: str = "auto", device: str = "cpu", config: Optional[dict[str, Any]] = None
) -> LoadedScorer:
    """The scorer of the model folder ``model_dir`` (a folder or bucket URL), by ``runtime``
    (see the module's docstring). ``config``: its model_config.json when already read and
    checked (:func:`~torchrec_cloud.serving.read_model_config`)."""
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
    return LoadedScorer(module, "torchscript", storage.join(model_dir, SCORER_FILE), device)


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
    from torch._inductor import aoti_load_package

    path = storage.join(model_dir, name)
    data = _read(path, size)
    # The loader wants a file: the checked bytes go to a private one, never the folder's own
    # (which could change between the check and the load).
    with tempfile.TemporaryDirectory(prefix="torchrec-cloud-pt2-") as tmp:
        local = os.path.join(tmp, name)
        with open(local, "wb") as f:
            f.write(data)
        try:
            module = aoti_load_package(local, device_index=0 if device == "cuda" else -1)
        except Exception as e:  # noqa: BLE001 - a damaged archive or library fails in many ways
            raise ServingError(f"{path} is not a loadable AOTInductor package ({type(e).__name__}: "
                               f"{' '.join(str(e).split())[:200]})") from None  # fmt: skip
    return LoadedScorer(module, "pt2", path, device)
