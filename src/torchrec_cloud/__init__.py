"""torchrec-cloud: DLRM/DCNv2 training with TorchRec on one CPU, one GPU box, or many nodes."""

__version__ = "0.1.0"
