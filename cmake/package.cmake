# CPack: `cpack -G DEB` in the build directory makes a Debian package of everything the
# install rules install (cmake/install.cmake). scripts/release/deb-check.sh installs it on a fresh
# Debian and builds an application against it.
#
# One package, named as Debian names a static library with its headers: libfsdp-libtorch-dev.
# There is no shared library, so no runtime package (lib...N) to split off; the four
# tools are small and come with it rather than in a package of their own.
#
# Depends has two parts:
#  * what an application built against the package needs: the LibTorch and HDF5 -dev
#    packages this build used, found by asking dpkg which package owns them (libtorch-dev
#    on Debian 12 and 13, libtorch-cuda-dev for a CUDA build), so nothing here names a
#    release. LibTorch is pinned to the major.minor version compiled against: the static
#    library holds code inlined from its headers and LibTorch has no stable C++ ABI.
#  * what the tools load at run time: computed by dpkg-shlibdeps from the binaries.
set(FSDP_DEB_MAINTAINER "fsdp-libtorch maintainers <maintainers@users.noreply.a-seed-616d70da.example>"
    CACHE STRING "The Maintainer field of the Debian package")

# fsdp_deb_owner(<out> <file>): "<package> <version>" of the Debian package owning <file>, or "".
function(fsdp_deb_owner out file)
  set(${out} "" PARENT_SCOPE)
  find_program(FSDP_DPKG_QUERY dpkg-query)
  if(NOT FSDP_DPKG_QUERY OR NOT EXISTS "${file}")
    return()
  endif()
  # dpkg knows a path as installed; the real path is tried when the given one is not it.
  file(REAL_PATH "${file}" real)
  foreach(path IN ITEMS "${file}" "${real}")
    execute_process(COMMAND ${FSDP_DPKG_QUERY} -S "${path}" RESULT_VARIABLE rc OUTPUT_VARIABLE owner
                    ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(rc EQUAL 0)
      break()
    endif()
  endforeach()
  if(NOT rc EQUAL 0 OR NOT owner MATCHES "^([^:, ]+)(:[a-z0-9]+)?: ")
    return()
  endif()
  set(pkg "${CMAKE_MATCH_1}")
  execute_process(COMMAND ${FSDP_DPKG_QUERY} -W -f=\${Version} ${pkg} OUTPUT_VARIABLE ver
                  ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(${out} "${pkg} ${ver}" PARENT_SCOPE)
endfunction()

set(FSDP_DEB_DEPENDS "")
fsdp_deb_owner(torch_owner "${Torch_DIR}/TorchConfig.cmake")
if(torch_owner MATCHES "^([^ ]+) ([0-9]+:)?([0-9]+)\\.([0-9]+)")
  math(EXPR next_minor "${CMAKE_MATCH_4} + 1")
  set(mm "${CMAKE_MATCH_2}${CMAKE_MATCH_3}.${CMAKE_MATCH_4}")
  set(next "${CMAKE_MATCH_2}${CMAKE_MATCH_3}.${next_minor}")
  list(APPEND FSDP_DEB_DEPENDS "${CMAKE_MATCH_1} (>= ${mm}~)" "${CMAKE_MATCH_1} (<< ${next}~)")
else()
  message(STATUS "fsdp: LibTorch (${Torch_DIR}) is not from a Debian package; the .deb will not depend on it")
endif()
if(HDF5_FOUND)
  find_file(FSDP_HDF5_H hdf5.h PATHS ${HDF5_C_INCLUDE_DIRS} ${HDF5_INCLUDE_DIRS} NO_DEFAULT_PATH)
  fsdp_deb_owner(hdf5_owner "${FSDP_HDF5_H}")
  if(hdf5_owner MATCHES "^([^ ]+) ")
    list(APPEND FSDP_DEB_DEPENDS "${CMAKE_MATCH_1}")
  else()
    message(STATUS "fsdp: HDF5 (${FSDP_HDF5_H}) is not from a Debian package; the .deb will not depend on it")
  endif()
endif()
# libfsdp.a asks its consumer's linker for -luring (the NVMe offload's io_uring).
if(FSDP_HAVE_LIBURING)
  fsdp_deb_owner(uring_owner "${FSDP_LIBURING_H}/liburing.h")
  if(uring_owner MATCHES "^([^ ]+) ")
    list(APPEND FSDP_DEB_DEPENDS "${CMAKE_MATCH_1}")
  else()
    message(STATUS "fsdp: liburing (${FSDP_LIBURING_H}) is not from a Debian package; the .deb will not depend on it")
  endif()
endif()
list(JOIN FSDP_DEB_DEPENDS ", " FSDP_DEB_DEPENDS)

set(CPACK_PACKAGE_NAME fsdp-libtorch)
set(CPACK_PACKAGE_VENDOR "fsdp-libtorch")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "Fully Sharded Data Parallel training for LibTorch (C++)")
set(CPACK_PACKAGE_CONTACT "${FSDP_DEB_MAINTAINER}")
# Configure with -DCMAKE_INSTALL_PREFIX=/usr for Debian's multiarch libdir (GNUInstallDirs;
# scripts/release/deb-check.sh does); otherwise the libraries land in /usr/lib, which works too.
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_PACKAGE_NAME libfsdp-libtorch-dev)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${FSDP_DEB_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_SECTION libdevel)
# The synopsis is CPACK_PACKAGE_DESCRIPTION_SUMMARY; this is the extended description.
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION "A static library (fsdp::fsdp through find_package(fsdp CONFIG)) with its
headers and CMake package, and the tools fsdp-run, fsdp-estimate, fsdp-consolidate
and fsdp-inspect. Built against the LibTorch of the Depends line.")
set(CPACK_DEBIAN_PACKAGE_DEPENDS "${FSDP_DEB_DEPENDS}")
find_program(FSDP_DPKG_SHLIBDEPS dpkg-shlibdeps)
if(FSDP_DPKG_SHLIBDEPS)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
else()
  message(STATUS "fsdp: no dpkg-shlibdeps (package dpkg-dev); the .deb's Depends will lack the tools' libraries")
endif()
set(CPACK_RESOURCE_FILE_LICENSE "${PROJECT_SOURCE_DIR}/LICENSE")
set(CPACK_GENERATOR DEB)
include(CPack)
