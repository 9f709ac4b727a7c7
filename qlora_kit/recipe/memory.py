"""The memory section: how a run keeps what backward needs (checkpointing per layer, the loss head).

Read by ``memory/checkpointing.py`` (the policy applied to the decoder layers), ``memory/planner.py``
(``auto`` resolved against ``budget_gb``) and the loss head (``memory/loss_choice.py`` resolves its auto); part of ``recipe.Recipe``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from qlora_kit.recipe.base import Section
from qlora_kit.registries import checkpointing as policies


def _a_policy(value: str) -> str:
    # read at validation time, not import time: the table (registries/checkpointing.py) is the one list
    if value not in policies.POLICIES:
        raise ValueError(f"must be one of {policies.one_of(policies.names())} (got {value!r})")
    return value


def _a_layer_policy(value: str) -> str:
    if value not in policies.layer_policies():
        raise ValueError(f"must be one of {policies.one_of(policies.layer_policies())} (got {value!r})")
    return value


Policy = Annotated[str, AfterValidator(_a_policy)]
LayerPolicy = Annotated[str, AfterValidator(_a_layer_policy)]


class MemorySection(Section):
    checkpointing: Policy = policies.FULL
    """Activation checkpointing of decoder layers: none, full (keep a layer's input, recompute it all), selective
    (keep the 4-bit matmuls' and attention's outputs, recompute the cheap ops), every n-th layer full, per_layer
    (layer_policies), or auto (see budget_gb)."""
    every_n: int = Field(2, ge=1)
    """With checkpointing: every_n, checkpoint layers 0, n, 2n, ..."""
    layer_policies: list[LayerPolicy] | None = None
    """With checkpointing: per_layer, each decoder layer's policy in order (what auto chooses, shown by qlora-kit plan)."""
    budget_gb: float | None = Field(None, gt=0)
    """With checkpointing: auto, the GPU memory (GiB) to fit: each layer gets none, selective or full so that the
    predicted peak fits at the least recompute cost (timed once per run on its device; never more than the
    every_n that fits)."""
    over_budget: bool = False
    """With checkpointing: auto, train with full checkpointing even when no policy is predicted to fit budget_gb."""
    offload_activations: bool = False
    """Keep each checkpointed layer's saved input in host memory until its recompute (pinned, copied on a side
    stream with a one-layer prefetch on CUDA; host to host on the CPU): frees layers x tokens x hidden bytes."""
    experts_on_host: bool | Literal["auto"] = False
    """A mixture's frozen experts (4-bit packed, with their quantization statistics) in host memory, pinned on
    CUDA: each layer's copied to the device for its forward and again for its backward (its recompute shares that
    copy), one layer ahead on a side stream; auto: on only where the plan does not fit budget_gb without it."""
    mlp_tiles: int | Literal["auto"] = 1
    """Compute each decoder layer's MLP in this many tiles along the sequence, each recomputed in backward on
    its own, so one tile's intermediate exists at a time; auto: ceil(tokens / hidden) tiles; 1: untiled."""
    chunked_loss: bool | Literal["auto"] = "auto"
    """Compute the output head and loss in chunks of tokens, recomputed in backward: no full logits kept; auto:
    full logits where the planned peak with them fits budget_gb (else the device's free memory), else chunked,
    in the largest chunks that fit (memory/loss_choice.py; the run's log and qlora-kit plan say which)."""
    loss_chunk_tokens: int = Field(1024, gt=0)
    """Tokens per chunk of the chunked loss (each chunk materialises chunk x vocab logits); with chunked_loss
    auto, the smallest chunk tried (doubled while the plan fits)."""

    @model_validator(mode="after")
    def _check_budget(self) -> MemorySection:
        if self.mlp_tiles != "auto" and self.mlp_tiles < 1:
            raise ValueError(f"memory.mlp_tiles: must be >= 1 or auto (got {self.mlp_tiles})")
        if self.experts_on_host == "auto" and self.budget_gb is None:
            raise ValueError("memory.budget_gb: required with memory.experts_on_host: auto")
        needs = policies.policy(self.checkpointing).needs
        if needs is not None and getattr(self, needs) in (None, []):
            raise ValueError(f"memory.{needs}: required with memory.checkpointing: {self.checkpointing}")
        return self
