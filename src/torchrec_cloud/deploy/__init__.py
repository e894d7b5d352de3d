"""Deployment: container images, Kubernetes manifests, cluster configs and cloud jobs.

Everything here is generated from one source: the templates in ``templates/`` filled with a
cloud profile from ``profiles/`` (data, not code) and a :class:`~.spec.DeploySpec`::

    torchrec-cloud render --cloud aws --launcher job --nodes 2 --gpus_per_node 8 \\
        --image REGISTRY/torchrec-cloud:0.1.0 --preset criteo-1tb
    torchrec-cloud submit --target kubernetes --cloud gcp --nodes 2 --dry-run
    make render        # regenerate the committed copies in quickstart/, aws/, azure/, gcp/, docker/

Modules: ``spec`` (what to deploy), ``profiles`` (cloud data), ``manifests`` (Kubernetes),
``monitoring`` (what each cloud's metrics collector needs), ``schedulable`` (can the pods
run where the guide's cluster has what they ask for), ``azureml`` and ``vertex`` (managed
training services; ``managed``: what they share), ``torchx_component`` (legacy TorchX),
``layout`` (the committed files: cluster configs, storage, launch scripts, READMEs, images),
``render`` and ``submit`` (the sub-commands).
"""
