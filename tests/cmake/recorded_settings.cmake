# The installed package's recorded settings (cmake/fsdpConfig.cmake.in), each of its three
# outcomes, without LibTorch: the block that applies them is cut out of the template,
# given three recorded settings and run in a child cmake, whose output must say
#   - A (recorded, exists, not set by the application): applied, "as fsdp was built";
#   - B (recorded, no longer exists): left alone, "no longer exists";
#   - C (set by the application, to another value): the application's, "the application's";
# and the variables after it must be A = recorded, B unset, C = the application's.
#   cmake -DSOURCE=<tree> -DSCRATCH=<dir> -P tests/cmake/recorded_settings.cmake
file(READ ${SOURCE}/cmake/fsdpConfig.cmake.in config)
string(FIND "${config}" "set(_fsdp_found_with" begin)
string(FIND "${config}" "unset(_fsdp_found_with)" end)
if(begin EQUAL -1 OR end EQUAL -1)
  message(FATAL_ERROR "recorded_settings: cmake/fsdpConfig.cmake.in has no block from "
                      "set(_fsdp_found_with to unset(_fsdp_found_with)")
endif()
math(EXPR length "${end} - ${begin}")
string(SUBSTRING "${config}" ${begin} ${length} block)
file(REMOVE_RECURSE ${SCRATCH})
file(MAKE_DIRECTORY ${SCRATCH}/a ${SCRATCH}/c_recorded ${SCRATCH}/c_own)
string(REPLACE "@FSDP_PACKAGE_FOUND_WITH@"
               "FSDP_T_A=${SCRATCH}/a;FSDP_T_B=${SCRATCH}/gone;FSDP_T_C=${SCRATCH}/c_recorded"
               block "${block}")
file(WRITE ${SCRATCH}/apply.cmake
     "set(FSDP_T_C ${SCRATCH}/c_own)\n${block}\n"
     "message(STATUS \"after: A=\${FSDP_T_A} B=\${FSDP_T_B} C=\${FSDP_T_C}\")\n")
execute_process(COMMAND ${CMAKE_COMMAND} -P ${SCRATCH}/apply.cmake OUTPUT_VARIABLE out
                ERROR_VARIABLE out RESULT_VARIABLE rc)
set(expected
    "fsdp: FSDP_T_A=${SCRATCH}/a, as fsdp was built (set FSDP_T_A to use another)"
    "fsdp: FSDP_T_B=${SCRATCH}/gone, as fsdp was built, no longer exists; LibTorch's own search decides"
    "fsdp: FSDP_T_C=${SCRATCH}/c_own, the application's (fsdp was built with ${SCRATCH}/c_recorded)"
    "after: A=${SCRATCH}/a B= C=${SCRATCH}/c_own")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "recorded_settings: the block failed (exit ${rc}):\n${out}")
endif()
foreach(line IN LISTS expected)
  string(FIND "${out}" "${line}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "recorded_settings: expected the line\n  ${line}\nin:\n${out}")
  endif()
endforeach()
file(REMOVE_RECURSE ${SCRATCH})
message(STATUS "recorded_settings: the three outcomes as expected")
