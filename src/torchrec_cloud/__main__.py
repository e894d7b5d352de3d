"""``python -m torchrec_cloud`` is the ``torchrec-cloud`` command (and works under torchrun)."""

import sys

from torchrec_cloud.cli import main

sys.exit(main())
