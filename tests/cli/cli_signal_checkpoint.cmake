# SIGTERM to a training rank: it finishes the step, writes a step-numbered
# checkpoint (train.checkpoint_keep), says so and exits with 128 + 15; the
# next run with train.resume = "auto" continues from that step.
cmake_minimum_required(VERSION 3.25)
set(dir ${OUT}/cli_signal_checkpoint)
file(REMOVE_RECURSE ${dir})
set(common train --config ${SRC}/configs/mlp_fashion.toml --quiet --set train.threads=1
  --set train.eval=false --set data.limit_train=512 --set train.batch_size=64
  "--set" "model.hidden=[32]" "--set" "train.checkpoint=\"${dir}\"" --set train.checkpoint_keep=2
  --set train.checkpoint_every=200)

# The signal is sent once the run has written its first metrics line, so it
# lands in training whatever the machine's load (a fixed delay did not, on a
# busy machine). $0 is the metrics file, $1 the signal, the rest the command.
set(signal_when_training [=[
m=$0; sig=$1; shift; rm -f "$m"; "$@" --metrics "$m" --set train.log_every=1 & pid=$!
i=0; while [ ! -s "$m" ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done
kill -s "$sig" $pid; wait $pid]=])
execute_process(
  COMMAND sh -c "${signal_when_training}" ${dir}.jsonl TERM ${MESHTRAIN} ${common}
    --set train.epochs=1000000
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 143)
  message(FATAL_ERROR "expected exit status 143 after SIGTERM, got ${rc}:\n${out}\n${err}")
endif()
if(NOT err MATCHES "stopped by signal at step ([0-9]+) \\(SIGTERM\\); checkpoint written to ([^ ]+) ")
  message(FATAL_ERROR "no stop message:\n${err}")
endif()
set(step ${CMAKE_MATCH_1})
set(ckpt ${CMAKE_MATCH_2})
string(LENGTH "${step}" len)
math(EXPR pad "8 - ${len}")
string(REPEAT "0" ${pad} zeros)
if(NOT ckpt STREQUAL "${dir}/step_${zeros}${step}" OR NOT EXISTS ${ckpt}/index.json)
  message(FATAL_ERROR "checkpoint ${ckpt} of step ${step} is not ${dir}/step_${zeros}${step} or lacks its index")
endif()
file(GLOB kept LIST_DIRECTORIES true ${dir}/step_*)
list(LENGTH kept n)
if(n GREATER 2)
  message(FATAL_ERROR "train.checkpoint_keep=2 but ${n} checkpoints are left: ${kept}")
endif()

math(EXPR until "${step} + 5")
execute_process(
  COMMAND ${MESHTRAIN} ${common} --set train.epochs=1000000 --set train.steps=${until}
    "--set" "train.resume=\"auto\""
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "resume failed (${rc}):\n${out}\n${err}")
endif()
if(NOT err MATCHES "resumed from step ${step} \\(${ckpt}\\)" OR NOT out MATCHES "steps ${until} ")
  message(FATAL_ERROR "did not continue from step ${step} to ${until}:\n${out}\n${err}")
endif()

# SIGINT (Ctrl-C) likewise, with 128 + 2; the run resumed from the newest.
execute_process(
  COMMAND sh -c "${signal_when_training}" ${dir}.jsonl INT ${MESHTRAIN} ${common}
    --set train.epochs=1000000 "--set" "train.resume=\"auto\""
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 130 OR NOT err MATCHES "resumed from step ${until} "
   OR NOT err MATCHES "stopped by signal at step [0-9]+ \\(SIGINT\\); checkpoint written to ")
  message(FATAL_ERROR "SIGINT: expected exit status 130 and a checkpoint, got ${rc}:\n${out}\n${err}")
endif()
message(STATUS "ok: stopped at step ${step}, resumed to ${until}")
