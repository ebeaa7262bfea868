include(CMakePackageConfigHelpers)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/kvsift DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS kvsift kvsift_kernels EXPORT kvsiftTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

set(KVSIFT_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvsift)
install(EXPORT kvsiftTargets NAMESPACE kvsift:: DESTINATION ${KVSIFT_CMAKE_DIR})
export(EXPORT kvsiftTargets NAMESPACE kvsift:: FILE ${PROJECT_BINARY_DIR}/kvsiftTargets.cmake)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/kvsiftConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/kvsiftConfig.cmake INSTALL_DESTINATION ${KVSIFT_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/kvsiftConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/kvsiftConfig.cmake ${PROJECT_BINARY_DIR}/kvsiftConfigVersion.cmake
        DESTINATION ${KVSIFT_CMAKE_DIR})
