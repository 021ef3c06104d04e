# `meshtrain simulate`: a [parallel] plan and a --plan file on a shipped
# cluster file print the predicted step time, MFU and per-rank figures and
# write a trace in the runtime's format; bad input exits 1 naming the cause.
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
set(dir ${OUT}/cli_simulate)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})
set(cluster --cluster ${SRC}/configs/cluster/a100_ib200.toml)
set(gpt --config ${SRC}/configs/gpt_text.toml --set model.layers=4 --set model.d_model=64
  --set model.seq_len=16 --set train.batch_size=32)

# TP x PP x DP on the 32 A100s: 2 stages x 4 tensor coordinates = 8 programs.
expect_run(RC 0
  STDOUT "predicted step time: [0-9.]+ (s|ms|us)" "MFU: [0-9.]+%" "distinct rank programs: 8 \\(of 32 ranks\\)"
         "rank 0 \\+3" "rank 16 \\+3" "wrote the predicted timeline"
  COMMAND ${MESHTRAIN} simulate ${gpt} ${cluster} --set parallel.tp=4 --set parallel.pp=2
    --set parallel.microbatches=4 --trace ${dir}/trace.json)
file(READ ${dir}/trace.json trace)
string(JSON n LENGTH "${trace}" traceEvents)
if(n LESS 100)
  message(FATAL_ERROR "trace.json has only ${n} events")
endif()
if(NOT trace MATCHES "\"cat\":\"comm\"" OR NOT trace MATCHES "\"displayTimeUnit\":\"ms\"")
  message(FATAL_ERROR "trace.json lacks comm spans or the runtime's trailer")
endif()

# The same plan as a file: the same prediction.
string(REGEX MATCH "predicted step time: [^\n]+" first "${out}")
expect_run(RC 0 COMMAND ${MESHTRAIN} inspect ${gpt} --set parallel.tp=4 --set parallel.pp=2
  --set parallel.microbatches=4 --set dist.nproc=32 --write-plan ${dir}/plan.json)
expect_run(RC 0 STDOUT "${first}"
  COMMAND ${MESHTRAIN} simulate ${gpt} ${cluster} --plan ${dir}/plan.json)

# Data parallelism with ZeRO-2 (no plan): one program for all 32 ranks.
expect_run(RC 0 STDOUT "distinct rank programs: 1 \\(of 32 ranks\\)"
  COMMAND ${MESHTRAIN} simulate ${gpt} ${cluster} --set dist.zero_stage=2)

# Bad input: no --cluster; a missing cluster file; a plan for another world.
expect_run(RC 2 OUTPUT "--cluster" COMMAND ${MESHTRAIN} simulate ${gpt})
expect_run(RC 1 STDERR "error: .*${dir}/missing.toml"
  COMMAND ${MESHTRAIN} simulate ${gpt} --cluster ${dir}/missing.toml)
expect_run(RC 1 STDERR "error: .*(mesh|parallel).*32"
  COMMAND ${MESHTRAIN} simulate ${gpt} ${cluster} --set parallel.tp=3)

# Asynchronous pipelining is priced as its steady-state window (each
# stage updates after every micro-batch; the note says so); before, it was
# priced as the flushed 1F1B step. A plan whose stages carry meshes of their
# own is refused naming the stage's mesh (simulate crashed on docs/plan.md's
# example).
foreach(mode pipedream spectrain)
  expect_run(RC 0 STDOUT "predicted step time: [0-9.]+ (s|ms|us)"
    "note: pipeline: parallel.async = ${mode}: one window of the stream without flush"
    "an update after every micro-batch, after that micro-batch's gradients are all-reduced over dp"
    COMMAND ${MESHTRAIN} simulate ${gpt} ${cluster} --set parallel.pp=2 --set parallel.microbatches=2
      --set parallel.async=${mode} --set optim.clip_grad_norm=0)
endforeach()
file(WRITE ${dir}/three.toml "device = \"cpu\"
[devices.cpu]
peak_tflops = 0.1
memory_gb = 16
memory_bandwidth_gb_s = 20
[[nodes]]
name = \"n0\"
ranks = [0, 1, 2]
")
file(WRITE ${dir}/xmesh.json "{\"model\": \"mlp\", \"mesh\": [{\"name\": \"world\", \"size\": 3}],
  \"values\": {\"fc1.w\": {\"dims\": [null, \"tp\"]}, \"fc1.b\": {\"dims\": [\"tp\"]}},
  \"stages\": [
    {\"layers\": [\"fc1\"], \"ranks\": [0, 1], \"mesh\": [{\"name\": \"tp\", \"size\": 2}]},
    {\"layers\": [\"fc2\", \"head\"], \"ranks\": [2], \"mesh\": []}],
  \"microbatches\": 2}")
expect_run(RC 1 STDERR "error: plan: stages\\[0\\].mesh: the cost model prices pipelines on the plan's mesh"
  COMMAND ${MESHTRAIN} simulate --config ${SRC}/configs/mlp_fashion.toml --cluster ${dir}/three.toml
    --plan ${dir}/xmesh.json)
