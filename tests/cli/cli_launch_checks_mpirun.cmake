# Under a plain `mpirun -np 2` (no launcher of ours), every rank checks the
# keys that depend on the number of ranks against its communicator: a
# dist.slowdown of 3 factors ends the job with exit status 1 and an error
# naming the key, before training.
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
expect_run(RC 1 TIMEOUT 60
  STDERR "error: dist.slowdown: 3 factors \\[1, 1, 2\\] given for 2 ranks"
  NOT_OUTPUT "steps "
  COMMAND ${CMAKE_COMMAND} -E env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    ${MPIRUN} -np 2 --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader
    ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --quiet --set train.steps=2
    --set train.threads=1 "--set" "dist.slowdown=[1.0,1.0,2.0]")
message(STATUS "ok")
