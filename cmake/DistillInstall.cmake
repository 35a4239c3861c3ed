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
foreach(m core loss ipc teacher student ckpt train)
  if(EXISTS ${PROJECT_SOURCE_DIR}/${m}/include)
    install(DIRECTORY ${PROJECT_SOURCE_DIR}/${m}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  endif()
endforeach()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
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
