# Defines the imported target distill_torch (LibTorch with the include
# directories our public headers need). Used by the build and by the installed
# package (distillConfig.cmake): there it runs when the consumer configures, so
# torch is looked up on the consumer's machine, never at a path baked in here.
# Order: a Torch_DIR already set (the consumer's -DTorch_DIR or cache), else
# torch.utils.cmake_prefix_path of DISTILL_PYTHON (default: python3 on PATH).
if(TARGET distill_torch)
  return()
endif()
if(NOT TARGET torch)
  if(NOT Torch_DIR)
    if(DISTILL_PYTHON)
      set(_distill_python ${DISTILL_PYTHON})
    else()
      find_program(_distill_python NAMES python3)
    endif()
    execute_process(
      COMMAND ${_distill_python} -c "import torch; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _torch_rc ERROR_QUIET)
    if(NOT _torch_rc EQUAL 0)
      message(FATAL_ERROR "distill: '${_distill_python} -c \"import torch\"' failed. Install torch==2.11.0 "
                          "into this Python; under pip, build with 'pip install --no-build-isolation .' "
                          "(pip's build isolation hides the installed torch, as for any PyTorch C++ extension); "
                          "or set Torch_DIR to LibTorch's share/cmake/Torch")
    endif()
    list(APPEND CMAKE_PREFIX_PATH ${_torch_prefix})
  endif()
  # Only the architecture we run on (H100/H200); torch ignores CMAKE_CUDA_ARCHITECTURES.
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(ENV{TORCH_CUDA_ARCH_LIST} "9.0")
  endif()
  find_package(Torch REQUIRED)
endif()
add_library(distill_torch INTERFACE IMPORTED GLOBAL)
target_link_libraries(distill_torch INTERFACE ${TORCH_LIBRARIES})
target_include_directories(distill_torch SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})
if(TORCH_CXX_FLAGS)
  separate_arguments(_tflags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
  target_compile_options(distill_torch INTERFACE ${_tflags})
endif()
