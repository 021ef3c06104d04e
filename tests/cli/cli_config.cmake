# The binary's configuration discoverability: `config --list`, `--version`,
# a misspelt command, an empty config file and `--print-config`, each
# checked for its exit status and its message.
cmake_minimum_required(VERSION 3.25)

include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
function(run expect_rc)
  expect_run(RC ${expect_rc} TIMEOUT 120 COMMAND ${MESHTRAIN} ${ARGN})
  set(out "${out}" PARENT_SCOPE)
  set(err "${err}" PARENT_SCOPE)
endfunction()

function(expect text regex what)
  if(NOT text MATCHES "${regex}")
    message(FATAL_ERROR "${what}: no match for '${regex}' in:\n${text}")
  endif()
endfunction()

run(0 config --list)
expect("${out}" "optim\\.beta1 +number +0\\.9 +in \\[0, 1\\] +adamw and lamb" "config --list")
expect("${out}" "model\\.seq_len +integer +128" "config --list")
expect("${out}" "data\\.path +string" "config --list")

run(0 --version)
expect("${out}" "^meshtrain [0-9]+\\.[0-9]+\\.[0-9]+" "--version")

run(2 trian --config ${SRC}/configs/mlp_fashion.toml)
expect("${err}" "unknown command 'trian' \\(did you mean 'train'\\?\\); commands: train, inspect" "misspelt command")

file(WRITE ${OUT}/cli_config_empty.toml "# nothing set yet\n")
run(0 inspect --config ${OUT}/cli_config_empty.toml)
expect("${err}" "config ${OUT}/cli_config_empty.toml is empty: every key takes its default" "empty config")
expect("${out}" "planned peak activation memory" "inspect of an empty config")

run(0 train --config ${SRC}/configs/mlp_fashion.toml --set optim.name=adamw --print-config)
expect("${out}" "\\[optim\\]\nname = \"adamw\"\n" "--print-config")
expect("${out}" "beta1 = 0\\.9  # default" "--print-config")
if(out MATCHES "final loss")
  message(FATAL_ERROR "--print-config trained:\n${out}")
endif()
message(STATUS "ok")
