# dist.algorithm_choice: a bad value exits 1 naming the key and the allowed
# values, without training; a 2-rank run with "measured" probes the
# collectives at start-up, says what it chose, and trains to the static
# run's final loss exactly (on 2 ranks every all-reduce algorithm adds the
# same two numbers, so the bits agree whichever was picked).
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)

expect_run(RC 1 TIMEOUT 60
  STDERR "dist\\.algorithm_choice" "unknown value \"fastest\"; allowed: static, measured"
  NOT_OUTPUT "final loss"
  COMMAND ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml
    "--set" "dist.algorithm_choice=\"fastest\"")

set(base ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --nproc 2
  --set train.threads=1 --set train.steps=6 --set train.eval=false --set train.log_every=3
  --set data.limit_train=1024 "--set" "train.checkpoint=\"\"")

function(final_loss var)
  string(REGEX MATCH "final loss ([0-9.]+)" m "${err}${out}")
  if(NOT m)
    message(FATAL_ERROR "no final loss:\n${out}\n${err}")
  endif()
  set(${var} ${CMAKE_MATCH_1} PARENT_SCOPE)
endfunction()

expect_run(RC 0 TIMEOUT 120 NOT_OUTPUT "collectives measured" COMMAND ${base})
final_loss(static_loss)
expect_run(RC 0 TIMEOUT 120
  STDERR "meshtrain: collectives measured \\(probe on 2 ranks, [0-9.]+ s\\): all_reduce: [a-z_]+"
  COMMAND ${base} "--set" "dist.algorithm_choice=\"measured\"")
final_loss(measured_loss)
if(NOT static_loss STREQUAL measured_loss)
  message(FATAL_ERROR "measured choice: final loss ${measured_loss}, static ${static_loss}")
endif()
message(STATUS "ok: static and measured final loss ${static_loss}")
