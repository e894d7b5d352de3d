"""torchrec-cloud: DLRM/DCNv2 training with TorchRec on one CPU, one GPU box, or many nodes."""

__version__ = "0.1.0"


def counted(n: int, noun: str) -> str:
    """``1 shard``, ``2 shards``: a count with its noun in the right number (``noun`` is the
    singular; the plural adds an s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def install_extra(extra: str) -> str:
    """How to add an extra of this package: torchrec-cloud is installed from its checkout
    (``make install``), not from a package index, so the checkout's own extras."""
    return f"pip install -e '.[{extra}]' in the torchrec-cloud checkout"
