"""Progress of a long command that reads well wherever it goes: tqdm's bar in a terminal, and
outside one (a file, a pod's log) a plain line now and then, as ``train`` does::

    bar = Progress("preprocess", "rows", total=None)
    bar.update(65_536)        # terminal: the bar moves; a log: a line every EVERY_S seconds
    bar.close()

A log gets ``preprocess: 1,310,720 rows (61,233 rows/s)`` lines (``N of M rows, P%`` when
the total is known) and never tqdm's carriage returns; a run shorter than ``EVERY_S`` prints
none (the command's own last line says what it did).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Optional

EVERY_S = 30.0


def plural(n: int, word: str, many: Optional[str] = None) -> str:
    """``plural(1, "shard")`` is ``1 shard``; ``plural(3, "process", "processes")`` is ``3 processes``."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


class Progress:
    def __init__(self, desc: str, unit: str, total: Optional[int] = None, enabled: bool = True,
                 stream: Optional[IO[str]] = None) -> None:  # fmt: skip
        self.desc, self.unit, self.total = desc, unit, total
        self.stream = stream or sys.stderr
        self.count = 0
        self.start = self.last = time.perf_counter()
        self.bar: Any = None
        self.lines = enabled and not _is_terminal(self.stream)
        if enabled and not self.lines:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=f" {unit}", unit_scale=True, desc=desc, dynamic_ncols=True,
                            file=self.stream, leave=False)  # fmt: skip

    def update(self, n: int) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.lines:
            now = time.perf_counter()
            if now - self.last >= EVERY_S:
                self.last = now
                self.stream.write(self.line(now) + "\n")
                self.stream.flush()

    def line(self, now: Optional[float] = None) -> str:
        seconds = max((now or time.perf_counter()) - self.start, 1e-9)
        done = f"{self.count:,} {self.unit}"
        if self.total:
            done = f"{self.count:,} of {self.total:,} {self.unit}, {100 * self.count / self.total:.0f}%"
        return f"{self.desc}: {done} ({self.count / seconds:,.0f} {self.unit}/s)"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def quiet_library_warnings() -> None:
    """TorchRec and torch warn about internals users cannot act on; keep the console readable."""
    import logging
    import warnings

    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torch|torchrec|fbgemm_gpu)\b.*")
    for name in ("torchrec", "torch.distributed", "torch.fx"):
        logging.getLogger(name).setLevel(logging.ERROR)
