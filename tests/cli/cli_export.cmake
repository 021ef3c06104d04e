# `meshtrain export` and `train.init` through the binary: a short MLP run's
# checkpoint exports to a PyTorch-layout file, a new run starts from it, a
# model of another size is refused with every difference listed (exit 1), a
# partial load lists what it skipped and left at its initial values, and bad
# export invocations name their cause.
cmake_minimum_required(VERSION 3.25)
set(dir ${OUT}/cli_export)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})
set(common --config ${SRC}/configs/mlp_fashion.toml --set train.threads=1 --set train.eval=false
  --set data.limit_train=256 --set data.limit_test=64)

function(run expect_rc)
  execute_process(COMMAND ${MESHTRAIN} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
    ERROR_VARIABLE err)
  if(NOT rc EQUAL expect_rc)
    message(FATAL_ERROR "expected exit ${expect_rc}, got ${rc}: ${ARGN}\n${out}\n${err}")
  endif()
  set(out "${out}${err}" PARENT_SCOPE)
endfunction()

function(expect text)
  string(FIND "${out}" "${text}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "output lacks \"${text}\":\n${out}")
  endif()
endfunction()

run(0 train ${common} --quiet "--set" "model.hidden=[32]" --set train.steps=3
  "--set" "train.checkpoint=\"${dir}/ckpt.safetensors\"")
run(0 export ${common} "--set" "model.hidden=[32]"
  "--set" "train.checkpoint=\"${dir}/ckpt.safetensors\"" --out ${dir}/mlp.safetensors
  --logits-for 8)
expect("exported mlp (4 tensors, 25450 parameters; layout pytorch-v1, meshtrain names)")
expect("(step 3) to ${dir}/mlp.safetensors")
expect("logits of the first 8 test examples (f32): ${dir}/mlp.logits.safetensors")
if(NOT EXISTS ${dir}/mlp.logits.safetensors)
  message(FATAL_ERROR "no logits file")
endif()

run(0 train ${common} --quiet "--set" "model.hidden=[32]" --set train.steps=1
  "--set" "train.checkpoint=\"\"" "--set" "train.init=\"${dir}/mlp.safetensors\"")
expect("meshtrain: initialised 4 tensors (25450 values) from ${dir}/mlp.safetensors")

# Another width: every difference listed, exit status 1.
run(1 train ${common} --quiet "--set" "model.hidden=[16]" --set train.steps=1
  "--set" "train.checkpoint=\"\"" "--set" "train.init=\"${dir}/mlp.safetensors\"")
expect("error: ${dir}/mlp.safetensors: does not match the mlp model (3 differences; train.init_partial = true")
expect("fc1.weight: the file holds [32, 784], the model has [16, 784]")
expect("head.weight: the file holds [10, 32], the model has [10, 16]")

# The same as a deliberate partial load.
run(0 train ${common} --quiet "--set" "model.hidden=[16]" --set train.steps=1
  "--set" "train.checkpoint=\"\"" "--set" "train.init=\"${dir}/mlp.safetensors\""
  --set train.init_partial=true)
expect("initialised 1 tensor (10 values)")
expect("skipped 3 tensors of the file:")
expect("left at their initial values (3):\n  fc1.weight [16, 784]: no matching tensor")

# Export: a checkpoint of another size, a missing one, none configured, no --out.
run(1 export ${common} "--set" "model.hidden=[16]" --checkpoint ${dir}/ckpt.safetensors
  --out ${dir}/x.safetensors)
expect("its parameters do not match the mlp model of the config (3 differences")
expect("fc1.w: the checkpoint holds f32 [784, 32], the model has f32 [784, 16]")
run(1 export ${common} --checkpoint ${dir}/nope.safetensors --out ${dir}/x.safetensors)
expect("${dir}/nope.safetensors")
run(1 export ${common} "--set" "train.checkpoint=\"\"" --out ${dir}/x.safetensors)
expect("export: no checkpoint to read: pass --checkpoint PATH or set train.checkpoint")
run(2 export ${common} --checkpoint ${dir}/ckpt.safetensors)
expect("--out is required")
# A training checkpoint given to train.init says what to do instead.
run(1 train ${common} --quiet "--set" "model.hidden=[32]" --set train.steps=1
  "--set" "train.checkpoint=\"\"" "--set" "train.init=\"${dir}/ckpt.safetensors\"")
expect("is a meshtrain training checkpoint, not a PyTorch-layout weights file")
message(STATUS "ok")
