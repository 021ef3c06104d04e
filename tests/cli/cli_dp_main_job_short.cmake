# The CNN config on 2 local ranks under ZeRO-2, 20 steps: exits 0, reports
# the final test accuracy and writes its (sharded) checkpoint (label "mpi").
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
set(ckpt ${OUT}/ckpt_dp)
file(REMOVE_RECURSE ${ckpt})
expect_run(RC 0 TIMEOUT 280
  STDOUT "steps 20  final loss [0-9.]+" "final test accuracy: [0-9.]+%"
  NOT_OUTPUT "error:"
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/cnn_fashion.toml --nproc 2 --quiet
    --set train.threads=1 --set train.steps=20 --set data.limit_test=500 --set dist.zero_stage=2
    "--set" "train.checkpoint=\"${ckpt}\"")
if(NOT EXISTS ${ckpt})
  message(FATAL_ERROR "no checkpoint written to ${ckpt}")
endif()
message(STATUS "ok")
