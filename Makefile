# Thin wrapper over the CMake presets; see README.md.
JOBS ?= $(shell nproc)

.PHONY: deps demo test build python-test fidelity e2e clean
deps:
	@scripts/install-deps.sh

# In CI (CI set in the environment, as CI services set it; no GPU there) the CUDA code is built as sm_80 and sm_90a
# machine code without the compute_90 PTX, which nothing there loads: a third less CUDA compile time, which keeps
# `make test` on a clean clone under 30 minutes on 2 cores. Both code paths (before and from sm_90) still compile.
CI_CMAKE_FLAGS := $(if $(CI),'-DCMAKE_CUDA_ARCHITECTURES=80-real;90a-real')

build: deps
	cmake --preset release $(CI_CMAKE_FLAGS)
	cmake --build --preset release -j $(JOBS)

# Only the demo's targets: the first thing a new user runs should not wait for every test and benchmark.
demo: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS) --target kvsift_demo
	build/release/bench/kvsift_demo

test: build
	ctest --preset release -j $(JOBS)
	cmake --preset asan-ubsan
	cmake --build --preset asan-ubsan -j $(JOBS)
	ctest --preset asan-ubsan -j $(JOBS)
	scripts/python-test.sh

# The Python package built with pip into build/pyenv, and its tests (part of `make test`).
python-test: deps
	scripts/python-test.sh

# Scores the selectors on real-model captures: the results section of docs/fidelity.md and docs/fidelity_mass_recall.png.
fidelity: build
	scripts/fidelity.sh

# Every layer of SmolLM2-135M decoding through kvsift: the results section of docs/e2e.md and docs/e2e_quality.png.
e2e: deps
	scripts/e2e.sh

clean:
	rm -rf build
