# Resume is strict, through the binary: a checkpoint of another model size is
# refused (exit status 1) with the differences named, in both checkpoint
# forms; a single-file checkpoint's missing directories are created as a
# sharded one's are; a sharded directory without index.json says the save
# did not complete.
cmake_minimum_required(VERSION 3.25)
set(dir ${OUT}/cli_resume_strict)
file(REMOVE_RECURSE ${dir})
set(common train --config ${SRC}/configs/mlp_fashion.toml --quiet --set train.threads=1
  --set train.eval=false --set data.limit_train=256 --set train.batch_size=32)

function(expect_in text)
  foreach(part IN LISTS ARGN)
    string(FIND "${text}" "${part}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "'${part}' not in:\n${text}")
    endif()
  endforeach()
endfunction()

foreach(ckpt ${dir}/new/sub/ckpt.safetensors ${dir}/ckpt_dir)
  execute_process(
    COMMAND ${MESHTRAIN} ${common} --set train.steps=3 "--set" "model.hidden=[32, 32]"
      "--set" "train.checkpoint=\"${ckpt}\""
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT EXISTS ${ckpt})
    message(FATAL_ERROR "saving ${ckpt} failed (${rc}):\n${out}\n${err}")
  endif()
  expect_in("${out}" "checkpoint: ${ckpt}")

  execute_process(
    COMMAND ${MESHTRAIN} ${common} --set train.steps=5 "--set" "model.hidden=[32]"
      "--set" "train.resume=\"${ckpt}\""
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 1)
    message(FATAL_ERROR "resuming ${ckpt} into another model: expected exit status 1, got ${rc}:\n${out}\n${err}")
  endif()
  expect_in("${err}" "meshtrain: error: checkpoint ${ckpt} does not fit the model"
    "model.hidden: checkpoint [32, 32], this run [32]"
    "in the checkpoint that this model does not have (2): fc2.b f32[32], fc2.w f32[32, 32]"
    "train.init")

  execute_process(
    COMMAND ${MESHTRAIN} ${common} --set train.steps=5 "--set" "model.hidden=[32, 32]"
      "--set" "train.resume=\"${ckpt}\""
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "resuming ${ckpt} into the same model failed (${rc}):\n${out}\n${err}")
  endif()
  expect_in("${err}" "meshtrain: resumed from step 3 (${ckpt})")
  expect_in("${out}" "steps 5 ")
endforeach()

file(REMOVE ${dir}/ckpt_dir/index.json)
execute_process(
  COMMAND ${MESHTRAIN} ${common} --set train.steps=5 "--set" "model.hidden=[32, 32]"
    "--set" "train.resume=\"${dir}/ckpt_dir\""
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "resuming without index.json: expected exit status 1, got ${rc}:\n${err}")
endif()
expect_in("${err}" "checkpoint ${dir}/ckpt_dir: no index.json -- the save did not complete (rank shards present: shard-0-of-1-")
message(STATUS "ok")
