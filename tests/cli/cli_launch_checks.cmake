# Launch-time checks (no rank starts): --nproc out of 1..1024 is a usage
# error (exit 2); dist.batch_shares / dist.slowdown of the wrong length and a
# fault drill naming a rank that does not exist are config errors (exit 1)
# naming the key, reported by the launcher before mpirun is started; an
# unreadable --hosts file too. The same checks in a single process.
cmake_minimum_required(VERSION 3.25)
set(base train --config ${SRC}/configs/mlp_fashion.toml --quiet --set train.threads=1
  --set train.steps=2 --set train.eval=false "--set" "train.checkpoint=\"\"")

include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
# Rejected before any rank started: no MPI banner, no training output.
function(expect rc_want pattern)
  expect_run(RC ${rc_want} TIMEOUT 60 STDERR "${pattern}" NOT_OUTPUT "MPI_ABORT|mpirun|training "
    COMMAND ${MESHTRAIN} ${base} ${ARGN})
endfunction()

expect(2 "--nproc: Value 0 not in range 1 to 1024" --nproc 0)
expect(2 "--nproc: Value -1 not in range 1 to 1024" --nproc -1)
expect(2 "--nproc: Value 1025 not in range 1 to 1024" --nproc 1025)
expect(1 "dist.nproc: .*1025" --set dist.nproc=1025)
expect(1 "error: dist.batch_shares: 3 shares \\[1, 1, 1\\] given for 2 ranks"
  --nproc 2 --set "dist.batch_shares=[1,1,1]")
expect(1 "error: dist.slowdown: 1 factors \\[2\\] given for 4 ranks"
  --nproc 4 --set "dist.slowdown=[2.0]")
expect(1 "error: dist.fault: \"kill:2@5\" names rank 2, but the job has 2 ranks \\(0..1\\)"
  --nproc 2 "--set" "dist.fault=\"kill:2@5\"")
expect(1 "error: dist.fault: expected \"kill:RANK@STEP\" or \"stall:RANK@STEP\", got \"kill:1x@5\""
  --nproc 2 "--set" "dist.fault=\"kill:1x@5\"")
expect(1 "error: --hosts /nonexistent/hosts: cannot read the hostfile"
  --nproc 2 --hosts /nonexistent/hosts)
# More ranks than cores (taskset leaves one) warns; an mpirun that cannot be
# started is an error naming it.
expect_run(RC 1 TIMEOUT 60
  STDERR "warning: 2 ranks on 1 core: they share cores"
         "error: cannot start /nonexistent/mpirun to launch 2 ranks: No such file"
  COMMAND taskset -c 0 ${CMAKE_COMMAND} -E env MESHTRAIN_MPIRUN=/nonexistent/mpirun
    ${MESHTRAIN} ${base} --nproc 2)
# One process (world size 1).
expect(1 "error: dist.batch_shares: 2 shares \\[1, 2\\] given for 1 rank " --set "dist.batch_shares=[1,2]")
expect(1 "error: dist.fault: \"stall:1@0\" names rank 1, but the job has 1 rank \\(0..0\\)"
  "--set" "dist.fault=\"stall:1@0\"")
message(STATUS "ok")
