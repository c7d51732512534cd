# ggufrope — see README.md
#   make build        patched llama-cpp-python into .venv (CPU; CUDA=1 for CUDA, CUDA_ARCH=90 to pick archs)
#   make demo         the main job on the default model: build, fetch, set mixed + log-n, generate at n_ctx 16384
#   make demo MODEL=gemma3   the same on Gemma 3 270M (L = 32768): ~34,800-token prompt at n_ctx 40960
#   make test         the test suite (what CI runs); builds the unpatched library too (make stock)
#   make stock        the UNPATCHED llama.cpp of the same sdist into build/stock-lib (incremental)
#   make tools        the patched llama-server, llama-cli, llama-perplexity, llama-bench, ggml-rpc-server
#                     into build/tools/bin (CPU; CUDA=1 for CUDA; UI=1 builds the server's web UI with npm)
#   make results-report  docs/results/ (table, JSON, plot) from the committed per-unit results
#   make results-v2-report  docs/results/v2/*/ the same way, and their tables quoted in docs/results.md

PYTHON   ?= python3
VENV     := .venv
PY       := $(VENV)/bin/python
CUDA     ?= $(shell nvidia-smi -L >/dev/null 2>&1 && command -v nvcc >/dev/null 2>&1 && echo 1 || echo 0)
DEMO_DIR := build/demo
MODEL    ?= smollm2
# per model: n_ctx of the demo (above the model's L; the prompt is ggufrope.corpus.DEMO_PROMPTS)
DEMO_NCTX_smollm2 := 16384
DEMO_NCTX_gemma3  := 40960
DEMO_NCTX := $(DEMO_NCTX_$(MODEL))
NPROC    := $(shell nproc)

.PHONY: all venv build stock tools model demo test test-slow results-report results-dynamic-report results-v2-report cuda-compile test-backend-ops gpu-check clean distclean

all: build

# extras: test, eval, and server = what `python -m llama_cpp.server` imports, listed by name: never
# llama-cpp-python[server], which could build a stock library over the patched one
$(VENV)/.deps: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,eval,server]'
	touch $@

venv: $(VENV)/.deps

build: venv
	CUDA=$(CUDA) native/build.sh

# the unpatched llama.cpp of the same pinned sdist (the stock-compatibility tests load it with
# LLAMA_CPP_LIB_PATH=build/stock-lib); a few minutes once, then a no-op ninja run
stock: build
	bench/build-stock.sh

# the patched llama.cpp tools from the same tree (static binaries, incremental): native/tools.sh
UI ?= 0
tools: build
	CUDA=$(CUDA) UI=$(UI) native/tools.sh

model: venv
	@$(PY) -m ggufrope.models --model $(MODEL)

demo: build
	@test -n "$(DEMO_NCTX)" || { echo "make demo: unknown MODEL=$(MODEL) (smollm2 or gemma3)" >&2; exit 2; }
	@mkdir -p $(DEMO_DIR)
	$(PY) -m ggufrope.corpus --demo-text $(DEMO_DIR)/long-$(MODEL).txt --model $(MODEL)
	$(VENV)/bin/ggufrope set "$$($(PY) -m ggufrope.models --model $(MODEL))" --method mixed --b 0.625 --logn -o $(DEMO_DIR)/$(MODEL)-mixed-logn.gguf
	$(VENV)/bin/ggufrope show $(DEMO_DIR)/$(MODEL)-mixed-logn.gguf
	$(VENV)/bin/ggufrope generate $(DEMO_DIR)/$(MODEL)-mixed-logn.gguf --n-ctx $(DEMO_NCTX) -f $(DEMO_DIR)/long-$(MODEL).txt -n 64

test: build stock tools
	$(PY) -m pytest -ra --durations=20

test-slow: build
	$(PY) -m pytest -ra -m slow

# the grid of docs/results.md is computed by the commands listed there (hours on 2 cores); this
# rewrites its report from the cached units in docs/results/cache, computing nothing
RESULTS_GRID := --n-ctx 8192,16384,32768 --methods all --logn both --text paradise_lost --max-windows 1 \
	--trials 3 --depths 0,0.5,1
results-report: build
	$(VENV)/bin/ggufrope eval compare "$$($(PY) -m ggufrope.models)" $(RESULTS_GRID) \
		--cache docs/results/cache --out docs/results --report-only -q

# issue 13: dynamic vs static k per document (beyond L at 2x and 4x; within L at 8192 with the static
# k of a 16k context), written from the committed units in docs/results/cache, computing nothing
DYN_TEXTS := paradise_lost hamlet comus
results-dynamic-report: build
	@for t in $(DYN_TEXTS); do \
	  $(VENV)/bin/ggufrope eval compare "$$($(PY) -m ggufrope.models)" --methods ntk-mixed --logn both --dynamic both \
	    -c 16384,32768 --trials 0 --text $$t --cache docs/results/cache --out docs/results/dynamic/$$t --report-only -q || exit 1; \
	  $(VENV)/bin/ggufrope eval compare "$$($(PY) -m ggufrope.models)" --methods none,ntk-mixed --logn off --dynamic both \
	    -k 2 -c 8192 --trials 0 --text $$t --cache docs/results/cache --out docs/results/dynamic/$$t-within-L --report-only -q || exit 1; \
	done

# issue 15: the grids on three documents (docs/results/v2/*), rewritten from the committed units, computing
# nothing, and their tables quoted in docs/results.md between <!-- grid-NAME:start/end --> markers
results-v2-report: build
	$(PY) -m ggufrope.evaluation.publish

# compile the patched CUDA rope sources with nvcc (no GPU needed); see native/cuda-compile.sh
cuda-compile: build
	native/cuda-compile.sh

# build the patched test-backend-ops and run -o ROPE / ROPE_SET_ROWS (CUDA=1: CUDA vs CPU)
test-backend-ops: build
	CUDA=$(CUDA) native/test-backend-ops.sh

# on a machine with an NVIDIA GPU: CUDA build, test-backend-ops, tiny models and SmolLM2 on the GPU
gpu-check: venv
	native/gpu-check.sh

clean:
	rm -rf build/src build/demo

distclean:
	rm -rf build $(VENV)
