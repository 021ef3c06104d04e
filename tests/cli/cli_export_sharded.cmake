# Export from a sharded checkpoint written by 2 ranks under ZeRO-3, and a
# 2-rank run that starts from the exported file (label "mpi").
cmake_minimum_required(VERSION 3.25)
set(dir ${OUT}/cli_export_sharded)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})
set(common --config ${SRC}/configs/mlp_fashion.toml --set train.threads=1 --set train.eval=false
  --set data.limit_train=256 --set data.limit_test=64 "--set" "model.hidden=[32]")

include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
function(run)
  expect_run(RC 0 TIMEOUT 280 COMMAND ${MESHTRAIN} ${ARGN})
  set(out "${out}${err}" PARENT_SCOPE)
endfunction()

run(train ${common} --quiet --nproc 2 --set dist.zero_stage=3 --set train.steps=3
  "--set" "train.checkpoint=\"${dir}/ckpt\"")
if(NOT EXISTS ${dir}/ckpt/index.json)
  message(FATAL_ERROR "no sharded checkpoint in ${dir}/ckpt")
endif()
run(export ${common} --checkpoint ${dir}/ckpt --out ${dir}/mlp.safetensors)
string(FIND "${out}" "exported mlp (4 tensors, 25450 parameters" at)
if(at EQUAL -1)
  message(FATAL_ERROR "unexpected export output:\n${out}")
endif()
run(train ${common} --quiet --nproc 2 --set dist.zero_stage=3 --set train.steps=2
  "--set" "train.checkpoint=\"\"" "--set" "train.init=\"${dir}/mlp.safetensors\"")
string(FIND "${out}" "initialised 4 tensors (25450 values)" at)
if(at EQUAL -1)
  message(FATAL_ERROR "no init report:\n${out}")
endif()
message(STATUS "ok")
