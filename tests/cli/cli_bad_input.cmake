# Bad input through the binary (-DCASE=...): each must exit with status 1
# (docs/errors.md) and a message naming the cause and place, on stderr,
# without training.
#   bad_config      a misspelt key: named, with the key it probably meant
#   missing_config  a config file that does not exist: the path named
#   bad_overlap     Streaming DiLoCo's overlap not below the period: the key
#                   and the range named, before any step
#   bad_codec_momentum  sync.codec_momentum with adamw, and the sparsity
#                   warm-up's first density below the codec's fraction: the
#                   key and what was expected named
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
elseif(CASE STREQUAL "bad_overlap")
  expect_run(RC 1 TIMEOUT 60
    STDERR "meshtrain: error: .*sync\\.overlap_steps: the inner steps a fragment's exchange "
           "overlaps must be in \\[0, sync\\.period\\) = \\[0, 4\\) .* got 4"
    NOT_OUTPUT "final loss" "steps [0-9]+"
    COMMAND ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --set sync.scheme="diloco"
            --set sync.period=4 --set sync.overlap_steps=4)
elseif(CASE STREQUAL "bad_codec_momentum")
  expect_run(RC 1 TIMEOUT 60
    STDERR "meshtrain: error: .*sync\\.codec_momentum = true applies SGD's momentum before the "
           "codec; it needs optim\\.name = \"sgd\", got \"adamw\""
    NOT_OUTPUT "final loss" "steps [0-9]+"
    COMMAND ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --set optim.name="adamw"
            --set sync.codec="topk:0.01" --set sync.codec_momentum=true)
  expect_run(RC 1 TIMEOUT 60
    STDERR "meshtrain: error: sync\\.codec_warmup_density: the warm-up's first density must be "
           "in \\[0\\.01, 1\\] .* got 0\\.001"
    NOT_OUTPUT "final loss" "steps [0-9]+"
    COMMAND ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml
            --set sync.codec="topk:0.01" --set sync.codec_warmup_steps=10
            --set sync.codec_warmup_density=0.001)
else()
  message(FATAL_ERROR "unknown CASE '${CASE}'")
endif()
message(STATUS "ok: ${CASE}")
