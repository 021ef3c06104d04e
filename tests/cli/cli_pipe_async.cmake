# Asynchronous pipelining through the binary: an MLP trains with
# parallel.async = pipedream and spectrain at pp = 2 (the summary names the
# mode and rank 0's stash), the GPT too (also at dp 2 x pp 2 and
# tp 2 x pp 2), inspect
# prints the version gaps, and what async does not carry is refused before
# any step naming parallel.async.
cmake_minimum_required(VERSION 3.25)
set(mlp --config ${SRC}/configs/mlp_fashion.toml --set model.hidden=[32,32]
  --set train.batch_size=16 --set data.limit_train=256)
set(gpt --config ${SRC}/configs/gpt_text.toml --set model.layers=2 --set model.d_model=32
  --set model.seq_len=8 --set train.batch_size=8)
set(quick --quiet --set train.threads=1 --set train.steps=3 --set train.eval=false
  "--set" "train.checkpoint=\"\"")
set(pp --set parallel.pp=2 --set parallel.microbatches=4)
set(dir ${OUT}/cli_pipe_async)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})

function(run rc_want out_pattern err_pattern)
  execute_process(COMMAND ${MESHTRAIN} ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  if(NOT rc EQUAL rc_want)
    message(FATAL_ERROR "${ARGN}: exit ${rc}, expected ${rc_want}:\n${out}\n${err}")
  endif()
  if(NOT out MATCHES "${out_pattern}")
    message(FATAL_ERROR "${ARGN}: stdout does not match '${out_pattern}':\n${out}\n${err}")
  endif()
  if(NOT err MATCHES "${err_pattern}")
    message(FATAL_ERROR "${ARGN}: stderr does not match '${err_pattern}':\n${err}")
  endif()
  if(rc EQUAL 1 AND out MATCHES "steps [0-9]")
    message(FATAL_ERROR "${ARGN}: a step ran:\n${out}\n${err}")
  endif()
endfunction()

foreach(mode pipedream spectrain)
  run(0 "steps 3  final loss" "" train ${mlp} ${quick} ${pp} --set parallel.async=\"${mode}\"
    --nproc 2 --metrics ${dir}/${mode}.jsonl)
  file(READ ${dir}/${mode}.jsonl metrics)
  if(NOT metrics MATCHES "\"async\":\"${mode}\"")
    message(FATAL_ERROR "the ${mode} summary does not name the mode:\n${metrics}")
  endif()
endforeach()
# Rank 0 (stage 0 of 2) stashes one older version of its weights at a time.
if(NOT metrics MATCHES "\"peak_weight_versions\":0")
  message(FATAL_ERROR "spectrain stashes no versions:\n${metrics}")
endif()
file(READ ${dir}/pipedream.jsonl metrics)
if(NOT metrics MATCHES "\"peak_weight_versions\":1")
  message(FATAL_ERROR "pipedream rank 0 should hold 1 stashed version:\n${metrics}")
endif()

run(0 "async pipedream: stage 0 weight-version gap per micro-batch \\(updates between its forward and backward\\): 0,1,1,1 in the first step, then 1 \\(no flush.*stage 1 .*: 0,0,0,0 in the first step, then 0" ""
  inspect ${mlp} --set dist.nproc=2 ${pp} --set parallel.async=\"pipedream\")

run(1 "" "parallel.async: pipedream runs on schedule 1f1b.*not gpipe"
  train ${mlp} ${quick} ${pp} --set parallel.async=\"pipedream\" --set parallel.schedule=\"gpipe\"
  --nproc 2)
run(1 "" "parallel.async: spectrain .*needs a pipeline"
  train ${mlp} ${quick} --set parallel.async=\"spectrain\")
run(1 "" "parallel.async: .*optim.clip_grad_norm"
  train ${mlp} ${quick} ${pp} --set parallel.async=\"pipedream\" --set optim.clip_grad_norm=1
  --nproc 2)
# The GPT (tied wte on the first and last stage) trains under both modes,
# and with a dp axis (PipeDream's hybrid: dp 2 x pp 2).
foreach(mode pipedream spectrain)
  run(0 "steps 3  final loss" "" train ${gpt} ${quick} ${pp} --set parallel.async=\"${mode}\"
    --set optim.clip_grad_norm=0 --nproc 2)
endforeach()
run(0 "steps 3  final loss" "" train ${gpt} ${quick} ${pp} --set parallel.async=\"pipedream\"
  --set optim.clip_grad_norm=0 --set parallel.dp=2 --nproc 4)
run(0 "steps 3  final loss" "" train ${gpt} ${quick} ${pp} --set parallel.async=\"spectrain\"
  --set optim.clip_grad_norm=0 --set parallel.tp=2 --nproc 4)
# Still refused, before any step: stages on meshes of their own, f16, ZeRO.
file(WRITE ${dir}/xmesh.json "{\"model\": \"mlp\", \"mesh\": [{\"name\": \"world\", \"size\": 3}],
  \"values\": {\"fc1.w\": {\"dims\": [null, \"tp\"]}, \"fc1.b\": {\"dims\": [\"tp\"]}},
  \"stages\": [
    {\"layers\": [\"fc1\"], \"ranks\": [0, 1], \"mesh\": [{\"name\": \"tp\", \"size\": 2}]},
    {\"layers\": [\"fc2\", \"head\"], \"ranks\": [2], \"mesh\": []}],
  \"schedule\": \"1f1b\", \"async\": \"pipedream\", \"microbatches\": 2}")
run(1 "" "parallel.async: pipedream .*stages on meshes of their own"
  train ${mlp} ${quick} --nproc 3 --plan ${dir}/xmesh.json)
run(1 "" "parallel.async: pipedream .*train.precision = f16"
  train ${mlp} ${quick} ${pp} --set parallel.async=\"pipedream\" --set train.precision=\"f16\"
  --nproc 2)
run(1 "" "parallel.async: pipedream .*dist.zero_stage > 0"
  train ${mlp} ${quick} ${pp} --set parallel.async=\"pipedream\" --set parallel.dp=2
  --set dist.zero_stage=1 --nproc 4)
run(1 "" "parallel.async.*unknown|parallel.async.*expected"
  train ${mlp} ${quick} ${pp} --set parallel.async=\"stale\" --nproc 2)
