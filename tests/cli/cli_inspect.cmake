# `meshtrain inspect` of the GPT config exits 0 and prints the graph, the
# FLOPs per training step and the planned peak activation memory, and trains
# nothing.
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
expect_run(RC 0 TIMEOUT 120
  STDOUT "^graph: [0-9]+ nodes"
         "FLOPs per training step \\(forward \\+ backward\\): [0-9.]+ [KMGT]?FLOP per rank"
         "planned peak activation memory: [0-9.]+ [KMGT]iB \\([0-9]+ bytes"
  NOT_OUTPUT "error:" "final loss"
  COMMAND ${MESHTRAIN} inspect --config ${SRC}/configs/gpt_text.toml)
message(STATUS "ok")
