# Configures scratch builds of the source tree in the variants a user or a parent
# project may pick, and fails naming the variant that does not configure or does not
# do what its options say. Run by ctest (Build.ConfiguresWithoutHdf5ExamplesTestsOrBenchmarks):
#   cmake -DSOURCE=<tree> -DSCRATCH=<dir> -DGENERATOR=<gen> [-DPREFIX=<prefix path>]
#         [-DTORCH_CACHE=<initial cache: how the build found LibTorch>] -P configure_variants.cmake
foreach(v SOURCE SCRATCH GENERATOR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "configure_variants.cmake needs -D${v}=...")
  endif()
endforeach()
file(REMOVE_RECURSE "${SCRATCH}")

# configure(NAME SOURCE_DIR EXPECT_REGEX... [ARGS ...]): configures and checks the output.
function(configure name src)
  cmake_parse_arguments(C "" "" "EXPECT;REJECT;ARGS" ${ARGN})
  set(dir "${SCRATCH}/${name}")
  set(cache "")
  if(TORCH_CACHE)
    set(cache -C "${TORCH_CACHE}")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} ${cache} -S "${src}" -B "${dir}" -G "${GENERATOR}"
                          "-DCMAKE_PREFIX_PATH=${PREFIX}" ${C_ARGS}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "variant '${name}' (${C_ARGS}) does not configure:\n${out}\n${err}")
  endif()
  foreach(re IN LISTS C_EXPECT)
    if(NOT "${out}${err}" MATCHES "${re}")
      message(FATAL_ERROR "variant '${name}': the configure output lacks '${re}':\n${out}\n${err}")
    endif()
  endforeach()
  foreach(re IN LISTS C_REJECT)
    if("${out}${err}" MATCHES "${re}")
      message(FATAL_ERROR "variant '${name}': the configure output has '${re}':\n${out}\n${err}")
    endif()
  endforeach()
  message(STATUS "variant '${name}' configures")
endfunction()

configure(no_examples "${SOURCE}" ARGS -DFSDP_BUILD_EXAMPLES=OFF
          EXPECT "FSDP_BUILD_EXAMPLES=OFF, so test_programs")
configure(no_hdf5 "${SOURCE}" ARGS -DCMAKE_DISABLE_FIND_PACKAGE_HDF5=ON
          EXPECT "HDF5 not found; checkpoints are disabled" "no HDF5, so test_checkpoint")
configure(library_only "${SOURCE}"
          ARGS -DFSDP_BUILD_TESTS=OFF -DFSDP_BUILD_EXAMPLES=OFF -DFSDP_BUILD_BENCHMARKS=OFF
               -DCMAKE_DISABLE_FIND_PACKAGE_HDF5=ON
          REJECT "Found GTest")
if(NOT EXISTS "${SCRATCH}/library_only/build.ninja" AND NOT EXISTS "${SCRATCH}/library_only/Makefile")
  message(FATAL_ERROR "variant 'library_only' wrote no build files")
endif()

# A LibTorch older than 2.6 is refused at configure time, by name: a stand-in Torch
# package that says it is 1.13.1 (Debian 12's), found through Torch_DIR.
file(MAKE_DIRECTORY "${SCRATCH}/torch-1.13")
file(WRITE "${SCRATCH}/torch-1.13/TorchConfig.cmake" "set(Torch_FOUND TRUE)\n")
file(WRITE "${SCRATCH}/torch-1.13/TorchConfigVersion.cmake"
     "set(PACKAGE_VERSION 1.13.1)\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n")
execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE}" -B "${SCRATCH}/old_torch" -G "${GENERATOR}"
                        "-DTorch_DIR=${SCRATCH}/torch-1.13"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(REGEX REPLACE "[ \n]+" " " said "${out}${err}")
if(rc EQUAL 0 OR NOT said MATCHES "fsdp: LibTorch 1\\.13\\.1 \\(.*torch-1\\.13\\) is older than 2\\.6, the oldest this project supports")
  message(FATAL_ERROR "variant 'old_torch': LibTorch 1.13.1 was not refused by name (exit ${rc}):\n${out}\n${err}")
endif()
message(STATUS "variant 'old_torch' is refused")

# A parent project that includes this one: tests, examples and benchmarks are off by
# default, and the parent's build type is its own.
file(MAKE_DIRECTORY "${SCRATCH}/parent")
file(WRITE "${SCRATCH}/parent/CMakeLists.txt" "
cmake_minimum_required(VERSION 3.24)
project(parent LANGUAGES C CXX)
add_subdirectory(\"${SOURCE}\" fsdp)
foreach(opt FSDP_BUILD_TESTS FSDP_BUILD_EXAMPLES FSDP_BUILD_BENCHMARKS)
  if(\${\${opt}})
    message(FATAL_ERROR \"\${opt} is ON in a parent project\")
  endif()
endforeach()
if(CMAKE_BUILD_TYPE)
  message(FATAL_ERROR \"the parent's CMAKE_BUILD_TYPE was set to '\${CMAKE_BUILD_TYPE}' by fsdp\")
endif()
foreach(t train_gpt test_parity bench_adamw)
  if(TARGET \${t})
    message(FATAL_ERROR \"target \${t} exists in a parent project\")
  endif()
endforeach()
add_executable(app app.cpp)
target_link_libraries(app PRIVATE fsdp)
")
file(WRITE "${SCRATCH}/parent/app.cpp" "#include <fsdp/fsdp.h>\nint main() { return 0; }\n")
configure(parent "${SCRATCH}/parent")
if(EXISTS "${SCRATCH}/parent/fsdp/fsdpConfig.cmake")
  message(FATAL_ERROR "variant 'parent': fsdp made install rules under a parent that did not ask (FSDP_INSTALL)")
endif()
# A parent that ships fsdp in its own install asks for fsdp's install rules.
configure(parent_install "${SCRATCH}/parent" ARGS -DFSDP_INSTALL=ON)
if(NOT EXISTS "${SCRATCH}/parent_install/fsdp/fsdpConfig.cmake")
  message(FATAL_ERROR "variant 'parent_install': -DFSDP_INSTALL=ON made no fsdpConfig.cmake")
endif()
file(REMOVE_RECURSE "${SCRATCH}")
