# Output paths and data settings are checked before the first step (exit 1,
# message naming the key and path, within seconds although the run is long),
# missing parent directories are created, and values a run did not measure
# print as "n/a" / null instead of 0.
cmake_minimum_required(VERSION 3.25)
set(base ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --set train.threads=1
  --set data.limit_train=1024 --set data.limit_test=200 "--set" "train.checkpoint=\"\"")
set(work ${OUT}/cli_outputs)
file(REMOVE_RECURSE ${work})
file(MAKE_DIRECTORY ${work})
file(WRITE ${work}/plain_file "x")

# run(<expected exit status> <regex the output must match> args...)
function(run want regex)
  execute_process(COMMAND ${base} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
    ERROR_VARIABLE err TIMEOUT 120)
  if(NOT rc STREQUAL "${want}")
    message(FATAL_ERROR "exit status ${rc}, expected ${want}: ${ARGN}\n${out}\n${err}")
  endif()
  if(NOT "${out}${err}" MATCHES "${regex}")
    message(FATAL_ERROR "output does not match '${regex}': ${ARGN}\n${out}\n${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

# A run of 100000 steps: these must fail before training, not after it.
set(long --set train.steps=100000 --quiet)
run(1 "error: --metrics ${work}/plain_file/m.jsonl: cannot write there: ${work}/plain_file is not a directory"
  ${long} --metrics ${work}/plain_file/m.jsonl)
run(1 "error: dist.trace \\(--trace\\) ${work}: cannot write there: it is a directory"
  ${long} --trace ${work})
run(1 "error: train.checkpoint ${work}/plain_file/c/ck.safetensors: cannot write there"
  ${long} "--set" "train.checkpoint=\"${work}/plain_file/c/ck.safetensors\"")
run(1 "error: .*data.limit_test = 0 leaves no test examples, but train.eval is on"
  ${long} --set data.limit_test=0)
run(1 "error: .*train.eval_batches: .*>= 0" ${long} --set train.eval_batches=-1)

# Work that would be lost without a checkpoint is said before the first step.
run(0 "warning: train.halt_after = 2 stops this invocation early, but train.checkpoint is empty"
  --set train.steps=3 --set train.halt_after=2 --set train.eval=false)
run(0 "warning: train.checkpoint_every = 2 has no effect: train.checkpoint is empty"
  --set train.steps=3 --set train.checkpoint_every=2 --set train.eval=false)

# Stopped by halt_after before any evaluation, 2 steps: n/a, a flagged rate;
# the missing directories of the checkpoint and the metrics file are made.
set(ckpt ${work}/new/sub/ck.safetensors)
set(common --set train.steps=3 --set train.eval_batch_size=100 "--set" "train.checkpoint=\"${ckpt}\"")
run(0 "final test accuracy: n/a  \\(no evaluation ran: train.halt_after"
  ${common} --set train.halt_after=2 --metrics ${work}/m/first.jsonl)
if(NOT out MATCHES "steps 2  final loss [0-9.]+  [0-9]+ samples/s \\(median of all 2 steps, warm-up included\\)")
  message(FATAL_ERROR "no flagged short-run rate:\n${out}")
endif()
if(NOT EXISTS ${ckpt} OR NOT EXISTS ${work}/m/first.jsonl)
  message(FATAL_ERROR "checkpoint or metrics file not written under the created directories")
endif()
file(STRINGS ${work}/m/first.jsonl lines)
list(GET lines -1 summary)
string(JSON acc_type TYPE "${summary}" test_accuracy)
if(NOT acc_type STREQUAL "NULL")
  message(FATAL_ERROR "test_accuracy without an evaluation is not null: ${summary}")
endif()

# The last step, evaluated on the first batch of 100 only; epoch is a float.
run(0 "final test accuracy: [0-9.]+%  \\(test loss [0-9.]+, 100 test examples\\)"
  ${common} "--set" "train.resume=\"${ckpt}\"" --set train.eval_batches=1
  --metrics ${work}/second.jsonl)
file(READ ${work}/second.jsonl second)
if(NOT second MATCHES "\"epoch\":0\\.375,")
  message(FATAL_ERROR "no evaluation line with epoch 0.375 (3 of 8 steps):\n${second}")
endif()

# Resuming the finished run runs no step: no loss, no rate.
run(0 "steps 3  final loss n/a  n/a samples/s  \\(no steps ran: the run had already finished\\)"
  ${common} "--set" "train.resume=\"${ckpt}\"" --set train.eval=false --metrics ${work}/third.jsonl)
file(STRINGS ${work}/third.jsonl lines)
list(GET lines -1 summary)
foreach(key final_loss samples_per_s)
  string(JSON t TYPE "${summary}" ${key})
  if(NOT t STREQUAL "NULL")
    message(FATAL_ERROR "${key} of a run without steps is not null: ${summary}")
  endif()
endforeach()
# Text without a test split (data.test_fraction = 0): fine without
# evaluation (the test split is then not read), an error naming both keys with it.
set(base ${MESHTRAIN} train --config ${SRC}/configs/gpt_text.toml --set train.threads=1
  --set data.limit_train=16 --set train.batch_size=8 --set data.test_fraction=0
  "--set" "train.checkpoint=\"\"" --quiet)
run(1 "error: .*data.test_fraction = 0 leaves no test split, but train.eval is on" --set train.steps=100000)
run(0 "steps 1  final loss [0-9.]+" --set train.steps=1 --set train.eval=false)
message(STATUS "ok")
