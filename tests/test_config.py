"""Config tree: presets, flag parsing, overrides and start-up validation."""

import subprocess

import pytest

from helpers import PYTHON, run
from torchrec_cloud.config import (
    CRITEO_1TB_TABLE_SIZES,
    ConfigError,
    ModelConfig,
    parse_job_config,
)


def test_quickstart_preset_is_the_seed_defaults():
    cfg = parse_job_config([])
    assert cfg.preset == "quickstart"
    m = cfg.model
    assert (m.num_dense_features, m.num_sparse_features) == (13, 26)
    assert m.table_sizes == [100_000] * 26
    assert m.embedding_dim == 64
    assert m.dense_arch_layer_sizes == [512, 256, 64]
    assert m.over_arch_layer_sizes == [512, 256, 1]
    assert cfg.data.batch_size == 8192


def test_criteo_1tb_preset_matches_the_seed_train_dlrm_flags():
    cfg = parse_job_config(["--preset", "criteo-1tb"])
    assert cfg.model.table_sizes == CRITEO_1TB_TABLE_SIZES
    assert max(cfg.model.table_sizes) == 40_000_000
    assert cfg.model.embedding_dim == 128
    assert cfg.model.dense_arch_layer_sizes == [512, 256, 128]
    assert cfg.model.over_arch_layer_sizes == [1024, 1024, 512, 256, 1]
    assert cfg.optimizer.learning_rate == 1.0


def test_mlperf_dcnv2_preset():
    cfg = parse_job_config(["--preset", "mlperf-dcnv2"])
    assert cfg.model.interaction == "dcn"
    assert (cfg.model.dcn_num_layers, cfg.model.dcn_low_rank_dim) == (3, 512)


def test_flags_override_the_preset_and_accept_the_seed_list_forms():
    cfg = parse_job_config(
        [
            "--preset", "criteo-1tb",
            "--batch_size", "4096",
            "--embedding_dim", "64",
            "--dense_arch_layer_sizes", "512,256,64",
            "--over_arch_layer_sizes", "1024", "512", "1",
            "--learning_rate", "0.5",
        ]
    )  # fmt: skip
    assert cfg.data.batch_size == 4096
    assert cfg.model.embedding_dim == 64
    assert cfg.model.over_arch_layer_sizes == [1024, 512, 1]
    assert cfg.optimizer.learning_rate == 0.5
    assert cfg.model.table_sizes == CRITEO_1TB_TABLE_SIZES  # untouched preset field


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--batch_size", "0"], "batch_size"),
        (["--learning_rate", "-1"], "learning_rate"),
        (["--embedding_dim", "32", "--dense_arch_layer_sizes", "512,64"], "dense_arch_layer_sizes"),  # must end at 32
        (["--over_arch_layer_sizes", "512,2"], "over_arch_layer_sizes"),
        (["--num_embeddings_per_feature", "10,20"], "num_embeddings_per_feature"),
        (["--lr_end", "2"], "lr_end"),
    ],
)
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(ConfigError) as e:
        parse_job_config(argv)
    assert e.value.flag == flag
    assert f"--{flag}" in str(e.value)


def test_model_config_validates_on_construction():
    with pytest.raises(ConfigError):
        ModelConfig(num_embeddings=0)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--batch_size", "abc"], "--batch_size"),
        (["train", "--batch_size", "0"], "--batch_size"),
        (["train", "--no_such_flag", "1"], "--no_such_flag"),
        (["train", "--synthetic", "gaussian"], "--synthetic"),
        (["train", "--dense_arch_layer_sizes", "1,x"], "--dense_arch_layer_sizes"),
    ],
)
def test_cli_bad_flags_exit_2_with_one_line(argv, needle):
    proc = run([PYTHON, "-m", "torchrec_cloud", *argv], timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]
    assert "error" in lines[0]


def test_help_lists_every_seed_flag():
    proc = subprocess.run([PYTHON, "-m", "torchrec_cloud", "train", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for flag in (
        "--batch_size", "--embedding_dim", "--num_epochs", "--learning_rate", "--num_embeddings",
        "--num_embeddings_per_feature", "--dense_arch_layer_sizes", "--over_arch_layer_sizes",
        "--dataset_path", "--synthetic", "--num_batches_per_epoch", "--output_dir", "--eval_every",
    ):  # fmt: skip
        assert flag in proc.stdout
