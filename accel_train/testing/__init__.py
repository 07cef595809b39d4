"""Test scaffolding that must run inside a training process: the fault-injection seams.

The library calls `faults.point(name, ...)` at a few named places; nothing happens unless the environment variable
``ACCEL_TRAIN_FAULT`` names that point (the reliability tests set it in the processes they launch).
"""
