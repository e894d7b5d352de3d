"""The config tree of a training job: one dataclass per section (model, data, optimizer,
train, output, checkpoint, speedups, sharding), each field a flag with its docstring as the
flag's help, checked in ``__post_init__``; and :class:`ConfigError`, a bad value naming its
flag. Presets: ``presets.py``; the flags made from the tree: ``flags.py``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from torchrec_cloud.progress import plural


class ConfigError(ValueError):
    """A configuration value that cannot be used; ``flag`` names the offending flag."""

    def __init__(self, flag: str, message: str) -> None:
        # flag "--": the flags after '--', which the message names itself.
        super().__init__(message if flag == "--" else f"--{flag}: {message}")
        self.flag = flag


def _positive(flag: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(flag, f"must be {bound}, got {value}")


def _positive_list(flag: str, values: Optional[list[int]], min_len: int = 1) -> None:
    if values is None:
        return
    if len(values) < min_len:
        raise ConfigError(flag, f"needs at least {plural(min_len, 'value')}, got {len(values)}")
    for v in values:
        if v <= 0:
            raise ConfigError(flag, f"every value must be > 0, got {v} in {values}")


def _env_flag(name: str, default: bool) -> bool:
    """A switch's default from the environment: ``0`` (or ``false``, ``off``, ``no``) is off."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    return value.strip().lower() not in ("0", "false", "off", "no")


def _env_int(flag: str, name: str, default: int) -> int:
    """A number's default from the environment."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(flag, f"its default from {name} must be an integer, got {value!r}") from None


def _env_seconds(flag: str, name: str) -> Optional[float]:
    """A duration's default from the environment (unset or empty: none)."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError(flag, f"its default from {name} must be a number of seconds, got {value!r}") from None


_FEATURE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")

# Numeric precision of the dense compute (``--precision`` of train and bench).
Precision = Literal["fp32", "tf32", "bf16"]

# Where a table's rows live on a GPU (TorchRec's EmbeddingComputeKernel values, and ``auto``).
EmbeddingKernel = Literal["auto", "fused", "fused_uvm_caching", "fused_uvm"]


