#!/bin/sh
# tensorboard_check.sh BUILD_DIR LOGDIR: runs tensorboard_check.py with the
# bench venv's python when there is one, else the system python3.
py="$1/bench-venv/bin/python3"
[ -x "$py" ] || py=python3
exec "$py" "$(dirname "$0")/tensorboard_check.py" "$2"
