"""Reads meshtrain's TensorBoard event file with the tensorboard package.

Usage: tensorboard_check.py LOGDIR. Exits 77 (ctest: skipped) when the
tensorboard package is not installed; 1 when the file does not hold the
expected scalars.
"""
import sys

try:
    from tensorboard.backend.event_processing import event_accumulator
except ImportError:
    print("skipped: python package 'tensorboard' not installed")
    sys.exit(77)

acc = event_accumulator.EventAccumulator(sys.argv[1])
acc.Reload()
tags = set(acc.Tags().get("scalars", []))
want = {"loss", "lr", "samples_per_s", "test_loss", "test_accuracy"}
if not want <= tags:
    print(f"missing scalars {sorted(want - tags)}; found {sorted(tags)}")
    sys.exit(1)
loss = acc.Scalars("loss")
if [e.step for e in loss] != [10, 20, 30] or not all(e.value > 0 for e in loss):
    print(f"unexpected loss events: {loss}")
    sys.exit(1)
acc_events = acc.Scalars("test_accuracy")
if len(acc_events) != 3 or not all(0 <= e.value <= 1 for e in acc_events):
    print(f"unexpected test_accuracy events: {acc_events}")
    sys.exit(1)
print(f"ok: tensorboard reads {sorted(tags)}")
