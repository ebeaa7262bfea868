# Thin wrapper over the CMake presets; see README.md.
JOBS ?= $(shell nproc)

.PHONY: deps demo test build fidelity clean
deps:
	@scripts/install-deps.sh

build: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS)

demo: build
	build/release/bench/kvsift_demo

test: build
	ctest --preset release -j $(JOBS)
	cmake --preset asan-ubsan
	cmake --build --preset asan-ubsan -j $(JOBS)
	ctest --preset asan-ubsan -j $(JOBS)

# Scores the selectors on real-model captures: the results section of docs/fidelity.md and docs/fidelity_mass_recall.png.
fidelity: build
	scripts/fidelity.sh

clean:
	rm -rf build
