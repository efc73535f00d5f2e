# Install rules: the static libraries, the public headers, the tools and a CMake package
# (find_package(fsdp CONFIG) -> fsdp::fsdp), plus CPack's Debian package (cmake/package.cmake).
# Included from the top CMakeLists.txt when FSDP_INSTALL is ON. Why static: docs/design.md,
# "Packaging".
include(CMakePackageConfigHelpers)

set(FSDP_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/fsdp" CACHE STRING
    "Where the CMake package (fsdpConfig.cmake, fsdpTargets.cmake) is installed, relative to the prefix")
mark_as_advanced(FSDP_INSTALL_CMAKEDIR)

# fsdp links the core and the checkpoint core statically, so a consumer needs them;
# fsdp_estimate is the estimator's (<fsdp/tools/estimate.h>: link fsdp::fsdp_estimate); the object
# library fsdp_exe_pch only serves this build's executables and is not installed.
set(FSDP_EXPORTED_LIBRARIES fsdp fsdp_core fsdp_estimate)
if(TARGET fsdp_ckpt_core)
  list(APPEND FSDP_EXPORTED_LIBRARIES fsdp_ckpt_core)
endif()
install(TARGETS ${FSDP_EXPORTED_LIBRARIES} EXPORT fsdpTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT Development)

# Headers: the public ones from the source tree and the generated version.h.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/fsdp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        COMPONENT Development FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/include/fsdp/version.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/fsdp
        COMPONENT Development)

# Tools. With a LibTorch outside /usr (a LibTorch zip in /opt) the installed tools keep
# the directories they linked from as their RPATH, so they find libc10 at run time.
# Debian's LibTorch and HDF5 need none (the loader finds libhdf5_serial.so.* without the
# hdf5/serial link directory), and a Debian package should carry none.
set(FSDP_TOOLS fsdp-run fsdp-estimate fsdp-trace)
if(TARGET fsdp-consolidate)
  list(APPEND FSDP_TOOLS fsdp-consolidate fsdp-inspect)
endif()
if(NOT Torch_DIR MATCHES "^/usr/")
  set_target_properties(${FSDP_TOOLS} PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
endif()
install(TARGETS ${FSDP_TOOLS} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT Tools)

# The CMake package.
install(EXPORT fsdpTargets NAMESPACE fsdp:: DESTINATION ${FSDP_INSTALL_CMAKEDIR}
        COMPONENT Development)
if(HDF5_FOUND)
  set(FSDP_PACKAGE_HAS_HDF5 ON)
else()
  set(FSDP_PACKAGE_HAS_HDF5 OFF)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/fsdpConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/fsdpConfig.cmake
                              INSTALL_DESTINATION ${FSDP_INSTALL_CMAKEDIR})
# 0.x: a minor version may break the API, so 0.1.x satisfies a request for 0.1 only.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/fsdpConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/fsdpConfig.cmake ${PROJECT_BINARY_DIR}/fsdpConfigVersion.cmake
        DESTINATION ${FSDP_INSTALL_CMAKEDIR} COMPONENT Development)

# The licence (BSD-3-Clause), where Debian and GNUInstallDirs put a package's documents.
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT Development)

# CPack only for the top-level project: a parent project packages itself.
if(PROJECT_IS_TOP_LEVEL)
  include(${PROJECT_SOURCE_DIR}/cmake/package.cmake)
endif()
