"""Ctrl-C and pre-emption: SIGINT or SIGTERM finishes the current step, writes a checkpoint and stops.

The handler only raises a flag; the Trainer callback turns it into "save, then stop" at the end of the
step, so the checkpoint is a consistent one that ``--resume`` continues exactly. A second signal while
that is under way ends the run at once (the previous complete checkpoint stays the newest).
"""

from __future__ import annotations

import signal
import threading

from transformers import TrainerCallback

from qlora_kit.training.distributed import any_rank

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopOnSignal(TrainerCallback):
    def __init__(self) -> None:
        self.received: int | None = None  # the signal this process got
        self.stopped = False  # this run stopped on a signal (any rank's)
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (notebooks run there too)
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            self.restore()
            raise KeyboardInterrupt  # a second signal: stop now
        self.received = signum

    def on_step_end(self, args, state, control, **kwargs):
        # Every rank must stop at the same step, even if the signal reached only some of them.
        if any_rank(self.received is not None):
            self.stopped = True
            control.should_save = True
            control.should_training_stop = True
        return control
