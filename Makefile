# Two commands for a newcomer: `make run` (set up + main job), `make test` (set up + tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned exactly: a looser pin pulls a multi-GB CUDA build.
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup run test thorough clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(wildcard backends/*/pyproject.toml) examples/thirdparty-backend/pyproject.toml integrations/transformers/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q "nixl>=1.5"  # kvabi[nixl]: NIXL transfers (~430 MB of wheels; keeps the CPU torch)
	$(BIN)/pip install -q -e ".[test]" $(foreach b,$(wildcard backends/*/pyproject.toml),-e $(dir $(b)))
	$(BIN)/pip install -q -e examples/thirdparty-backend  # the worked third-party backend (README)
	$(BIN)/pip install -q -e integrations/transformers  # kvabi-transformers: transformers>=5.23 (torch already pinned)
	touch $(STAMP)

run: setup
	$(BIN)/kvabi backends
	$(BIN)/kvabi plan examples/configs/*.json
	$(BIN)/kvabi conformance --all --quick
	$(BIN)/kvabi-transformers demo  # generate_batch of a Gemma-4-like model on kvabi backends

test: setup
	$(BIN)/python -m pytest -q

# The long property and fuzz runs (e.g. 10,000 mutated layout descriptors): the `thorough`
# Hypothesis profile over the hostile-input (descriptor, config, metadata) and transfer-plan tests.
THOROUGH_TESTS ?= tests/test_hostile_*.py tests/test_metadata_hostile.py tests/test_transfer_plan.py
thorough: setup
	KVABI_HYPOTHESIS_PROFILE=thorough $(BIN)/python -m pytest -q $(THOROUGH_TESTS)

clean:
	rm -rf $(VENV)