@dataclass
class ModelConfig:
    """The DLRM family from ``torchrec.models.dlrm``."""

    interaction: Literal["dot", "dcn", "projection"] = "dot"
    """Feature interaction: ``dot`` (DLRM pairwise dots), ``dcn`` (DCNv2 cross layers),
    ``projection`` (DLRM_Projection)."""
    num_dense_features: int = 13
    """Dense (integer) input features per sample."""
    num_sparse_features: int = 26
    """Categorical features per sample, one embedding table each."""
    num_embeddings: int = 100_000
    """Rows per embedding table when --num_embeddings_per_feature is not given."""
    num_embeddings_per_feature: Optional[list[int]] = None
    """Rows of each table (comma-separated, one per sparse feature); overrides --num_embeddings."""
    embedding_dim: int = 64
    """Width of every embedding table; the last bottom-MLP layer must equal it (given alone on
    the command line, it sets that layer too)."""
    dense_arch_layer_sizes: list[int] = field(default_factory=lambda: [512, 256, 64])
    """Bottom MLP layer sizes (comma-separated)."""
    over_arch_layer_sizes: list[int] = field(default_factory=lambda: [512, 256, 1])
    """Top MLP layer sizes (comma-separated); the last must be 1."""
    dcn_num_layers: int = 3
    """Cross layers of the DCNv2 interaction."""
    dcn_low_rank_dim: int = 512
    """Low-rank width of each DCNv2 cross layer."""
    interaction_branch1_layer_sizes: list[int] = field(default_factory=lambda: [2048, 2048])
    """Projection interaction: first branch MLP sizes."""
    interaction_branch2_layer_sizes: list[int] = field(default_factory=lambda: [2048, 2048])
    """Projection interaction: second branch MLP sizes."""
    feature_names: Optional[list[str]] = None
    """Names of the sparse features (comma-separated), one table ``t_NAME`` each; unset:
    cat_0, cat_1, ... A --dataset_path made from a schema sets them from its manifest."""
    pooling: Optional[list[str]] = None
    """How each table pools a feature's ids (comma-separated ``sum`` or ``mean``, one per
    sparse feature); unset: sum. A --dataset_path made from a schema sets them."""

    def __post_init__(self) -> None:
        _positive("num_dense_features", self.num_dense_features)
        _positive("num_sparse_features", self.num_sparse_features)
        _positive("num_embeddings", self.num_embeddings)
        _positive("embedding_dim", self.embedding_dim)
        _positive("dcn_num_layers", self.dcn_num_layers)
        _positive("dcn_low_rank_dim", self.dcn_low_rank_dim)
        _positive_list("dense_arch_layer_sizes", self.dense_arch_layer_sizes)
        _positive_list("over_arch_layer_sizes", self.over_arch_layer_sizes)
        _positive_list("interaction_branch1_layer_sizes", self.interaction_branch1_layer_sizes)
        _positive_list("interaction_branch2_layer_sizes", self.interaction_branch2_layer_sizes)
        _positive_list("num_embeddings_per_feature", self.num_embeddings_per_feature)
        if self.num_embeddings_per_feature is not None and (
            len(self.num_embeddings_per_feature) != self.num_sparse_features
        ):
            raise ConfigError(
                "num_embeddings_per_feature",
                f"needs one value per sparse feature ({self.num_sparse_features}), "
                f"got {len(self.num_embeddings_per_feature)}",
            )
        for flag in ("feature_names", "pooling"):
            values = getattr(self, flag)
            if values is not None and len(values) != self.num_sparse_features:
                raise ConfigError(flag, f"needs one value per sparse feature ({self.num_sparse_features}), got {len(values)}")
        if self.feature_names is not None:
            bad = [n for n in self.feature_names if not _FEATURE_NAME.match(n)]
            if bad or len(set(self.feature_names)) != len(self.feature_names):
                raise ConfigError("feature_names",
                                  f"names must be distinct identifiers (letters, digits, _), got {bad or self.feature_names}")  # fmt: skip
        if self.pooling is not None and not set(self.pooling) <= {"sum", "mean"}:
            raise ConfigError("pooling", f"every value must be sum or mean, got {self.pooling}")
        if self.over_arch_layer_sizes[-1] != 1:
            raise ConfigError(
                "over_arch_layer_sizes",
                f"the last layer must be 1 (one click logit), got {self.over_arch_layer_sizes}",
            )
        if self.dense_arch_layer_sizes[-1] != self.embedding_dim:
            raise ConfigError(
                "dense_arch_layer_sizes",
                f"the last layer ({self.dense_arch_layer_sizes[-1]}) must equal "
                f"--embedding_dim ({self.embedding_dim})",
            )
        if self.interaction == "projection":
            b1, b2 = self.interaction_branch1_layer_sizes, self.interaction_branch2_layer_sizes
            if b1[-1] % self.embedding_dim or b2[-1] % self.embedding_dim:
                raise ConfigError(
                    "interaction_branch1_layer_sizes",
                    "the last layer of each projection branch must be a multiple of "
                    f"--embedding_dim ({self.embedding_dim})",
                )

    @property
    def sparse_names(self) -> list[str]:
        """The sparse features' names, in table order."""
        return list(self.feature_names) if self.feature_names is not None else [f"cat_{i}" for i in range(self.num_sparse_features)]

    @property
    def table_sizes(self) -> list[int]:
        """Rows of each embedding table, one per sparse feature."""
        if self.num_embeddings_per_feature is not None:
            return list(self.num_embeddings_per_feature)
        return [self.num_embeddings] * self.num_sparse_features


