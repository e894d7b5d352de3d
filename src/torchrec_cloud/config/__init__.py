"""One typed config tree for a training job, its presets, and the CLI flags made from it,
one module per concept:

- ``sections.py``: the tree, one dataclass per section (:class:`JobConfig` holds them), each
  field checked in ``__post_init__``, and :class:`ConfigError`;
- ``presets.py``: ``--preset``'s full configs that differ in a few fields;
- ``flags.py``: one flag per leaf field, of the same snake_case name (``--batch_size``,
  ``--embedding_dim``, ...: the names the seed scripts use), and :class:`FlagParser`.

Flags given on the command line override the preset's values::

    cfg = parse_job_config(["--preset", "criteo-1tb", "--batch_size", "4096"])

A bad value raises :class:`ConfigError` naming the flag; the CLI turns it into a one-line
message and exit code 2. Every name is importable from ``torchrec_cloud.config``.
"""

from __future__ import annotations

from torchrec_cloud.config.flags import (  # noqa: F401
    _field_docs,
    _int_list,
    _preset_defaults,
    _str_list,
    _with_defaults,
    add_config_flags,
    config_from_args,
    flag_key,
    flag_kwargs,
    FlagParser,
    parse_job_config,
    respelled,
)
from torchrec_cloud.config.presets import (  # noqa: F401
    CRITEO_1TB_TABLE_SIZES,
    MLPERF_MULTI_HOT_SIZES,
    PRESETS,
    criteo_1tb,
    mlperf_dcnv2,
    quickstart,
)
from torchrec_cloud.config.sections import (  # noqa: F401
    _FEATURE_NAME,
    JOB_ID,
    SECTIONS,
    _env_flag,
    _env_int,
    _env_seconds,
    _positive,
    _positive_list,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    EmbeddingKernel,
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    OutputConfig,
    Precision,
    ShardingConfig,
    SpeedupsConfig,
    TrainConfig,
)
