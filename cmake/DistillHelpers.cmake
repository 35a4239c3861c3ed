# Helpers shared by every folder.

set(DISTILL_WARNINGS -Wall -Wextra -Wno-unused-parameter)

if(DISTILL_SANITIZE)
  set(DISTILL_SAN_FLAGS -fsanitize=${DISTILL_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
endif()

# One precompiled header for torch, built once and reused by every target that
# needs torch (REUSE_FROM needs identical flags, hence one static owner target).
set(DISTILL_TORCH_PCH_HEADERS <torch/torch.h>)

function(distill_common_flags target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${DISTILL_WARNINGS} -Winvalid-pch>)
  if(DISTILL_SAN_FLAGS)
    target_compile_options(${target} PRIVATE ${DISTILL_SAN_FLAGS})
    target_link_options(${target} PRIVATE ${DISTILL_SAN_FLAGS})
  endif()
  target_include_directories(${target} PRIVATE ${PROJECT_BINARY_DIR}/generated)
endfunction()

# The tests' own sources (and their support code) are compiled at DISTILL_TEST_OPT; the libraries
# and programs they test keep the build type's level. At -O0 a test file compiles in about 60 % of
# its -O2 time (ckpt_test.cpp 20 -> 11.5 s, hang_test.cpp 15 -> 9 s of CPU); the test code itself
# is thin and its run time does not change measurably. Empty: the build type's level.
set(DISTILL_TEST_OPT "-O0" CACHE STRING "Optimisation flag of the tests' own sources (empty: the build type's)")

# distill_test_flags(target): a test or test-support target's optimisation level.
function(distill_test_flags target)
  if(DISTILL_TEST_OPT)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${DISTILL_TEST_OPT}>)
  endif()
endfunction()

# distill_torch_pch(target [TEST]): give `target` the shared torch PCH. TEST: the tests' own PCH,
# built at DISTILL_TEST_OPT (GCC refuses a PCH built at another -O level: __OPTIMIZE__ differs).
function(distill_torch_pch target)
  cmake_parse_arguments(A "TEST" "" "" ${ARGN})
  if(NOT DISTILL_TORCH_PCH)
    return()
  endif()
  set(owner distill_pch_owner)
  if(A_TEST AND DISTILL_TEST_OPT)
    set(owner distill_pch_owner_test)
  endif()
  if(NOT TARGET ${owner})
    file(WRITE ${PROJECT_BINARY_DIR}/pch_owner.cpp "// owns the torch precompiled header\n")
    add_library(${owner} STATIC ${PROJECT_BINARY_DIR}/pch_owner.cpp)
    target_link_libraries(${owner} PRIVATE distill_torch)
    distill_common_flags(${owner})
    if(A_TEST)
      distill_test_flags(${owner})
    endif()
    target_precompile_headers(${owner} PRIVATE ${DISTILL_TORCH_PCH_HEADERS})
  endif()
  target_precompile_headers(${target} REUSE_FROM ${owner})
  # The PCH is built with -fPIC; CMake would give an executable -fPIE, which
  # makes GCC reject the PCH ("created and used with different settings of
  # -fpie") and silently parse all of torch again. -fPIC code links into a PIE.
  get_target_property(_type ${target} TYPE)
  if(_type STREQUAL "EXECUTABLE")
    set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
    target_compile_options(${target} PRIVATE -fPIC)
  endif()
endfunction()

# distill_unity(target [sources left out...]): with DISTILL_UNITY_BUILD, the
# target's sources are compiled as one translation unit (CMake's UNITY_BUILD),
# so torch's headers are parsed and its inline templates instantiated and
# optimised once per library instead of once per file: that is where a clean
# build's time goes (docs/building.md, "Build time"). The sources listed are
# left out (the cheap ones that need no torch).
function(distill_unity target)
  if(NOT DISTILL_UNITY_BUILD)
    return()
  endif()
  set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_MODE BATCH UNITY_BUILD_BATCH_SIZE 0)
  if(ARGN)
    set_source_files_properties(${ARGN} TARGET_DIRECTORY ${target} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  endif()
endfunction()

# distill_library(name SOURCES ... DEPS ... [TORCH_SOURCES ...])
# A module: folder `name`, namespace distill, shared library distill_<name>,
# alias distill::<name>, public headers in <folder>/include/distill/<name>/.
# Only TORCH_SOURCES get the torch PCH; the others must not need torch.
function(distill_library name)
  cmake_parse_arguments(A "" "" "SOURCES;TORCH_SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  set(t distill_${name})
  add_library(${t} SHARED ${A_SOURCES} ${A_TORCH_SOURCES})
  add_library(distill::${name} ALIAS ${t})
  set_target_properties(${t} PROPERTIES EXPORT_NAME ${name} OUTPUT_NAME distill_${name})
  target_include_directories(${t} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/generated>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${t} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
  distill_common_flags(${t})
  if(A_TORCH_SOURCES)
    distill_torch_pch(${t})
    set_source_files_properties(${A_SOURCES} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
  endif()
  distill_unity(${t} ${A_SOURCES})
  set_property(GLOBAL APPEND PROPERTY DISTILL_LIBRARIES ${t})
endfunction()

# distill_test(name SOURCES ... [LIBS ...] [LABELS ...] [TORCH] [TIMEOUT s])
# One gtest executable per test file; registered with ctest as one test so that
# multi-process fixtures own their processes. TORCH: use the torch PCH.
function(distill_test name)
  cmake_parse_arguments(A "TORCH" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${A_SOURCES})
  # support/main.cpp: runs a child role (support/roles.h) or the tests.
  target_link_libraries(${name} PRIVATE ${A_LIBS} distill_testing distill_testing_main GTest::gtest)
  distill_common_flags(${name})
  distill_test_flags(${name})
  if(A_TORCH)
    distill_torch_pch(${name} TEST)
  endif()
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${A_TIMEOUT} LABELS "${A_LABELS}"
    ENVIRONMENT "DISTILL_BIN_DIR=${PROJECT_BINARY_DIR}/bin;DISTILL_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
endfunction()

set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/lib)

# From the installed programs to the installed libraries (their RPATH).
file(RELATIVE_PATH DISTILL_BIN_TO_LIB "/${CMAKE_INSTALL_BINDIR}" "/${CMAKE_INSTALL_LIBDIR}")
