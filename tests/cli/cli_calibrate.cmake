# meshtrain calibrate --quick on 2 ranks: writes a cluster file of this
# machine that the cluster-file reader and the planner accept (measured
# device kind, efficiency per operator, collective fits per algorithm, and
# what the measured algorithm choice picks here, as a comment).
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)

set(dir ${OUT}/cli_calibrate)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})
expect_run(RC 0 TIMEOUT 120
  STDERR "meshtrain calibrate: kernels: mlp" "collectives: all_reduce ring" "wrote ${dir}/cal\\.toml"
  COMMAND ${MESHTRAIN} calibrate --quick --nproc 2 --out ${dir}/cal.toml)
file(READ ${dir}/cal.toml cal)
foreach(re "\\[devices\\.cpu\\]" "peak_tflops_f32 = [0-9.e-]+" "memory_gb = [0-9.]+"
    "memory_bandwidth_gb_s = [0-9.]+" "\"matmul\" = [0-9.e-]+\n" "\\[collectives\\.ring\\.intra_node\\]"
    "\\[collectives\\.halving_doubling\\.intra_node\\]" "ranks_per_node = 2"
    "# dist\\.algorithm_choice = measured would pick, on 2 ranks here: all_reduce: [a-z_]+"
    # Kernels timed as training runs them (both ranks at once where each has
    # a core), collectives through the runtime's async path, the blocking
    # call's time beside each.
    "Kernels and the copy: timed on (all 2 ranks at once|rank 0 alone)"
    "all_reduce 4096 B [0-9.]+ us \\(blocking [0-9.]+\\)"
    # The executor's own time per kernel.
    "# per kernel, the executor's run time less its kernels': mlp hidden [0-9]+ [0-9.]+ us \\([0-9]+ kernels\\)"
    "\nop_overhead_us = [0-9.e-]+\n"
    # The matmuls' weight traffic: its rate, and per model whether it was
    # taken out of the matmul's time or the weights fit the cache.
    "# matmuls' weight traffic, taken out of their measured time \\(the rates below\\): mlp hidden [0-9]+ (in cache|[0-9.]+ of [0-9.]+ ms)"
    "\nweight_bandwidth_gb_s = [0-9.]+\n"
    # The cores the node's ranks share (the model prices more ranks than cores).
    "\ncores = [1-9][0-9]*\n")
  if(NOT cal MATCHES "${re}")
    message(FATAL_ERROR "cal.toml does not match '${re}':\n${cal}")
  endif()
endforeach()
# With the ranks timed at once: how late the last one is (compute_jitter).
# (or says why not: a loaded machine left no repetition with every rank on
# its core).
if(cal MATCHES "timed on all 2 ranks at once" AND NOT cal MATCHES
   "\ncompute_jitter = [0-9.e-]+\n" AND NOT cal MATCHES "# compute_jitter: not measured \\(no repetition")
  message(FATAL_ERROR "cal.toml has no compute_jitter:\n${cal}")
endif()
# Every fitted bandwidth is positive (the fit keeps W > 0, latency >= 0).
string(REGEX MATCHALL "bandwidth_gbit_s = [^\n]+" bws "${cal}")
foreach(bw IN LISTS bws)
  if(bw MATCHES "= -" OR bw MATCHES "= 0\n" OR bw MATCHES "nan|inf")
    message(FATAL_ERROR "bad fitted bandwidth: ${bw}\n${cal}")
  endif()
endforeach()
# The planner takes the measured file as it is (2 ranks of this machine).
expect_run(RC 0 TIMEOUT 60 STDOUT "on 2 ranks of [^\n]*cal\\.toml" "wrote the best plan"
  COMMAND ${MESHTRAIN} plan --config ${SRC}/configs/mlp_fashion.toml --cluster ${dir}/cal.toml
    --quiet --out ${dir}/plan.json)
# Bad arguments exit 2 (CLI11) before measuring anything.
expect_run(RC 2 STDERR "nproc" COMMAND ${MESHTRAIN} calibrate --nproc 0)
