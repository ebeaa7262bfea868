include(GNUInstallDirs)

set(KVSIFT_CUDA AUTO CACHE STRING "Build the CUDA backend: AUTO (when nvcc is found), ON, or OFF")
set_property(CACHE KVSIFT_CUDA PROPERTY STRINGS AUTO ON OFF)
option(KVSIFT_TESTS "Build kvsift's tests" ${KVSIFT_TOP_LEVEL})
option(KVSIFT_BENCH "Build kvsift's demo, benchmarks and tools (tools/)" ${KVSIFT_TOP_LEVEL})
option(KVSIFT_INSTALL "Generate kvsift's install rules and package config" ${KVSIFT_TOP_LEVEL})
option(KVSIFT_PYTHON "Build the Python extension module kvsift._kvsift (nanobind; pyproject.toml turns it on)" OFF)
option(KVSIFT_HEADER_CHECKS "With the tests, compile every public header on its own (tests/headers/)" ON)
option(KVSIFT_TESTS_O1
       "Compile the CPU tests at -O1 (CI: half their compile time at -O3, for a longer run; the library's own sources stay optimized)"
       OFF)
option(KVSIFT_CUDA_COMPILE_ONLY
       "The CUDA code only compiles here (no GPU: CI): device code unoptimized, CUDA tests and benchmarks at -O0" OFF)

if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE Release CACHE STRING "Build type" FORCE)
endif()

set(KVSIFT_WARNINGS -Wall -Wextra -Wpedantic -Wno-unused-parameter)
