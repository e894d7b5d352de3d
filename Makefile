# The README's two commands: `make quickstart` and `make test`. Both install the pinned
# stack into .venv first (fast when already done): `make quickstart` with what the
# commands need (the `report`, `deploy` and `serve` extras), `make test` also with the test
# tools, storage emulators and cloud SDKs (the `test` extra). `make quickstart` keeps its
# model's checkpoint in $(OUTPUT_DIR)/checkpoints, which `export` turns into a model that
# `serve` answers requests with (docs/serving.md, "Serve a model: three commands"); run again,
# it resumes that finished checkpoint rather than training anew (`make clean` first for that).
VENV ?= .venv
PY := $(VENV)/bin/python
OUTPUT_DIR ?= runs/quickstart
PYTEST_ARGS ?=
EXTRAS ?= report,deploy,serve

.PHONY: install quickstart test bench clean render

install:
	@VENV=$(VENV) EXTRAS=$(EXTRAS) bash scripts/install.sh

quickstart: install
	$(PY) -m torchrec_cloud train --preset quickstart --output_dir $(OUTPUT_DIR) --checkpoint_path $(OUTPUT_DIR)/checkpoints

test: EXTRAS = test
test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(PY) -m torchrec_cloud bench

# Regenerate the committed deployment files (quickstart/, docker/, aws/, azure/, gcp/) from
# src/torchrec_cloud/deploy/ templates + profiles; tests/test_deploy.py fails when they drift.
render: install
	$(PY) -m torchrec_cloud.deploy.layout

clean:
	rm -rf $(VENV) runs .pytest_cache
