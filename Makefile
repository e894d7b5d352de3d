# The README's two commands: `make quickstart` and `make test`. Both install the pinned
# stack into .venv first (fast when already done).
VENV ?= .venv
PY := $(VENV)/bin/python
OUTPUT_DIR ?= runs/quickstart
PYTEST_ARGS ?=

.PHONY: install quickstart test bench clean

install:
	@VENV=$(VENV) bash scripts/install.sh

quickstart: install
	$(PY) -m torchrec_cloud train --preset quickstart --output_dir $(OUTPUT_DIR)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(PY) -m torchrec_cloud bench

clean:
	rm -rf $(VENV) runs .pytest_cache
