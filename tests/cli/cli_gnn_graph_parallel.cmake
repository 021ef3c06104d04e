# Graph-parallel GNN training through the binary (--nproc 2 starts the ranks
# through mpirun): the shipped GCN config with gnn.parallel = "graph" ends
# with the single-process run's loss and accuracies, and prints the bytes
# each rank sent per epoch, the halo part equal to what inspect predicts;
# likewise 1.5D (gnn.replication = 2 over 4 ranks).
cmake_minimum_required(VERSION 3.25)
execute_process(
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/gcn_csbm.toml --quiet
  RESULT_VARIABLE rc OUTPUT_VARIABLE single ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "single-process run failed (${rc}):\n${single}\n${err}")
endif()
set(graph_args --set "gnn.parallel=\"graph\"" --set "gnn.partition=\"locality\"")
execute_process(
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/gcn_csbm.toml --nproc 2 --quiet ${graph_args}
  RESULT_VARIABLE rc OUTPUT_VARIABLE dist ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "graph-parallel run failed (${rc}):\n${dist}\n${err}")
endif()
# Loss to 4 decimals and accuracies to 3 (the runs differ by float rounding only).
string(REGEX MATCH "loss [0-9.]+, accuracy train [0-9.]+ val [0-9.]+ test [0-9.]+" a "${single}")
string(REGEX MATCH "loss [0-9.]+, accuracy train [0-9.]+ val [0-9.]+ test [0-9.]+" b "${dist}")
if(a STREQUAL "" OR NOT a STREQUAL b)
  message(FATAL_ERROR "graph parallel ends elsewhere: '${a}' vs '${b}'\n${single}\n${dist}")
endif()
if(NOT dist MATCHES "halo exchange \\[([0-9]+), ([0-9]+)\\], gradient all-reduce \\[[0-9]+, [0-9]+\\]")
  message(FATAL_ERROR "no bytes line:\n${dist}")
endif()
set(measured "${CMAKE_MATCH_1}, ${CMAKE_MATCH_2}")
execute_process(
  COMMAND ${MESHTRAIN} inspect --config ${SRC}/configs/gcn_csbm.toml --set dist.nproc=2
    ${graph_args}
  RESULT_VARIABLE rc OUTPUT_VARIABLE insp ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT insp MATCHES "halo bytes each rank sends per epoch [^:]*: \\[([0-9, ]+)\\]")
  message(FATAL_ERROR "inspect printed no halo bytes (${rc}):\n${insp}\n${err}")
endif()
if(NOT CMAKE_MATCH_1 STREQUAL measured)
  message(FATAL_ERROR "halo bytes measured [${measured}], predicted [${CMAKE_MATCH_1}]")
endif()

# 1.5D: 4 ranks as 2 row blocks of 2 replicas end alike too and report the
# replicas' all-reduce bytes.
execute_process(
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/gcn_csbm.toml --nproc 4 --quiet ${graph_args}
    --set gnn.replication=2
  RESULT_VARIABLE rc OUTPUT_VARIABLE d15 ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "1.5D run failed (${rc}):\n${d15}\n${err}")
endif()
string(REGEX MATCH "loss [0-9.]+, accuracy train [0-9.]+ val [0-9.]+ test [0-9.]+" c "${d15}")
if(NOT a STREQUAL c)
  message(FATAL_ERROR "1.5D ends elsewhere: '${a}' vs '${c}'\n${d15}")
endif()
if(NOT d15 MATCHES "partial aggregations over the replicas \\[[0-9]+, [0-9]+, [0-9]+, [0-9]+\\]")
  message(FATAL_ERROR "1.5D printed no replica bytes:\n${d15}")
endif()
