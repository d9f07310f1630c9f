# dimd: `make demo` and `make test` do everything on a fresh machine.
PYTHON      ?= python3
VENV        ?= .venv
# A site that wants another torch build (CUDA, ROCm) overrides this.
TORCH_SPEC  ?= torch==2.13.0
DEMO_DIR    ?= demo
NP          ?= 2

BIN   := $(VENV)/bin
PY    := $(BIN)/python
PIP   := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.dimd-installed
# pillow-simd's resize is 5-7x faster with AVX2; build with it when the CPU has it.
SIMD_CC := $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo "cc -mavx2" || echo cc)

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH_SPEC)"
	@if $(PY) -c "import importlib.metadata as m; m.version('pillow')" 2>/dev/null; then \
	  echo "removing plain Pillow (dimd uses pillow-simd)"; $(PIP) uninstall -y pillow; fi
	$(PY) -c "import importlib.metadata as m; m.version('pillow-simd')" 2>/dev/null || \
	  CC="$(SIMD_CC)" $(PIP) install --no-binary pillow-simd pillow-simd
	$(PIP) install -e '.[test]'
	@! $(PY) -c "import importlib.metadata as m; m.version('pillow')" 2>/dev/null || \
	  { echo "error: plain Pillow was installed over pillow-simd" >&2; exit 1; }
	touch $@

# The whole pipeline on generated sample data: make, pack, shuffle, allreduce, train.
demo: setup
	$(BIN)/dimd sample-data $(DEMO_DIR)/images/train --classes 10 --per-class 80 --seed 1
	$(BIN)/dimd sample-data $(DEMO_DIR)/images/val --classes 10 --per-class 20 --seed 2 --layout flat
	$(BIN)/dimd pack $(DEMO_DIR)/images/train -o $(DEMO_DIR)/train --force
	$(BIN)/dimd pack $(DEMO_DIR)/images/val --list $(DEMO_DIR)/images/val/labels.txt \
	  --classes-file $(DEMO_DIR)/images/val/classes.txt -o $(DEMO_DIR)/val --force
	$(BIN)/dimd inspect $(DEMO_DIR)/train
	$(BIN)/mpiexec -n $(NP) $(BIN)/dimd shuffle $(DEMO_DIR)/train --rounds 3 --verify
	$(BIN)/mpiexec -n $(NP) $(BIN)/dimd bench-allreduce --check --max-bytes 4M --algorithms all
	$(BIN)/mpiexec -n $(NP) $(BIN)/dimd train $(DEMO_DIR)/train --val $(DEMO_DIR)/val \
	  --model resnet20 --image-size 32 --epochs 8 --batch-size 32 --lr 0.4 \
	  --checkpoint-dir $(DEMO_DIR)/checkpoints --json $(DEMO_DIR)/train.json

test: setup
	$(PY) -m pytest

clean:
	rm -rf $(DEMO_DIR) build *.egg-info
