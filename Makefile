# carve: `make demo` and `make test` are the whole quick start. Each installs the
# Debian 12 packages it lacks (as root), configures, builds and runs.
BUILD ?= build
JOBS ?= $(shell nproc)
PYTHON := /usr/bin/python3

# Debian 12 packages carve builds and tests with (see ../shared/DESIGN.md).
PACKAGES := cmake ninja-build g++ ccache python3 \
  llvm-22-dev libmlir-22-dev mlir-22-tools llvm-22-tools \
  libonnx-dev libprotobuf-dev protobuf-compiler \
  nlohmann-json3-dev libfmt-dev libgtest-dev \
  libopenblas-dev libopenblas-openmp-dev libopenmpi-dev openmpi-bin coinor-libcbc-dev pkg-config \
  python3-torch python3-onnx python3-numpy python3-protobuf python3-venv \
  clang libclang-rt-14-dev

.PHONY: all deps configure build demo test check test-gpu test-modern clean

all: build

deps:
	@missing=$$(for p in $(PACKAGES); do \
	    dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; \
	  done); \
	if [ -n "$$missing" ]; then \
	  echo "carve: installing Debian packages:" $$missing; \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "carve: error: missing packages and not root; run as root or install:" $$missing >&2; \
	    exit 1; \
	  fi; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -q && apt-get install -y -q $$missing; \
	fi

$(BUILD)/build.ninja: CMakeLists.txt | deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release

configure: deps $(BUILD)/build.ninja

build: configure
	ninja -C $(BUILD) -j $(JOBS)

demo: build
	@$(PYTHON) models/demo.py --carve $(BUILD)/bin/carve --workdir $(BUILD)/demo

# The GPU tests (label gpu) need a GPU: `make test-gpu` runs them and fails
# when none is visible; `make test` runs everything else.
test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE '^gpu$$'

# The quick tier for everyday work: unit, lit and the runtime's unit tests
# (with the reference models' export that lit reads), a few minutes.
check: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -L '^quick$$'

# Exports from a current PyTorch (torch 2.x from PyPI, about 5 GB, in $(BUILD)/venv-modern):
# TorchScript and dynamo exports of 11 models trained against that torch (docs/onnx-ops.md).
# Not part of `make test`, which uses Debian's torch 1.13.
test-modern: build
	@test -x $(BUILD)/venv-modern/bin/python || { \
	  $(PYTHON) -m venv $(BUILD)/venv-modern && \
	  $(BUILD)/venv-modern/bin/python -m pip install -q torch onnx onnxscript numpy; }
	$(PYTHON) tests/e2e/modern_exports.py --carve $(BUILD)/bin/carve \
	  --workdir $(BUILD)/tests/e2e-modern --python $(BUILD)/venv-modern/bin/python \
	  --exporters torchscript,dynamo

test-gpu: build
	@tests/gpu/run.sh $(BUILD)

clean:
	rm -rf $(BUILD)
