"""A mixture of experts' GGUF form: what llama.cpp's ``convert_hf_to_gguf.py`` does for its experts, repeated.

The merged folder (after/merge.py: the experts dequantized from 4 bits, their LoRA merged in fp32) is
saved by transformers in the checkpoint's own layout, one matrix per expert
(``mlp.experts.<e>.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.<e>.w1.weight``). llama.cpp
reads each projection of a layer as one 3-D tensor, experts first (``blk.N.ffn_gate_exps``,
``ffn_up_exps``, ``ffn_down_exps``: PyTorch (experts, out, in)), so ``ExpertStacks`` gathers a layer's
experts and stacks them, under the stacked name the converter gives gguf's ``TensorNameMap``
(``Qwen2MoeModel.modify_tensors``, ``LlamaModel.modify_tensors``). transformers 5's fused form
(``experts.gate_up_proj``: experts x 2*intermediate x hidden) is split into its gate and up halves. The
router (``ffn_gate_inp``) stays F32 in every file type, as the converter keeps it
(``prepare_tensors``: "some tensor types are always in float32"), and the floor keeps it so too.
"""

from __future__ import annotations

import re

import torch

from qlora_kit.errors import ExportError
from qlora_kit.registries import families

# one expert's matrix in a checkpoint's per-expert layout, and transformers 5's fused 3-D stacks
PER_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>\w+)\.weight$")
FUSED = re.compile(r"^(?P<layer>.+\.experts)\.(?P<projection>gate_up_proj|down_proj)$")
ROUTER_GGUF = re.compile(r"^blk\.\d+\.ffn_gate_inp\.weight$")


def stays_f32(gguf_name: str) -> bool:
    """Whether llama.cpp's converter keeps this tensor in F32 whatever the file's type (the router)."""
    return bool(ROUTER_GGUF.match(gguf_name))


class ExpertStacks:
    """A layer's per-expert matrices, held until all ``count`` experts of a projection are in, then
    handed back as one (experts, out, in) stack named as the converter names it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pending: dict[str, dict[int, torch.Tensor]] = {}

    def take(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """None for a tensor that is not an expert's; else the stacks it completes (often none yet)."""
        if found := FUSED.match(key):
            if found["projection"] == "down_proj":
                return [(f"{found['layer']}.down_proj.weight", tensor)]
            gate, up = tensor.chunk(2, dim=1)  # gate rows first, as transformers' fused gate_up_proj
            return [(f"{found['layer']}.gate_proj.weight", gate), (f"{found['layer']}.up_proj.weight", up)]
        found = PER_EXPERT.match(key)
        if found is None:
            return None
        stacked = f"{found['layer']}.{found['projection']}.weight"  # the converter's merged name
        experts = self.pending.setdefault(stacked, {})
        experts[int(found["expert"])] = tensor
        if len(experts) < self.count:
            return []
        del self.pending[stacked]
        return [(stacked, torch.stack([experts[e] for e in range(self.count)]))]

    def finish(self) -> None:
        """Refuse a checkpoint with a layer whose experts did not all arrive (the converter's check)."""
        if self.pending:
            name, experts = next(iter(self.pending.items()))
            raise ExportError(
                f"export --to gguf: {name} has {len(experts)} of {self.count} experts in the merged folder"
            )


def expert_count(config) -> int:
    """How many experts each mixture layer of ``config`` holds (0: a dense model)."""
    entry = families.family(config.model_type)
    return getattr(config, entry.experts.count_key) if entry and entry.experts else 0


def write_parameters(writer, config, entry) -> None:
    """The expert hyperparameters the converter writes: TextModel's expert_count and expert_used_count
    (from the families table's count keys), and Qwen2MoeModel's expert_feed_forward_length where the
    experts' width is its own key (Mixtral's experts are intermediate_size wide, feed_forward_length)."""
    writer.add_expert_count(getattr(config, entry.experts.count_key))
    writer.add_expert_used_count(getattr(config, entry.experts.active_key))
    if getattr(config, "moe_intermediate_size", None) is not None:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
