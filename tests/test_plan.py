"""``torchrec-cloud plan``: TorchRec's planner for a cluster not rented yet, on this CPU.

The plans are TorchRec's own (its planner, enumerator and estimators, for a CUDA topology
built from flags or a cloud profile); what is checked is what a user reads off them: fits
or not, which kernel each table got, memory against the caps, and the way out when it
does not fit. That the trainer uses the same plan is checked where a 2-rank run already
happens (test_train.test_two_ranks_through_torchrun_agree_and_spread_tables).
"""

from __future__ import annotations

import json

import pytest

from torchrec_cloud.cli import main
from torchrec_cloud.config import ConfigError, parse_job_config
from torchrec_cloud.plan import GIB, Cluster, memory_gib, plan_once

CRITEO = ["--preset", "criteo-1tb"]


def plan_cli(capsys, *args: str) -> tuple[int, list[str], dict | None, str]:
    """Exit code, stdout lines, the JSON of the last line (with --json) and stderr."""
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    return code, lines, json.loads(lines[-1]) if "--json" in args and lines else None, err


def test_criteo_1tb_with_its_40m_row_tables_plans_on_one_80gb_gpu_with_uvm_caching(capsys):
    code, lines, report, _ = plan_cli(capsys, *CRITEO, "--gpus_per_node", "1", "--gpu_memory", "80", "--json")
    assert code == 0, lines
    assert report["fits"] and report["world_size"] == 1
    assert report["hbm_cap_bytes"] == 80 * GIB
    tables = {t["name"]: t for t in report["tables"]}
    assert len(tables) == 26 and max(t["rows"] for t in tables.values()) == 40_000_000
    assert all(t["dim"] == 128 and t["ranks"] == [0] for t in tables.values())
    cached = {n for n, t in tables.items() if t["compute_kernel"] == "fused_uvm_caching"}
    in_hbm = {n for n, t in tables.items() if t["compute_kernel"] == "fused"}
    assert cached and in_hbm and cached | in_hbm == set(tables)
    # Only the biggest tables are worth a cache: every cached one is a 40M-row table.
    assert all(tables[n]["rows"] == 40_000_000 for n in cached)
    # The planner's estimates stay within the GPU (after TorchRec's reservation) and the host.
    (rank,) = report["per_rank"]
    assert 0 < rank["hbm_bytes"] <= report["hbm_for_tables_bytes"] < report["hbm_cap_bytes"]
    assert 0 < rank["host_bytes"] <= report["host_cap_bytes"]
    assert report["estimated_step_ms"] > 0
    # The text a user reads: one row per table with its kernel, and the verdict.
    assert sum(" fused_uvm_caching " in line for line in lines) == len(cached)
    assert any(line.startswith(f"fits: {len(in_hbm)} fused, {len(cached)} fused_uvm_caching") for line in lines)


def test_two_p4d_nodes_hold_every_table_in_gpu_memory(capsys):
    args = [*CRITEO, "--cloud", "aws", "--instance", "p4d.24xlarge", "--nodes", "2", "--json"]
    code, lines, report, _ = plan_cli(capsys, *args)
    assert code == 0, lines
    assert report["fits"] and report["world_size"] == 16 and report["gpus_per_node"] == 8
    assert report["hbm_cap_bytes"] == int(39.39 * GIB)  # the profile's A100 40GB, as CUDA reports it
    assert {t["compute_kernel"] for t in report["tables"]} == {"fused"}
    assert {r for t in report["tables"] for r in t["ranks"]} == set(range(16))
    assert [r["rank"] for r in report["per_rank"]] == list(range(16))
    assert all(r["hbm_bytes"] <= report["hbm_for_tables_bytes"] for r in report["per_rank"])


def test_a_gpu_too_small_even_for_the_largest_tables_cache_says_why_and_what_would_hold_it(capsys):
    code, lines, report, _ = plan_cli(capsys, *CRITEO, "--gpus_per_node", "1", "--gpu_memory", "4", "--json")
    assert code == 1
    assert not report["fits"] and report["smallest_nodes"] is not None
    reason = lines[-2]  # the line before the JSON
    assert reason == report["reason"] and "\n" not in reason
    assert "does not fit" in reason and "t_cat_0" in reason and "40,000,000 rows" in reason
    assert f"the smallest cluster that holds it: {report['smallest_nodes']} nodes of 1 GPU of 4 GiB" in reason
    # The node count it names is the smallest that fits, by the planner itself.
    cfg = parse_job_config(CRITEO)
    n = report["smallest_nodes"]
    assert plan_once(cfg, Cluster(nodes=n, gpus_per_node=1, gpu_memory_gib=4)).fits
    assert not plan_once(cfg, Cluster(nodes=n - 1, gpus_per_node=1, gpu_memory_gib=4)).fits


def test_fused_only_names_the_kernel_choice_in_its_reason(capsys):
    code, lines, _, _ = plan_cli(capsys, *CRITEO, "--gpus_per_node", "1", "--gpu_memory", "80",
                                 "--embedding_kernel", "fused")  # fmt: skip
    assert code == 1
    assert "--embedding_kernel fused keeps every table in GPU memory" in lines[-1]


def test_cpu_nodes_plan_every_table_fused_in_host_memory(capsys):
    code, lines, report, _ = plan_cli(capsys, "--preset", "quickstart", "--gpus_per_node", "0", "--procs_per_node",
                                      "2", "--host_memory", "64", "--json")  # fmt: skip
    assert code == 0, lines
    assert report["world_size"] == 2 and report["hbm_cap_bytes"] == 0
    assert report["host_cap_bytes"] == 32 * GIB  # 64 GiB per node over its 2 ranks
    assert {t["compute_kernel"] for t in report["tables"]} == {"fused"}
    assert all(r["hbm_bytes"] == 0 and r["host_bytes"] > 0 for r in report["per_rank"])


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--nodes", "1"], "--gpus_per_node"),
        (["--gpus_per_node", "1"], "--gpu_memory"),
        (["--gpus_per_node", "0", "--embedding_kernel", "fused_uvm"], "--embedding_kernel"),
        (["--gpus_per_node", "1", "--gpu_memory", "80", "--cache_load_factor", "1.5"], "--cache_load_factor"),
        (["--cloud", "aws", "--instance", "p9.huge"], "--instance_type"),
        (["--gpus_per_node", "1", "--gpu_memory", "80", "--nodes", "0"], "--nodes"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(capsys, args, flag):
    code, lines, _, err = plan_cli(capsys, "--preset", "quickstart", *args)
    assert code == 2 and not lines
    assert len(err.strip().splitlines()) == 1 and f"error: {flag}:" in err, err


def test_profile_memory_sizes():
    assert memory_gib("1152 GiB") == 1152
    assert memory_gib("1.5 TiB") == 1536
    assert memory_gib("680 GB") == pytest.approx(680e9 / GIB)
    with pytest.raises(ValueError):
        memory_gib("lots")


def test_kernels_that_need_a_gpu_are_refused_on_cpu():
    cfg = parse_job_config(["--embedding_kernel", "fused_uvm_caching"])
    cfg.sharding.check_device("cuda")
    with pytest.raises(ConfigError) as e:
        cfg.sharding.check_device("cpu")
    assert e.value.flag == "embedding_kernel"
