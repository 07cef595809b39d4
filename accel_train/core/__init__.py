"""The loop and what it cannot run without. Imports neither the observer (observe/) nor the task kits (tasks/).

    loop.py        run_loop: the step loop only
    session.py     Session: one run's prepared objects; start / resume / evaluate / save / finish
    guard.py       non-finite and SIGTERM verdicts, agreed by every rank; locating the first non-finite module
    loss.py        the loss contract (means, or sums and counts), default_loss, the exact step gradient
    evaluation.py  gather and evaluate, the confusion matrix
    hooks.py       the hook protocol and EarlyStopping
    control.py     RunControl: what a hook may steer (stop, save, evaluate), agreed by every rank
    optim.py       optimizer, schedule and the step plan, in optimizer steps
    data.py        loaders, worker seeding, length-grouped batches
    stream.py      a stream's loader position in checkpoints: exact resume without re-reading
    accelerator.py build_accelerator and the checks of what is really running
    meter.py       loss, throughput, MFU and memory between log events
    peak.py        the peak an MFU is measured against: a GPU's datasheet, a CPU's fastest timed matmul (cached)
    state.py       TrainState (saved with checkpoints) and TrainResult
    batch_size.py  --auto_find_batch_size
"""
