# Shared helper for the CLI tests (CMake -P scripts): run a command, then
# check its exit status AND its output, so a run that should fail must fail
# with the right status and message, and one that should succeed must exit 0.
#
#   include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
#   expect_run(RC <status> [TIMEOUT <s>]
#              [STDOUT <regex>...] [STDERR <regex>...] [OUTPUT <regex>...]
#              [NOT_OUTPUT <regex>...]
#              COMMAND <command> <args>...)
#
# STDOUT / STDERR regexes must match that stream, OUTPUT ones stdout and
# stderr together, NOT_OUTPUT ones neither. A failure names the command, the
# status and the missing pattern, and prints both streams. Afterwards `out`
# and `err` hold the streams in the caller's scope.
cmake_minimum_required(VERSION 3.25)

function(expect_run)
  cmake_parse_arguments(PARSE_ARGV 0 E "" "RC;TIMEOUT" "STDOUT;STDERR;OUTPUT;NOT_OUTPUT;COMMAND")
  if(NOT DEFINED E_RC OR NOT E_COMMAND)
    message(FATAL_ERROR "expect_run: RC and COMMAND are required")
  endif()
  if(NOT E_TIMEOUT)
    set(E_TIMEOUT 600)
  endif()
  execute_process(COMMAND ${E_COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out
    ERROR_VARIABLE err TIMEOUT ${E_TIMEOUT})
  list(JOIN E_COMMAND " " cmd)
  set(shown "command: ${cmd}\n--- stdout:\n${out}\n--- stderr:\n${err}")
  if(NOT "${rc}" STREQUAL "${E_RC}")
    message(FATAL_ERROR "exit status ${rc}, expected ${E_RC}\n${shown}")
  endif()
  foreach(re IN LISTS E_STDOUT)
    if(NOT out MATCHES "${re}")
      message(FATAL_ERROR "stdout does not match '${re}'\n${shown}")
    endif()
  endforeach()
  foreach(re IN LISTS E_STDERR)
    if(NOT err MATCHES "${re}")
      message(FATAL_ERROR "stderr does not match '${re}'\n${shown}")
    endif()
  endforeach()
  foreach(re IN LISTS E_OUTPUT)
    if(NOT "${out}${err}" MATCHES "${re}")
      message(FATAL_ERROR "output does not match '${re}'\n${shown}")
    endif()
  endforeach()
  foreach(re IN LISTS E_NOT_OUTPUT)
    if("${out}${err}" MATCHES "${re}")
      message(FATAL_ERROR "output matches '${re}', which it must not\n${shown}")
    endif()
  endforeach()
  set(out "${out}" PARENT_SCOPE)
  set(err "${err}" PARENT_SCOPE)
endfunction()
