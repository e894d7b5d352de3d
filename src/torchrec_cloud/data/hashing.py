"""Deterministic hashing of int64 tensors: ids and weights derived from keys without storing them.

The planted teacher's weight for (table, id) and the multi-hot bags' extra ids are
functions of their keys, so a 40M-row table's teacher or bags need no memory and give the
same values on every rank and in every run::

    h = mix(keys)                       # splitmix64's finaliser, int64 in, int64 out
    w = hashed_normal(keys, salt=1)     # one N(0, 1) float per key
"""

from __future__ import annotations

import torch

# splitmix64's multipliers as int64 (torch has no uint64 arithmetic)
_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors: wrapping multiplications, and logical right
    shifts written as arithmetic ones masked to the bits a logical shift keeps."""
    x = x * _M1
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * _M2
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * _M3
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


def hashed_normal(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """A standard-normal float per int64 key, fixed by (key, salt)."""
    offset = (salt * 0x632BE59BD9B4E019) % (1 << 63)
    h = mix(keys + offset)
    u = ((h >> 11) & ((1 << 52) - 1)).double() / float(1 << 52)
    u = u.clamp(1e-12, 1 - 1e-12)
    return (torch.special.ndtri(u)).float()
