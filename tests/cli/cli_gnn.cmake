# Full-graph GNN training through the binary: the shipped GCN config learns
# its CSBM graph well above chance (0.25) in seconds and writes metrics;
# configurations it cannot run exit 1 naming the key.
cmake_minimum_required(VERSION 3.25)
set(metrics ${OUT}/cli_gnn.jsonl)
file(REMOVE ${metrics})
execute_process(
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/gcn_csbm.toml --metrics ${metrics}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "meshtrain train gcn_csbm failed (${rc}):\n${out}\n${err}")
endif()
if(NOT out MATCHES "accuracy train [0-9.]+ val [0-9.]+ test (0\\.[0-9]+|1\\.000)")
  message(FATAL_ERROR "no accuracy line printed:\n${out}")
endif()
set(test_acc ${CMAKE_MATCH_1})
if(test_acc LESS 0.8)
  message(FATAL_ERROR "GCN test accuracy ${test_acc} on the CSBM graph is below 0.8:\n${out}")
endif()
file(STRINGS ${metrics} lines)
list(GET lines -1 last)
string(JSON acc ERROR_VARIABLE jerr GET "${last}" test_acc)
if(jerr)
  message(FATAL_ERROR "last metrics line lacks test_acc: ${last}")
endif()

# graph-gen writes the configured graph; training from that file gives the
# same result as training on the generated graph.
set(graph ${OUT}/cli_gnn_graph.safetensors)
file(REMOVE ${graph})
execute_process(
  COMMAND ${MESHTRAIN} graph-gen --config ${SRC}/configs/gcn_csbm.toml --out ${graph}
  RESULT_VARIABLE rc OUTPUT_VARIABLE gen_out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT EXISTS ${graph})
  message(FATAL_ERROR "graph-gen failed (${rc}):\n${gen_out}\n${err}")
endif()
if(NOT gen_out MATCHES "3000 vertices, 29842 edges, 32 features, 4 classes")
  message(FATAL_ERROR "graph-gen did not describe the graph:\n${gen_out}")
endif()
execute_process(
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/gcn_csbm.toml --set data.graph=file
    "--set" "data.graph_file=\"${graph}\"" --quiet
  RESULT_VARIABLE rc OUTPUT_VARIABLE out2 ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "training from the graph file failed (${rc}):\n${out2}\n${err}")
endif()
string(REGEX MATCH "loss [0-9.]+, accuracy[^,]*" from_gen "${out}")
string(REGEX MATCH "loss [0-9.]+, accuracy[^,]*" from_file "${out2}")
if(NOT from_gen STREQUAL from_file)
  message(FATAL_ERROR "the graph file trains differently: '${from_gen}' vs '${from_file}'")
endif()

# inspect of a graph config prints the partition's edge cut and halo sizes
# for dist.nproc ranks; the locality-aware partitioner cuts less than random.
function(inspect_cut method out_var)
  execute_process(
    COMMAND ${MESHTRAIN} inspect --config ${SRC}/configs/gcn_csbm.toml --set dist.nproc=4
      --set gnn.partition=${method}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "inspect (${method}) failed (${rc}):\n${out}\n${err}")
  endif()
  if(NOT out MATCHES "edge cut: ([0-9]+) of 29842 entries")
    message(FATAL_ERROR "inspect (${method}) printed no edge cut:\n${out}")
  endif()
  set(cut ${CMAKE_MATCH_1})
  if(NOT out MATCHES "halo rows [^:]*: [0-9]+ in all" OR NOT out MATCHES "\n +3 +[0-9]+ +[0-9]+")
    message(FATAL_ERROR "inspect (${method}) printed no halo table for 4 parts:\n${out}")
  endif()
  set(${out_var} ${cut} PARENT_SCOPE)
endfunction()
inspect_cut(random random_cut)
inspect_cut(locality locality_cut)
if(NOT locality_cut LESS random_cut)
  message(FATAL_ERROR "locality cut ${locality_cut} is not below random's ${random_cut}")
endif()

function(expect_error what expect)
  execute_process(COMMAND ${MESHTRAIN} train --config ${SRC}/configs/gcn_csbm.toml ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 1)
    message(FATAL_ERROR "${what}: expected exit status 1, got ${rc}:\n${out}\n${err}")
  endif()
  string(FIND "${err}" "${expect}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${what}: expected '${expect}' in:\n${err}")
  endif()
endfunction()
expect_error("two ranks, one process" "gnn.parallel = \"none\" trains the graph in one process"
  --set dist.nproc=2)
expect_error("gat under 1.5D" "gnn.replication = 2: model.kind gat needs each vertex's whole neighbourhood"
  --set model.kind=gat --set "gnn.parallel=\"graph\"" --set gnn.replication=2 --set dist.nproc=2)
expect_error("replication not dividing the ranks" "gnn.replication = 2 must divide the 3 ranks"
  --set "gnn.parallel=\"graph\"" --set gnn.replication=2 --set dist.nproc=3)
expect_error("wrong data" "data.kind 'fashion_mnist' does not fit model.kind 'gcn'"
  --set data.kind=fashion_mnist)
expect_error("file without path" "data.graph = \"file\" needs data.graph_file" --set data.graph=file)
expect_error("missing file" "${OUT}/no_such_graph.safetensors" --set data.graph=file
  "--set" "data.graph_file=\"${OUT}/no_such_graph.safetensors\"")
expect_error("bf16" "train.precision" --set train.precision=bf16)

# A text edge list (data.graph = "edges"): two cliques of 10 joined by one
# edge, classes by clique, one-hot features; GCN learns it well above
# chance (0.5), and a bad line exits 1 naming the file and the line.
set(edges ${OUT}/cli_gnn_two_cliques.edges)
set(text "# two cliques\nvertices 20 classes 2\n")
foreach(v RANGE 0 19)
  if(v LESS 10)
    string(APPEND text "label ${v} 0\n")
  else()
    string(APPEND text "label ${v} 1\n")
  endif()
endforeach()
foreach(a RANGE 0 19)
  foreach(b RANGE 0 19)
    math(EXPR ca "${a} / 10")
    math(EXPR cb "${b} / 10")
    if(a LESS b AND ca EQUAL cb)
      string(APPEND text "edge ${a} ${b}\n")
    endif()
  endforeach()
endforeach()
string(APPEND text "edge 9 10\n")
file(WRITE ${edges} "${text}")
execute_process(
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/gcn_csbm.toml --set data.graph=edges
    "--set" "data.graph_file=\"${edges}\"" --set data.train_fraction=0.5
    --set data.val_fraction=0.2 --set train.epochs=60
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "test (0\\.[0-9]+|1\\.000)")
  message(FATAL_ERROR "training on an edge list failed (${rc}):\n${out}\n${err}")
endif()
if(CMAKE_MATCH_1 LESS 0.65)
  message(FATAL_ERROR "GCN test accuracy ${CMAKE_MATCH_1} on two cliques is below 0.65:\n${out}")
endif()
file(WRITE ${OUT}/cli_gnn_bad.edges "vertices 2 classes 1\nlabel 0 0\nlabel 1 0\nedge 0 2\n")
expect_error("edge list with a bad vertex" "cli_gnn_bad.edges:4: endpoint '2' is not a vertex id in [0, 2)"
  --set data.graph=edges "--set" "data.graph_file=\"${OUT}/cli_gnn_bad.edges\"")
