# configs/gpt_medium.toml (the wider GPT of `bench/run zero`) stays usable:
# every key is valid, the model builds (12 layers, d_model 768: 85,449,216
# parameters) and its ZeRO-3 plan at 4 ranks holds a quarter of the model
# state per rank. Planning only: a training step is about 1 TFLOP.
cmake_minimum_required(VERSION 3.25)

execute_process(COMMAND ${MESHTRAIN} inspect --config ${SRC}/configs/gpt_medium.toml
  --set dist.nproc=4 --set dist.zero_stage=3
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "inspect gpt_medium: exit ${rc}, expected 0:\n${out}\n${err}")
endif()
if(NOT out MATCHES "parameters: 85449216 ")
  message(FATAL_ERROR "inspect gpt_medium: not the 85,449,216-parameter model:\n${out}")
endif()
# (P + G + O) / 4 for AdamW: 85449216 x 16 bytes / 4 = 326 MiB.
if(NOT out MATCHES "rank 0 of 4, ZeRO stage 3.*parameters +81\\.[0-9]+ MiB.*gradients +81\\.[0-9]+ MiB.*optimizer state +16[23]\\.[0-9]+ MiB")
  message(FATAL_ERROR "inspect gpt_medium: the ZeRO-3 plan is not a quarter per rank:\n${out}")
endif()
message(STATUS "ok")
