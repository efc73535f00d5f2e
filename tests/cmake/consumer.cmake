# Builds and runs the user's application in tests/consumer one way, as a user would:
#
#   cmake -DMODE=install|package|subdirectory|fetchcontent|minimal -DSOURCE=<tree> -DBUILD=<this build>
#         -DSCRATCH=<dir> -DGENERATOR=<gen> [-DPREFIX=<prefix path>] -P consumer.cmake
#
# install: `cmake --install BUILD --prefix SCRATCH/prefix` (the other modes need it:
# every mode runs the application under the installed fsdp-run).
# package: the application finds the installed package (find_package(fsdp)).
# subdirectory, fetchcontent: the application builds the source tree as part of itself.
# minimal: examples/minimal (minimal_gpt.cpp) built against the installed package, run,
# and resumed from its checkpoint.
# Each built application trains 2 ranks under SCRATCH/prefix/bin/fsdp-run, saves a
# sharded checkpoint and loads it back (tests/consumer/app.cpp checks what it loaded).
foreach(v MODE SOURCE BUILD SCRATCH GENERATOR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "consumer.cmake needs -D${v}=...")
  endif()
endforeach()
set(prefix "${SCRATCH}/prefix")

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer (${MODE}): ${what} failed (exit ${rc}):\n${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}${err}" PARENT_SCOPE)
endfunction()

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE "${prefix}")
  run("cmake --install" ${CMAKE_COMMAND} --install "${BUILD}" --prefix "${prefix}")
  foreach(f bin/fsdp-run include/fsdp/fsdp.h include/fsdp/version.h lib/cmake/fsdp/fsdpConfig.cmake
            share/doc/fsdp_libtorch/LICENSE)
    if(NOT EXISTS "${prefix}/${f}")
      message(FATAL_ERROR "consumer (install): ${prefix}/${f} was not installed")
    endif()
  endforeach()
  message(STATUS "installed into ${prefix}")
  return()
endif()

if(NOT EXISTS "${prefix}/bin/fsdp-run")
  message(FATAL_ERROR "consumer (${MODE}): no ${prefix}/bin/fsdp-run; the install step (MODE=install) runs first")
endif()
set(dir "${SCRATCH}/${MODE}")
set(args -DFSDP_CONSUMER_MODE=${MODE} -DCMAKE_BUILD_TYPE=Release)
set(env_prefix "")
set(project_dir "${SOURCE}/tests/consumer")
if(MODE STREQUAL "minimal")
  # examples/minimal/CMakeLists.txt: the one-file example as a user's own project.
  set(project_dir "${SOURCE}/examples/minimal")
  set(args -DCMAKE_BUILD_TYPE=Release)
endif()
if(MODE STREQUAL "package" OR MODE STREQUAL "minimal")
  # Two prefixes: through the environment, whose list separator (':') passes through
  # execute_process unsplit.
  set(env_prefix "CMAKE_PREFIX_PATH=${prefix}:${PREFIX}")
else()
  # The library's sources compiled as part of a user's project that chose no build type,
  # CMake's default: no optimization and assertions on (NDEBUG unset), which the suite's
  # own builds never compile, in a third less time than Release's -O3 (this test alone on
  # a 2-core AMD EPYC, ccache off: 230 s against 349 s; docs/benchmarks.md).
  set(args -DFSDP_CONSUMER_MODE=${MODE} -DCMAKE_BUILD_TYPE=)
  list(APPEND args "-DFSDP_SOURCE_DIR=${SOURCE}" "-DCMAKE_PREFIX_PATH=${PREFIX}")
  # The library's sources are compiled here again. Both modes put its build in
  # <dir>/fsdp-libtorch and ccache sees paths under SCRATCH relative to the build
  # directory, so the second mode (and the next run of the suite) reuses the first's
  # objects and precompiled header instead of compiling them again.
  find_program(CCACHE ccache)
  if(CCACHE)
    set(launcher "${SCRATCH}/ccache-launcher.sh")
    file(WRITE "${launcher}" "#!/bin/sh\nCCACHE_BASEDIR='${SCRATCH}' CCACHE_NOHASHDIR=1 "
         "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime exec '${CCACHE}' \"$@\"\n")
    file(CHMOD "${launcher}" PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE
         WORLD_READ WORLD_EXECUTE)
    list(APPEND args "-DCMAKE_CXX_COMPILER_LAUNCHER=${launcher}")
  endif()
endif()
# Configured and built in place, so that the next run of the suite is incremental. The
# source-tree modes find LibTorch as this build did (its cache file); the installed
# package needs nothing but CMAKE_PREFIX_PATH: it applies what it recorded.
if(TORCH_CACHE AND NOT MODE MATCHES "^(package|minimal)$")
  list(PREPEND args -C "${TORCH_CACHE}")
endif()
run("configure" ${CMAKE_COMMAND} -E env ${env_prefix} ${CMAKE_COMMAND} -S "${project_dir}" -B "${dir}" -G "${GENERATOR}" ${args})
set(configure_output "${last_output}")
run("build" ${CMAKE_COMMAND} --build "${dir}")  # jobs: CMAKE_BUILD_PARALLEL_LEVEL, or the generator's default
file(REMOVE_RECURSE "${dir}/ck")
if(MODE STREQUAL "minimal")
  # As its header comment says: 4 steps with a checkpoint, then 8 resuming from it.
  run("minimal_gpt, 2 ranks" "${prefix}/bin/fsdp-run" --nproc 2 -- "${dir}/minimal_gpt" --steps 4 --ckpt "${dir}/ck")
  if(NOT last_output MATCHES "saved [^\n]* at step 4")
    message(FATAL_ERROR "consumer (minimal): the first run saved no checkpoint at step 4:\n${last_output}")
  endif()
  run("minimal_gpt, resumed" "${prefix}/bin/fsdp-run" --nproc 2 -- "${dir}/minimal_gpt" --steps 8 --ckpt "${dir}/ck")
  message(STATUS "${last_output}")
  if(NOT last_output MATCHES "resumed from [^\n]* at step 4" OR NOT last_output MATCHES "step 7 loss")
    message(FATAL_ERROR "consumer (minimal): the second run did not resume at step 4 and train to 8:\n${last_output}")
  endif()
  return()
endif()
run("2 ranks under the installed fsdp-run" "${prefix}/bin/fsdp-run" --nproc 2 -- "${dir}/consumer_app" "${dir}/ck")
message(STATUS "${last_output}")
if(NOT last_output MATCHES "consumer: fsdp [0-9.]+ .*2 ranks.*: ok")
  message(FATAL_ERROR "consumer (${MODE}): the application did not report success:\n${last_output}")
endif()
# The package says how it found LibTorch's parts, where it applied what it recorded.
if(MODE STREQUAL "package" AND EXPECT_RECORDED)
  string(REPLACE "," ";" EXPECT_RECORDED "${EXPECT_RECORDED}")
  foreach(v ${EXPECT_RECORDED})
    if(NOT configure_output MATCHES "fsdp: ${v}=[^\n]*as fsdp was built")
      message(FATAL_ERROR "consumer (package): find_package(fsdp) did not say it applied ${v}:\n${configure_output}")
    endif()
  endforeach()
endif()
