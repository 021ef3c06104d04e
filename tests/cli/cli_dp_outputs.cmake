# On 2 ranks, an output only rank 0 writes (the merged trace) that cannot be
# written stops every rank before the first step, with the error, instead
# of leaving rank 1 waiting in a collective until the timeout.
cmake_minimum_required(VERSION 3.25)
set(work ${OUT}/cli_dp_outputs)
file(REMOVE_RECURSE ${work})
file(MAKE_DIRECTORY ${work})
execute_process(
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --nproc 2 --quiet
    --set train.threads=1 --set train.steps=100000 --set train.eval=false --set dist.timeout_s=60
    "--set" "train.checkpoint=\"\"" --trace ${work}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 50)
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "exit status ${rc}, expected 1:\n${out}\n${err}")
endif()
if(NOT err MATCHES "dist.trace \\(--trace\\) ${work}: cannot write there: it is a directory")
  message(FATAL_ERROR "no error naming dist.trace and the path:\n${err}")
endif()
message(STATUS "ok")
