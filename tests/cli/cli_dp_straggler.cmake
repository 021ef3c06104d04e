# A rank slowed 3x (dist.slowdown) on 2 local ranks is reported as a
# straggler once, the other rank never, and the end-of-run summary names it;
# the metrics file carries the same lines.
cmake_minimum_required(VERSION 3.25)
set(metrics ${OUT}/cli_dp_straggler.jsonl)
file(REMOVE ${metrics})
execute_process(
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --nproc 2
    --set train.threads=1 --set train.steps=200 --set train.eval=false --set train.log_every=50
    --set data.limit_train=5120 "--set" "train.checkpoint=\"\""
    "--set" "dist.slowdown=[1.0, 3.0]" --metrics ${metrics}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "meshtrain train failed (${rc}):\n${out}\n${err}")
endif()
string(REGEX MATCHALL "rank [0-9] is a straggler" found "${err}")
if(NOT found STREQUAL "rank 1 is a straggler")
  message(FATAL_ERROR "expected one 'rank 1 is a straggler', got '${found}':\n${err}")
endif()
if(NOT err MATCHES "straggler summary: rank 1 was a straggler [^\n]* not recovered by the end")
  message(FATAL_ERROR "no straggler summary for rank 1:\n${err}")
endif()
if(err MATCHES "rank 0 (is a straggler|was a straggler)" OR err MATCHES "rank [0-9] recovered")
  message(FATAL_ERROR "rank 0 reported, or a recovery:\n${err}")
endif()
file(READ ${metrics} m)
if(NOT m MATCHES "\"straggler\":\"rank 1 is a straggler")
  message(FATAL_ERROR "no straggler line in ${metrics}:\n${m}")
endif()
message(STATUS "ok: ${found}")
