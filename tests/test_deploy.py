"""Deployment files around the manifests: committed copies, cluster configs, launch
scripts, the submit command, and the Azure ML / Vertex AI / TorchX jobs built offline with
the real SDKs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from torchrec_cloud.deploy import azureml, layout, vertex
from torchrec_cloud.deploy.manifests import load_documents
from torchrec_cloud.deploy.profiles import load_profile
from torchrec_cloud.deploy.spec import DeploySpec

ROOT = Path(__file__).resolve().parents[1]
CLOUDS = ["aws", "azure", "gcp"]


class Done:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(capsys):
    """`torchrec-cloud ARGS` in this process (a subprocess would import torch again each time)."""
    from torchrec_cloud.cli import main

    def run(*args: str) -> Done:
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return Done(code, out.out, out.err)

    return run


def workload(docs: list[dict]) -> dict:
    """The one Job / PyTorchJob / TrainJob of a bundle (the collector's objects follow it)."""
    (doc,) = [d for d in docs if d["kind"] in ("Job", "PyTorchJob", "TrainJob")]
    return doc


def test_committed_files_match_a_fresh_render():
    stale = layout.check(ROOT)
    assert not stale, f"committed deployment files differ from the templates: {stale}; run `make render`"


def test_drift_is_detected(tmp_path):
    """The check above can fail: a hand edit to a committed copy is reported."""
    for rel in ("requirements/stack.txt", "requirements/torchrec-deps.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text())
    for rel, text in layout.generated_files(ROOT).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert layout.check(tmp_path) == []
    job = tmp_path / "aws" / "torchrec_job.yaml"
    job.write_text(job.read_text().replace("parallelism: 2", "parallelism: 4"))
    assert layout.check(tmp_path) == ["aws/torchrec_job.yaml"]


def test_seed_layout_is_complete():
    for rel in ["quickstart/Dockerfile", "quickstart/kubernetes_job.yaml", "quickstart/requirements.txt",
                "quickstart/README.md", "quickstart/train_torchrec_quickstart.py", "aws/eks_cluster.yaml",
                "azure/aks_cluster.yaml", "gcp/gke_cluster.yaml", "azure/azure_ml_training.py",
                "gcp/vertex_ai_training.py", "docs/deploy.md"] + [
        f"{c}/{f}" for c in CLOUDS for f in ("README.md", f"train_dlrm_{c}.sh", "cloud_component.py")
    ]:
        assert (ROOT / rel).is_file(), rel


def test_render_command_line_prints_multi_document_yaml():
    """The interface other checks rely on, through the real entry point."""
    done = subprocess.run([sys.executable, "-m", "torchrec_cloud", "render", "--cloud", "gcp", "--launcher", "job", "--nodes", "3", "--gpus_per_node", "8",
               "--image", "registry.example/t:1", "--", "--batch_size", "2048"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=300)
    assert done.returncode == 0, done.stderr
    docs = load_documents(done.stdout)
    assert [d["kind"] for d in docs] == ["Namespace", "ServiceAccount", "Service", "Job", "NetworkPolicy",
                                         "PodMonitoring"]
    job = docs[3]
    assert job["spec"]["parallelism"] == 3
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/t:1"
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--batch_size", "2048"]


def test_render_cli_writes_files(tmp_path, cli):
    done = cli("render", "--cloud", "aws", "--launcher", "trainjob", "--nodes", "2", "--gpus_per_node", "8",
               "--output", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["storage.yaml", "trainjob.yaml"]
    assert workload(load_documents((tmp_path / "trainjob.yaml").read_text()))["kind"] == "TrainJob"


@pytest.mark.parametrize("args, needle", [
    (["--nodes", "0"], "--nodes"),
    (["--launcher", "mpijob"], "--launcher"),
    (["--cloud", "nocloud"], "--cloud"),
    (["--", "--batch_size", "-1"], "--batch_size"),
])
def test_render_cli_bad_flags_one_line_exit_2(args, needle, cli):
    done = cli("render", *args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], done.stderr


def test_submit_dry_run_prints_what_would_be_applied(cli):
    done = cli("submit", "--target", "kubernetes", "--cloud", "azure", "--launcher", "pytorchjob", "--nodes", "2",
               "--dry-run")
    assert done.returncode == 0, done.stderr
    assert workload(load_documents(done.stdout))["kind"] == "PyTorchJob"
    assert "kubectl apply -f -" in done.stderr


def test_submit_a_preprocessing_job_to_kubernetes_only(cli):
    flags = ["--", "--schema", "s3://b/schema.yaml", "--input", "s3://b/events/", "--output", "s3://b/shards"]
    done = cli("submit", "--target", "kubernetes", "--cloud", "gcp", "--job", "preprocess", "--nodes", "3",
               "--dry-run", *flags)  # fmt: skip
    assert done.returncode == 0, done.stderr
    job = workload(load_documents(done.stdout))
    assert job["spec"]["completions"] == 3
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["torchrec-cloud", "data", "preprocess"]
    assert "-l torchrec-cloud/job=torchrec-preprocess" in done.stderr  # the logs it would follow
    done = cli("submit", "--target", "vertex", "--cloud", "gcp", "--job", "preprocess", "--dry-run", *flags)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "torchrec-cloud submit: error: --job: --job preprocess is a Kubernetes Indexed Job: --target kubernetes"]


def test_submit_without_kubectl_says_so(cli):
    done = cli("submit", "--target", "kubernetes", "--nodes", "2", "--image", "registry.example/t:1",
               "--kubectl", "no-such-kubectl")
    assert done.returncode == 1
    assert "'no-such-kubectl' not found on PATH" in done.stderr


def fake_kubectl(folder: Path, server: str) -> Path:
    """A kubectl whose cluster runs Kubernetes ``server`` (``kubectl version -o json``, as
    kubectl 1.33 prints it) and whose ``apply`` keeps what it was given."""
    script = folder / "kubectl"
    version = json.dumps({"clientVersion": {"major": "1", "minor": "33", "gitVersion": "v1.33.1"},
                          "serverVersion": {"major": server.split(".")[0], "minor": server.split(".")[1] + "+",
                                            "gitVersion": f"v{server}.4-eks-1234abc"}})  # fmt: skip
    script.write_text(
        "#!/bin/sh\n"
        f"if [ \"$1\" = version ]; then echo '{version}'; exit 0; fi\n"
        f"if [ \"$1\" = apply ]; then cat > {folder / 'applied.yaml'}; echo applied; exit 0; fi\n"
        "exit 1\n"
    )
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("launcher, too_old, new_enough", [("job", "1.32", "1.33"), ("trainjob", "1.31", "1.34")])
def test_submit_refuses_a_cluster_older_than_the_bundle_needs(cli, tmp_path, launcher, too_old, new_enough):
    """The bundle records the Kubernetes version its objects need (an older API server drops
    backoffLimitPerIndex without a word); submit compares it with `kubectl version`."""
    flags = ["submit", "--target", "kubernetes", "--launcher", launcher, "--nodes", "2", "--gpus_per_node", "0",
             "--image", "registry.example/torchrec-cloud:1"]  # fmt: skip
    old = fake_kubectl(tmp_path, too_old)
    done = cli(*flags, "--kubectl", str(old))
    assert done.returncode == 1 and not (tmp_path / "applied.yaml").exists()
    (line,) = done.stderr.strip().splitlines()
    needed = {"job": "1.33", "trainjob": "1.32"}[launcher]
    assert f"the cluster runs Kubernetes {too_old}, older than the {needed} a --launcher {launcher} job needs" in line
    fake_kubectl(tmp_path, new_enough)
    done = cli(*flags, "--kubectl", str(old))
    assert done.returncode == 0, done.stderr
    applied_docs = load_documents((tmp_path / "applied.yaml").read_text())
    applied = workload(applied_docs)
    assert applied["metadata"]["annotations"]["torchrec-cloud/min-kubernetes"] == needed
    # The job's NetworkPolicy is applied with it.
    (policy,) = [d for d in applied_docs if d["kind"] == "NetworkPolicy"]
    assert policy["metadata"]["namespace"] == applied["metadata"]["namespace"]


def test_submit_refuses_placeholders_one_line_each(cli):
    done = cli("submit", "--target", "kubernetes", "--cloud", "aws", "--nodes", "2", "--kubectl", "no-such-kubectl")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("torchrec-cloud submit: error: ") for line in lines), lines
    image, identity, storage = lines
    assert "--image torchrec-cloud:0.1.0 names no registry" in image and "pass --image REGISTRY/" in image
    assert "111122223333" in identity and "pass --identity" in identity
    assert "fsx-pvc" in storage and "--storage_claim NAME" in storage and "--no-storage" in storage
    # The example account's registry is refused too, naming the example value.
    done = cli("submit", "--target", "kubernetes", "--cloud", "aws", "--nodes", "2", "--no-storage",
               "--image", "111122223333.dkr.ecr.us-west-2.amazonaws.com/torchrec-cloud:0.1.0",
               "--identity", "arn:aws:iam::444455556666:role/train", "--kubectl", "no-such-kubectl")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--image 111122223333.dkr.ecr" in done.stderr and "example value 111122223333" in done.stderr
    # Real values pass the checks and reach kubectl.
    done = cli("submit", "--target", "kubernetes", "--cloud", "aws", "--nodes", "2", "--storage_claim", "fsx",
               "--image", "444455556666.dkr.ecr.us-west-2.amazonaws.com/torchrec-cloud:0.1.0",
               "--identity", "arn:aws:iam::444455556666:role/train", "--kubectl", "no-such-kubectl")
    assert done.returncode == 1 and "not found on PATH" in done.stderr, done.stderr
    # --dry-run shows the bundle as it is, placeholders included.
    assert cli("submit", "--target", "kubernetes", "--cloud", "aws", "--nodes", "2", "--dry-run").returncode == 0


def test_spot_without_a_checkpoint_destination_is_refused(cli):
    done = cli("render", "--cloud", "gcp", "--launcher", "job", "--nodes", "2", "--spot")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "--checkpoint_url" in line and "--spot" in line
    assert cli("render", "--cloud", "gcp", "--nodes", "2", "--spot", "--checkpoint_url", "gs://b/c").returncode == 0
    assert cli("render", "--cloud", "gcp", "--nodes", "2", "--spot", "--", "--checkpoint_path", "/ckpt").returncode == 0


def test_cluster_wide_collector_config_and_rdma_only_on_request(cli):
    kinds = lambda done: [d["kind"] for d in load_documents(done.stdout)]  # noqa: E731
    plain = cli("render", "--cloud", "aws", "--nodes", "2")
    assert "ConfigMap" not in kinds(plain) and "--cluster_monitoring" in plain.stdout  # the job says how
    assert kinds(cli("render", "--cloud", "aws", "--nodes", "2", "--cluster_monitoring")).count("ConfigMap") == 2

    def limits(done):
        return workload(load_documents(done.stdout))["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]

    # The resource name Azure's aks-rdma-infiniband guide gives its RDMA shared device plugin.
    assert "rdma/shared_ib" not in limits(cli("render", "--cloud", "azure", "--nodes", "2"))
    assert limits(cli("render", "--cloud", "azure", "--nodes", "2", "--rdma"))["rdma/shared_ib"] == 1


def test_launch_scripts_dry_run(tmp_path):
    for c in CLOUDS:
        script = ROOT / c / f"train_dlrm_{c}.sh"
        assert os.access(script, os.X_OK), script
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
    # One of them end to end (they differ only in profile data); each run imports torch.
    cloud = "aws"
    script = ROOT / cloud / f"train_dlrm_{cloud}.sh"
    # The script calls the installed console script; point it at this checkout.
    shim = tmp_path / "torchrec-cloud"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m torchrec_cloud \"$@\"\n")
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT / "src"),
           "DRY_RUN": "1", "NODES": "3", "LAUNCHER": "trainjob", "SPOT": "1", "CHECKPOINT_URL": "s3://b/ckpt"}
    done = subprocess.run(["bash", str(script), "--", "--batch_size", "1024"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    tj = workload(load_documents(done.stdout))
    assert tj["kind"] == "TrainJob" and tj["spec"]["trainer"]["numNodes"] == 3
    assert tj["spec"]["trainer"]["args"][-2:] == ["--batch_size", "1024"]
    runtime = next(d for d in load_documents(done.stdout) if d["kind"] == "TrainingRuntime")
    node_selector = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"]["nodeSelector"]
    assert load_profile(cloud).spot["node_selector"].items() <= node_selector.items()


def test_cluster_configs():
    eks = yaml.safe_load((ROOT / "aws/eks_cluster.yaml").read_text())
    assert eks["apiVersion"] == "eksctl.io/v1alpha5" and eks["kind"] == "ClusterConfig"
    gpu = [g for g in eks["managedNodeGroups"] if g.get("efaEnabled")]
    assert [bool(g.get("spot")) for g in gpu] == [False, True]
    for g in gpu:
        assert len(g["availabilityZones"]) == 1 and g["placement"]["groupName"]
        # The key eksctl's EFA device plugin tolerates (tests/test_targets.py says why).
        assert g["taints"] == [{"key": "aws.amazon.com/efa", "value": "true", "effect": "NoSchedule"}]
    assert eks["iam"]["withOIDC"] is True

    aks = list(yaml.safe_load_all((ROOT / "azure/aks_cluster.yaml").read_text()))
    assert [d["kind"] for d in aks] == ["ResourceGroup", "ManagedCluster", "ManagedClustersAgentPool",
                                       "ManagedClustersAgentPool"]
    assert aks[1]["spec"]["securityProfile"]["workloadIdentity"]["enabled"] is True
    pools = aks[2:]
    assert all(p["spec"]["owner"]["name"] == aks[1]["metadata"]["name"] for p in pools)
    assert all(len(p["spec"]["azureName"]) <= 12 and p["spec"]["azureName"].isalnum() for p in pools)
    assert pools[1]["spec"]["scaleSetPriority"] == "Spot"

    gke = list(yaml.safe_load_all((ROOT / "gcp/gke_cluster.yaml").read_text()))
    assert [d["kind"] for d in gke] == ["ContainerCluster", "ContainerNodePool", "ContainerNodePool"]
    a2 = load_profile("gcp").instance("a2-highgpu-8g")
    for pool in gke[1:]:
        assert pool["spec"]["clusterRef"]["name"] == gke[0]["metadata"]["name"]
        (acc,) = pool["spec"]["nodeConfig"]["guestAccelerator"]
        assert acc["type"] == a2.accelerator and acc["count"] == a2.gpus
    assert gke[2]["spec"]["nodeConfig"]["spot"] is True


def test_readme_facts_come_from_the_profiles():
    gcp = (ROOT / "gcp/README.md").read_text()
    assert "| `a2-highgpu-8g` | 8x NVIDIA A100 40GB | 96 | 680 GB |" in gcp
    assert "1.3TB" not in gcp and "1.3 TB" not in gcp.replace("not 1.3 TB", "")
    assert "| `p4d.24xlarge` | 8x NVIDIA A100 40GB | 96 | 1152 GiB |" in (ROOT / "aws/README.md").read_text()
    assert "| `Standard_ND96asr_v4` | 8x NVIDIA A100 40GB | 96 | 900 GiB |" in (ROOT / "azure/README.md").read_text()


def test_azure_ml_job_built_offline():
    spec = DeploySpec(cloud="azure", nodes=3, gpus_per_node=8, image="acr.example/torchrec-cloud:1",
                      train_args=["--batch_size", "2048"])
    job = azureml.build_command_job(spec, compute="gpu-cluster")
    d = yaml.safe_load(azureml.dump_job(job))
    assert d["type"] == "command"
    assert d["resources"]["instance_count"] == 3
    assert d["distribution"] == {"type": "pytorch", "process_count_per_instance": 1}
    assert d["environment"]["image"] == "acr.example/torchrec-cloud:1"
    assert d["compute"].endswith("gpu-cluster")
    cmd = d["command"]
    assert cmd.startswith("torchrec-cloud launch --nnodes=3 --nproc_per_node=8 --rdzv_backend=c10d "
                          "--rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT")
    assert "-m torchrec_cloud train --preset quickstart --output_dir ./outputs/" in cmd and cmd.endswith("--batch_size 2048")
    assert d["environment_variables"]["NCCL_IB_HCA"] == "mlx5"


def test_vertex_custom_job_built_offline():
    spec = DeploySpec(cloud="gcp", nodes=3, gpus_per_node=8, image="us-docker.pkg.dev/p/r/t:1", spot=True,
                      checkpoint_url="gs://bucket/ckpt")
    job = vertex.build_custom_job(spec, staging_bucket="gs://bucket")
    d = json.loads(vertex.dump_job(job))
    pools = d["jobSpec"]["workerPoolSpecs"]
    assert [int(p["replicaCount"]) for p in pools] == [1, 2]
    for p in pools:
        machine = {k: p["machineSpec"][k] for k in ("machineType", "acceleratorType", "acceleratorCount")}
        assert machine == {"machineType": "a2-highgpu-8g", "acceleratorType": "NVIDIA_TESLA_A100", "acceleratorCount": 8}
        assert p["containerSpec"]["imageUri"] == "us-docker.pkg.dev/p/r/t:1"
        bash, flag, script = p["containerSpec"]["command"]
        assert (bash, flag) == ("/bin/bash", "-c")
        assert "torchrec-cloud launch --nnodes=3 --nproc_per_node=8 --rdzv_backend=c10d" in script
        assert '--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"' in script
        assert "--output_dir /gcs/bucket/runs/torchrec-dlrm" in script
    assert d["jobSpec"]["scheduling"]["strategy"] == "SPOT"
    # Where the trainer writes (--output_dir above, through Cloud Storage FUSE).
    assert d["jobSpec"]["baseOutputDirectory"]["outputUriPrefix"] == "gs://bucket/runs/torchrec-dlrm"


def test_vertex_rendezvous_env_from_cluster_spec():
    spec = {"cluster": {"workerpool0": ["chief-0:2222"], "workerpool1": ["w-0:2222", "w-1:2222"]},
            "task": {"type": "workerpool1", "index": 1}}
    assert vertex.rendezvous_env(json.dumps(spec)) == {"NODE_RANK": "2", "MASTER_ADDR": "chief-0",
                                                      "MASTER_PORT": "2222"}
    spec["task"] = {"type": "workerpool0", "index": 0}
    assert vertex.rendezvous_env(json.dumps(spec))["NODE_RANK"] == "0"
    with pytest.raises(ValueError, match="CLUSTER_SPEC"):
        vertex.rendezvous_env("{}")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CLUSTER_SPEC": json.dumps(spec)}
    done = subprocess.run(["bash", "-c", 'eval "$(python -m torchrec_cloud.deploy.vertex rendezvous-env)" && '
                           'echo "$NODE_RANK $MASTER_ADDR $MASTER_PORT"'], capture_output=True, text=True, env={
                               **env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"})
    assert done.stdout.strip() == "0 chief-0 2222", done.stderr


@pytest.mark.parametrize("module, blocked, extra", [("azureml", "azure.ai.ml", "azure"),
                                                   ("vertex", "google.cloud.aiplatform_v1", "gcp")])
def test_missing_sdk_names_the_extra(module, blocked, extra, monkeypatch):
    from torchrec_cloud.deploy.spec import MissingExtraError

    monkeypatch.setitem(sys.modules, blocked, None)  # what an uninstalled package looks like to import
    build = {"azureml": lambda: azureml.build_command_job(DeploySpec(cloud="azure"), compute="c"),
             "vertex": lambda: vertex.build_custom_job(DeploySpec(cloud="gcp"))}[module]
    with pytest.raises(MissingExtraError, match=rf"pip install -e '\.\[{extra}\]' in the torchrec-cloud checkout"):
        build()


@pytest.mark.parametrize("script, target", [("azure/azure_ml_training.py", "azureml"),
                                            ("gcp/vertex_ai_training.py", "vertex")])
def test_managed_service_scripts_dry_run(script, target):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, script, "--dry-run", "--nodes", "2", "--", "--batch_size", "512"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "--preset criteo-1tb" in done.stdout and "--batch_size 512" in done.stdout
    assert layout.cloud_image(load_profile(script.split("/")[0])) in done.stdout


@pytest.mark.parametrize("cloud", CLOUDS)
def test_the_guides_render_the_committed_job_with_your_image_and_identity(cloud, cli):
    """The README's own render command, given the profile's example image and identity,
    is the committed torchrec_job.yaml: the guide's job has the committed settings
    (checkpoint destination and cadence, preset, nodes)."""
    import shlex

    from doc_examples import markdown_examples, parse_command

    profile = load_profile(cloud)
    (command,) = [e.text for e in markdown_examples(f"{cloud}/README.md")
                  if e.text.startswith(f"torchrec-cloud render --cloud {cloud} --nodes 2 ")]
    values = {"$IMAGE": layout.cloud_image(profile), f"${profile.identity['variable']}": profile.identity["example"]}
    parsed = parse_command(command)
    assert parsed.writes == ["job.yaml"]
    args = [values.get(a, a) for a in parsed.argv[1:]]
    assert not any(a.startswith("$") for a in args), shlex.join(args)
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    committed = (ROOT / cloud / "torchrec_job.yaml").read_text()
    assert done.stdout == committed.split("\n", 1)[1]
