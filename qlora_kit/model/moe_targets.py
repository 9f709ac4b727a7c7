"""Model stage: what peft's LoraConfig targets on a mixture of experts (model/adapters.py reads it).

all-linear is spelled out as the model's linear layers' names, less those LoRA cannot adapt there, and the
experts come as peft's target_parameters, run in low-rank form by moe_experts.LoraExperts (docs/moe.md).
"""

from __future__ import annotations

import re

import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import _check_lora_target_modules_mamba

from qlora_kit.errors import RecipeError
from qlora_kit.model import moe_flat
from qlora_kit.model.layers import features, is_linear
from qlora_kit.model.moe_experts import LoraExperts, experts_of, fused_experts, stacks_of


def lora_targets(model, target_modules, experts: bool, router: bool = False) -> dict:
    """peft LoraConfig arguments for a mixture-of-experts ``model`` ({} for a dense one).

    On transformers 5 MoE models peft rewrites a string target_modules ("all-linear") for checkpoints of
    transformers 4 (peft's utils/transformers_weight_conversion): it adds the router (``gate.weight``) and
    the fused experts, at twice the rank. The router stays frozen here, so all-linear is spelled out as
    the linear layers' names, and the experts come as target_parameters when ``experts`` is on; with
    ``router`` each layer's router trains whole (peft's modules_to_save)."""
    modules = fused_experts(model)
    if not modules:
        return flat_lora_targets(model, target_modules, experts, router)
    model_type, facet = experts_of(model)
    if target_modules == "all-linear":
        target_modules = all_linear_names(model)
    arguments = {"target_modules": target_modules}
    if experts:
        # each stack where it was found, relative to its decoder layer (mlp.experts, feed_forward.experts, ...)
        arguments["target_parameters"] = sorted(
            {f"{LAYER_PREFIX.sub('', where)}.{name}" for where, m in modules for name in stacks_of(m)}
        )
        arguments["custom"] = {type(m): LoraExperts for _, m in modules}
    if router:  # trained whole: peft keeps a trainable copy and saves it in the adapter
        if facet is None or facet.router is None:
            raise RecipeError(f"lora.router: {model_type}'s router is not in qlora_kit's families table")
        arguments["modules_to_save"] = [facet.router]
    return arguments


def flat_lora_targets(model, target_modules, experts: bool, router: bool) -> dict:
    """lora_targets for a mixture whose experts are flat 2-D stacks (moe_flat.py; {} for a dense model):
    the stacks as peft's target_parameters, in peft's own 2-D form (plain peft reloads them)."""
    blocks = moe_flat.flat_experts(model)
    if not blocks:
        return {}
    if router:
        raise RecipeError(
            f"lora.router: {model.config.model_type}'s router is not in qlora_kit's families table"
        )
    arguments = {"target_modules": target_modules}
    if experts:
        arguments["target_parameters"] = sorted(
            {
                f"{LAYER_PREFIX.sub('', where)}.{layout.holder}.{stack}"
                for where, _, layout in blocks
                for stack in moe_flat.stack_names(layout)
            }
        )
        holders = {type(moe_flat.holder_of(block, layout)) for _, block, layout in blocks}
        arguments["custom"] = dict.fromkeys(holders, moe_flat.LoraFlatExperts)
    return arguments


def all_linear_names(model) -> list[str]:
    """all-linear on a mixture, spelled out as leaf names: every linear layer but the output head, a linear
    subclass of the model's code with a forward of its own (PhiMoE's router returns logits, weights and picks, DeepSeek-V4's
    grouped output projection runs per group: LoRA adds x A^T B^T to nn.Linear's output, which these are
    not), a router that is a linear layer, and the linears of a sparse-attention indexer (DeepSeek-V3.2's, GLM-5's): they only choose which
    keys attend, through a top-k no gradient crosses, so LoRA there would never train."""
    output = model.get_output_embeddings()
    # a router that is a linear layer (Hunyuan's gate.wg): the one linear of a module in the experts' block,
    # one output per expert; routers stay frozen (lora.router trains one whole)
    blocks = {name.rpartition(".")[0]: getattr(m, "num_experts", None) for name, m in fused_experts(model)}
    kept, left_out = set(), set()
    for name, module in model.named_modules():
        if not is_linear(module) or module is output:
            continue
        leaf = name.rsplit(".", 1)[-1]
        # (bitsandbytes' Linear4bit has a forward of its own too, and is a linear layer)
        own_forward = type(module).__module__.startswith("transformers.models.") and (
            type(module).forward is not torch.nn.Linear.forward
        )
        block = next((b for b in blocks if name.startswith(f"{b}.")), None)
        parent = name.rpartition(".")[0]
        router = (  # the one linear of a module of the block (a shared expert's MLP holds three)
            block is not None
            and parent != block
            and features(module)[1] == blocks[block]
            and sum(map(is_linear, model.get_submodule(parent).children())) == 1
        )
        refused = peft_refuses(model, leaf)
        (left_out if own_forward or router or refused or ".indexer." in f".{name}." else kept).add(leaf)
    return sorted(kept - left_out)


def peft_refuses(model, leaf: str) -> bool:
    """peft refuses LoRA on this layer name for this model (a Mamba mixer's out_proj on Nemotron-H), by its
    own check (tuners_utils._check_lora_target_modules_mamba), which raises at get_peft_model."""
    try:
        _check_lora_target_modules_mamba(LoraConfig(), model, leaf)
    except ValueError:
        return True
    return False


LAYER_PREFIX = re.compile(r"^.*?\.\d+\.")  # model.layers.3. (a decoder layer's path, up to its index)