@dataclass
class DataConfig:
    """Where batches come from and how big they are."""

    synthetic: Literal["random", "planted"] = "planted"
    """Synthetic data when no --dataset_path: ``random`` (random labels, as in the seeds) or
    ``planted`` (labels from a fixed random teacher, so learning is measurable)."""
    dataset_path: Optional[str] = None
    """Folder or URL of a preprocessed dataset (``torchrec-cloud data preprocess``): Criteo
    shards, or shards made from a schema, whose manifest then sets the model's features."""
    data_source: Optional[str] = None
    """``module:function`` (or ``path/file.py:function``) returning your own DataSource for
    (config, rank, world_size); see examples/custom_source.py. The model's shape comes from
    the flags."""
    batch_size: int = 8192
    """Samples per batch on each rank."""
    num_batches_per_epoch: int = 100
    """Synthetic data: training batches per rank per epoch."""
    num_eval_batches: int = 8
    """Synthetic data: held-out batches per split (val and test), shared by all ranks."""
    seed: int = 0
    """Seed for data generation, model initialisation and shuffling."""
    shuffle: bool = False
    """Criteo data: shuffle the training rows every epoch (8192-row blocks in a random
    order, then rows within windows of about 256K rows), deterministically from --seed.
    Off: each rank reads its contiguous part in file order, as the references do."""
    dense_transform: Literal["torchrec", "log1p"] = "torchrec"
    """Criteo data: how the 13 integer features become model inputs. ``torchrec``: as
    torchrec.datasets.criteo, log(x - m + 2) with m the smallest value in the source file
    (missing = 0); ``log1p``: log(max(x, 0) + 1), as the original DLRM."""
    multi_hot_sizes: Optional[list[int]] = None
    """Bag size per sparse feature (comma-separated, MLPerf DCNv2 style): each id becomes
    the id plus size-1 ids derived from it. Unset: one id per feature."""
    multi_hot_pooling: Literal["fixed", "random"] = "fixed"
    """With --multi_hot_sizes: every bag has its full size (``fixed``, as MLPerf) or a
    size drawn from 1..size per sample (``random``)."""
    data_workers: Optional[int] = None
    """Make training batches ahead of the step, pinned for the copy to a GPU: synthetic
    batches in this many worker processes (torch DataLoader), other sources in one reading
    thread when > 0. Unset: on a GPU the rank's share of the cores less two, at most 16; on
    CPU 0 (the step's own threads already use every core): each batch made when needed."""

    def __post_init__(self) -> None:
        _positive("batch_size", self.batch_size)
        if self.data_workers is not None:
            _positive("data_workers", self.data_workers, allow_zero=True)
        _positive("num_batches_per_epoch", self.num_batches_per_epoch)
        _positive("num_eval_batches", self.num_eval_batches)
        if self.dataset_path is not None and not self.dataset_path.strip():
            raise ConfigError("dataset_path", "must not be empty")
        if self.data_source is not None:
            if self.dataset_path is not None:
                raise ConfigError("data_source", "give --data_source or --dataset_path, not both")
            module, sep, function = self.data_source.rpartition(":")
            if not sep or not module.strip() or not function.isidentifier():
                raise ConfigError("data_source", f"expected module:function or file.py:function, got {self.data_source!r}")
        _positive_list("multi_hot_sizes", self.multi_hot_sizes)


