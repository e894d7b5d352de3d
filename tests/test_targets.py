"""Every cloud target as its own tool runs it: the pods of a bundle land where a device plugin
advertises what they ask for, torchx accepts the components (``torchx run --dryrun``) and
gets back what its schedulers drop, Azure ML and Vertex AI spot jobs resume.

The node side of the schedulability check is data (profiles' ``gpu_nodes`` and
``node_daemons``, read from eksctl v0.230.0, NVIDIA's device-plugin chart 0.20.0, GKE's device
plugin, the NVIDIA Network Operator); these tests tie that data to the committed cluster
configs and READMEs, and show the check refusing the configurations that left pods Pending.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from torchrec_cloud.config import ConfigError
from torchrec_cloud.deploy import azureml, schedulable, vertex
from torchrec_cloud.deploy.manifests import LAUNCHER_TEMPLATES, load_documents, render_bundle
from torchrec_cloud.deploy.profiles import load_profile
from torchrec_cloud.deploy.schedulable import Unschedulable, check_documents, extended_requests, pod_specs, tolerates
from torchrec_cloud.deploy.spec import DeploySpec

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "src/torchrec_cloud/deploy/profiles"
CLOUDS = ["aws", "azure", "gcp"]
# What a spot job's trainer gets on every target: the profiles' spot.checkpoint_every_s, in
# the background.
SPOT_FLAGS = "--checkpoint_every_s 600 --async_checkpoint"
GRACE = "TORCHREC_CLOUD_GRACE_S"


def bundle(**kw) -> list[dict]:
    return load_documents(render_bundle(DeploySpec(**kw)))


def profile_file(tmp_path: Path, cloud: str, change) -> str:
    """A copy of a shipped profile with ``change(data)`` applied, as --cloud takes it."""
    data = yaml.safe_load((PROFILES / f"{cloud}.yaml").read_text())
    change(data)
    path = tmp_path / f"{cloud}-changed.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


# -- where the pods can run --------------------------------------------------------------


def test_tolerations_match_taints_as_kubernetes_does():
    """k8s.io/api/core/v1/toleration.go ToleratesTaint, case by case."""
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    assert tolerates({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, taint)
    assert tolerates({"operator": "Exists"}, taint)  # no key, Exists: every taint
    assert tolerates({"key": "nvidia.com/gpu", "value": "present"}, taint)  # no operator: Equal, every effect
    assert not tolerates({"key": "nvidia.com/gpu", "value": "true"}, taint)
    assert not tolerates({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}, taint)
    assert not tolerates({"key": "sku", "operator": "Exists"}, taint)


@pytest.mark.parametrize("launcher", list(LAUNCHER_TEMPLATES))
def test_the_check_sees_every_launchers_pods(launcher):
    """Each launcher keeps its pod template elsewhere; the check finds it and what it asks for."""
    docs = bundle(cloud="aws", launcher=launcher, nodes=2, gpus_per_node=8)
    asks = [extended_requests(p) for p in pod_specs(docs)]
    assert asks and all(a == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 4} for a in asks), asks
    assert check_documents(docs, load_profile("aws")) == []


def test_efa_under_a_gpu_taint_is_refused(tmp_path):
    """The EKS config as it was: GPU node groups tainted nvidia.com/gpu=true, which eksctl's
    EFA device plugin does not tolerate, so nothing advertises vpc.amazonaws.com/efa."""
    def old_taint(data):
        data["gpu_nodes"]["taints"] = [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]
        data["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]

    with pytest.raises(Unschedulable) as e:
        render_bundle(DeploySpec(cloud=profile_file(tmp_path, "aws", old_taint), nodes=2, gpus_per_node=8))
    message = str(e.value)
    assert e.value.flag == "instance_type"
    assert "vpc.amazonaws.com/efa" in message and "EFA device plugin" in message
    assert "does not tolerate the taint nvidia.com/gpu=true:NoSchedule" in message
    assert "nvidia.com/gpu," not in message  # the NVIDIA plugin copies the node groups' taints: GPUs are advertised


def test_gpus_on_aks_need_the_node_label_the_chart_selects(tmp_path):
    """AKS runs no node-feature-discovery: without nvidia.com/gpu.present=true on the pools
    the device plugin chart's node affinity matches no node, and no GPU is advertised."""
    def no_label(data):
        data["gpu_nodes"]["labels"] = {}

    with pytest.raises(Unschedulable) as e:
        render_bundle(DeploySpec(cloud=profile_file(tmp_path, "azure", no_label), nodes=2, gpus_per_node=8))
    assert "nvidia.com/gpu" in str(e.value) and "nvidia.com/gpu.present In true" in str(e.value)


