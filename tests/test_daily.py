"""The daily loop's publishing half (issue #42): ``export --publish ROOT --gate DATASET``
publishes a model only when it scores DATASET's test split about as well as the one serving,
records its lineage, publishes a checkpoint once however often it is run, and ``serve ROOT``
swaps to what it publishes; the daily CronJob's step script resumes after a lost pod.

One module-scoped run: the planted events preprocessed (day 0 trains, 1 validates, 2 tests),
trained two epochs on one process with every step's checkpoint kept: step 1 has learned
little, the last one much more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import PYTHON, cli, explain, one_line_error, run
from test_serve import Server, get
from torchrec_cloud.cli import main
from torchrec_cloud.data.events_gen import DAY_S, SCHEMA, START, write_events

MODEL = ["--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1",
         "--batch_size", "100", "--no-progress", "--no-tensorboard", "--eval_every", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("daily")
    write_events(str(root / "events"), days=3, rows_per_day=600, seed=0)
    (root / "schema.yaml").write_text(SCHEMA)
    assert main(["data", "preprocess", "--no_progress", "--schema", str(root / "schema.yaml"), "--input",
                 str(root / "events"), "--output", str(root / "data"), "--split_by", "ts",
                 "--val_from", str(START + DAY_S), "--test_from", str(START + 2 * DAY_S)]) == 0  # fmt: skip
    proc = run([PYTHON, "-m", "torchrec_cloud", "train", "--dataset_path", str(root / "data"), *MODEL, "--num_epochs",
                "2", "--checkpoint_path", str(root / "ck"), "--checkpoint_interval", "1", "--checkpoint_keep", "0",
                "--output_dir", str(root / "run")])  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    return root


def versions(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def test_the_gate_refuses_a_worse_model_and_serve_swaps_to_what_passes(trained, capsys, tmp_path):
    root, data = tmp_path / "models", str(trained / "data")
    early, last = trained / "ck" / "step_00000001", sorted((trained / "ck").glob("step_*"))[-1]
    rc, out, err = cli(capsys, "export", str(early), "--publish", str(root), "--gate", data)
    assert rc == 0 and "names no model yet" in out, err
    (first,) = versions(root)
    server = Server(root, tmp_path, "--poll_s", "0.1")
    try:
        rc, out, err = cli(capsys, "export", str(last), "--publish", str(root), "--gate", data)
        assert rc == 0 and "passed" in out, err
        current = (root / "current").read_text().strip()
        assert current != first and versions(root) == sorted([first, current])
        server.wait_for(lambda: get(server.url + "/v2/models/m")[1]["versions"] == [current], "the new version served")
        lineage = json.loads((root / current / "model_config.json").read_text())["lineage"]
        assert lineage["parent"] == first and lineage["checkpoint"] == {"path": str(last), "step": 12}
        assert lineage["dataset"]["manifest_digest"] and lineage["dataset"]["vocabulary"]["version"] == 0
        assert lineage["gate"]["auc"] > lineage["gate"]["current_auc"]

        # The step-1 model again, now that a better one serves: refused, nothing written, current stays.
        line = one_line_error(capsys, 1, "export", str(early), "--publish", str(root), "--gate", data)
        assert "test AUC" in line and f"{lineage['gate']['current_auc']:.5f}" in line and "still names" in line
        new, served = [float(w.rstrip(":;,")) for w in line.split() if w[:2] == "0."][:2]
        assert new < served - 0.002
        assert (root / "current").read_text().strip() == current and versions(root) == sorted([first, current])
        assert get(server.url + "/v2/models/m")[1]["versions"] == [current]
    finally:
        assert server.stop() == 0


def test_a_checkpoint_already_serving_is_published_once(trained, capsys, tmp_path):
    root, last = tmp_path / "models", str(trained / "ck")
    assert cli(capsys, "export", last, "--publish", str(root), "--gate", str(trained / "data"))[0] == 0
    rc, out, _ = cli(capsys, "export", last, "--publish", str(root), "--gate", str(trained / "data"))
    assert rc == 0 and "nothing to publish" in out and len(versions(root)) == 1
    # A pod lost between writing a version and naming it: the version is there, current still
    # names its parent. Run again, the publish names it, and writes no other.
    early = str(trained / "ck" / "step_00000001")
    assert cli(capsys, "export", early, "--publish", str(root / "next"))[0] == 0
    (first,) = versions(root / "next")
    assert cli(capsys, "export", last, "--publish", str(root / "next"), "--gate", str(trained / "data"))[0] == 0
    second = (root / "next" / "current").read_text().strip()
    (root / "next" / "current").write_text(first + "\n")
    rc, out, _ = cli(capsys, "export", last, "--publish", str(root / "next"), "--gate", str(trained / "data"))
    assert rc == 0 and "not yet named" in out
    assert (root / "next" / "current").read_text().strip() == second and versions(root / "next") == sorted([first, second])


def test_gate_and_tolerance_need_publish(trained, capsys, tmp_path):
    line = one_line_error(capsys, 2, "export", str(trained / "ck"), "--output", str(tmp_path / "m"), "--gate", "x")
    assert "--gate" in line and "--publish" in line


# -- the daily CronJob (render --job daily) -------------------------------------------------

DAY = "2026-11-28"
TINY = ["--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1",
        "--batch_size", "100", "--no-progress", "--no-tensorboard", "--eval_every", "0", "--num_epochs", "3",
        "--checkpoint_interval", "2"]  # fmt: skip


def daily(**kw) -> list[dict]:
    from test_render import render

    return render(job="daily", **kw)


@pytest.mark.parametrize("cloud", ["generic", "aws", "gcp", "azure"])
def test_every_cloud_renders_a_valid_admitted_daily_cronjob(cloud):
    from test_render import assert_hardened, by_kind, validate
    from torchrec_cloud.deploy import admission

    docs = daily(cloud=cloud, gpus_per_node=1)
    for doc in docs:
        validate(doc)
    assert admission.check(docs) == [] and [d["kind"] for d in docs] == ["Namespace", "ServiceAccount", "CronJob",
                                                                         "NetworkPolicy"]  # fmt: skip
    assert_hardened(docs)
    cron = by_kind(docs, "CronJob")["spec"]
    assert cron["concurrencyPolicy"] == "Forbid" and cron["schedule"] == "0 2 * * *"
    # What `submit` compares with the cluster: the Job template's podFailurePolicy is GA in 1.31.
    assert by_kind(docs, "CronJob")["metadata"]["annotations"]["torchrec-cloud/min-kubernetes"] == "1.31"
    (container,) = cron["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["bash", "-c"] and "--gate" in container["command"][2]


def test_daily_flags_are_checked():
    from torchrec_cloud.config import ConfigError
    from torchrec_cloud.deploy.spec import DeploySpec

    for kw, flag in [({"nodes": 2}, "nodes"), ({"schedule": "daily"}, "schedule"),
                     ({"train_args": ["--dataset_path", "x"]}, "train_args")]:  # fmt: skip
        with pytest.raises(ConfigError) as caught:
            DeploySpec(job="daily", gpus_per_node=0, **kw)
        assert caught.value.flag == flag or flag == "train_args"
    with pytest.raises(ConfigError, match="--job daily"):
        DeploySpec(schedule="0 3 * * *")


def test_the_daily_steps_resume_after_a_lost_pod_and_publish_once(tmp_path):
    """The CronJob's own script, run here against a local root: killed during training, run
    again (the retried pod), it finishes the day and publishes it once; a third run (a pod
    retried after the publish) changes nothing."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import env_for_subprocess
    from test_render import by_kind

    cron = by_kind(daily(cloud="generic", gpus_per_node=0, train_args=TINY), "CronJob")
    (container,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    script = container["command"][2]
    root = tmp_path / "daily"
    write_events(str(root / "input" / DAY), days=1, rows_per_day=1500, seed=4)
    (root / "schema.yaml").write_text(SCHEMA)
    env = {**env_for_subprocess(), "DAY": DAY, "DAILY_ROOT": str(root), "DAILY_SCHEMA": str(root / "schema.yaml"),
           "DAILY_INPUT": str(root / "input"), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip

    def step(**kw) -> subprocess.Popen:
        return subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True, **kw)  # fmt: skip

    pod = step()
    checkpoints = root / "checkpoints" / DAY
    try:
        deadline = time.monotonic() + 600
        while not list(checkpoints.glob("step_*/COMMIT.json")) and pod.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pod.poll() is None, pod.stdout.read()
    finally:
        os.killpg(pod.pid, signal.SIGKILL)  # the pod lost mid-training, its processes with it
        pod.wait()
    assert not (root / "models").exists()
    again = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    records = [json.loads(line) for line in (root / "runs" / DAY / "metrics.jsonl").read_text().splitlines()]
    assert any(r["event"] == "resume" and r["step"] >= 2 for r in records), "training resumed the day's checkpoint"
    (version,) = versions(root / "models")
    assert (root / "models" / "current").read_text().strip() == version
    third = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert third.returncode == 0 and "nothing to publish" in third.stdout, third.stdout[-3000:] + third.stderr[-3000:]
    assert versions(root / "models") == [version]
