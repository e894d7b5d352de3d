"""The GPU scripts as a user runs them on a machine without a GPU, and what their GPU runs
rely on that a CPU can check (issue #43).

``bash scripts/install.sh && bash bench/gpu_check.sh && bash bench/gpu_bench.sh`` is the
command a GPU machine runs; here (no GPU) each script prints one ``NOT RUN name: why`` line per
phase or check and exits 3. The uvm phase's GPU memory cap is checked against TorchRec's
planner: at that cap the full criteo-1tb tables get a UVM cache, on the whole H200 they do not.
The staging for a machine that cannot install (``GPU_STAGING``) is unpacked from a small
staging folder made here.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from torchrec_cloud.cli import main

REPO = Path(__file__).resolve().parents[1]
CHECKS = ("fused", "uvm_prefetch", "cache_unlocked", "host_lengths", "rng_devices", "pinned")


def run_script(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", f"bench/{script}", *args], cwd=REPO, env=environ, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def not_run_names(proc: subprocess.CompletedProcess) -> list[str]:
    lines = proc.stdout.strip().splitlines()
    assert lines and all(line.startswith("NOT RUN ") for line in lines), proc.stdout + proc.stderr
    assert all("no CUDA GPU visible" in line for line in lines), lines
    return [line[len("NOT RUN "):].split(":")[0] for line in lines]


def test_gpu_bench_without_a_gpu_says_not_run_for_each_phase_and_exits_3():
    proc = run_script("gpu_bench.sh")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert not_run_names(proc) == ["info", "quickstart", "criteo", "uvm"]
    proc = run_script("gpu_bench.sh", "uvm")
    assert proc.returncode == 3 and not_run_names(proc) == ["uvm"]


def test_gpu_check_without_a_gpu_says_not_run_for_each_check_and_exits_3():
    proc = run_script("gpu_check.sh")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert not_run_names(proc) == list(CHECKS)


def test_gpu_train_and_the_device_run_without_a_gpu_say_not_run_and_exit_3(tmp_path):
    proc = run_script("gpu_train.sh")
    assert proc.returncode == 3 and not_run_names(proc) == ["gpu_train"]
    proc = run_script("gpu_device_run.sh", OUT=str(tmp_path))
    assert proc.returncode == 3 and not_run_names(proc) == ["gpu_device_run"]
    assert (tmp_path / "summary.txt").read_text().startswith("NOT RUN gpu_device_run: ")


def test_without_the_projects_python_the_scripts_say_what_to_run():
    for script in ("gpu_bench.sh", "gpu_check.sh"):
        proc = run_script(script, PYTHON=str(REPO / "no-such-venv" / "python"))
        assert proc.returncode == 3, (script, proc.stdout, proc.stderr)
        assert "run bash scripts/install.sh" in proc.stdout and proc.stdout.startswith("NOT RUN "), proc.stdout


def test_an_unknown_phase_is_one_line_and_exit_2():
    proc = run_script("gpu_bench.sh", "info", "uvmm")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "gpu_bench: no phase uvmm (phases: info quickstart criteo profile_quickstart profile_criteo ab uvm)"
    ]


def uvm_gpu_memory() -> float:
    """The uvm phase's default cap, as gpu_bench.sh sets it."""
    (value,) = re.findall(r"^UVM_GPU_MEMORY=\$\{UVM_GPU_MEMORY:-([0-9.]+)\}$", (REPO / "bench/gpu_bench.sh").read_text(),
                          re.M)  # fmt: skip
    return float(value)


