"""The attention kernel a CUDA run picks, run in the planner's trace (which runs on the CPU).

What attention keeps for backward is the kernel's choice, and the kernel is the device's: on the CPU,
``scaled_dot_product_attention`` picks the CPU's fused kernel or its math fallback by what the CPU build
supports; on CUDA it picks FlashAttention when there is no mask and the values are 16-bit (keeping q, k
and v unrepeated, the output and a float32 log-sum-exp per row), else the memory-efficient kernel
(keeping the same plus the mask as an additive bias in the query's dtype). Both have meta kernels, so a
plan for CUDA calls them on the trace's fake CPU tensors directly (``cuda_attention``), as torch's CUDA
dispatcher would (``sdp_utils``: flash first, then memory-efficient, then math), and never depends on
what this machine's CPU would pick. Each call's choice is recorded, so ``qlora-kit plan`` says what
it assumed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

FLASH = "flash (CUDA: q, k, v, output, log-sum-exp)"
EFFICIENT = "memory-efficient (CUDA: q, k, v, the mask as a bias, output, log-sum-exp)"
HALF = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def cuda_attention(picked: set[str]):
    """Within the block, ``F.scaled_dot_product_attention`` runs the kernel CUDA would pick (its meta
    kernel, on fake tensors) and adds that kernel's name to ``picked``. transformers looks the function
    up at each call, so replacing the module's attribute reaches it."""
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        name, output = _as_cuda(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        picked.add(name)
        return output

    F.scaled_dot_product_attention = sdpa
    try:
        yield picked
    finally:
        F.scaled_dot_product_attention = original


def _as_cuda(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa):
    if torch.is_autocast_enabled(
        "cpu"
    ):  # sdpa is on CUDA autocast's 16-bit list: the trace's autocast's dtype
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(dtype) for t in (query, key, value))
    head_dim = query.shape[-1]
    if mask is None and query.dtype in HALF and head_dim <= 256:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )
        return FLASH, out[0]
    if enable_gqa and key.shape[-3] != query.shape[-3]:  # the memory-efficient kernel takes equal heads
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    if mask is not None and mask.dtype == torch.bool:  # as CUDA's sdpa turns a boolean mask into a bias
        mask = torch.where(mask, torch.zeros((), dtype=query.dtype), float("-inf")).to(query.dtype)
    if mask is not None:
        mask = mask.expand(*query.shape[:-1], key.shape[-2])
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, mask, True, dropout_p, is_causal, scale=scale
    )
    return EFFICIENT, out[0]
