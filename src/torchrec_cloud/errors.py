"""The one kind of error the command line turns into one line.

A :class:`CommandError` says what failed and where (a file and line, a URL, a checkpoint
step, a flag's value); ``torchrec-cloud`` prints it as ``torchrec-cloud COMMAND: error:
MESSAGE`` and exits 1, with no traceback (``cli.main`` is the only place that does). The
domain errors derive from it: :class:`~torchrec_cloud.storage.StorageError`,
``CheckpointError`` (and ``CheckpointDamagedError``), ``CompatError``, ``ServingError``, the
data layer's ``PreprocessError`` and :class:`~torchrec_cloud.untrusted.UntrustedInputError`
(a file read as input breaks its format: file and field). A bad flag is a ``ConfigError`` instead
(exit 2). This module imports nothing, so every module can raise these cheaply.
"""

from __future__ import annotations


class CommandError(Exception):
    """A failure whose message names what and where; the CLI prints it as one line, exit 1."""
