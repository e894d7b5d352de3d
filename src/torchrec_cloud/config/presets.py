"""Presets: full configs that differ in a few fields (``--preset``); the flags given on the
command line override a preset's values (``flags.config_from_args``)."""

from __future__ import annotations

from typing import Callable

from torchrec_cloud.config.sections import DataConfig, JobConfig, ModelConfig, OptimizerConfig, OutputConfig, TrainConfig

CRITEO_1TB_TABLE_SIZES = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]  # fmt: skip


# MLPerf DLRM-DCNv2's multi-hot bag size per Criteo categorical feature.
MLPERF_MULTI_HOT_SIZES = [
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
]  # fmt: skip


def quickstart() -> JobConfig:
    """The seed quickstart: 13 dense + 26 sparse features, 100K rows, dim 64, batch 8192;
    200 steps at learning rate 0.01 with an evaluation every 50, which end within about 0.02
    of the planted data's Bayes-optimal AUC in about a minute on 2 CPU cores, with no loss
    spike (docs/quickstart-tuning.md says how they were chosen)."""
    return JobConfig(
        data=DataConfig(num_batches_per_epoch=200),
        optimizer=OptimizerConfig(learning_rate=0.01),
        train=TrainConfig(eval_every=50),
        preset="quickstart",
    )


def criteo_1tb() -> JobConfig:
    """The seeds' train_dlrm.py flags for Criteo 1TB (tables capped at 40M rows)."""
    return JobConfig(
        model=ModelConfig(
            num_embeddings_per_feature=list(CRITEO_1TB_TABLE_SIZES),
            embedding_dim=128,
            dense_arch_layer_sizes=[512, 256, 128],
            over_arch_layer_sizes=[1024, 1024, 512, 256, 1],
        ),
        data=DataConfig(batch_size=2048),
        optimizer=OptimizerConfig(learning_rate=1.0),
        output=OutputConfig(output_dir="runs/criteo-1tb"),
        preset="criteo-1tb",
    )


def mlperf_dcnv2() -> JobConfig:
    """MLPerf DLRM-DCNv2: Criteo 1TB tables, dim 128, DCNv2 with 3 layers of rank 512."""
    return JobConfig(
        model=ModelConfig(
            interaction="dcn",
            num_embeddings_per_feature=list(CRITEO_1TB_TABLE_SIZES),
            embedding_dim=128,
            dense_arch_layer_sizes=[512, 256, 128],
            over_arch_layer_sizes=[1024, 1024, 512, 256, 1],
            dcn_num_layers=3,
            dcn_low_rank_dim=512,
        ),
        data=DataConfig(batch_size=2048, multi_hot_sizes=list(MLPERF_MULTI_HOT_SIZES)),
        optimizer=OptimizerConfig(learning_rate=0.004),
        output=OutputConfig(output_dir="runs/mlperf-dcnv2"),
        preset="mlperf-dcnv2",
    )


PRESETS: dict[str, Callable[[], JobConfig]] = {
    "quickstart": quickstart,
    "criteo-1tb": criteo_1tb,
    "mlperf-dcnv2": mlperf_dcnv2,
}
