# A 4-rank run with dist.node_size = 2 (2 forced nodes: hierarchical
# all-reduce) and one with an emulated cluster file (2 nodes joined by
# 1 Gbit/s, 1 ms) both train to the flat run's losses: the summation order
# differs from the flat shared-memory all-reduce, so they are compared to 3
# decimals (the logged losses of these 6 steps agree to about 1e-6).
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)

set(base ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --nproc 4
  --set train.threads=1 --set train.steps=6 --set train.eval=false --set train.log_every=3
  --set data.limit_train=1024 "--set" "train.checkpoint=\"\"")

function(final_loss var)
  string(REGEX MATCH "final loss ([0-9.]+)" m "${err}${out}")
  if(NOT m)
    message(FATAL_ERROR "no final loss:\n${out}\n${err}")
  endif()
  set(${var} ${CMAKE_MATCH_1} PARENT_SCOPE)
endfunction()

expect_run(RC 0 TIMEOUT 120 NOT_OUTPUT "meshtrain: cluster" COMMAND ${base})
final_loss(flat)
expect_run(RC 0 TIMEOUT 120
  STDERR "meshtrain: cluster dist\\.node_size = 2: 4 ranks on 2 nodes \\(2 \\+ 2\\); links unconstrained; all-reduce hierarchical"
  COMMAND ${base} --set dist.node_size=2)
final_loss(hier)
expect_run(RC 0 TIMEOUT 120
  STDERR "meshtrain: cluster file [^\n]*2x2_1gbit\\.toml: 4 ranks on 2 nodes \\(2 \\+ 2\\); emulated links: intra-node unconstrained, inter-node 1 Gbit/s, 1 ms; one link per rank pair and direction; all-reduce hierarchical"
  COMMAND ${base} "--set" "dist.cluster=\"${SRC}/configs/cluster/2x2_1gbit.toml\"")
final_loss(emulated)
# ZeRO-3 (reduce-scatter of gradients, all-gather of parameters, both
# hierarchical on 2 nodes) against the flat ZeRO-3 run.
expect_run(RC 0 TIMEOUT 120 COMMAND ${base} --set dist.zero_stage=3)
final_loss(zero3_flat)
expect_run(RC 0 TIMEOUT 120 STDERR "all-reduce hierarchical"
  COMMAND ${base} --set dist.zero_stage=3 --set dist.node_size=2)
final_loss(zero3_hier)
string(SUBSTRING "${zero3_hier}" 0 5 got)
string(SUBSTRING "${zero3_flat}" 0 5 want)
if(NOT got STREQUAL want)
  message(FATAL_ERROR "ZeRO-3 with node_size 2: final loss ${zero3_hier}, flat ${zero3_flat}")
endif()
foreach(v hier emulated)
  string(SUBSTRING "${${v}}" 0 5 got)
  string(SUBSTRING "${flat}" 0 5 want)
  if(NOT got STREQUAL want)
    message(FATAL_ERROR "${v} run's final loss ${${v}} differs from the flat run's ${flat}")
  endif()
endforeach()
message(STATUS "ok: flat ${flat}, hierarchical ${hier}, emulated ${emulated}, ZeRO-3 flat ${zero3_flat} hierarchical ${zero3_hier}")
