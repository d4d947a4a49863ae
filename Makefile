# The README's two commands: `make demo` and `make test` (and `make docs`, the site). Each builds .venv on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Use the machine's local CPU wheel of torch when there is one; never pull a CUDA build for dev.
WHEELS := $(wildcard /opt/wheels)
FIND_LINKS := $(if $(WHEELS),--find-links $(WHEELS),)
STAMP  := $(VENV)/.installed

.PHONY: demo test test-quick docs lint bench bench-remote bench-lightning bench-smoke venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check $(FIND_LINKS) "torch==2.13.0"
	$(PIP) install -q --disable-pip-version-check $(FIND_LINKS) -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py
	$(PY) examples/lightning_train.py
	$(PY) examples/accelerate_train.py
	$(PY) examples/hf_trainer_train.py

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=20

# the inner loop: everything but what starts a process or a server or runs a real Trainer (marked slow)
test-quick: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

# the site (mkdocs.yml, docs/) into site/; --strict: a broken link or a page missing from nav fails
# pyflakes and pycodestyle over every Python file (pyproject.toml's [tool.ruff]); CI runs it
lint: $(STAMP)
	$(PY) -m ruff check .

docs: $(STAMP)
	$(PY) -m mkdocs build --strict

bench: $(STAMP)
	$(PY) benchmarks/bench_save.py

bench-remote: $(STAMP)
	$(PY) benchmarks/bench_remote.py

bench-lightning: $(STAMP)
	$(PY) benchmarks/bench_lightning.py

# every benchmark's --smoke (tiny sizes: a check that each still runs, not a measurement); part of `make test`
bench-smoke: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/test_benchmarks_smoke.py

clean:
	rm -rf $(VENV) demo-out bench-out site
