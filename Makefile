# Two entry points, each doing all of its own set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DFK := $(VENV)/bin/dflashkit
STAMP := $(VENV)/.installed
TARGET := qwen2.5-coder-0.5b-instruct
DEMO_PROMPT := Write a Python function that returns the n-th Fibonacci number, with a docstring and a short test.

.PHONY: demo test setup clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned to the CPU build on this machine; then every other dependency exactly
	# as locked, without resolution, so nothing can pull another torch build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(DFK) models prepare $(TARGET)
	@block="--block-size auto"; if [ -f checkpoints/$(TARGET)/config.json ]; then \
		drafter=checkpoints/$(TARGET); block="--tree 7"; \
	else \
		echo "NOTE: no trained drafter ships yet: using a freshly initialised, UNTRAINED drafter."; \
		echo "      Its proposals are almost never accepted, so expect NO speedup (a slowdown)."; \
		echo "      The point of this demo today is that the output is identical to plain decoding."; \
		drafter=build/untrained-drafter; \
		[ -f $$drafter/config.json ] || $(DFK) drafter init --target $(TARGET) --out $$drafter --block-size 4; \
	fi; \
	$(DFK) generate --target $(TARGET) --drafter $$drafter --prompt "$(DEMO_PROMPT)" \
		--max-new-tokens 128 $$block --compare

test: $(STAMP)
	$(DFK) models prepare --quiet $(TARGET) smollm2-135m-instruct
	$(PY) -m pytest -q

clean-venv:
	rm -rf $(VENV)
