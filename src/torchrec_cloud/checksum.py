"""Checksums of the files torchrec-cloud writes (checkpoints, data shards), to tell damaged
bytes from good ones when they are read back.

The hash is xxHash's XXH3 (64 bits), as hex: fast enough to compute while the bytes are
written or read (a checksum must not slow a save down), and sensitive to any changed byte.
It guards against damage (a bad disk, a copy cut short or altered, bit rot), not against
someone who means to forge a file.

A checkpoint file's checksum is a list: the hash of each :data:`BLOCK_BYTES` block, so that
a rank that reads part of a file can verify exactly the blocks it reads::

    hasher = BlockHasher()
    hasher.update(b"...")                  # as the bytes are written, in order
    hasher.blocks()                        # ["9a3c...", ...]
    hash_file(path).blocks()               # the same, of a file read back
    first_mismatch(path, blocks)           # None, or which bytes differ

A data shard's checksum is one hash of the whole file (:func:`digest`, :func:`file_digest`).
"""

from __future__ import annotations

import math
from typing import Optional

from torchrec_cloud import storage

ALGORITHM = "xxh3_64"
BLOCK_BYTES = 4 << 20
"""Block size of checkpoint checksums: about one object-store read, and a few hundred bytes
of COMMIT.json per GiB of checkpoint."""
_READ_BYTES = 8 << 20


def _new():
    import xxhash

    return xxhash.xxh3_64()


def digest(data: bytes | memoryview) -> str:
    """The checksum of ``data`` (hex)."""
    h = _new()
    h.update(data)
    return h.hexdigest()


class BlockHasher:
    """The checksum of each ``block_bytes`` block of a stream of bytes fed in order."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self.size = 0
        self._done: list[str] = []
        self._hash = _new()
        self._filled = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_bytes - self._filled)
            self._hash.update(view[:take])
            self._filled += take
            self.size += take
            view = view[take:]
            if self._filled == self.block_bytes:
                self._done.append(self._hash.hexdigest())
                self._hash.reset()
                self._filled = 0

    def blocks(self) -> list[str]:
        """The checksums of the blocks so far, the last one possibly partial."""
        return self._done + ([self._hash.hexdigest()] if self._filled else [])


def block_count(size: int, block_bytes: int = BLOCK_BYTES) -> int:
    """How many checksums a file of ``size`` bytes has."""
    return math.ceil(size / block_bytes)


def hash_file(path: str, block_bytes: int = BLOCK_BYTES) -> BlockHasher:
    """A file (local path or URL) read start to end through a :class:`BlockHasher`."""
    hasher = BlockHasher(block_bytes)
    with storage.open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            hasher.update(chunk)
    return hasher


def file_digest(path: str) -> tuple[int, str]:
    """``(size, checksum)`` of a whole file (local path or URL), read start to end."""
    whole = hash_file(path, block_bytes=1 << 62)  # one block: the hash of every byte
    return whole.size, (whole.blocks() or [digest(b"")])[0]


def first_mismatch(path: str, expected: list[str], block_bytes: int = BLOCK_BYTES) -> Optional[str]:
    """None when the file's blocks have the ``expected`` checksums, else what differs (the
    first bad block's byte range). Reads the whole file."""
    hasher = hash_file(path, block_bytes)
    actual = hasher.blocks()
    for i, (want, got) in enumerate(zip(expected, actual)):
        if want != got:
            return describe_block(i, hasher.size, block_bytes)
    if len(actual) != len(expected):
        return f"{hasher.size} bytes, not the {len(expected)} blocks of {block_bytes} bytes that were written"
    return None


def describe_block(index: int, size: int, block_bytes: int = BLOCK_BYTES) -> str:
    """What a mismatch of block ``index`` of a ``size``-byte file means, in one phrase."""
    start = index * block_bytes
    return (
        f"bytes {start}..{min(start + block_bytes, size)} differ from what was saved "
        f"({ALGORITHM} checksum mismatch)"
    )
