# The C++ runtime: every distill library and program must use the shared libstdc++ that torch
# and the Python interpreter load (libstdc++.so.6).
#
# A GCC whose own library folder holds libstdc++.a and no libstdc++.so (a compiler relocated
# under /opt, as on one GPU image) makes the linker take the archive: each shared library then
# carries a private copy of libstdc++, its locale and stream state apart from the process's, and
# the first `stream << number` inside distill called from Python crashes. This check links a small
# shared library the way the build will and reads what it needs (objdump -p). If libstdc++.so.6
# is not among its needs, the shared runtime the compiler can find is linked into every target
# explicitly (named after the objects, so the driver's trailing -lstdc++ finds nothing left to
# resolve); when there is none, the configure stops and says which compiler to use.
if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU" OR NOT CMAKE_SYSTEM_NAME STREQUAL "Linux")
  return()
endif()
find_program(DISTILL_OBJDUMP NAMES objdump ${CMAKE_OBJDUMP})
if(NOT DISTILL_OBJDUMP)
  message(STATUS "distill: no objdump; the libstdc++ link check is skipped")
  return()
endif()

set(_dir ${CMAKE_BINARY_DIR}/CMakeFiles/distill-libstdcxx-check)
file(MAKE_DIRECTORY ${_dir})
file(WRITE ${_dir}/probe.cpp "#include <sstream>\n#include <string>\nstd::string distill_probe(long v) { std::ostringstream s; s << v; return s.str(); }\n")

# distill_libstdcxx_needed(OUT [extra link arguments...]): TRUE when the probe library needs
# libstdc++.so.6.
function(distill_libstdcxx_needed out)
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -shared -fPIC -O1 ${_dir}/probe.cpp -o ${_dir}/probe.so ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "distill: ${CMAKE_CXX_COMPILER} cannot link a shared library:\n${err}")
  endif()
  execute_process(COMMAND ${DISTILL_OBJDUMP} -p ${_dir}/probe.so OUTPUT_VARIABLE deps RESULT_VARIABLE rc)
  if(rc EQUAL 0 AND deps MATCHES "NEEDED[ \t]+libstdc\\+\\+\\.so")
    set(${out} TRUE PARENT_SCOPE)
  else()
    set(${out} FALSE PARENT_SCOPE)
  endif()
endfunction()

distill_libstdcxx_needed(_shared)
if(NOT _shared)
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so.6
                  OUTPUT_VARIABLE _so6 OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(IS_ABSOLUTE "${_so6}" AND EXISTS "${_so6}")
    distill_libstdcxx_needed(_shared "${_so6}")
  endif()
  if(NOT _shared)
    message(FATAL_ERROR
      "distill: ${CMAKE_CXX_COMPILER} links libstdc++ statically into shared libraries (its library "
      "folder has libstdc++.a and no libstdc++.so), and no libstdc++.so.6 was found to link instead. "
      "A private libstdc++ in each library crashes inside Python. Configure with the system compiler: "
      "-DCMAKE_CXX_COMPILER=/usr/bin/g++")
  endif()
  get_filename_component(_so6 "${_so6}" REALPATH)
  message(STATUS "distill: ${CMAKE_CXX_COMPILER} would link libstdc++ statically into shared libraries; "
                 "linking ${_so6} into every target instead")
  link_libraries("${_so6}")
endif()
