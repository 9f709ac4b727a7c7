"""Attention kernels: the ones a recipe may name, what each needs installed, and how packed rows reach it.

``model.attn_implementation`` (``auto``: sdpa where the architecture supports it, else eager) goes to
``from_pretrained`` resolved, so a checkpoint whose config.json names a kernel never picks it behind the
recipe's back. Packing must never let one example attend to
another (transformers 5.24, ``masking_utils`` and ``modeling_flash_attention_utils``):

- sdpa, eager, flex_attention: packed rows with restarting position ids and no attention mask;
  transformers reads the restarts and builds a block-diagonal causal mask, for any batch size.
- flash_attention_2 / 3, and the varlen flash kernels of the kernels hub: transformers finds packed sequences
  from position ids only when a batch is one row; several rows would be one causal flash call each,
  over whole rows, examples attending to each other. So each micro-batch of packed rows is flattened
  into one sequence whose example boundaries go to the varlen kernel as ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` (``data/packing.py``, through transformers' ``DataCollatorWithFlattening``): no
  padding, no mask, no cross-attention.
- any other kernel from the hub (``VARLEN_HUB_KERNELS`` lists the flash ones known to take varlen
  boundaries): how it treats packed rows is unknown, so packing is refused.

Adding a kernel is one entry in ``KERNELS``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


def _always() -> bool:
    return True


def _flex() -> bool:
    from transformers.utils import is_torch_flex_attn_available

    return is_torch_flex_attn_available()


def _flash(version: int) -> Callable[[], bool]:
    def available() -> bool:
        from transformers.utils import import_utils

        return getattr(import_utils, f"is_flash_attn_{version}_available")()

    return available


def _kernels() -> bool:
    from transformers.utils import is_kernels_available

    return is_kernels_available()


@dataclass(frozen=True)
class AttentionKernel:
    name: str
    packing: Literal["rows", "flattened"] | None  # how packed examples reach it; None: packing refused
    needs: str  # what must be installed, as the error line says it
    available: Callable[[], bool]
    half_precision: bool = False  # computes in bfloat16 / float16 only
    cuda: bool = False  # runs on CUDA GPUs only
    quadratic: bool = False  # materializes the (batch, heads, seq, seq) scores: memory grows with seq squared


KERNELS = {
    # auto: sdpa where the architecture supports it, else eager (transformers' own preference, without
    # letting a checkpoint's config.json choose)
    "auto": AttentionKernel("auto", "rows", "torch", _always),
    "sdpa": AttentionKernel("sdpa", "rows", "torch", _always),
    "eager": AttentionKernel("eager", "rows", "torch", _always, quadratic=True),
    # FlexAttention has no backward on the CPU (torch 2.13): it trains on CUDA GPUs only
    "flex_attention": AttentionKernel("flex_attention", "rows", "torch >= 2.5", _flex, cuda=True),
    "flash_attention_2": AttentionKernel(
        "flash_attention_2",
        "flattened",
        "the flash-attn package (pip install flash-attn --no-build-isolation)",
        _flash(2),
        half_precision=True,
        cuda=True,
    ),
    "flash_attention_3": AttentionKernel(
        "flash_attention_3",
        "flattened",
        "FlashAttention-3 (flash_attn_interface, built from flash-attention's hopper/ folder)",
        _flash(3),
        half_precision=True,
        cuda=True,
    ),
}
HUB_KERNEL = re.compile(
    r"^([\w.-]+/[\w.-]+)(@[\w.-]+)?(:[\w.-]+)?$"
)  # kernels-community/flash-attn[@rev][:fn]
# Hub kernels known to expose flash_attn_varlen_func, which transformers then calls with the flattened
# batch's boundaries. A hub kernel without it is registered with sdpa-style masking
# (transformers' integrations/hub_kernels.py), so packing it is refused like any unknown kernel.
VARLEN_HUB_KERNELS = {  # including the ones transformers itself falls back to for flash_attention_2/3/4
    "kernels-community/flash-attn",
    "kernels-community/flash-attn2",
    "kernels-community/flash-attn3",
    "kernels-community/flash-attn4",
    "kernels-community/vllm-flash-attn3",
}


def kernel(name: str) -> AttentionKernel:
    """The registry entry, or one made for a kernels-hub id (``org/name``)."""
    if name in KERNELS:
        return KERNELS[name]
    match = HUB_KERNEL.match(name)
    if not match:
        raise ValueError(
            f"model.attn_implementation: {name!r} is not one of {', '.join(KERNELS)} nor a kernels-hub id (org/name)"
        )
    varlen = match.group(1) in VARLEN_HUB_KERNELS
    return AttentionKernel(
        name,
        "flattened" if varlen else None,
        "the kernels package (pip install kernels)",
        _kernels,
        varlen,
        True,
    )


# The architecture's class attribute saying it supports each kernel (transformers' PreTrainedModel).
SUPPORT_FLAGS = {
    "sdpa": "_supports_sdpa",
    "flex_attention": "_supports_flex_attn",
    "flash_attention_2": "_supports_flash_attn",
    "flash_attention_3": "_supports_flash_attn",
}


def resolve(name: str, config) -> str | None:
    """The kernel to load ``config``'s model with: ``auto`` made concrete, an explicit choice checked
    against what the architecture supports (a ValueError naming the field). None for remote code,
    whose class transformers alone knows."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        return None if name == "auto" else name
    check_sinks(name, config)
    if name == "auto":
        return "sdpa" if model_class._supports_sdpa else "eager"
    flag = SUPPORT_FLAGS.get(name)
    if flag is not None and not getattr(model_class, flag, False):
        raise ValueError(
            f"model.attn_implementation: {model_class.__name__} does not support {name} in this transformers; "
            "use auto or eager"
        )
    return name


