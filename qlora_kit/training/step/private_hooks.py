"""The private methods of transformers' Trainer and TRL's trainers that qlora_kit's trainers override,
each with the reason no public hook serves.

A library may rename a private method in any release, and an override of a renamed method is then
never called: silently, the run loses what the override did (an atomic checkpoint, a repaged optimizer,
the worst-batch probe). ``checked`` runs when each trainer class is defined and raises at import, naming
the method and the library class it went missing from. transformers is also pinned below 6 and TRL
below 2 (pyproject.toml), so a rename meets this check in a pin bump, not on a user's machine.
"""

from __future__ import annotations

from importlib.metadata import version

PRIVATE_OVERRIDES = {
    # step/trainer.py
    "_save_checkpoint": (
        "atomic checkpoints: on_save runs after the checkpoint is written, too late to stage it"
    ),
    "_get_output_dir": "where _save_checkpoint writes: the staging folder (no argument or hook sets it)",
    "_get_train_sampler": (
        "group_by_length's order drawn from the seed and the epoch: transformers' sampler takes no generator"
    ),
    "_load_optimizer_and_scheduler": (
        "a resumed paged optimizer pages again: no callback runs between loading its state and step 1"
    ),
    # step/trainer.py (the worst-batch probe)
    "_run_epoch": (
        "the worst-batch probe: on_train_begin runs before the model is prepared (DDP, FSDP, autocast) "
        "and the optimizer built; _run_epoch is the first point after both"
    ),
    # objectives/dpo.py
    "_prepare_dataset": "DPO's rows arrive tokenized (data/preference.py); TRL has no switch to skip its own",
    # objectives/dpo.py, kto.py, grpo/grpo.py
    "_send_telemetry": "TRL reports usage over the network; a training run here makes no such call",
    # objectives/grpo/grpo.py
    "_get_per_token_logps_and_entropies": (
        "several processes agree on an out-of-memory error before TRL's loss all-reduces (grpo/oom.py)"
    ),
    "_generate_single_turn": (
        "grpo.seed_each_completion: each row of the generate call drawn from its own seed (objectives/grpo/row_sampling.py)"
    ),
    # objectives/grpo/oom.py
    "_prepare_inputs": "a split policy step reuses its sampled rollout instead of sampling again",
}


def checked(cls: type) -> type:
    """``cls`` as it is, after checking that every private method it (or a qlora_kit class it inherits)
    defines from ``PRIVATE_OVERRIDES`` still exists on one of its library bases."""
    library = [base for base in cls.__mro__ if not _ours(base) and base is not object]
    for klass in (base for base in cls.__mro__ if _ours(base)):
        for name in vars(klass):
            if name in PRIVATE_OVERRIDES and not any(name in vars(base) for base in library):
                bases = ", ".join(base.__name__ for base in library if base.__name__ != "Generic")
                raise ImportError(
                    f"{klass.__name__}.{name} overrides a private method that {bases} no longer define "
                    f"(transformers {version('transformers')}, trl {version('trl')}): it would never be "
                    f"called ({PRIVATE_OVERRIDES[name]}); install the versions pyproject.toml pins"
                )
    return cls


def overridden(cls: type) -> set[str]:
    """The private library methods ``cls`` overrides (tests: each must be in ``PRIVATE_OVERRIDES``)."""
    library = [base for base in cls.__mro__ if not _ours(base) and base is not object]
    return {
        name
        for klass in cls.__mro__
        if _ours(klass)
        for name in vars(klass)
        if name.startswith("_") and not name.startswith("__") and any(name in vars(b) for b in library)
    }


def _ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "qlora_kit"
