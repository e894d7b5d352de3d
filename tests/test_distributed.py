"""Process set-up shared by every entry point: the allocator keeps a step's freed buffers."""

import os
import platform
import subprocess

import pytest

from helpers import PYTHON, REPO, explain

# Ten steps that each allocate, touch and free one 16 MiB buffer (one activation at batch
# 2048); prints the page faults they cost.
PROBE = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from torchrec_cloud.distributed import keep_freed_memory
    keep_freed_memory()
def step():
    t = torch.empty(4 << 20)
    t.fill_(1.0)
    del t
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, **env: str) -> int:
    proc = subprocess.run([PYTHON, "-c", PROBE, mode], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **env}, timeout=120)  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    return int(proc.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc only")
def test_freed_step_buffers_are_reused_without_page_faults():
    # 10 x 16 MiB = 40,960 pages: glibc maps and unmaps each one afresh by default. Kept,
    # the heap may still grow once or twice (Python's own small objects land in the gap).
    assert _faults("plain") > 20_000
    assert _faults("keep") < 2 * 4096 + 500
    # A user's own MALLOC_* setting wins over ours.
    assert _faults("keep", MALLOC_MMAP_THRESHOLD_="65536") > 20_000
