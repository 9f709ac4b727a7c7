"""``python tests/e2e/fsdp_launch.py ARGS`` is ``qlora-kit ARGS`` with FSDP allowed on CPU processes.

accelerate turns an FSDP launch into FSDP only for GPU-like devices: ``AcceleratorState.__init__``
(accelerate 1.15, state.py) switches ``distributed_type`` to ``FSDP`` inside a branch for
``MULTI_GPU``/``MULTI_NPU``/… and leaves ``MULTI_CPU`` as it is, so a CPU launch with an FSDP config
silently trains with DDP. torch's FSDP2 (``fully_shard``) itself runs on CPUs over gloo. This launcher
applies the same switch to ``MULTI_CPU`` (the lines of that branch, nothing else), so the suite runs
accelerate's and transformers' real FSDP path — sharding, the FSDP state dicts, checkpoints, resume —
on the CPU. On GPUs it changes nothing (benchmarks/fsdp_check.py runs it there for the kill switch).
Tests and checks only: nobody shards a model over CPU processes.

``QLORA_KIT_TEST_KILL_AFTER_STEP=K`` makes rank 0 SIGKILL itself right after optimizer step K (the
launcher then stops the other rank), for the resume test.
"""

import os

from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

_init = AcceleratorState.__init__


def _init_with_cpu_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    use_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if self.distributed_type == DistributedType.MULTI_CPU and use_fsdp and fsdp_plugin is not None:
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin


AcceleratorState.__init__ = _init_with_cpu_fsdp


def _kill_after_step(step: int) -> None:
    import signal

    from transformers import TrainerCallback

    import qlora_kit.training.pipeline

    class KillAfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step and state.is_world_process_zero:
                os.kill(os.getpid(), signal.SIGKILL)

    real_run = qlora_kit.training.pipeline.run
    qlora_kit.training.pipeline.run = lambda *a, callbacks=None, **k: real_run(
        *a, callbacks=[KillAfterStep(), *(callbacks or [])], **k
    )


if __name__ == "__main__":
    from qlora_kit.cli.app import main
    from qlora_kit.testing import faults

    faults.install()  # the caps a test sets in the environment (test_oom.py's FSDP stop)
    if "QLORA_KIT_TEST_KILL_AFTER_STEP" in os.environ:
        _kill_after_step(int(os.environ["QLORA_KIT_TEST_KILL_AFTER_STEP"]))
    main()
