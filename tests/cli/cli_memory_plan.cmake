# `meshtrain inspect` and training report one planned activation memory (the
# MLP in f32, bf16 and bf16_storage, which plans less than f32), and a configuration too big for this machine
# (model.seq_len=100000) exits 1 at once with a message naming the values.
cmake_minimum_required(VERSION 3.25)

foreach(precision f32 bf16 bf16_storage)
  set(common --config ${SRC}/configs/mlp_fashion.toml --set train.precision=${precision}
    --set train.threads=1)
  execute_process(COMMAND ${MESHTRAIN} inspect ${common}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "inspect (${precision}) failed (${rc}):\n${out}\n${err}")
  endif()
  if(NOT out MATCHES "planned peak activation memory: [^(]*\\(([0-9]+) bytes")
    message(FATAL_ERROR "inspect (${precision}) printed no planned bytes:\n${out}")
  endif()
  set(inspected ${CMAKE_MATCH_1})
  if(NOT out MATCHES "parameters +[0-9.]+ [KMG]iB.*gradients.*optimizer state.*total")
    message(FATAL_ERROR "inspect (${precision}) printed no per-rank memory picture:\n${out}")
  endif()

  set(metrics ${OUT}/cli_memory_plan_${precision}.jsonl)
  file(REMOVE ${metrics})
  execute_process(COMMAND ${MESHTRAIN} train ${common} --set train.steps=2 --set train.eval=false
    --set data.limit_train=256 "--set" "train.checkpoint=\"\"" --quiet --metrics ${metrics}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "train (${precision}) failed (${rc}):\n${out}\n${err}")
  endif()
  file(STRINGS ${metrics} lines)
  list(GET lines -1 summary)
  string(JSON trained GET "${summary}" planned_arena_bytes)
  if(NOT inspected EQUAL trained)
    message(FATAL_ERROR
      "${precision}: inspect plans ${inspected} activation bytes, training ${trained}")
  endif()
  message(STATUS "${precision}: ${inspected} bytes in both")
  set(planned_${precision} ${inspected})
endforeach()
if(NOT planned_bf16_storage LESS planned_f32)
  message(FATAL_ERROR "bf16_storage plans ${planned_bf16_storage} bytes, f32 ${planned_f32}")
endif()

execute_process(COMMAND ${MESHTRAIN} train --config ${SRC}/configs/gpt_text.toml
  --set model.seq_len=100000 --set train.threads=1 --quiet "--set" "train.checkpoint=\"\""
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 30)
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "seq_len=100000: exit ${rc}, expected 1:\n${out}\n${err}")
endif()
if(NOT err MATCHES "error: planned memory per rank [0-9.]+ TiB exceeds available memory [0-9.]+ [KMGT]iB: training activations [0-9.]+ TiB at train.batch_size=16, model.seq_len=100000")
  message(FATAL_ERROR "seq_len=100000: message does not name the plan and the values:\n${err}")
endif()
message(STATUS "ok")
