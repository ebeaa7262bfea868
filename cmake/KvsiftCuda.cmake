# Decides whether the CUDA backend is built (KVSIFT_CUDA = AUTO | ON | OFF) and sets its architectures:
# sm_80 and sm_90a machine code plus compute_90 PTX, unless the caller sets CMAKE_CUDA_ARCHITECTURES.
set(KVSIFT_WITH_CUDA OFF)
if(NOT KVSIFT_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "KVSIFT_CUDA must be AUTO, ON or OFF (got '${KVSIFT_CUDA}')")
endif()
if(NOT KVSIFT_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(KVSIFT_WITH_CUDA ON)
  elseif(KVSIFT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "KVSIFT_CUDA=ON but no CUDA compiler was found (set CUDACXX or put nvcc on PATH)")
  else()
    message(STATUS "kvsift: no CUDA compiler found; building the CPU backend only")
  endif()
endif()

if(KVSIFT_WITH_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 80-real 90a-real 90-virtual)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  # CMake 3.25 does not know nvcc 13's C++20 flag (CMAKE_CUDA_STANDARD 20 fails), so pass it directly. Used for
  # the library's .cu files and for the .cuh header checks (tests/headers/).
  set(KVSIFT_CUDA_FLAGS -std=c++20 --expt-relaxed-constexpr)
  message(STATUS "kvsift: CUDA backend ON (${CMAKE_CUDA_COMPILER_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES})")
endif()

# Adds every kernels/*.cu translation unit (the shared ones, and each selector's in kernels/selectors/<name>/) and
# the host code of the CUDA backend (src/cuda/, src/selectors/<name>/cuda/) to `target`
# (kvsift_cuda, see CMakeLists.txt) and links the CUDA runtime.
function(kvsift_add_cuda_sources target)
  file(GLOB cuda_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/kernels/*.cu ${PROJECT_SOURCE_DIR}/kernels/selectors/*/*.cu
       ${PROJECT_SOURCE_DIR}/src/cuda/*.cpp ${PROJECT_SOURCE_DIR}/src/selectors/*/cuda/*.cpp ${PROJECT_SOURCE_DIR}/src/step/*.cpp)
  target_sources(${target} PRIVATE ${cuda_sources})
  target_link_libraries(${target} PUBLIC CUDA::cudart)
  target_compile_definitions(${target} PUBLIC KVSIFT_WITH_CUDA=1)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${KVSIFT_CUDA_FLAGS} -lineinfo>)
  if(KVSIFT_CUDA_COMPILE_ONLY)
    # Kernels that never run need no optimizing: with cicc and ptxas at -O0 the kernels (sm_80) take 300 s of
    # compile time on 2 cores against 472 (kernels/rerank.cu 12.6 against 42; ptxas alone at -O0: 429). The machines
    # that run kvsift build it optimized.
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:SHELL:-Xcicc -O0>"
                                             "$<$<COMPILE_LANGUAGE:CUDA>:SHELL:-Xptxas -O0>")
  endif()
  set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF)
endfunction()
