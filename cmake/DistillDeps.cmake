# Third-party dependencies: LibTorch (PyPI wheel), Boost, yaml-cpp, nlohmann-json and CLI11 (Debian),
# OpenSSL's libcrypto and LMDB (Debian), GoogleTest (as installed), and the CUDA toolkit for DISTILL_CUDA.

# ---- LibTorch from the torch wheel ----
if(NOT DISTILL_PYTHON)
  set(DISTILL_PYTHON python3 CACHE STRING "Python whose torch wheel provides LibTorch")
endif()
include(DistillTorch)
find_package(Threads REQUIRED)

# The torch wheel links gloo statically into libtorch_cpu but ships no gloo
# headers; c10d's ProcessGroupGloo.hpp needs them. Debian's libgloo-dev provides
# them (declarations only; we never link Debian's libgloo).
find_path(DISTILL_GLOO_INCLUDE_DIR gloo/algorithm.h PATHS /usr/include)
if(NOT DISTILL_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "distill: gloo headers not found; apt-get install libgloo-dev")
endif()

# ---- Boost.Interprocess, yaml-cpp, OpenSSL (the rendezvous store's HMAC), nlohmann-json ----
find_package(Boost 1.74 REQUIRED)
find_package(yaml-cpp REQUIRED)
find_package(OpenSSL REQUIRED COMPONENTS Crypto)
# Header-only; the checkpoint manifest is read and written with it (ckpt/).
find_package(nlohmann_json 3 REQUIRED)
# Header-only; distill-run's command line (launcher/src/args.cpp). Debian libcli11-dev.
find_package(CLI11 2 REQUIRED)

# ---- LMDB: the teacher-output cache's store (teacher/src/cache/store.cpp; Debian liblmdb-dev) ----
find_path(DISTILL_LMDB_INCLUDE_DIR lmdb.h)
find_library(DISTILL_LMDB_LIBRARY lmdb)
if(NOT DISTILL_LMDB_INCLUDE_DIR OR NOT DISTILL_LMDB_LIBRARY)
  message(FATAL_ERROR "distill: LMDB not found; apt-get install liblmdb-dev")
endif()
add_library(distill_lmdb INTERFACE IMPORTED GLOBAL)
set_target_properties(distill_lmdb PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${DISTILL_LMDB_INCLUDE_DIR}"
                                              INTERFACE_LINK_LIBRARIES "${DISTILL_LMDB_LIBRARY}")

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
