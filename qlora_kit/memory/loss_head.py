"""The chunked, recomputed loss head: ``lm_head`` + cross-entropy without ever keeping full logits.

After gradient checkpointing, the loss head is the largest activation left: transformers computes
(batch, seq, vocab) logits, upcasts them to fp32 and keeps the log-probabilities for backward
(Llama-3's 128,256-token vocabulary: ~1 GB per 2,048-token sequence). Here the decoder runs without
its head; only positions whose next-token label is trained are kept (completion-only training skips
most of the prompt); and those go through the head in chunks of ``memory.loss_chunk_tokens``, each
chunk under torch's non-reentrant checkpoint: forward keeps only the chunk's hidden states, backward
recomputes the chunk's logits, so one chunk of logits exists at a time.

The forward pass still runs through the model's own forward (with an identity in place of the head),
so wrappers such as DDP see it and all-reduce the gradients.

On a GPU the Trainer runs the forward pass under accelerate's autocast and converts its outputs to
fp32 on the way out, while ``compute_loss`` runs outside autocast. So the hidden states come back in
fp32 next to a bf16 head: they are cast back to the head's dtype before they are kept (fp32 copies
would double what the head keeps), and the chunks run under the same autocast as the forward pass
(``autocast``, the Trainer's ``accelerator.autocast``), which makes the loss equal transformers' own
under autocast.

Nothing in transformers, peft or PyTorch does this on every device: Liger's and Apple's
cut-cross-entropy fused kernels are CUDA/Triton only. So Liger-Kernel's fused linear cross-entropy runs
the head where it can (CUDA, ``liger_kernel`` installed, a plain linear head: ``fused_loss``), and this
plain PyTorch (about twenty lines) everywhere else: any output head module, LoRA on ``lm_head`` included.
Both work with packing and under gradient accumulation: the sum of token losses is divided by the
Trainer's ``num_items_in_batch`` exactly as transformers' ``ForCausalLMLoss`` divides it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from qlora_kit.registries import objectives
from qlora_kit.registries.formats import IGNORE_INDEX

# Config fields of models whose head does more than lm_head(hidden): those keep transformers' loss.
UNSUPPORTED_HEAD_FIELDS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def has_plain_head(config) -> bool:
    """Whether the model's head is lm_head(hidden) alone (Gemma-2's logit soft-capping, for one, is not)."""
    text = config.get_text_config()
    return all(getattr(text, name, None) in (None, 1, 1.0) for name in UNSUPPORTED_HEAD_FIELDS)


def uses_chunked_loss(recipe, config) -> bool:
    """Whether a run of ``recipe`` on a model of ``config`` trains with the chunked head (training/objective_trainer.py
    decides the same way): asked for, SFT (TRL's DPO and GRPO heads keep no whole logits already), and a
    plain head."""
    return recipe.memory.chunked_loss and objectives.of(recipe).chunked_head and has_plain_head(config)


def final_hidden_states(model, model_inputs: dict[str, Any], causal_lm) -> torch.Tensor:
    """The model's forward pass with an identity in place of its head: (B, T, H) final hidden states."""
    return headless_forward(model, model_inputs, causal_lm).logits


def headless_forward(model, model_inputs: dict[str, Any], causal_lm):
    """The model's output with an identity in place of its head: its ``logits`` are the final hidden
    states (and a mixture of experts' ``aux_loss`` is there as the model computed it)."""
    head = causal_lm.get_output_embeddings()
    # For the forward pass the head is an identity, so the model returns its final hidden states where
    # it would return logits; the real head is then applied chunk by chunk.
    causal_lm.set_output_embeddings(torch.nn.Identity())
    try:
        return model(**model_inputs, use_cache=False)
    finally:
        causal_lm.set_output_embeddings(head)


def chunked_lm_loss(
    model,
    inputs: dict[str, Any],
    chunk_tokens: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    causal_lm=None,
    autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext,
) -> torch.Tensor:
    """Next-token cross-entropy of ``model`` on ``inputs`` (with labels), computed chunk by chunk.

    ``model`` is what the forward pass runs through (the peft model, or its DDP wrapper, whose forward
    must run for gradients to be all-reduced); ``causal_lm`` the transformers model inside it;
    ``autocast`` the mixed-precision context the forward pass ran under.
    """
    causal_lm = causal_lm if causal_lm is not None else model.get_base_model()
    labels = inputs["labels"]
    model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
    head = causal_lm.get_output_embeddings()
    outputs = headless_forward(model, model_inputs, causal_lm)
    hidden = outputs.logits  # (B, T, H)
    targets = labels[:, 1:]  # (B, T-1): position t predicts token t + 1
    trained = targets != IGNORE_INDEX
    # (n, H): only positions whose next token is trained, in the head's dtype (a lossless cast back when
    # accelerate converted bf16 outputs to fp32). The head's host syncs, once a step whatever the chunk
    # count: on CUDA the first selection waits for the forward pass (the count of trained positions sizes
    # the chunks), the second finds the queue drained already
    kept_hidden = hidden[:, :-1][trained].to(head.weight.dtype)
    kept_targets = targets[trained]  # (n,)
    fused = fused_loss(head, kept_hidden) if kept_targets.numel() else None
    with autocast():  # torch's checkpoint records it and recomputes each chunk under it
        if fused is not None:  # Liger's kernel chunks the head itself and keeps no logits either
            total = fused(head.weight, kept_hidden, kept_targets, head.bias)
        else:
            total = _chunks_loss(head, kept_hidden, kept_targets, chunk_tokens)
    denominator = num_items_in_batch if num_items_in_batch is not None else max(kept_targets.numel(), 1)
    loss = total / denominator
    aux = getattr(outputs, "aux_loss", None)
    if aux is not None:  # a mixture of experts' load balancing, added as transformers adds it with labels
        loss = loss + causal_lm.config.router_aux_loss_coef * aux.to(loss.device)
    return loss


def fused_loss(head: torch.nn.Module, hidden: torch.Tensor) -> Callable | None:
    """Liger-Kernel's fused linear cross-entropy (summed over positions) where it runs: ``liger_kernel``
    installed (the ``liger`` extra), a CUDA device (its kernels are Triton's) and a head that is one plain
    ``nn.Linear`` (it takes the weight alone: LoRA on ``lm_head`` or a 4-bit head run ours). None elsewhere."""
    if hidden.device.type != "cuda" or type(head) is not torch.nn.Linear:
        return None
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:  # not installed, or no Triton
        return None
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")


def _chunks_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int):
    """The summed loss of (n, H) ``hidden`` against (n,) ``targets``, ``chunk_tokens`` positions at a time."""
    # The chunks are views from one split, whose backward joins their gradients once; slicing chunk by
    # chunk would give each chunk's gradient the size of all n positions and add them up, once per chunk
    chunks = zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True)
    losses = [checkpoint(_chunk_loss, head, h, t, use_reentrant=False) for h, t in chunks]
    # one sum of the chunks' losses, not an addition per chunk; with no position trained the split's one
    # empty chunk gives a zero that keeps the head in the graph
    return torch.stack(losses).sum()


def _chunk_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # (chunk, V), as transformers upcasts before its loss
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
