# The two commands of the README: `make train` and `make test`. Both set up, build, then act.
BUILD ?= build
JOBS ?= $(shell nproc)
GENERATOR := $(shell command -v ninja >/dev/null 2>&1 && echo Ninja || echo "Unix Makefiles")
CMAKE_FLAGS ?=

.PHONY: all setup configure build test train clean

all: build

setup:
	KILN_BUILD_DIR=$(BUILD) bash scripts/setup.sh

configure: setup
	cmake -S . -B $(BUILD) -G "$(GENERATOR)" -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# Every test; on a machine without a GPU the tests labelled `gpu` skip themselves.
test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 1800

# The default job: the small CNN on Fashion-MNIST (GPU when present, else CPU).
train: build
	$(BUILD)/kiln train --config configs/fashion_mnist.yaml

clean:
	rm -rf $(BUILD)