def test_infiniband_on_spot_pools_is_refused_naming_rdma():
    """The Network Operator's daemons tolerate nvidia.com/gpu but not AKS's spot taint."""
    assert bundle(cloud="azure", nodes=2, rdma=True)  # on-demand pools: advertised
    with pytest.raises(Unschedulable) as e:
        bundle(cloud="azure", nodes=2, rdma=True, spot=True, checkpoint_url="az://c/ck")
    assert e.value.flag == "rdma"
    assert "rdma/shared_ib" in str(e.value) and "kubernetes.azure.com/scalesetpriority=spot:NoSchedule" in str(e.value)


def _flat(taints):
    return [{"key": t["key"], "value": str(t["value"]), "effect": t["effect"]} for t in taints]


def test_the_cluster_configs_and_guides_are_the_profiles_data():
    """What the check assumes of the nodes is what the committed cluster files make, and the
    AKS guide installs the device plugin with the tolerations the check was given."""
    for cloud in CLOUDS:
        nodes = load_profile(cloud).gpu_nodes
        spot_taints = _flat(nodes["taints"] + nodes.get("spot", {}).get("taints", []))
        if cloud == "aws":
            groups = [g for g in yaml.safe_load((ROOT / "aws/eks_cluster.yaml").read_text())["managedNodeGroups"]
                      if g.get("efaEnabled")]
            assert [g["taints"] for g in groups] == [_flat(nodes["taints"]), spot_taints]
        if cloud == "azure":
            pools = list(yaml.safe_load_all((ROOT / "azure/aks_cluster.yaml").read_text()))[2:]
            for pool in pools:
                assert pool["spec"]["nodeLabels"] == nodes["labels"]
                assert pool["spec"]["nodeTaints"] == [f"{t['key']}={t['value']}:{t['effect']}" for t in nodes["taints"]]
        if cloud == "gcp":
            cluster, on_demand, spot = yaml.safe_load_all((ROOT / "gcp/gke_cluster.yaml").read_text())
            assert "taint" not in on_demand["spec"]["nodeConfig"]
            assert [(t["key"], t["value"]) for t in spot["spec"]["nodeConfig"]["taint"]] == [
                (t["key"], t["value"]) for t in spot_taints]
    readme = (ROOT / "azure/README.md").read_text()
    (tolerations,) = re.findall(r"--set-json 'tolerations=(\[.*?\])'", readme)
    plugin = next(d for d in load_profile("azure").node_daemons if d["id"] == "nvidia-device-plugin")
    assert json.loads(tolerations) == plugin["tolerations"]
    assert f"--version {plugin['helm']['version']}" in readme
    assert "--labels nvidia.com/gpu.present=true" in readme


