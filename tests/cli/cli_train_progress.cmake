# Progress lines, rates and TensorBoard output through the binary: with stderr
# not a terminal, the plain lines show the epoch and an ETA; a text model's
# lines, metrics and summary carry tokens/s next to samples/s (an image
# model's do not); "1 thread" is singular; --tensorboard writes an event file,
# and a directory that cannot be created is an error naming it.
cmake_minimum_required(VERSION 3.25)

function(run_train name)
  execute_process(COMMAND ${MESHTRAIN} train ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name}: meshtrain train failed (${rc}):\n${out}\n${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
  set(err "${err}" PARENT_SCOPE)
endfunction()

function(expect name text regex)
  if(NOT text MATCHES "${regex}")
    message(FATAL_ERROR "${name}: no match for '${regex}' in:\n${text}")
  endif()
endfunction()

# Image model: 3 epochs of 10 steps, a line every 10 steps.
set(tb ${OUT}/cli_train_progress_tb)
set(metrics ${OUT}/cli_train_progress_mlp.jsonl)
file(REMOVE_RECURSE ${tb})
file(REMOVE ${metrics})
run_train(mlp --config ${SRC}/configs/mlp_fashion.toml --set train.epochs=3
  --set data.limit_train=1280 --set data.limit_test=500 --set train.log_every=10
  --set train.threads=1 "--set" "train.checkpoint=\"\"" --metrics ${metrics} --tensorboard ${tb})
expect(mlp "${err}" "ZeRO stage 0, 1 thread, f32")
expect(mlp "${err}" "1 rank,")
expect(mlp "${err}" "step 10/30 epoch 1/3  loss [0-9.]+  [0-9]+ samples/s  lr [0-9.e-]+  ETA [0-9:]+s?\n")
expect(mlp "${err}" "step 20/30 epoch 2/3 ")
expect(mlp "${err}" "step 30/30 epoch 3/3 .* done\n")
if(err MATCHES "tokens/s" OR out MATCHES "tokens/s")
  message(FATAL_ERROR "mlp: an image model reports tokens/s:\n${out}\n${err}")
endif()
expect(mlp "${out}" "steps 30  final loss [0-9.]+  [0-9]+ samples/s \\(median\\)")
file(READ ${metrics} m)
if(m MATCHES "tokens_per_s")
  message(FATAL_ERROR "mlp: tokens_per_s in an image model's metrics:\n${m}")
endif()
file(GLOB events ${tb}/events.out.tfevents.*)
list(LENGTH events n)
if(NOT n EQUAL 1)
  message(FATAL_ERROR "expected one event file in ${tb}, found: ${events}")
endif()
file(READ ${events} bytes HEX)
# The tags written as protobuf strings (length byte, then the name).
foreach(tag brain.Event:2 loss lr samples_per_s test_loss test_accuracy)
  string(HEX "${tag}" hex)
  if(NOT bytes MATCHES "${hex}")
    message(FATAL_ERROR "event file ${events} lacks '${tag}'")
  endif()
endforeach()

# Text model (a small GPT): tokens/s everywhere samples/s is.
set(metrics ${OUT}/cli_train_progress_gpt.jsonl)
file(REMOVE ${metrics})
run_train(gpt --config ${SRC}/configs/gpt_text.toml --set train.steps=6 --set train.log_every=2
  --set model.layers=1 --set model.d_model=32 --set model.heads=2 --set model.seq_len=16
  --set train.batch_size=4 --set train.eval=false --set train.threads=1
  "--set" "train.checkpoint=\"\"" --metrics ${metrics})
expect(gpt "${err}" "step 2/6 epoch 1/1  loss [0-9.]+  [0-9]+ samples/s  [0-9]+ tokens/s  lr ")
expect(gpt "${out}" "steps 6  final loss [0-9.]+  [0-9]+ samples/s, [0-9]+ tokens/s \\(median\\)")
file(STRINGS ${metrics} lines)
list(GET lines 0 first)
string(JSON sps GET "${first}" samples_per_s)
string(JSON tps GET "${first}" tokens_per_s)
# 16 tokens per sample (seq_len): tokens_per_s = 16 x samples_per_s, checked
# on the integer parts (CMake has no floating point).
function(check_ratio where sps tps)
  string(REGEX MATCH "^[0-9]+" si "${sps}")
  string(REGEX MATCH "^[0-9]+" ti "${tps}")
  math(EXPR lo "16 * ${si}")
  math(EXPR hi "16 * ${si} + 16")
  if(si EQUAL 0 OR ti LESS lo OR ti GREATER hi)
    message(FATAL_ERROR "gpt ${where}: tokens_per_s ${tps} is not 16 x samples_per_s ${sps}")
  endif()
endfunction()
check_ratio("first line" "${sps}" "${tps}")
list(GET lines -1 last)
string(JSON is_summary ERROR_VARIABLE jerr GET "${last}" summary)
string(JSON summary_tps ERROR_VARIABLE jerr2 GET "${last}" tokens_per_s)
if(jerr OR jerr2)
  message(FATAL_ERROR "gpt: the summary line lacks tokens_per_s: ${last}")
endif()
string(JSON summary_sps GET "${last}" samples_per_s)
check_ratio("summary" "${summary_sps}" "${summary_tps}")
message(STATUS "ok: gpt ${sps} samples/s = ${tps} tokens/s; summary ${summary_sps} / ${summary_tps}")

# An event directory that cannot be created: exit status 1, the path named.
set(bad ${metrics}/tb)  # under a regular file
execute_process(COMMAND ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml
  --set train.steps=2 --set train.eval=false --set train.threads=1 --set data.limit_train=256
  "--set" "train.checkpoint=\"\"" --tensorboard ${bad}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "bad --tensorboard: expected exit status 1, got ${rc}:\n${out}\n${err}")
endif()
expect(bad_tensorboard "${err}" "error: train.tensorboard \\(--tensorboard\\) ${bad}: cannot write there")
