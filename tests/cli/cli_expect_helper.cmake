# The helper itself can fail: expect_run rejects a wrong exit status even
# when the message is right, and a wrong message even when the status is
# right, in both directions (a failure that should have been a success and
# the reverse), and accepts the matching run.
cmake_minimum_required(VERSION 3.25)
set(dir ${OUT}/cli_expect_helper)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})

# check(<should pass: TRUE/FALSE> <expect_run arguments as one string>)
function(check should_pass call)
  string(MD5 id "${call}")
  set(script ${dir}/${id}.cmake)
  file(WRITE ${script} "include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)\nexpect_run(${call})\n")
  execute_process(COMMAND ${CMAKE_COMMAND} -P ${script} RESULT_VARIABLE rc OUTPUT_VARIABLE out
    ERROR_VARIABLE err)
  if(should_pass AND NOT rc EQUAL 0)
    message(FATAL_ERROR "expect_run(${call}) failed, should pass:\n${err}")
  elseif(NOT should_pass AND rc EQUAL 0)
    message(FATAL_ERROR "expect_run(${call}) passed, should fail")
  endif()
endfunction()

check(TRUE [[RC 1 STDERR "error: bad key" COMMAND sh -c "echo 'error: bad key' >&2; exit 1"]])
check(FALSE [[RC 1 STDERR "error: bad key" COMMAND sh -c "echo 'error: bad key' >&2; exit 0"]])
check(FALSE [[RC 1 STDERR "error: bad key" COMMAND sh -c "echo 'error: other' >&2; exit 1"]])
check(FALSE [[RC 1 STDERR "error: bad key" COMMAND sh -c "echo 'error: bad key'; exit 1"]])
check(TRUE [[RC 0 STDOUT "accuracy: [0-9]+%" COMMAND sh -c "echo 'accuracy: 80%'"]])
check(FALSE [[RC 0 STDOUT "accuracy: [0-9]+%" COMMAND sh -c "echo 'accuracy: 80%'; exit 134"]])
check(FALSE [[RC 0 OUTPUT "accuracy" NOT_OUTPUT "error:" COMMAND sh -c "echo accuracy; echo error: x >&2"]])
file(REMOVE_RECURSE ${dir})
message(STATUS "ok")
