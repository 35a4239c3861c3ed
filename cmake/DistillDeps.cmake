# Third-party dependencies: LibTorch (PyPI wheel), Boost and yaml-cpp (Debian),
# GoogleTest (as installed), and the CUDA toolkit for DISTILL_CUDA.

# ---- LibTorch from the torch wheel ----
if(NOT DISTILL_PYTHON)
  set(DISTILL_PYTHON python3 CACHE STRING "Python whose torch wheel provides LibTorch")
endif()
if(NOT Torch_DIR)
  execute_process(
    COMMAND ${DISTILL_PYTHON} -c "import torch; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _torch_rc ERROR_QUIET)
  if(NOT _torch_rc EQUAL 0)
    message(FATAL_ERROR "distill: '${DISTILL_PYTHON} -c import torch' failed; install the wheel: "
                        "pip install torch==2.11.0")
  endif()
  list(APPEND CMAKE_PREFIX_PATH ${_torch_prefix})
endif()

# Only the architecture we run on (H100/H200); torch ignores CMAKE_CUDA_ARCHITECTURES
# and would otherwise add 11 architectures to any CUDA code built through it.
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(ENV{TORCH_CUDA_ARCH_LIST} "9.0")
endif()
find_package(Torch REQUIRED)
find_package(Threads REQUIRED)

# LibTorch as one imported target with the include directories our headers need.
# TORCH_LIBRARIES mixes targets and paths; wrap it so our targets say "distill_torch".
if(NOT TARGET distill_torch)
  add_library(distill_torch INTERFACE IMPORTED GLOBAL)
  target_link_libraries(distill_torch INTERFACE ${TORCH_LIBRARIES})
  target_include_directories(distill_torch SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})
  if(TORCH_CXX_FLAGS)
    separate_arguments(_tflags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
    target_compile_options(distill_torch INTERFACE ${_tflags})
  endif()
endif()

# The torch wheel links gloo statically into libtorch_cpu but ships no gloo
# headers; c10d's ProcessGroupGloo.hpp needs them. Debian's libgloo-dev provides
# them (declarations only; we never link Debian's libgloo).
find_path(DISTILL_GLOO_INCLUDE_DIR gloo/algorithm.h PATHS /usr/include)
if(NOT DISTILL_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "distill: gloo headers not found; apt-get install libgloo-dev")
endif()

# ---- Boost.Interprocess and yaml-cpp ----
find_package(Boost 1.74 REQUIRED)
find_package(yaml-cpp REQUIRED)

# ---- CUDA ----
set(DISTILL_CUDA_ENABLED 0)
if(NOT DISTILL_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(DISTILL_CUDA_ENABLED 1)
  elseif(DISTILL_CUDA STREQUAL "ON")
    message(FATAL_ERROR "distill: DISTILL_CUDA=ON but no CUDA toolkit was found")
  endif()
endif()
if(DISTILL_CUDA_ENABLED)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  # NCCL: prefer the headers of the wheel torch was built against.
  execute_process(
    COMMAND ${DISTILL_PYTHON} -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'include'))"
    OUTPUT_VARIABLE _nccl_wheel_inc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  find_path(DISTILL_NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_wheel_inc} ${CUDAToolkit_INCLUDE_DIRS})
endif()
message(STATUS "distill: torch ${Torch_VERSION}, CUDA code ${DISTILL_CUDA_ENABLED}, "
               "gloo headers ${DISTILL_GLOO_INCLUDE_DIR}")
