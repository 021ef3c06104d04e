# The --nproc launcher stays the ranks' parent: SIGTERM sent to it (by
# `timeout`, after the ranks have started training) reaches the ranks, and
# the job ends at once with 128 + 15 and no rank left running. With
# -DFAKE_MPIRUN (an "mpirun" whose children ignore SIGTERM), the launcher
# kills them after dist.stop_grace_s.
cmake_minimum_required(VERSION 3.25)
string(RANDOM LENGTH 12 token)
set(metrics ${OUT}/cli_launch_signal_${token}.jsonl)
set(env)
set(after 10)
set(grace 3)
if(FAKE_MPIRUN)
  set(env ${CMAKE_COMMAND} -E env MESHTRAIN_MPIRUN=${FAKE_MPIRUN})
  set(after 3)
endif()
string(TIMESTAMP t0 "%s")
execute_process(
  COMMAND ${env} timeout --foreground --preserve-status -s TERM ${after} ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --nproc 2
    --set train.threads=1 --set train.epochs=100000 --set train.eval=false --set train.log_every=1
    --set data.limit_train=2000 "--set" "train.checkpoint=\"\"" --set dist.stop_grace_s=${grace}
    --metrics ${metrics}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
string(TIMESTAMP t1 "%s")
math(EXPR took "${t1} - ${t0}")
if(NOT rc EQUAL 143)
  message(FATAL_ERROR "exit status ${rc}, expected 143 (128 + SIGTERM):\n${out}\n${err}")
endif()
if(NOT err MATCHES "meshtrain: SIGTERM: passing it on to the 2 local ranks")
  message(FATAL_ERROR "no word of the signal passed on:\n${err}")
endif()
if(FAKE_MPIRUN)
  if(NOT err MATCHES "ranks still running ${grace} s after SIGTERM: killing them")
    message(FATAL_ERROR "the ranks were not killed after the grace period:\n${err}")
  endif()
  math(EXPR limit "${after} + ${grace} + 3")
else()
  # The ranks were training when the signal came.
  if(NOT EXISTS ${metrics})
    message(FATAL_ERROR "no metrics written before the signal:\n${err}")
  endif()
  file(STRINGS ${metrics} lines REGEX "\"step\"")
  list(LENGTH lines n)
  if(n LESS 1)
    message(FATAL_ERROR "the ranks had not started training when the signal came:\n${err}")
  endif()
  if(err MATCHES "killing them")
    message(FATAL_ERROR "the ranks had to be killed:\n${err}")
  endif()
  math(EXPR limit "${after} + ${grace}")
endif()
if(took GREATER limit)
  message(FATAL_ERROR "took ${took} s after the signal at ${after} s (limit ${limit} s):\n${err}")
endif()
# Nothing of the job is left: no process has the run's unique metrics path.
execute_process(COMMAND pgrep -f ${token} RESULT_VARIABLE found OUTPUT_VARIABLE pids)
if(found EQUAL 0)
  message(FATAL_ERROR "processes of the job still run: ${pids}")
endif()
file(REMOVE ${metrics})
message(STATUS "ok: exit ${rc} after ${took} s")
