# PyTorch computes the same logits as meshtrain from exported weights (MLP,
# CNN, GPT): a short run per model, `meshtrain export --logits-for 16`, then
# bench/peers/torch_export_check.py builds the equivalent torch modules,
# loads the file with load_state_dict and compares the logits. Uses the
# bench's PyTorch venv (VENV, or $ENV{MT_BENCH_VENV}; bench/run creates it);
# without it the test reports SKIPPED and ctest lists it as skipped.
cmake_minimum_required(VERSION 3.25)
if(DEFINED ENV{MT_BENCH_VENV})
  set(VENV $ENV{MT_BENCH_VENV})
endif()
set(py ${VENV}/bin/python)
if(NOT EXISTS ${py})
  message(STATUS "SKIPPED: no PyTorch venv at ${VENV} (bench/run core creates it)")
  return()
endif()
execute_process(COMMAND ${py} -c "import torch, numpy" RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(STATUS "SKIPPED: torch does not import in ${VENV}: ${err}")
  return()
endif()

set(dir ${OUT}/cli_export_torch)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})
set(mlp_args --config ${SRC}/configs/mlp_fashion.toml "--set" "model.hidden=[32,16]")
set(cnn_args --config ${SRC}/configs/cnn_fashion.toml "--set" "model.conv_channels=[4,8]"
  --set model.fc=16)
set(gpt_args --config ${SRC}/configs/gpt_text.toml --set model.layers=2 --set model.d_model=32
  --set model.heads=2 --set model.seq_len=16 --set train.batch_size=8)
foreach(model mlp cnn gpt)
  set(args ${${model}_args} --set train.threads=1 --set data.limit_train=256
    --set data.limit_test=64 "--set" "train.checkpoint=\"${dir}/${model}.ckpt.safetensors\"")
  execute_process(COMMAND ${MESHTRAIN} train ${args} --quiet --set train.steps=3
    --set train.eval=false RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${model}: train failed (${rc}):\n${out}\n${err}")
  endif()
  execute_process(COMMAND ${MESHTRAIN} export ${args} --out ${dir}/${model}.safetensors
    --logits-for 16 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${model}: export failed (${rc}):\n${out}\n${err}")
  endif()
  execute_process(COMMAND ${py} ${SRC}/bench/peers/torch_export_check.py
    --weights ${dir}/${model}.safetensors --logits ${dir}/${model}.logits.safetensors
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "\"ok\": true")
    message(FATAL_ERROR "${model}: PyTorch disagrees (exit ${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${model}: ${out}")
endforeach()
