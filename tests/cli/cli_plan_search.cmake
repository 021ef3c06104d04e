# meshtrain plan: the best plans for a model on a cluster file, the same
# output on every run, a plan file `meshtrain train --plan` runs with the
# printed settings (uneven batch shares on a cluster whose second rank is
# 3x slower), and clear errors when nothing fits or the cluster file is bad.
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)

set(dir ${OUT}/cli_plan_search)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})
set(cfg ${SRC}/configs/mlp_fashion.toml)
file(WRITE ${dir}/two.toml "device = \"cpu\"\n[devices.cpu]\npeak_tflops = 0.05\nmemory_gb = 4\n[[nodes]]\nranks_per_node = 2\n[ranks]\nslowdown = [1, 3]\n")

expect_run(RC 0 TIMEOUT 60
  STDOUT "mlp \\(batch [0-9]+\\) on 2 ranks" "#[ ]+step[ ]+samples/s" " 1 [^\n]*dp=2 tp=1 pp=1[^\n]*shares=.96,32."
    "wrote the best plan to ${dir}/plan\\.json; run it with:\n  meshtrain train --config [^\n]* --set dist\\.batch_shares=.96,32."
  STDERR "meshtrain plan: [0-9]+/[0-9]+ shapes priced"
  COMMAND ${MESHTRAIN} plan --config ${cfg} --cluster ${dir}/two.toml --top 3 --out ${dir}/plan.json)
set(first "${out}")
# Deterministic: the same table and the same plan file again.
file(READ ${dir}/plan.json plan1)
expect_run(RC 0 TIMEOUT 60 NOT_OUTPUT "shapes priced"
  COMMAND ${MESHTRAIN} plan --config ${cfg} --cluster ${dir}/two.toml --top 3 --out ${dir}/plan.json --quiet)
file(READ ${dir}/plan.json plan2)
if(NOT first STREQUAL out OR NOT plan1 STREQUAL plan2)
  message(FATAL_ERROR "plan output differs between runs:\n${first}\n---\n${out}")
endif()

# The printed command runs (2 steps).
string(REGEX MATCH "meshtrain train --config [^\n]*" run "${first}")
string(REPLACE "meshtrain train " "" run "${run}")
separate_arguments(run_args UNIX_COMMAND "${run}")
expect_run(RC 0 TIMEOUT 120 OUTPUT "final loss"
  COMMAND ${MESHTRAIN} train ${run_args} --set train.steps=2 --set train.eval=false --quiet)

# Nothing fits: the closest plan and by how much.
file(WRITE ${dir}/small.toml "[devices.cpu]\npeak_tflops = 0.05\nmemory_gb = 0.0001\n[[nodes]]\nranks_per_node = 2\n")
expect_run(RC 1 TIMEOUT 60
  STDERR "meshtrain: error: no plan fits: of [0-9]+ plans tried, [0-9]+ exceed device memory[^\n]*the closest \\([^)]*\\) needs at least [^\n]* per rank for its parameters, gradients and optimizer state alone, the largest device has 97\\.66 KiB: [0-9.]+ [KM]iB over"
  COMMAND ${MESHTRAIN} plan --config ${cfg} --cluster ${dir}/small.toml --quiet --out ${dir}/none.json)
if(EXISTS ${dir}/none.json)
  message(FATAL_ERROR "a plan file was written although nothing fits")
endif()

# A bad cluster file names the key.
file(WRITE ${dir}/bad.toml "[devices.cpu]\npeak_tflops = 0.05\nmemory_gb = 4\n[[nodes]]\nranks_per_node = 2\ndevice = \"gpu\"\n")
expect_run(RC 1 STDERR "cluster file [^\n]*bad\\.toml: nodes\\[0\\]\\.device: unknown device kind \"gpu\""
  COMMAND ${MESHTRAIN} plan --config ${cfg} --cluster ${dir}/bad.toml)
file(WRITE ${dir}/nomem.toml "[devices.cpu]\npeak_tflops = 0.05\n[[nodes]]\nranks_per_node = 2\n")
expect_run(RC 1 STDERR "nomem\\.toml: devices\\.cpu\\.memory_gb: required by the planner"
  COMMAND ${MESHTRAIN} plan --config ${cfg} --cluster ${dir}/nomem.toml)

# dist.slowdown stands in for a file without ranks.slowdown (as for simulate).
file(WRITE ${dir}/plain.toml "device = \"cpu\"\n[devices.cpu]\npeak_tflops = 0.05\nmemory_gb = 4\n[[nodes]]\nranks_per_node = 2\n")
expect_run(RC 0 TIMEOUT 60 STDOUT " 1 [^\n]*shares=.96,32."
  COMMAND ${MESHTRAIN} plan --config ${cfg} --cluster ${dir}/plain.toml --set "dist.slowdown=[1, 3]"
    --quiet --out ${dir}/plain.json)
expect_run(RC 1 STDERR "dist\\.slowdown: 3 factors for the cluster's 2 ranks"
  COMMAND ${MESHTRAIN} plan --config ${cfg} --cluster ${dir}/plain.toml --set "dist.slowdown=[1, 3, 1]"
    --quiet --out ${dir}/plain.json)
