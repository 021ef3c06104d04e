# On 2 ranks, an output only rank 0 writes (the merged trace) that cannot be
# written stops every rank before the first step, with the error, instead
# of leaving rank 1 waiting in a collective until the timeout.
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
set(work ${OUT}/cli_dp_outputs)
file(REMOVE_RECURSE ${work})
file(MAKE_DIRECTORY ${work})
expect_run(RC 1 TIMEOUT 50
  STDERR "dist.trace \\(--trace\\) ${work}: cannot write there: it is a directory"
  NOT_OUTPUT "steps [0-9]+  final loss"
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --nproc 2 --quiet
    --set train.threads=1 --set train.steps=100000 --set train.eval=false --set dist.timeout_s=60
    "--set" "train.checkpoint=\"\"" --trace ${work})
message(STATUS "ok")
