# `cmake --install` yields a package: find_package(distill REQUIRED) and link
# distill::distill; includes look the same as in the tree (distill/...).
include(CMakePackageConfigHelpers)

set(_libs ${DISTILL_LIBRARIES})
set_target_properties(${_libs} PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON
                                          INSTALL_RPATH "$ORIGIN")
install(TARGETS ${_libs} distill EXPORT distillTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# The installed headers: distill/distill.h and every distill header it reaches
# through #include "distill/...", followed here at configure time; plus
# distill/student/losses.h, the old include path of the losses. A header no
# installed one includes (the launcher's, the segment's, sys.h, ...) is internal.
set(_hdr_dirs ${PROJECT_SOURCE_DIR}/include)
foreach(m core loss ipc group teacher student ckpt train)
  list(APPEND _hdr_dirs ${PROJECT_SOURCE_DIR}/${m}/include)
endforeach()
set(_todo distill/distill.h distill/student/losses.h)
set(_done distill/build_config.h) # generated: installed below
while(_todo)
  list(POP_FRONT _todo _h)
  if(_h IN_LIST _done)
    continue()
  endif()
  list(APPEND _done ${_h})
  set(_found "")
  foreach(_d ${_hdr_dirs})
    if(EXISTS ${_d}/${_h})
      set(_found ${_d}/${_h})
    endif()
  endforeach()
  if(NOT _found)
    message(FATAL_ERROR "${_h}: included by an installed distill header, but in no include folder")
  endif()
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_found})
  file(STRINGS ${_found} _incs REGEX "^#include \"distill/")
  foreach(_line ${_incs})
    string(REGEX REPLACE "^#include \"([^\"]+)\".*" "\\1" _inc "${_line}")
    list(APPEND _todo ${_inc})
  endforeach()
  get_filename_component(_sub ${_h} DIRECTORY)
  install(FILES ${_found} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/${_sub})
endwhile()
install(FILES ${PROJECT_BINARY_DIR}/generated/distill/build_config.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/distill)

set(_cfgdir ${CMAKE_INSTALL_LIBDIR}/cmake/distill)
install(EXPORT distillTargets NAMESPACE distill:: DESTINATION ${_cfgdir})
configure_package_config_file(cmake/distillConfig.cmake.in
  ${PROJECT_BINARY_DIR}/distillConfig.cmake INSTALL_DESTINATION ${_cfgdir})
# find_package(distill X.Y) takes this package only when X.Y is its major.minor
# and the request is no newer: before 1.0 a minor bump is incompatible (the
# version is bumped on every incompatible change, CHANGELOG.md), so 0.1 is
# refused by 0.2 and 0.2 is taken by 0.2.z.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/distillConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/distillConfig.cmake
              ${PROJECT_BINARY_DIR}/distillConfigVersion.cmake
              cmake/DistillTorch.cmake
        DESTINATION ${_cfgdir})
