"""Selective activation checkpointing of a decoder layer: keep the expensive ops' outputs, recompute the rest.

``memory.checkpointing: selective`` checkpoints a layer through transformers' own mechanism (the layer's
``_gradient_checkpointing_func``, torch's non-reentrant ``checkpoint``) with a ``context_fn`` made by
torch's ``create_selective_checkpoint_contexts``: during the forward pass every op of the layer runs
under a dispatch mode that asks ``policy`` whether to keep its output; in backward the layer is replayed
and the kept outputs are handed back instead of being computed again. So a selective layer keeps its
input plus the kept outputs, and its backward recomputes only the ops the policy let go.

What is kept (``MUST_SAVE``), and why:
- the 4-bit matmuls: ``torch.ops.bitsandbytes.gemm_4bit`` (bitsandbytes' ``MatMul4Bit`` calls it: it
  dequantizes the whole weight and multiplies, the costliest op of the layer to replay, and the
  dequantize inside it is not replayed either), and, where a 4-bit linear is stood in for by a plain
  linear (the planner's trace, a model without quantization), ``aten.mm``/``addmm`` that contract over at least ``MIN_CONTRACTION`` values. The MLP's gate and up outputs are kept with the
  rest: recomputing them costs two of the MLP's three matmuls, a third of the layer's FLOPs, to free
  ``2 x intermediate`` values a token (benchmarks/memory.py's frontier measures the choice);
- attention kernels (sdpa's fused kernels, flash, flex): their output and log-sum-exp; eager attention's
  batched matmuls (scores, weighted values);
- LoRA's A projection (contracts over ``d_in``; its output is ``rank`` values a token: nearly free to keep).

What is recomputed (``PREFER_RECOMPUTE``): everything else: norms, rotary embeddings, activations,
element-wise products, residual adds, casts, dropout (non-reentrant checkpoint restores the RNG state
before the replay, so LoRA dropout draws the same masks) and LoRA's B projection, which contracts over
``rank`` values only: memory-bound like an element-wise op, while its output is as wide as the layer's.

Bytes kept this way do not pass through autograd's saved-tensor hooks, so each kept output is reported to
``accounting.note_saved`` (what ``SavedTensors`` counts, in a run and in the planner's trace) by a
dispatch mode of ours above torch's, which sees the op's output on every torch in the declared range.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from qlora_kit.memory.accounting import note_saved

# A matmul that contracts over fewer values than this does ~2 x this FLOPs per output value: at or under
# the machine balance of a GPU or a CPU (FLOPs per byte moved), memory-bound like an element-wise op.
# LoRA's B (rank 8..64) falls below, every 4-bit linear of a real model (hidden >= 128) above.
MIN_CONTRACTION = 128

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default}
# Batched matmuls arise in a decoder layer only inside eager attention (scores and the weighted values):
# kept, as attention is.
BATCHED_MATMULS = {aten.bmm.default, aten.baddbmm.default}


def _attention_ops() -> set:
    names = [
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    ]
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return ops | ({flex} if flex is not None else set())


ATTENTION = _attention_ops()


def _is_4bit_matmul(func) -> bool:
    # bitsandbytes registers its kernels as torch ops (gemm_4bit, and gemv_4bit for the CPU's packed
    # inference layout); the namespace is looked up by name so this module does not import bitsandbytes.
    return (
        getattr(func, "namespace", None) == "bitsandbytes"
        and "4bit" in func.name()
        and "quantize" not in func.name()
    )


def keeps(func, args) -> bool:
    """Whether the selective policy keeps this op's output (see the module docstring)."""
    if func in ATTENTION or func in BATCHED_MATMULS or _is_4bit_matmul(func):
        return True
    if func in MATMULS:
        a = args[1] if func is aten.addmm.default else args[0]  # addmm(bias, a, b)
        return a.shape[-1] >= MIN_CONTRACTION
    return False


# Called as observer(func, args, kwargs, output, kept) for every op the policy decides on in a forward pass
# (the planner's trace counts recompute costs with one).
OBSERVERS: list[Callable] = []

# Ops torch's caching mode passes through without asking the policy (detach, device queries, ...).
_IGNORED = getattr(torch_checkpoint, "SAC_IGNORED_OPS", frozenset())


def policy(ctx: SelectiveCheckpointContext, func, *args, **kwargs) -> CheckpointPolicy:
    """torch's selective-checkpoint policy: called once per op in the forward pass and again in the replay.

    It decides from the op and its inputs alone: torch calls it before the op runs up to 2.11 (whose
    context has no ``op_output``) and after it from 2.12 on, so what needs the output (the saved-bytes
    count, the observers) is done by ``_KeptOutputs`` instead, the same way on every torch."""
    return CheckpointPolicy.MUST_SAVE if keeps(func, args) else CheckpointPolicy.PREFER_RECOMPUTE


class _KeptOutputs(TorchDispatchMode):
    """A selective layer's forward context: torch's caching mode with this mode above it, which sees each
    op's output, reports the kept ones to ``accounting.note_saved`` (they bypass autograd's saved-tensor
    hooks) and every one to ``OBSERVERS``. A dispatch mode itself, as torch.compile requires of a
    checkpoint's contexts."""

    def __init__(self, caching: TorchDispatchMode) -> None:
        super().__init__()
        self.caching = caching

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # as torch's own caching mode: torch.compile traces through it

    # Under torch.compile (a compiled decoder layer, training/compiled.py) the checkpoint becomes a
    # higher-order op that numbers its region by setting ``ac_graph_id`` on the forward context it gets
    # from context_fn (torch/_higher_order_ops/wrap.py), and torch's caching mode tags every traced node
    # with its own ``ac_graph_id``: handed down to it, or the partitioner compares None with None
    # (cleanup_recompute_tags: "'>' not supported between instances of 'NoneType' and 'NoneType'").
    @property
    def ac_graph_id(self):
        return self.caching.ac_graph_id

    @ac_graph_id.setter
    def ac_graph_id(self, value) -> None:
        self.caching.ac_graph_id = value

    def __enter__(self):
        self.caching.__enter__()  # first, so below this one: ours runs first and hands each op down
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self.caching.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _IGNORED:
            return out
        kept = keeps(func, args)
        for observer in OBSERVERS:
            observer(func, args, kwargs, out, kept)
        if kept:
            pytree.tree_map_only(torch.Tensor, note_saved, out)
        return out


def context_fn():
    """The context_fn handed to torch's checkpoint (through transformers' checkpointing kwargs): one fresh
    pair of contexts per checkpointed call."""
    caching, cached = create_selective_checkpoint_contexts(policy)
    return _KeptOutputs(caching), cached
