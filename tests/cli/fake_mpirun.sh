#!/bin/sh
# Stands in for mpirun in cli_launch_signal_grace: starts two "ranks" that
# ignore SIGTERM and SIGINT (as a rank stuck in a system call might), so only
# the launcher's SIGKILL after the grace period ends them.
trap '' TERM INT
for r in 0 1; do
  sleep 60 &
done
wait
