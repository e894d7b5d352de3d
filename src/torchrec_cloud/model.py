"""The DLRM family from ``torchrec.models.dlrm``, built from a :class:`ModelConfig`.

Tables are created on the meta device: DistributedModelParallel materialises only each
rank's shards, so a 40M-row table never exists whole on one process::

    model = build_model(cfg.model, dense_device=torch.device("cpu"))
    loss, (loss, logits, labels) = model(batch)

The model is TorchRec's, module for module. The speed-ups layer (:mod:`torchrec_cloud.speedups`)
may later swap some of its arches and layers for cheaper ones with the same parameters.
"""

from __future__ import annotations

import torch
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_cloud.config import ModelConfig


def table_configs(cfg: ModelConfig) -> list[EmbeddingBagConfig]:
    """One table per sparse feature, named ``t_<feature>``, pooling its ids by sum (or by
    mean, where ``--pooling`` says so: a dataset's list features)."""
    pooling = cfg.pooling or ["sum"] * cfg.num_sparse_features
    return [
        EmbeddingBagConfig(
            name=f"t_{name}",
            embedding_dim=cfg.embedding_dim,
            num_embeddings=rows,
            feature_names=[name],
            pooling=PoolingType.MEAN if how == "mean" else PoolingType.SUM,
        )
        for name, rows, how in zip(cfg.sparse_names, cfg.table_sizes, pooling)
    ]


def build_model(cfg: ModelConfig, dense_device: torch.device) -> DLRMTrain:
    """DLRMTrain (BCE loss around the chosen DLRM) with its tables on the meta device."""
    ebc = EmbeddingBagCollection(tables=table_configs(cfg), device=torch.device("meta"))
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=cfg.num_dense_features,
        dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
        over_arch_layer_sizes=list(cfg.over_arch_layer_sizes),
        dense_device=dense_device,
    )
    if cfg.interaction == "dot":
        dlrm = DLRM(**common)
    elif cfg.interaction == "dcn":
        dlrm = DLRM_DCN(
            **common, dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim
        )
    else:
        dlrm = DLRM_Projection(
            **common,
            interaction_branch1_layer_sizes=list(cfg.interaction_branch1_layer_sizes),
            interaction_branch2_layer_sizes=list(cfg.interaction_branch2_layer_sizes),
        )
    return DLRMTrain(dlrm)