def test_the_eks_cluster_config_is_one_eksctl_accepts():
    """aws/eks_cluster.yaml against eksctl v0.230.0's own ClusterConfig schema (strict)."""
    import jsonschema

    schema = json.loads((ROOT / "tests/schemas/eksctl.io_v1alpha5_clusterconfig.schema.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    config = yaml.safe_load((ROOT / "aws/eks_cluster.yaml").read_text())
    assert [e.message for e in validator.iter_errors(config)] == []
    config["managedNodeGroups"][1]["efaEnable"] = True  # the check can fail
    assert [e.message for e in validator.iter_errors(config)] == [
        "Additional properties are not allowed ('efaEnable' was unexpected)"]


def test_gke_mounts_filestore_the_way_the_cluster_supports():
    """gcp/storage.yaml mounts the share as plain NFS; the cluster enables no Filestore CSI
    add-on that nothing uses (nor the guide's gcloud command)."""
    cluster = next(yaml.safe_load_all((ROOT / "gcp/gke_cluster.yaml").read_text()))
    assert "gcpFilestoreCsiDriverConfig" not in json.dumps(cluster)
    assert "GcpFilestoreCsiDriver" not in (ROOT / "gcp/README.md").read_text()
    pv = next(yaml.safe_load_all((ROOT / "gcp/storage.yaml").read_text()))
    assert "nfs" in pv["spec"] and "csi" not in pv["spec"]


# -- TorchX ------------------------------------------------------------------------------


def _torchx(capsys, *argv: str) -> tuple[dict, dict]:
    """`torchx run --dryrun ...` through torchx's own CLI entry point: (the AppDef as torchx
    printed it, the scheduler request)."""
    from torchx.cli.argparse_util import ArgOnceAction, torchxconfig
    from torchx.cli.main import main

    # The CLI is made for one command per process: its actions' "given twice?" memory is
    # kept on their classes.
    torchxconfig.called_args.clear()
    ArgOnceAction.called_args.clear()
    main(["run", "--dryrun", "--workspace", "", *argv])
    out = capsys.readouterr().out
    app_text, request = out.split("=== SCHEDULER REQUEST ===")
    return app_text, yaml.safe_load(request)


def _volcano_pods(job: dict) -> list[dict]:
    assert job["kind"] == "Job" and job["apiVersion"] == "batch.volcano.sh/v1alpha1"
    return [t["template"] for t in job["spec"]["tasks"]]


def test_the_components_pass_torchx_s_linter():
    from torchx.specs.file_linter import validate

    for cloud in CLOUDS:
        assert validate(str(ROOT / cloud / "cloud_component.py"), "trainer") == [], cloud


@pytest.mark.parametrize("cloud", CLOUDS)
def test_torchx_run_dryrun_on_kubernetes(cloud, capsys):
    """The documented `torchx run` is accepted; what its kubernetes scheduler cannot carry
    (tolerations, spot selector, grace period) is missing from its pods, and the check says
    where that leaves them: on EKS nothing tolerates the EFA taint, on AKS and GKE the API
    server's ExtendedResourceToleration lets them onto on-demand GPU nodes."""
    app_text, job = _torchx(capsys, "-s", "kubernetes", "-cfg", "queue=default,service_account=torchrec-trainer",
                            f"{ROOT / cloud / 'cloud_component.py'}:trainer", "--nodes", "3", "--", "--batch_size", "512")
    assert "'torchrec-cloud/pod'" in app_text  # the pod fields travel with the AppDef
    pods = _volcano_pods(job)
    assert len(pods) == 3
    for index, pod in enumerate(pods):
        (c,) = pod["spec"]["containers"]
        assert c["command"][:2] == ["bash", "-c"]
        assert c["command"][2].startswith(f"export TORCHREC_CLOUD_NODE_RANK={index} && exec torchrec-cloud launch ")
        assert c["command"][2].endswith("--batch_size 512")
        assert not [e for e in c["env"] if "${" in e["value"]], c["env"]
        assert pod["spec"]["serviceAccountName"] == "torchrec-trainer"
        assert "tolerations" not in pod["spec"] and "terminationGracePeriodSeconds" not in pod["spec"]
    problems = schedulable.problems(pods[0]["spec"], load_profile(cloud))
    if cloud == "aws":
        (problem,) = problems
        assert "taint aws.amazon.com/efa=true:NoSchedule not tolerated" in problem.message
    else:
        assert problems == []


def _component(cloud: str):
    """``<cloud>/cloud_component.py`` as a module (the file a user runs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{cloud}_cloud_component", ROOT / cloud / "cloud_component.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchx_component_script_carries_what_the_scheduler_drops(capsys):
    """`python <cloud>/cloud_component.py` (the documented TorchX command) runs the component
    through torchx's runner and writes the dropped pod fields back: every cloud's spot pods
    land on spot GPU nodes that advertise what they ask for. AWS as a user runs it, the
    others in this process (each run of the file imports torch)."""
    from torchrec_cloud.deploy.torchx_component import main

    for cloud, url in (("aws", "s3://b/ck"), ("azure", "az://c/ck"), ("gcp", "gs://b/ck")):
        argv = ["--dry-run", "--nodes", "2", "--spot", "True", "--checkpoint_url", url]
        if cloud == "aws":
            done = subprocess.run([sys.executable, f"{cloud}/cloud_component.py", *argv], cwd=ROOT, text=True,
                                  capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=300)
            assert done.returncode == 0, done.stderr
            out = done.stdout
        else:
            assert main(_component(cloud).trainer, argv) == 0
            out = capsys.readouterr().out
        profile = load_profile(cloud)
        for pod in _volcano_pods(yaml.safe_load(out)):
            spec = pod["spec"]
            assert profile.spot["node_selector"].items() <= spec["nodeSelector"].items()
            assert spec["terminationGracePeriodSeconds"] == profile.termination_grace_period_s
            assert spec["serviceAccountName"] == "torchrec-trainer"
            assert (profile.identity or {}).get("pod_labels", {}).items() <= pod["metadata"]["labels"].items()
            assert schedulable.problems(spec, profile) == [], cloud
            (container,) = spec["containers"]
            assert f"--checkpoint_path {url}" in container["command"][2]
            # The spot job's cadence, and the grace its pods can count on whatever submitted
            # them (`torchx run` gives them Kubernetes' default 30 s).
            assert SPOT_FLAGS in container["command"][2], cloud
            env = {e["name"]: e["value"] for e in container["env"]}
            assert env[GRACE] == str(min(profile.reclaim_grace_s(), 30)), cloud


def test_aws_batch_reads_the_node_index_at_run_time(capsys, tmp_path):
    """Under aws_batch ${replica_id} is $AWS_BATCH_JOB_NODE_INDEX, which only a shell expands:
    the role's script exports it, and the launcher reads it too. Run as the container runs it
    (bash -c, a stand-in torchrec-cloud on PATH), node 1 gets rank 1 and the main node's
    address, node 0 hosts the store."""
    _, request = _torchx(capsys, "-s", "aws_batch", "-cfg", "queue=torchrec",
                         f"{ROOT / 'aws/cloud_component.py'}:trainer", "--nodes", "2",
                         "--mounts", "type=bind,src=/fsx,dst=/fsx")
    (node_range,) = request["job_def"]["nodeProperties"]["nodeRangeProperties"]
    container = node_range["container"]
    assert not [e for e in container["environment"] if "$" in e["value"]], container["environment"]
    assert [(v["host"]["sourcePath"], m["containerPath"]) for v, m in zip(container["volumes"], container["mountPoints"])] \
        == [("/fsx", "/fsx")]
    bash, flag, script = container["command"]
    assert "--output_dir /fsx/runs/torchrec-dlrm" in script
    stand_in = tmp_path / "torchrec-cloud"
    stand_in.write_text('#!/bin/sh\necho "rank=$TORCHREC_CLOUD_NODE_RANK"\n'
                        'for a in "$@"; do case "$a" in --rdzv_endpoint=*) echo "$a";; esac; done\n')
    stand_in.chmod(0o755)
    base = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    worker = subprocess.run([bash, flag, script], capture_output=True, text=True, env={
        **base, "AWS_BATCH_JOB_NODE_INDEX": "1", "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS": "10.0.0.5"})
    assert worker.stdout.split() == ["rank=1", "--rdzv_endpoint=10.0.0.5:29500"], worker.stderr
    main = subprocess.run([bash, flag, script], capture_output=True, text=True,
                          env={**base, "AWS_BATCH_JOB_NODE_INDEX": "0"})
    assert main.stdout.split() == ["rank=0", "--rdzv_endpoint=localhost:29500"], main.stderr

    import argparse

    from torchrec_cloud import launch

    for index, host in (("0", "1"), ("1", "0")):
        args = argparse.Namespace(rdzv_backend="c10d", rdzv_conf="join_timeout=60")
        os.environ.pop("TORCHREC_CLOUD_NODE_RANK", None)
        os.environ["AWS_BATCH_JOB_NODE_INDEX"] = index
        try:
            launch._set_is_host(args)
        finally:
            del os.environ["AWS_BATCH_JOB_NODE_INDEX"]
        assert args.rdzv_conf == f"join_timeout=60,is_host={host}"


def test_a_kubernetes_claim_is_no_aws_batch_volume(capsys):
    """torchx's aws_batch scheduler makes a VolumeMount an EFS file system id: the profile's
    claim is refused there, in one line naming --mounts."""
    from torchrec_cloud.deploy.torchx_component import main

    assert main(_component("aws").trainer, ["--dry-run", "--scheduler", "aws_batch", "--cfg", "queue=q"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--mounts" in line and "fsx-pvc" in line and "EFS" in line


# -- Azure ML and Vertex AI --------------------------------------------------------------


def _aml(job) -> dict:
    return yaml.safe_load(azureml.dump_job(job))


def test_azure_ml_spot_is_the_tier_the_sdk_sends_and_resumes_from_a_datastore():
    spec = DeploySpec(cloud="azure", nodes=2, gpus_per_node=8, spot=True, identity="client-id-1",
                      checkpoint_url="azureml://datastores/workspaceblobstore/paths/ck/run1")
    job = azureml.build_command_job(spec)
    d = _aml(job)
    assert d["compute"].endswith("serverless") and d["resources"]["instance_type"] == "Standard_ND96asr_v4"
    # What goes over the wire: the REST QueueSettings' jobTier.
    assert job._to_job()._to_rest_object().as_dict()["properties"]["queueSettings"] == {"jobTier": "Spot"}
    assert d["outputs"]["checkpoints"] == {"mode": "rw_mount", "type": "uri_folder",
                                           "path": "azureml://datastores/workspaceblobstore/paths/ck/run1"}
    assert d["identity"] == {"type": "managed_identity", "client_id": "client-id-1"}
    cmd = d["command"]
    assert "--checkpoint_path '${{outputs.checkpoints}}'" in cmd and SPOT_FLAGS in cmd
    # The trainer knows the notice a spot VM gets: it saves on SIGTERM only when a save fits.
    assert d["environment_variables"][GRACE] == "30"

    on_demand = _aml(azureml.build_command_job(DeploySpec(cloud="azure", nodes=2, gpus_per_node=8)))
    assert on_demand["compute"].endswith("gpu-cluster") and "queue_settings" not in on_demand
    assert "--checkpoint_every_s" not in on_demand["command"] and "--async_checkpoint" not in on_demand["command"]
    assert GRACE not in on_demand["environment_variables"]  # no grace is known there: none is told
    # A named cluster keeps its own priority: no job tier is sent to it.
    cluster = _aml(azureml.build_command_job(spec, compute="lowpri-cluster"))
    assert cluster["compute"].endswith("lowpri-cluster") and "queue_settings" not in cluster


def test_managed_targets_name_their_own_url_schemes(capsys):
    from torchrec_cloud.cli import main

    for target, cloud, url, scheme in (("azureml", "azure", "s3://b/ck", "azureml://"),
                                       ("vertex", "gcp", "/checkpoints", "gs://")):
        code = main(["submit", "--target", target, "--cloud", cloud, "--nodes", "2", "--dry-run", "--spot",
                     "--checkpoint_url", url])
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and "--checkpoint_url" in line and scheme in line and "s3://" not in line.split(url)[1], line
    with pytest.raises(ConfigError, match=r"az://criteo-data/checkpoints.*azureml://datastores/") as e:
        DeploySpec(cloud="azure", spot=True)
    assert "s3://" not in str(e.value)


def test_azure_ml_writes_a_blob_container_with_the_jobs_managed_identity(capsys, monkeypatch):
    """az:// on Azure ML (issue #43): the trainer writes it itself (adlfs, DefaultAzureCredential)
    with the job's user-assigned managed identity, which AZURE_CLIENT_ID names, in the storage
    account AZURE_STORAGE_ACCOUNT_NAME names where `submit` runs; without either, one line says
    which is missing, and never that the bucket would not outlive the node."""
    from torchrec_cloud.cli import main

    submit = ["submit", "--target", "azureml", "--cloud", "azure", "--nodes", "2", "--dry-run", "--spot",
              "--checkpoint_url", "az://checkpoints/run1"]  # fmt: skip
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "torchrecstore")
    assert main([*submit, "--identity", "client-id-1"]) == 0
    out, err = capsys.readouterr()
    d = yaml.safe_load(out)
    assert "--checkpoint_path az://checkpoints/run1" in d["command"] and "checkpoints" not in (d.get("outputs") or {})
    assert d["identity"] == {"type": "managed_identity", "client_id": "client-id-1"}
    env = d["environment_variables"]
    assert env["AZURE_CLIENT_ID"] == "client-id-1" and env["AZURE_STORAGE_ACCOUNT_NAME"] == "torchrecstore"
    assert SPOT_FLAGS in d["command"] and env[GRACE] == "30"

    assert main(submit) == 2  # no identity to write it with
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--identity" in line and "Storage Blob Data Contributor" in line and "outlive" not in line, line
    for account in (None, "Not An Account"):
        if account is None:
            monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME")
        else:
            monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", account)
        assert main([*submit, "--identity", "client-id-1"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "--checkpoint_url" in line and "AZURE_STORAGE_ACCOUNT_NAME" in line and "outlive" not in line, line


def test_vertex_refuses_what_its_api_refuses(capsys):
    from torchrec_cloud.cli import main

    code = main(["submit", "--target", "vertex", "--cloud", "gcp", "--nodes", "2", "--gpus_per_node", "4", "--dry-run"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "--gpus_per_node" in line and "a2-highgpu-8g comes with exactly 8 GPUs" in line
    with pytest.raises(ConfigError) as e:
        vertex.build_custom_job(DeploySpec(cloud="gcp", nodes=2), staging_bucket="my-bucket")
    assert e.value.flag == "staging_bucket"


def test_vertex_spot_resumes_and_writes_where_its_base_output_is():
    spec = DeploySpec(cloud="gcp", nodes=2, gpus_per_node=8, spot=True, checkpoint_url="gs://b/ck",
                      identity="trainer@p.iam.gserviceaccount.com")
    d = json.loads(vertex.dump_job(vertex.build_custom_job(spec, staging_bucket="gs://b")))["jobSpec"]
    assert d["scheduling"]["strategy"] == "SPOT" and d["scheduling"]["restartJobOnWorkerRestart"] is True
    assert d["serviceAccount"] == "trainer@p.iam.gserviceaccount.com"
    container = d["workerPoolSpecs"][0]["containerSpec"]
    script = container["command"][2]
    assert SPOT_FLAGS in script and "--checkpoint_path gs://b/ck" in script
    # Compute Engine's 30 s notice, not GKE's 15 s (its kubelet keeps half for system pods).
    assert {e["name"]: e["value"] for e in container["env"]}[GRACE] == "30"
    output_dir = re.search(r"--output_dir (\S+)", script).group(1)
    assert d["baseOutputDirectory"]["outputUriPrefix"] == "gs://" + output_dir.removeprefix("/gcs/")
    on_demand = json.loads(vertex.dump_job(vertex.build_custom_job(DeploySpec(cloud="gcp", nodes=2))))["jobSpec"]
    assert "scheduling" not in on_demand and "--checkpoint_every_s" not in json.dumps(on_demand)
    assert GRACE not in json.dumps(on_demand) and "--async_checkpoint" not in json.dumps(on_demand)
    assert "baseOutputDirectory" not in on_demand  # nothing written to a bucket: no output directory claimed


def test_one_spot_cadence_for_every_target(tmp_path):
    """A profile's spot.checkpoint_every_s is the cadence of its spot jobs on Kubernetes, Azure
    ML, Vertex AI and TorchX alike; a job's own --checkpoint_every_s wins everywhere."""
    from torchrec_cloud.deploy.torchx_component import build_app

    def every_target(cloud: str, url: str, managed_url: str, train_args: list[str]) -> dict[str, str]:
        """Each target's trainer command line for a spot job of the profile ``cloud``."""
        spec = DeploySpec(cloud=cloud, nodes=2, gpus_per_node=8, spot=True, checkpoint_url=url, train_args=train_args)
        (job,) = [d for d in load_documents(render_bundle(spec)) if d["kind"] == "Job"]
        (role,) = build_app(spec).roles
        commands = {"job": " ".join(job["spec"]["template"]["spec"]["containers"][0]["args"]), "torchx": role.args[1]}
        managed = dataclasses.replace(spec, checkpoint_url=managed_url)
        if managed_url.startswith("azureml://"):
            commands["azureml"] = _aml(azureml.build_command_job(managed))["command"]
        else:
            pools = json.loads(vertex.dump_job(vertex.build_custom_job(managed)))["jobSpec"]["workerPoolSpecs"]
            commands["vertex"] = pools[0]["containerSpec"]["command"][2]
        return commands

    def every_45_s(data: dict) -> None:
        data.setdefault("spot", {})["checkpoint_every_s"] = 45

    for cloud, url, managed_url in (("azure", "az://c/ck", "azureml://datastores/workspaceblobstore/paths/ck"),
                                    ("gcp", "gs://b/ck", "gs://b/ck")):
        changed = profile_file(tmp_path, cloud, every_45_s)
        for target, command in every_target(changed, url, managed_url, []).items():
            assert "--checkpoint_every_s 45 --async_checkpoint" in command, (cloud, target)
        for target, command in every_target(changed, url, managed_url, ["--checkpoint_every_s", "120"]).items():
            assert command.count("--checkpoint_every_s") == 1 and "--checkpoint_every_s 120" in command, (cloud, target)
