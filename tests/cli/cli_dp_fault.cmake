# Fault drills through the binary on 2 local ranks (-DMODE=kill or stall):
# the job ends with the exit status docs/errors.md gives (kill: 137, the
# killed rank's 128 + SIGKILL; stall: 1, the error) and an error naming the
# rank (and, for a stall, the collective), within the timeout plus a small
# margin (MPI start-up, 5 training steps, the abort), not after a hang.
cmake_minimum_required(VERSION 3.25)
set(timeout_s 5)
set(margin_s 8)
string(TIMESTAMP t0 "%s")
execute_process(
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --nproc 2 --quiet
    --set train.threads=1 --set train.steps=40 --set train.eval=false
    "--set" "train.checkpoint=\"\"" "--set" "dist.fault=\"${MODE}:1@5\""
    --set dist.timeout_s=${timeout_s}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
string(TIMESTAMP t1 "%s")
math(EXPR took "${t1} - ${t0}")
if(MODE STREQUAL "kill")
  set(want 137)
  set(pattern "error: data-parallel.*rank 1 .*is no longer running")
else()
  set(want 1)
  set(pattern "timed out after 5.000 s.*ranks that have not entered all_reduce #[0-9]+: rank 1")
endif()
if(NOT rc EQUAL want)
  message(FATAL_ERROR "exit status ${rc}, expected ${want}:\n${out}\n${err}")
endif()
if(NOT err MATCHES "fault drill: rank 1 [a-z]+ after step 5")
  message(FATAL_ERROR "the drill did not run:\n${err}")
endif()
if(NOT err MATCHES "${pattern}")
  message(FATAL_ERROR "stderr does not match '${pattern}':\n${err}")
endif()
math(EXPR limit "${timeout_s} + ${margin_s}")
if(took GREATER limit)
  message(FATAL_ERROR "the job took ${took} s, more than the timeout (${timeout_s} s) + ${margin_s} s:\n${err}")
endif()
message(STATUS "ok: exit ${rc} after ${took} s")
