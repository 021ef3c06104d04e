# GNNPipe's hybrid of layer pipelining with graph parallelism through the
# binary: the shipped GCN config over 4 ranks as 2 stages x 2 graph parts
# (gnn.graph_parts = 2), one chunk, ends with the single-process run's loss
# and accuracies and prints the three byte counts per rank, those between
# stages and of the halo exchange as `inspect` predicts; combinations it
# cannot run fail before any rank starts, naming the key.
cmake_minimum_required(VERSION 3.25)
execute_process(
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/gcn_csbm.toml --quiet
  RESULT_VARIABLE rc OUTPUT_VARIABLE single ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "single-process run failed (${rc}):\n${single}\n${err}")
endif()
set(hybrid --set "gnn.parallel=\"layer\"" --set gnn.graph_parts=2 --set gnn.chunks=1)
execute_process(
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/gcn_csbm.toml --nproc 4 --quiet ${hybrid}
  RESULT_VARIABLE rc OUTPUT_VARIABLE dist ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "hybrid run failed (${rc}):\n${dist}\n${err}")
endif()
string(REGEX MATCH "loss [0-9.]+, accuracy train [0-9.]+ val [0-9.]+ test [0-9.]+" a "${single}")
string(REGEX MATCH "loss [0-9.]+, accuracy train [0-9.]+ val [0-9.]+ test [0-9.]+" b "${dist}")
if(a STREQUAL "" OR NOT a STREQUAL b)
  message(FATAL_ERROR "the hybrid ends elsewhere: '${a}' vs '${b}'\n${single}\n${dist}")
endif()
if(NOT dist MATCHES "(between stages \\[[0-9, ]+\\], halo exchange \\[[0-9, ]+\\]), gradient all-reduce \\[[0-9, ]+\\]")
  message(FATAL_ERROR "no bytes line:\n${dist}")
endif()
set(measured "${CMAKE_MATCH_1}")
# inspect predicts the bytes between stages and of the halo exchange.
execute_process(
  COMMAND ${MESHTRAIN} inspect --config ${SRC}/configs/gcn_csbm.toml --set dist.nproc=4 ${hybrid}
  RESULT_VARIABLE rc OUTPUT_VARIABLE insp ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT insp MATCHES "2 stages x 2 graph parts, gcn\\): bytes each rank sends per epoch: (between stages [^\n]*)")
  message(FATAL_ERROR "inspect printed no hybrid bytes (${rc}):\n${insp}\n${err}")
endif()
if(NOT CMAKE_MATCH_1 STREQUAL measured)
  message(FATAL_ERROR "hybrid bytes measured '${measured}', predicted '${CMAKE_MATCH_1}'")
endif()

function(refused what expect)
  execute_process(
    COMMAND ${MESHTRAIN} train --config ${SRC}/configs/gcn_csbm.toml --quiet ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${what}: no error\n${out}")
  endif()
  string(FIND "${err}" "${expect}" at)
  if(at LESS 0)
    message(FATAL_ERROR "${what}: expected '${expect}' in:\n${err}")
  endif()
endfunction()
refused("3 parts of 4 ranks" "gnn.graph_parts = 3 must be >= 1 and divide the 4 ranks"
  --nproc 4 --set "gnn.parallel=\"layer\"" --set gnn.graph_parts=3)
refused("parts under graph parallelism" "gnn.graph_parts = 2: only with gnn.parallel = \"layer\""
  --nproc 4 --set "gnn.parallel=\"graph\"" --set gnn.graph_parts=2)
refused("more stages than layers" "model.gnn_layers = 2 cannot be cut into 4 stages"
  --nproc 8 --set "gnn.parallel=\"layer\"" --set gnn.graph_parts=2)
