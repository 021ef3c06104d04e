# train.eval_every: evaluations every N steps besides the end of the run (no
# whole epoch in between), each a metrics line with its step; a negative
# value is refused before training, naming the key.
cmake_minimum_required(VERSION 3.25)
set(base ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --set train.threads=1
  --set data.limit_train=1024 --set data.limit_test=200 --set train.batch_size=64
  --set train.eval_batch_size=100 "--set" "train.checkpoint=\"\"" --quiet)
set(work ${OUT}/cli_eval_every)
file(REMOVE_RECURSE ${work})
file(MAKE_DIRECTORY ${work})

execute_process(COMMAND ${base} --set train.eval_every=-1 RESULT_VARIABLE rc
  OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "train.eval_every.*>= 0")
  message(FATAL_ERROR "train.eval_every=-1: exit ${rc}, expected a message naming the key\n${out}${err}")
endif()

# 7 steps (an epoch is 16), every 3: evaluations after steps 3, 6 and 7 (the end).
execute_process(COMMAND ${base} --set train.steps=7 --set train.eval_every=3
  --metrics ${work}/m.jsonl RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "exit ${rc}\n${out}${err}")
endif()
file(STRINGS ${work}/m.jsonl lines)
set(steps "")
foreach(line IN LISTS lines)
  string(JSON summary ERROR_VARIABLE e GET "${line}" summary)
  if(NOT e STREQUAL "NOTFOUND")
    string(JSON acc ERROR_VARIABLE e2 GET "${line}" test_accuracy)
    if(e2 STREQUAL "NOTFOUND")
      string(JSON s GET "${line}" step)
      list(APPEND steps ${s})
      if(acc LESS 0 OR acc GREATER 1)
        message(FATAL_ERROR "test accuracy out of [0, 1]: ${line}")
      endif()
    endif()
  endif()
endforeach()
if(NOT steps STREQUAL "3;6;7")
  message(FATAL_ERROR "evaluations after steps '${steps}', expected 3;6;7\n${lines}")
endif()
