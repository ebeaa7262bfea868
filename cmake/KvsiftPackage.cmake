include(CMakePackageConfigHelpers)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/kvsift DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

# Two export sets: kvsiftTargets (headers, kvsift::cpu; and kvsift::kernels without CUDA) needs no CUDA toolkit;
# kvsiftCudaTargets (kvsift::cuda, and kvsift::kernels, which links it) refers to CUDA::cudart, so
# kvsiftConfig.cmake loads it only when the consumer's CMake finds the CUDA toolkit.
set(KVSIFT_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvsift)
set(destinations ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
                 INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
set(export_sets kvsiftTargets)
if(KVSIFT_WITH_CUDA)
  install(TARGETS kvsift kvsift_cpu EXPORT kvsiftTargets ${destinations})
  install(TARGETS kvsift_cuda kvsift_kernels EXPORT kvsiftCudaTargets ${destinations})
  list(APPEND export_sets kvsiftCudaTargets)
else()
  install(TARGETS kvsift kvsift_cpu kvsift_kernels EXPORT kvsiftTargets ${destinations})
endif()
foreach(export_set IN LISTS export_sets)
  install(EXPORT ${export_set} NAMESPACE kvsift:: DESTINATION ${KVSIFT_CMAKE_DIR})
  # The build tree serves as a package too (find_package with kvsift_DIR = the build directory).
  export(EXPORT ${export_set} NAMESPACE kvsift:: FILE ${PROJECT_BINARY_DIR}/${export_set}.cmake)
endforeach()

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/kvsiftConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/kvsiftConfig.cmake INSTALL_DESTINATION ${KVSIFT_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/kvsiftConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/kvsiftConfig.cmake ${PROJECT_BINARY_DIR}/kvsiftConfigVersion.cmake
        DESTINATION ${KVSIFT_CMAKE_DIR})