def plan_kernels(capsys, gib: float) -> dict[str, int]:
    code = main(["plan", "--preset", "criteo-1tb", "--batch_size", "65536", "--gpus_per_node", "1",
                 "--gpu_memory", str(gib), "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, out + err
    return json.loads(out.strip().splitlines()[-1])["kernels"]


def test_the_uvm_phases_gpu_memory_cap_makes_the_planner_cache_tables_a_h200_would_hold(capsys):
    # What the trainer's planner gets under `bench --gpu_memory` (distributed.topology) is what
    # `plan --gpu_memory` plans for: the same planner, the same cap on the GPU's memory.
    assert plan_kernels(capsys, 139.8) == {"fused": 26}  # the whole H200: no UVM to measure
    capped = plan_kernels(capsys, uvm_gpu_memory())
    assert capped.get("fused_uvm_caching", 0) >= 1 and sum(capped.values()) == 26, capped


def test_bench_gpu_memory_is_refused_without_a_measurement_to_apply_it_to(capsys):
    assert main(["bench", "--gpu_memory", "79"]) == 2
    assert "--gpu_memory: applies to one measurement of our trainer: add --worker ours" in capsys.readouterr().err
    assert main(["bench", "--worker", "ours", "--gpu_memory", "0"]) == 2
    assert "--gpu_memory: must be > 0" in capsys.readouterr().err


def _staging(root: Path) -> None:
    """A staging folder as bench/gpu_ship.py and `pip download` make it, with tiny packages."""
    (root / "whl").mkdir(parents=True)
    with zipfile.ZipFile(root / "whl" / "tinyrec-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("tinyrec/__init__.py", "NAME = 'tinyrec'\n")
    (root / "fbgemm").mkdir()
    payload = b"NAME = 'tinyfbgemm'\n"
    with tarfile.open(root / "fbgemm" / "fbgemm_gpu.tar.xz", "w:xz") as tar:
        info = tarfile.TarInfo("tinyfbgemm/__init__.py")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))


@pytest.mark.parametrize("with_xz", [True, False], ids=["xz", "python"])
def test_a_staging_folder_is_unpacked_once_onto_the_path(tmp_path, with_xz):
    _staging(tmp_path / "staging")
    site = tmp_path / "site"
    path = os.environ["PATH"]
    if not with_xz:  # the machine's tools, less xz: Python's lzma unpacks it
        (tmp_path / "bin").mkdir()
        for tool in ("ls", "mkdir", "touch", "tar"):
            (tmp_path / "bin" / tool).symlink_to(shutil.which(tool))
        path = str(tmp_path / "bin")
    script = ('. bench/gpu_env.sh && prepare_staging && prepare_staging && '
              '"$PYTHON" -c "import tinyrec, tinyfbgemm; print(tinyrec.NAME, tinyfbgemm.NAME)"')  # fmt: skip
    env = {**os.environ, "PYTHON": sys.executable, "GPU_STAGING": str(tmp_path / "staging"), "GPU_SITE": str(site)}
    bash = subprocess.run(["bash", "-c", "command -v bash"], capture_output=True, text=True).stdout.strip()
    proc = subprocess.run([bash, "-c", f"PATH={path}; {script}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "tinyrec tinyfbgemm"
    assert sum(line.startswith("staging ") for line in lines) == 1  # the second call found it unpacked
    assert (site / ".done").exists()


def test_a_staging_folder_without_its_archive_is_one_line():
    proc = subprocess.run(["bash", "-c", ". bench/gpu_env.sh && prepare_staging"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "GPU_STAGING": "/nonexistent-staging", "PYTHON": sys.executable},
                          timeout=60)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "GPU_STAGING=/nonexistent-staging has no fbgemm/fbgemm_gpu.tar.xz or whl/*.whl (bench/gpu_ship.py makes them)"
    ]


def test_the_cache_counters_are_read_only_where_a_table_has_a_uvm_cache():
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from torchrec_cloud import compat
    from torchrec_cloud.bench import cache_hit_rate

    tbe = SplitTableBatchedEmbeddingBagsCodegen([(100, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)])
    # A table in host memory on a CPU has no cache: nothing to count, no hit rate to report.
    assert compat.gather_cache_stats(tbe) == 0 and compat.cache_stats(tbe) is None
    assert cache_hit_rate(None) is None
    assert cache_hit_rate({"num_unique_indices": 200, "num_unique_misses": 50}) == 0.75


def test_a_device_run_step_ends_what_it_started_and_nothing_else(tmp_path):
    # gpu_device_run.sh ends a step's leftovers (a torchrun worker in a session of its own, say)
    # by the tag in their environment: a process it did not start, however named, lives on.
    text = (REPO / "bench/gpu_device_run.sh").read_text()
    functions = re.search(r"^say\(\) .*?$", text, re.M).group(0) + "\n" + re.search(r"^step\(\) \{.*?^\}$", text,
                                                                                       re.M | re.S).group(0)  # fmt: skip
    script = f"""
set -u
BUDGET=100 T0=$SECONDS SUMMARY={tmp_path}/summary.txt LOG={tmp_path}/steps.log
{functions}
sleep 600 & theirs=$!
step leaves_one 30 bash -c 'setsid sleep 601 </dev/null >/dev/null 2>&1 & echo $! > {tmp_path}/ours.pid'
sleep 0.5
kill -0 "$theirs" && echo "theirs alive"
state=$(awk '{{print $3}}' /proc/"$(cat {tmp_path}/ours.pid)"/stat 2>/dev/null)
case "$state" in ""|Z) echo "ours ended";; esac  # gone, or a zombie its new parent has not reaped
kill "$theirs"
"""
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    lines = proc.stdout.strip().splitlines()
    # The step's seconds are bash's whole $SECONDS: a short step that crosses a second's
    # boundary says 1 s (it did so once in CI), so the count is not part of the verdict.
    assert len(lines) == 3 and re.fullmatch(r"step leaves_one: exit 0 in \d+ s", lines[0]), proc.stdout + proc.stderr
    assert lines[1:] == ["theirs alive", "ours ended"], proc.stdout + proc.stderr
    assert "ending leaves_one's leftover process" in (tmp_path / "steps.log").read_text()
