"""What a hook may steer: `RunControl`, the run a hook's `attach(run)` receives, and how the loop honours its requests.

A hook that defines `attach(self, run)` gets the prepared objects (model, optimizer, scheduler, plateau, accelerator,
config) and may ask for a stop, a checkpoint or an evaluation at any time:

    class SaveWhenBelow:
        def attach(self, run):
            self.run = run

        def on_log(self, state, logs):
            if logs["loss"] < 0.1:
                self.run.request_save()

A request is local to the rank that made it. At every step boundary (after an optimizer step, never between
micro-batches) the loop agrees the requests of all ranks (one all-reduce of three numbers, on every step of a run with
such a hook on some rank, and only on several processes), so that every rank evaluates, saves and stops at the same
step: an evaluation or a save on one rank only would wait forever for the others. See docs/hooks.md.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError
from .hooks import call_hooks

REQUESTS = ("stop", "save", "evaluate")


class RunControl:
    """The run as a hook sees it: its prepared objects and three requests, honoured at the next step boundary on
    every rank. Built by the session once the hooks are attached; the objects are the session's own (a rollback or
    the best checkpoint's restore loads into them in place), so a hook may keep this object for the whole run."""

    def __init__(self, session: Any):
        self.session = session
        self.pending: set[str] = set()  # this rank's requests since the last agreement
        self.steering = False  # some rank has a hook that attached: the requests are agreed at every step boundary
        self.closed = False  # the loop is over: no step boundary is left to carry out a request

    # ------------------------------------------------------------------------------------- the prepared objects
    @property
    def model(self):
        """The prepared model (DDP/FSDP-wrapped as Accelerate made it; `accelerator.unwrap_model(run.model)` for
        the bare module)."""
        return self.session.model

    @property
    def optimizer(self):
        """The prepared optimizer: change `param_groups[i]["lr"]` here; the schedule steps after it."""
        return self.session.optimizer

    @property
    def scheduler(self):
        """The clock schedule the loop steps (yours, or the one built from --lr_scheduler_type)."""
        return self.session.scheduler

    @property
    def plateau(self):
        """A ReduceLROnPlateau passed beside the clock schedule (`scheduler=[step_lr, plateau]`), or None."""
        return self.session.plateau

    @property
    def accelerator(self):
        return self.session.accelerator

    @property
    def config(self):
        """The run's TrainConfig (read it; a config is never changed once parsed)."""
        return self.session.config

    @property
    def tracker_names(self) -> dict[str, str]:
        """{the loop's name: the name trackers get}, e.g. {"loss": "Loss/train"}: applied to every record sent to the
        trackers from then on (the training logs, evaluations, the summary). metrics.jsonl, all_results.json and the
        report keep the loop's names. Set it in `attach` to rename from the first record."""
        return self.session.log.tracker_names

    # ------------------------------------------------------------------------------------------- the requests
    def request_stop(self) -> None:
        """Stop at the next step boundary (every rank), then finish as usual: final evaluation, checkpoint, model."""
        self.ask("stop")

    def request_save(self) -> None:
        """A checkpoint at the next step boundary (every rank), a real one: resumable, rotated by --save_total_limit,
        written even with --save_strategy no. Nothing more when that step is saved anyway."""
        self.ask("save")

    def request_evaluate(self) -> None:
        """An evaluation at the next step boundary (every rank), as a due one: logged, on_evaluate called, the weight
        average evaluated too with --ema_decay, the best checkpoint saved when it improves. Nothing more when that
        step is evaluated anyway."""
        if self.session.eval_loader is None:
            raise ConfigError("request_evaluate(): this run has no evaluation loader; pass eval_loader= to train() "
                              "(evaluations follow --eval_strategy; a request adds one).")
        self.ask("evaluate")

    def ask(self, request: str) -> None:
        if self.closed:
            raise ConfigError(f"request_{request}() after the last step: training is over, nothing is left to "
                              f"{request} (the final evaluation and checkpoint follow --eval_strategy and "
                              "--save_strategy). Ask from attach, on_train_start, on_log, on_evaluate or on_save; "
                              "in on_finish, work on session.model directly.")
        self.pending.add(request)

    # --------------------------------------------------------------------------------------------- the loop's
    def close(self) -> None:
        """The loop ended: later requests are refused (a request pending now, made with no step left, is dropped)."""
        self.closed = True
        self.pending.clear()

    def agree(self, stop: bool = False) -> set[str]:
        """Every rank's requests since the last agreement (and `stop`, a hook's returned True), the same set on every
        rank; this rank's are then cleared. A collective on several processes: every rank calls it at the same
        boundary."""
        asked, self.pending = self.pending | ({"stop"} if stop else set()), set()
        acc = self.session.accelerator
        if acc.num_processes > 1:
            flags = torch.tensor([float(name in asked) for name in REQUESTS], device=acc.device)
            flags = acc.reduce(flags, reduction="sum")
            asked = {name for name, flag in zip(REQUESTS, flags.tolist(), strict=True) if flag > 0}
        return asked

    def forget(self) -> None:
        """--on_spike rollback: the requests made while the dropped step ran (from a loss function, say) are dropped
        with it; the hooks see the replayed steps and may ask again."""
        self.pending.clear()


def attach_hooks(session: Any) -> RunControl:
    """The run's RunControl, given to every hook with `attach(run)` in the order of the hooks. Whether some rank has
    such a hook is agreed once (a hook may be given on one rank only): then the requests are agreed at every step
    boundary on every rank."""
    control = RunControl(session)
    attached = False
    for hook in session.hooks:
        method = getattr(hook, "attach", None)
        if method is not None:
            method(control)
            attached = True
    control.steering = any_rank(session.accelerator, attached)
    return control


def any_rank(accelerator: Any, flag: bool) -> bool:
    """`flag` agreed across ranks: True on every rank when it is True on any (one all-reduce; none on one process)."""
    if accelerator.num_processes == 1:
        return flag
    total = accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), reduction="sum")
    return bool(total.item() > 0)


def settle(session: Any, state: Any, meter: Any, stop: bool, acted: bool, preempt: bool = False) -> bool:
    """The end of a step boundary, after the due log / evaluation / save: agree the ranks' requests and the hooks'
    returned stop, carry out an agreed evaluation or save this step has not done yet (their hooks may ask again: agreed
    again), and return whether every rank stops here. Without a steering hook and with nothing due, no collective.
    `preempt` (SIGTERM): an asked evaluation is left pending, for the resumed run, as a due one (Session.after_step;
    rescue.preempt puts it in this step's checkpoint, written already or not)."""
    control: RunControl = session.control
    if not (acted or control.steering):
        return False
    asked = control.agree(stop)
    while asked & {"save", "evaluate"}:
        stop, best = False, False
        meter.hold()  # evaluating and saving are not training time
        if "evaluate" in asked and state.last_eval[0] != state.step and preempt:
            state.evaluation_pending = True
        elif "evaluate" in asked and state.last_eval[0] != state.step:
            metrics, improved = session.evaluate(state)
            stop |= call_hooks(session.hooks, "on_evaluate", state, metrics)
            best = improved and session.config.save_strategy != "no"  # as a due evaluation: the best is saved
        if "save" in asked or best:
            session.keep_interval(state, meter)
            stop |= session.save(state, best=best, wait=False)
        meter.release()
        asked = (asked & {"stop"}) | control.agree(stop)
    return "stop" in asked