@dataclass
class OptimizerConfig:
    """Fused row-wise Adagrad for the tables (applied in backward), Adagrad or SGD for the MLPs."""

    learning_rate: float = 0.05
    """Peak learning rate of the dense optimizer and (unless set apart) of the tables."""
    embedding_learning_rate: Optional[float] = None
    """Learning rate of the fused row-wise Adagrad on the tables; defaults to --learning_rate."""
    dense_optimizer: Literal["adagrad", "sgd"] = "adagrad"
    """Optimizer of the MLPs (data-parallel part)."""
    eps: float = 1e-8
    """Adagrad epsilon (dense and row-wise)."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to the peak learning rate over this many steps."""
    decay_start_step: int = 0
    """Step at which polynomial decay starts (0 with --decay_steps 0: no decay)."""
    decay_steps: int = 0
    """Length of the polynomial decay; 0 turns decay off."""
    decay_power: float = 2.0
    """Power of the polynomial decay."""
    lr_end: float = 0.0
    """Learning rate at the end of the decay, as a fraction of the peak."""
    cpu_embedding_update: Literal["torch", "fbgemm"] = "torch"
    """On CPU, who applies the tables' row-wise Adagrad in backward: ``torch`` (the speed-ups
    layer's one update for all tables: C kernel, or torch ops without --cpu_kernels) or
    fbgemm's own per-table kernel. The arithmetic is the same; GPUs, and runs with
    --no-speedups, always use fbgemm."""

    def __post_init__(self) -> None:
        _positive("learning_rate", self.learning_rate)
        if self.embedding_learning_rate is not None:
            _positive("embedding_learning_rate", self.embedding_learning_rate)
        _positive("eps", self.eps)
        _positive("warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("decay_start_step", self.decay_start_step, allow_zero=True)
        _positive("decay_steps", self.decay_steps, allow_zero=True)
        _positive("decay_power", self.decay_power)
        if not 0.0 <= self.lr_end <= 1.0:
            raise ConfigError("lr_end", f"must be a fraction in [0, 1], got {self.lr_end}")
        if self.decay_steps and self.decay_start_step < self.warmup_steps:
            raise ConfigError(
                "decay_start_step",
                f"must be >= --warmup_steps ({self.warmup_steps}), got {self.decay_start_step}",
            )


@dataclass
class TrainConfig:
    """The training loop and the process group it runs in."""

    num_epochs: int = 1
    """Passes over the training data."""
    eval_every: int = 0
    """Evaluate on the validation split every this many steps (0: only at the end)."""
    eval_rows: int = 131_072
    """Rows an --eval_every evaluation scores: a fixed sample of the validation split (the
    same rows each time and on any number of ranks), so that evaluating does not outweigh
    training on a large split; the evaluation at the end scores the whole split. 0: the
    whole split every time."""
    log_every: int = 10
    """Write a train record (loss, samples/s) every this many steps."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; ``auto`` is NCCL when a GPU is present, else gloo."""
    num_threads: int = 0
    """CPU threads per rank; 0 divides the machine's cores among the local ranks."""
    precision: Precision = "fp32"
    """Dense compute of the training step: ``fp32``; ``tf32`` (CUDA matmuls in TF32, same
    as fp32 on CPU); ``bf16`` (bfloat16 autocast of the MLPs; the tables, the optimizer
    state, the dot interaction and the loss stay float32). Evaluations score float32
    logits either way, as an exported model does."""
    pg_timeout_s: int = field(default_factory=lambda: _env_int("pg_timeout_s", "TORCHREC_CLOUD_PG_TIMEOUT_S", 1800))
    """Seconds a collective may wait for another rank before the run fails (default 1800,
    or TORCHREC_CLOUD_PG_TIMEOUT_S)."""
    stop_stall_s: float = 120.0
    """After SIGTERM, a rank that finishes no training step for this many seconds (blocked
    in a collective with a lost or frozen peer) exits without saving, so that a restart is
    not held up until the launcher's SIGKILL; 0: wait for the step however long."""
    sigterm_grace_s: Optional[float] = field(
        default_factory=lambda: _env_seconds("sigterm_grace_s", "TORCHREC_CLOUD_GRACE_S")
    )
    """Seconds between SIGTERM and SIGKILL this process can count on. On SIGTERM a checkpoint
    is saved only when the last save's measured time fits in what is left of them;
    otherwise the run stops at once and the next start resumes from the last checkpoint
    (default: TORCHREC_CLOUD_GRACE_S, which rendered pods set to their cloud's reclaim
    grace; unset: always save)."""

    def __post_init__(self) -> None:
        _positive("stop_stall_s", self.stop_stall_s, allow_zero=True)
        if self.sigterm_grace_s is not None:
            _positive("sigterm_grace_s", self.sigterm_grace_s)
        _positive("num_epochs", self.num_epochs)
        _positive("eval_every", self.eval_every, allow_zero=True)
        _positive("eval_rows", self.eval_rows, allow_zero=True)
        _positive("log_every", self.log_every)
        _positive("num_threads", self.num_threads, allow_zero=True)
        _positive("pg_timeout_s", self.pg_timeout_s)


@dataclass
class SpeedupsConfig:
    """The speed-ups layer (torchrec_cloud.speedups): cheaper versions of TorchRec's modules,
    fbgemm's CPU update and gloo's collectives, with the same arithmetic."""

    speedups: bool = True
    """Apply the speed-ups layer to the built and the sharded model. Off: TorchRec's modules
    as built, fbgemm's row-wise Adagrad and the process group's own collectives (the same
    arithmetic, slower; the start record lists what was applied)."""
    cpu_kernels: bool = field(default_factory=lambda: _env_flag("TORCHREC_CLOUD_NATIVE", True))
    """Let the layer use its C kernels (speedups/cpu_kernels.c, built for this machine);
    off, or where they cannot be built, the same arithmetic runs on torch ops. Default on,
    or TORCHREC_CLOUD_NATIVE (0: off)."""
    shm_collectives: bool = field(default_factory=lambda: _env_flag("TORCHREC_CLOUD_SHM", True))
    """CPU ranks on one host move their all-to-alls and gradient all-reduces through
    /dev/shm (when every rank can, with 256 MiB free each); off: gloo's TCP. Default on,
    or TORCHREC_CLOUD_SHM (0: off)."""


@dataclass
class ShardingConfig:
    """Where the embedding tables live: TorchRec's planner places each table (sharding type,
    ranks, kernel) within these bounds; ``torchrec-cloud plan`` shows the placement for any
    cluster before it runs."""

    embedding_kernel: EmbeddingKernel = "auto"
    """How a table's rows are stored on a GPU: ``fused`` (all in GPU memory), ``fused_uvm_caching``
    (in host memory, reached through unified memory, with a cache of hot rows in GPU memory),
    ``fused_uvm`` (in host memory, no cache), or ``auto``: TorchRec's planner picks
    ``fused`` or ``fused_uvm_caching`` per table, caching only the tables GPU memory cannot
    hold. On CPU every table is ``fused`` (host memory): ``auto`` or ``fused`` only."""
    cache_load_factor: float = 0.2
    """For ``fused_uvm_caching`` tables: the share of a table's rows its GPU cache holds (TorchRec's
    CacheParams.load_factor, fbgemm's default 0.2); in (0, 1)."""
    prefetch_pipeline: bool = False
    """When some table is ``fused_uvm_caching`` on a GPU, train with TorchRec's
    PrefetchTrainPipelineSparseDist, which fetches the next batch's rows into the cache while
    the current batch computes (the tables' caches then keep rows in flight, fbgemm's
    prefetch_pipeline). Off until measured against the default pipeline on a GPU
    (``bash bench/gpu_bench.sh uvm``); ignored on CPU and when no table is cached."""

    def __post_init__(self) -> None:
        if not 0.0 < self.cache_load_factor < 1.0:
            raise ConfigError(
                "cache_load_factor",
                f"must be a fraction in (0, 1) (TorchRec's UVM cache size per table), got {self.cache_load_factor}",
            )

    def check_device(self, compute_device: str) -> None:
        """Raise :class:`ConfigError` for a kernel that does not exist on ``compute_device``
        (``cpu`` or ``cuda``): UVM places tables in host memory for a GPU to reach."""
        if compute_device != "cuda" and self.embedding_kernel not in ("auto", "fused"):
            raise ConfigError(
                "embedding_kernel",
                f"{self.embedding_kernel} places tables in host memory for a CUDA GPU to reach; on "
                f"{compute_device} every table is already in host memory: use auto or fused",
            )


@dataclass
class OutputConfig:
    """Where a run writes metrics and event files."""

    output_dir: str = "runs/quickstart"
    """Folder for metrics.jsonl and TensorBoard event files (written by rank 0)."""
    tensorboard: bool = True
    """Write TensorBoard event files to --output_dir."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    prometheus_port: Optional[int] = None
    """Serve Prometheus metrics over HTTP: rank r listens on this port + its local rank
    (off when not given)."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds to: this machine only by default (process and host
    gauges are not for the network); 0.0.0.0 for a cluster's collector (rendered manifests pass it)."""
    system_metrics_interval: float = 5.0
    """Seconds between samples of GPU (NVML) and host CPU/memory gauges for Prometheus."""
    prometheus_linger: float = 0.0
    """Seconds the Prometheus endpoint keeps serving after the run ends, so the collector's
    next scrape sees the final evaluation (give at least the scrape interval)."""

    def __post_init__(self) -> None:
        if not self.output_dir.strip():
            raise ConfigError("output_dir", "must not be empty")
        if self.prometheus_port is not None and not 1 <= self.prometheus_port <= 65535:
            raise ConfigError(
                "prometheus_port", f"must be a TCP port in 1..65535, got {self.prometheus_port}"
            )
        if not self.metrics_host.strip():
            raise ConfigError("metrics_host", "must not be empty (use 0.0.0.0 or 127.0.0.1)")
        _positive("system_metrics_interval", self.system_metrics_interval)
        _positive("prometheus_linger", self.prometheus_linger, allow_zero=True)


JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}")
"""What a job id (``--job_id``, recorded in every checkpoint it writes) may be."""


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (torch.distributed.checkpoint) to a folder or a bucket, and resuming."""

    checkpoint_path: Optional[str] = None
    """Folder or URL (s3://, gs://, az://) that checkpoints are written under; a run
    resumes from the newest complete one there. Unset: no checkpoints."""
    checkpoint_interval: int = 0
    """Save every this many steps (0: only at the end and on SIGTERM)."""
    checkpoint_every_s: float = 0.0
    """Also save every this many seconds of training (0: off), ending the step in progress
    on every rank, so that a reclaim loses at most this much work whatever its grace
    (with --async_checkpoint the write runs beside training)."""
    checkpoint_keep: int = 3
    """Keep the newest this many complete checkpoints, deleting older ones (0: keep all)."""
    resume_from: Optional[str] = None
    """Resume from this checkpoint (a step_NNNNNNNN folder, a folder of them or a run folder:
    its newest complete one) instead of the newest under --checkpoint_path."""
    warm_start: Optional[str] = None
    """Start a new run (step 0, the learning-rate schedule from its start) from the model and
    optimizer state of this checkpoint (a step_NNNNNNNN folder, a folder of them or a run
    folder): the day's warm start. The dataset's vocabulary must descend from the one the
    checkpoint trained on, and the rows it reused are reset. Once --checkpoint_path holds
    checkpoints of its own, the run resumes them instead (a restart does not warm-start again)."""
    async_checkpoint: bool = False
    """Write checkpoints in a background thread; training waits only while the state is
    copied in memory."""
    checkpoint_checksums: bool = True
    """Record a checksum of every checkpoint file as it is written, and check what a resume
    reads against them (a damaged checkpoint is skipped); off: file sizes only."""
    no_progress_restarts: int = 3
    """Give up for good (exit 2) when a start resumes from the same checkpoint step as the
    previous this many starts: an eviction or crash loop that never saves a newer
    checkpoint (the starts are listed in attempts.jsonl beside the checkpoints; 0: never)."""
    job_id: Optional[str] = None
    """The job whose checkpoints these are: a run never overwrites or deletes another job's
    checkpoints, and will not start on a --checkpoint_path that holds them. Default:
    $TORCHREC_CLOUD_JOB_ID, else torchrun's --rdzv_id when named (the rendered manifests name
    the job), else the job of the checkpoint this run resumes, else a new one."""

    def __post_init__(self) -> None:
        if self.job_id is not None and not JOB_ID.fullmatch(self.job_id):
            raise ConfigError("job_id", f"must be 1 to 128 letters, digits or ._:@/+- , got {self.job_id!r}")
        _positive("checkpoint_interval", self.checkpoint_interval, allow_zero=True)
        _positive("checkpoint_every_s", self.checkpoint_every_s, allow_zero=True)
        _positive("no_progress_restarts", self.no_progress_restarts, allow_zero=True)
        _positive("checkpoint_keep", self.checkpoint_keep, allow_zero=True)
        if self.warm_start is not None and self.resume_from is not None:
            raise ConfigError("warm_start", "give --warm_start (a new run from a checkpoint) or --resume_from (the same "
                              "run, continued), not both")  # fmt: skip
        for flag in ("checkpoint_path", "resume_from", "warm_start"):
            value = getattr(self, flag)
            if value is None:
                continue
            if not value.strip():
                raise ConfigError(flag, "must not be empty")
            from torchrec_cloud import storage  # light: cloud packages load only on use

            try:
                storage.scheme(value)
            except storage.StorageError as e:
                raise ConfigError(flag, str(e)) from e
        if self.checkpoint_path is None:
            for flag in ("checkpoint_interval", "checkpoint_every_s", "async_checkpoint"):
                if getattr(self, flag):
                    raise ConfigError(flag, "needs --checkpoint_path (where to write checkpoints)")


@dataclass
class JobConfig:
    """Everything a training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    speedups: SpeedupsConfig = field(default_factory=SpeedupsConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    preset: str = "quickstart"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = ("model", "data", "optimizer", "train", "output", "checkpoint", "speedups", "sharding")
