# Bad input through the binary (-DCASE=...): each must exit with status 1
# (docs/errors.md) and a message naming the cause and place, on stderr,
# without training.
#   bad_config      a misspelt key: named, with the key it probably meant
#   missing_config  a config file that does not exist: the path named
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)

if(CASE STREQUAL "bad_config")
  expect_run(RC 1 TIMEOUT 60
    STDERR "meshtrain: error: config ${SRC}/configs/mlp_fashion.toml: 1 unknown key"
           "train\\.epochz \\(from --set, did you mean \"train\\.epochs\"\\?\\)"
    NOT_OUTPUT "final loss" "steps [0-9]+"
    COMMAND ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --set train.epochz=1)
elseif(CASE STREQUAL "missing_config")
  expect_run(RC 1 TIMEOUT 60
    STDERR "meshtrain: error: config /nonexistent/x\\.toml: file not found"
    NOT_OUTPUT "final loss"
    COMMAND ${MESHTRAIN} train --config /nonexistent/x.toml)
else()
  message(FATAL_ERROR "unknown CASE '${CASE}'")
endif()
message(STATUS "ok: ${CASE}")
