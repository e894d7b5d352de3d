"""Local rehearsal of the rendered Indexed Job: its pods' commands and environment, run as
two "nodes" on this machine.

Each "pod" gets exactly what the manifest gives it: the container's env (the completion
index resolved from the annotation the Job controller sets), Kubernetes' $(VAR) expansion
of command and args, then the command itself. The changes are those of sharing one host:
the rendezvous host (pod 0's DNS name becomes 127.0.0.1, the port a free one) and the
metrics port (each pod has its own network namespace in Kubernetes; here each gets a free
port instead of --prometheus_port, bound to 127.0.0.1, lingering 2 s). Two torchrun
agents, one process each, gloo on CPU; training must finish, rank 0 must write
metrics.jsonl, and every pod's metrics endpoint must have served the training series.

The TrainJob gets the same treatment with the variables Kubeflow Trainer's torch plugin
sets on each node (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR,
PET_MASTER_PORT), which torchrun reads as its flags.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from torchrec_cloud.deploy.manifests import load_documents, render_bundle
from torchrec_cloud.deploy.spec import DeploySpec

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num_batches_per_epoch", "3", "--batch_size", "64", "--num_embeddings", "1000", "--embedding_dim", "16",
        "--dense_arch_layer_sizes", "32,16", "--over_arch_layer_sizes", "32,1", "--num_eval_batches", "2",
        "--no-progress"]


def expand_k8s(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, $$ escapes $, the
    rest is left as written."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def pod_env(container: dict, annotations: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand_k8s(item["value"], env)
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        m = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path)
        assert m, f"rehearsal cannot resolve {path}"
        env[item["name"]] = annotations[m.group(1)]
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def indexed_job_pods(docs: list[dict], port: int) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env) of each pod of the Indexed Job, as the kubelet would start them."""
    job = next(d for d in docs if d["kind"] == "Job")
    svc = next(d for d in docs if d["kind"] == "Service")
    pod = job["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert svc["metadata"]["name"] == pod["spec"]["subdomain"]
    endpoint = f"{job['metadata']['name']}-0.{pod['spec']['subdomain']}:{svc['spec']['ports'][0]['port']}"
    pods = []
    for index in range(job["spec"]["completions"]):
        env = pod_env(container, {"batch.kubernetes.io/job-completion-index": str(index)})
        argv = [expand_k8s(a, env) for a in container["command"] + container["args"]]
        assert any(endpoint in a for a in argv), "rendezvous endpoint not in the pod command"
        pods.append(([a.replace(endpoint, f"127.0.0.1:{port}") for a in argv], env))
    return pods


def trainjob_pods(docs: list[dict], port: int) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env) of each node of the TrainJob under the torch-distributed runtime."""
    trainer = next(d for d in docs if d["kind"] == "TrainJob")["spec"]["trainer"]
    pods = []
    for rank in range(trainer["numNodes"]):
        env = pod_env(trainer, {})
        env.update(PET_NNODES=str(trainer["numNodes"]), PET_NPROC_PER_NODE=str(trainer["numProcPerNode"]),
                   PET_NODE_RANK=str(rank), PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port))
        pods.append(([expand_k8s(a, env) for a in trainer["command"] + trainer["args"]], env))
    return pods


def own_metrics_port(argv: list[str]) -> tuple[list[str], int]:
    """The pod's argv with its metrics endpoint moved to a free port on 127.0.0.1 (flags as
    separate words, or inside the Indexed Job's shell script)."""
    port = free_port()
    values = {"--prometheus_port": f"{port} --metrics_host 127.0.0.1", "--prometheus_linger": "2"}
    out, found = [], set()
    for i, arg in enumerate(argv):
        if i and argv[i - 1] in values:
            out += values[argv[i - 1]].split()
            found.add(argv[i - 1])
            continue
        for flag, value in values.items():
            arg, n = re.subn(rf"{flag} \d+", f"{flag} {value}", arg)
            found |= {flag} if n else set()
        out.append(arg)
    assert found == set(values), f"pod command lacks {set(values) - found}"
    return out, port


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return ""


@pytest.mark.parametrize("launcher, pods_of", [("job", indexed_job_pods), ("trainjob", trainjob_pods)])
def test_rendered_job_trains_as_two_nodes(launcher, pods_of, tmp_path):
    out = tmp_path / "run"
    spec = DeploySpec(cloud="generic", launcher=launcher, nodes=2, gpus_per_node=1, name="rehearsal",
                      train_args=[*TINY, "--output_dir", str(out)])
    pods = pods_of(load_documents(render_bundle(spec)), free_port())

    procs, metrics_ports = [], []
    for index, (argv, env) in enumerate(pods):
        argv, metrics_port = own_metrics_port(argv)
        metrics_ports.append(metrics_port)
        full_env = {
            **os.environ,
            **env,
            # The image puts its virtualenv first on PATH and has the package installed.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1",
        }
        log = open(tmp_path / f"pod-{index}.log", "w")
        procs.append((subprocess.Popen(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT), log))
    served = [False] * len(procs)
    try:
        deadline = time.time() + 600
        while any(p.poll() is None for p, _ in procs) and time.time() < deadline:
            for i, port in enumerate(metrics_ports):
                served[i] = served[i] or "\ntorchrec_train_step{" in scrape(port)
            time.sleep(0.3)
        codes = [p.wait(timeout=max(1.0, deadline - time.time())) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            log.close()
    logs = "\n".join(f"--- pod {i}\n{(tmp_path / f'pod-{i}.log').read_text()[-3000:]}" for i in range(len(procs)))
    assert codes == [0, 0], logs
    assert served == [True, True], f"metrics endpoints that never served torchrec_train_step: {served}\n{logs}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "start" and records[0]["world_size"] == 2, records[0]
    assert any(r.get("split") == "test" and r.get("auc") is not None for r in records), logs
