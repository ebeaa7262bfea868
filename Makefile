# Thin wrapper over the CMake presets; see README.md.
JOBS ?= $(shell nproc)

.PHONY: deps demo test build python-test fidelity e2e clean
deps:
	@scripts/install-deps.sh

# In CI (CI set in the environment, as CI services set it; no GPU there) the CUDA code is built as sm_80 machine code
# alone, unoptimized (KVSIFT_CUDA_COMPILE_ONLY: device code at -O0, the CUDA tests, which skip there, and the
# benchmarks at -O0), and the CPU tests' own files at -O1 (KVSIFT_TESTS_O1: test_conformance.cpp 33 s against 66 at
# -O3; the suite runs as fast, 49 against 51 s, its time being in the library's optimized sources): with the
# sanitizer build at -Og (CMakePresets.json) this keeps `make test` on a clean clone under 30 minutes on 2 cores (31
# before the tests at -O1 and the device code at -O0, 52 before the rest). The code paths from sm_90 (clusters,
# tensor-core page scores) compile wherever kvsift is built for the GPU it runs on (the device runs build 90a-real,
# optimized), so CI compiles the other side: the paths before sm_90.
CI_CMAKE_FLAGS := $(if $(CI),-DCMAKE_CUDA_ARCHITECTURES=80-real -DKVSIFT_CUDA_COMPILE_ONLY=ON -DKVSIFT_TESTS_O1=ON)

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
