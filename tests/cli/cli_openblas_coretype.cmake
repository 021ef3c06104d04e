# exec.openblas_coretype end to end. OpenBLAS reads OPENBLAS_CORETYPE when it
# loads, so meshtrain re-executes itself to change its kernels. The
# environment's Prescott (SSE3 kernels) stands in for a build that misdetects
# the CPU:
#   best: re-executes with the CPU's best core type, the summary says so;
#   auto: the environment's choice wins (a note says what best would do);
#   keep: nothing is said or changed.
# With -DMPIRUN: the same for `best` when each rank is started by a plain
# `mpirun -np 2` (each rank re-executes itself; mpirun keeps its pid), and
# under `--nproc 2` (meshtrain's launcher restarts once; the ranks inherit).
# Skipped on a CPU without AVX2 + FMA (no core type above Prescott to ask for).
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
file(READ /proc/cpuinfo cpuinfo)
string(REGEX MATCH "\nflags[^\n]*" flags "${cpuinfo}")
set(best "")
if(flags MATCHES " avx2( |$)" AND flags MATCHES " fma( |$)")
  set(best Haswell)
  if(flags MATCHES " avx512f( |$)" AND flags MATCHES " avx512bw( |$)"
     AND flags MATCHES " avx512dq( |$)" AND flags MATCHES " avx512vl( |$)")
    set(best SkylakeX)
  endif()
endif()
if(best STREQUAL "")
  message(STATUS "SKIP: this CPU has no AVX2 + FMA")
  return()
endif()

set(name cli_openblas_coretype)
if(DEFINED MPIRUN)
  set(name cli_openblas_coretype_mpirun)  # its own files: ctest may run both at once
endif()
set(metrics ${OUT}/${name}.jsonl)
set(train ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --set train.steps=2
  --set train.threads=1 --set data.limit_test=200
  "--set" "train.checkpoint=\"${OUT}/${name}.ckpt\"" --metrics ${metrics})

# The OpenBLAS line of the run's summary (matmul_engines.openblas_core).
function(summary_core out_var)
  file(STRINGS ${metrics} lines)
  list(GET lines -1 last)
  string(JSON core ERROR_VARIABLE jerr GET "${last}" matmul_engines openblas_core)
  if(jerr)
    message(FATAL_ERROR "no matmul_engines.openblas_core in the summary: ${last}")
  endif()
  set(${out_var} "${core}" PARENT_SCOPE)
endfunction()

if(DEFINED MPIRUN)
  file(REMOVE ${metrics})
  expect_run(RC 0 TIMEOUT 120
    STDERR "OpenBLAS runs Prescott kernels \\(OPENBLAS_CORETYPE=Prescott from the environment\\).*restarting with OPENBLAS_CORETYPE=${best}"
    COMMAND ${CMAKE_COMMAND} -E env OPENBLAS_CORETYPE=Prescott OMPI_ALLOW_RUN_AS_ROOT=1
      OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
      ${MPIRUN} -np 2 --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader
      ${train} "--set" "exec.openblas_coretype=\"best\"")
  # Rank 0 alone says it, once.
  string(REGEX MATCHALL "restarting with OPENBLAS_CORETYPE" notes "${err}")
  list(LENGTH notes n)
  if(NOT n EQUAL 1)
    message(FATAL_ERROR "expected one restart note (rank 0), got ${n}:\n${err}")
  endif()
  summary_core(core)
  if(NOT core MATCHES "^${best} \\(re-executed with OPENBLAS_CORETYPE; OpenBLAS had chosen Prescott\\)")
    message(FATAL_ERROR "summary's OpenBLAS core is '${core}', expected ${best} after a re-execution")
  endif()
  # meshtrain's own launcher (--nproc 2): it re-executes once before
  # starting the ranks, which inherit the variable and say nothing more.
  file(REMOVE ${metrics})
  expect_run(RC 0 TIMEOUT 120
    STDERR "restarting with OPENBLAS_CORETYPE=${best}"
    COMMAND ${CMAKE_COMMAND} -E env OPENBLAS_CORETYPE=Prescott OMPI_ALLOW_RUN_AS_ROOT=1
      OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ${train} --nproc 2 "--set" "exec.openblas_coretype=\"best\"")
  string(REGEX MATCHALL "restarting with OPENBLAS_CORETYPE" notes "${err}")
  list(LENGTH notes n)
  if(NOT n EQUAL 1)
    message(FATAL_ERROR "expected one restart note (the launcher), got ${n}:\n${err}")
  endif()
  summary_core(core)
  if(NOT core MATCHES "^${best} \\(re-executed with OPENBLAS_CORETYPE; OpenBLAS had chosen Prescott\\)")
    message(FATAL_ERROR "--nproc 2: summary's OpenBLAS core is '${core}', expected ${best}")
  endif()
  message(STATUS "ok: mpirun ranks and --nproc ranks re-executed with ${best}")
  return()
endif()

# best: re-executed with the CPU's best kernels.
file(REMOVE ${metrics})
expect_run(RC 0 TIMEOUT 120
  STDERR "OpenBLAS runs Prescott kernels \\(OPENBLAS_CORETYPE=Prescott from the environment\\) on a CPU with [a-z0-9_,]+: restarting with OPENBLAS_CORETYPE=${best}"
  COMMAND ${CMAKE_COMMAND} -E env OPENBLAS_CORETYPE=Prescott ${train}
    "--set" "exec.openblas_coretype=\"best\"")
summary_core(core)
if(NOT core MATCHES "^${best} \\(re-executed with OPENBLAS_CORETYPE; OpenBLAS had chosen Prescott\\)")
  message(FATAL_ERROR "summary's OpenBLAS core is '${core}', expected ${best} after a re-execution")
endif()

# auto: the environment's choice wins.
file(REMOVE ${metrics})
expect_run(RC 0 TIMEOUT 120
  STDERR "OPENBLAS_CORETYPE=Prescott is set in the environment\\) on a CPU with [a-z0-9_,]+; left as set \\(exec.openblas_coretype = \"best\" asks for ${best}\\)"
  NOT_OUTPUT "restarting with"
  COMMAND ${CMAKE_COMMAND} -E env OPENBLAS_CORETYPE=Prescott ${train})
summary_core(core)
if(NOT core STREQUAL "Prescott (OPENBLAS_CORETYPE=Prescott from the environment)")
  message(FATAL_ERROR "summary's OpenBLAS core is '${core}', expected the environment's Prescott")
endif()

# keep: silent, unchanged.
file(REMOVE ${metrics})
expect_run(RC 0 TIMEOUT 120
  NOT_OUTPUT "restarting with" "left as set"
  COMMAND ${CMAKE_COMMAND} -E env OPENBLAS_CORETYPE=Prescott ${train}
    "--set" "exec.openblas_coretype=\"keep\"")
summary_core(core)
if(NOT core MATCHES "^Prescott")
  message(FATAL_ERROR "summary's OpenBLAS core is '${core}', expected Prescott (keep)")
endif()
message(STATUS "ok: best re-executes with ${best}, auto keeps the environment's, keep keeps")