# The kernels that add a family's attention sinks (families.Family.attention_sinks) to the softmax in
# transformers 5.24: eager (eager_attention_forward), flex_attention (renormalised by its log-sum-exp, CUDA
# only: integrations/flex_attention.py refuses sinks on the CPU), and the hub's vLLM FlashAttention-3, which
# takes them as s_aux. sdpa has no place for them; flash_attention_2/3 would drop them silently
# (modeling_flash_attention_utils passes s_aux only to a kernel that names it), and transformers swaps a
# flash_attention_* request for the model's hub kernel behind the recipe's back.
SINK_KERNELS = ("auto", "eager", "flex_attention", "kernels-community/vllm-flash-attn3")


def check_sinks(name: str, config) -> None:
    """A ValueError naming the field when ``config``'s family has attention sinks the kernel cannot add."""
    from qlora_kit.registries import families

    entry = families.family(getattr(config, "model_type", ""))
    if entry is None or not entry.attention_sinks or name.split("@")[0].split(":")[0] in SINK_KERNELS:
        return
    raise ValueError(
        f"model.attn_implementation: {name} cannot add {entry.model_type}'s attention sinks (a learned logit "
        f"per head in every softmax); use {', '.join(SINK_KERNELS[1:])} (auto: eager)"
    )


# eager's scores per (batch, head, query, key): the scores in the compute dtype, their fp32 softmax, and its
# cast back (transformers' eager_attention_forward), all alive at once
EAGER_BYTES_PER_SCORE = 2 + 4 + 2


def quadratic_refusal(name: str, batch: int, heads: int, seq: int, budget_bytes: int) -> str | None:
    """Why a kernel whose memory grows with the square of the sequence cannot train ``seq`` tokens in
    ``budget_bytes`` (one line naming the field and what to use instead), or None when it can."""
    if not (name in KERNELS and KERNELS[name].quadratic):
        return None
    scores = batch * heads * seq * seq * EAGER_BYTES_PER_SCORE
    if scores <= budget_bytes:
        return None
    gib = 1024**3
    return (
        f"model.attn_implementation: {name} attention materializes (batch, heads, seq, seq) scores, "
        f"{scores / gib:,.1f} GiB for one layer at {seq:,} tokens, more than the {budget_bytes / gib:,.1f} GiB "
        "to fit; use sdpa (or flash_attention_2 on a GPU), whose memory grows linearly with the sequence"
    )


def check_installed(name: str, cuda_available: bool) -> str | None:
    """Why ``name`` cannot run on this machine (one line naming the field), or None."""
    spec = kernel(name)
    if not spec.available():
        return f"model.attn_implementation: {name} needs {spec.needs}, which is not installed here"
    if spec.cuda and not cuda_available:
        return (
            f"model.attn_implementation: {name} trains on CUDA GPUs only; on this machine use sdpa or eager"
        )
    return None
