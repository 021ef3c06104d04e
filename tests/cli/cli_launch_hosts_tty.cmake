# `--nproc 2 --hosts FILE` with a hostfile of this machine trains; and with
# the user's stderr a terminal (`script` gives the launcher a pty), rank 0
# draws the progress bar (carriage returns) although its own stderr is
# mpirun's pipe, instead of plain "step N/M" lines.
cmake_minimum_required(VERSION 3.25)
set(hosts ${OUT}/cli_launch_hosts.txt)
file(WRITE ${hosts} "# this machine, two ranks\nlocalhost slots=2\n")
set(cmd ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --nproc 2 --hosts ${hosts}
  --set train.threads=1 --set train.steps=20 --set train.log_every=5 --set train.eval=false
  --set data.limit_train=2000 "--set" "train.checkpoint=\"\"")
execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
  TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--hosts run failed (${rc}):\n${out}\n${err}")
endif()
if(NOT out MATCHES "steps 20  final loss" OR NOT err MATCHES "\\(2 ranks,")
  message(FATAL_ERROR "no 2-rank training through the hostfile:\n${out}\n${err}")
endif()
# Not a terminal: plain lines.
if(NOT err MATCHES "step 20/20" OR err MATCHES "\r")
  message(FATAL_ERROR "expected plain progress lines on a pipe:\n${err}")
endif()

# A terminal: `script` runs the launcher on a pty and copies it to stdout.
set(line "")
foreach(arg IN LISTS cmd)
  string(APPEND line " '${arg}'")
endforeach()
execute_process(COMMAND script -q -e -c "${line}" /dev/null
  RESULT_VARIABLE rc OUTPUT_VARIABLE tty ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "run on a pty failed (${rc}):\n${tty}\n${err}")
endif()
# The bar is redrawn in place ("\r[###...] step 20/20"); plain lines start
# with "step" at the beginning of a line.
if(NOT tty MATCHES "\r\\[[#.]+\\] step 20/20" OR tty MATCHES "(^|\n)step [0-9]+/20")
  message(FATAL_ERROR "expected rank 0's progress bar on the terminal:\n${tty}")
endif()
file(REMOVE ${hosts})
message(STATUS "ok")
