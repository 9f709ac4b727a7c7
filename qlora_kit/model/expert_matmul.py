"""Model stage: the matmuls of a mixture's routed experts, for ``moe_experts.experts_forward``.

The batch's (token, slot) picks are sorted by expert once per layer (``route``), so each expert's rows are
consecutive. Each projection (the fused gate/up, then down) then runs over the sorted rows in one of two
ways, with the same results:

- ``looped`` (the CPU's path): one matmul per expert that has tokens, an idle expert costing nothing; a
  4-bit expert goes through bitsandbytes' ``matmul_4bit``, which dequantizes it for that matmul alone (and
  again in backward). Its states are gathered an expert at a time (``rows_per_expert``) and its down
  projection's rows added into the tokens' sums as they come (moe_experts.experts_forward): at 128 experts
  top-8 a (picks, hidden) tensor is 8 times the states, and on a CPU its fresh pages cost more than the
  copy into them;
- ``grouped`` (CUDA's path, where torch has a grouped GEMM): one grouped matmul over a run of experts
  (``torch._grouped_mm`` through transformers' dispatcher), the run's 4-bit weights dequantized in one
  bitsandbytes call, at most ``DEQUANTIZED_RUN_BYTES`` of them at a time, in forward and again in backward.

LoRA on the experts follows its projection: each expert's update is ``x @ A_e.T @ B_e.T`` on its rows, the
rank-r bottleneck, never ``B @ A``, scaled at the bottleneck (r values a row, not the output's). The loop
takes each expert's factors from one ``unbind`` of the stacked parameters, so backward writes the stacks'
gradients once, not once per expert (indexing the stack per expert cost a zeroed stack-sized gradient per
expert: quadratic in the experts).

What 128 experts top-8 cost beside 8 top-2 at the same active weights (benchmarks/moe.py --expert-counts):
four times the picks, which the loop never holds as (picks, hidden) tensors, and four times the stored
weights, each expert with tokens dequantized in forward and again in backward. On a CPU that second part
is what is left at a few hundred tokens a layer (bitsandbytes dequantizes about 10^9 values a second on one
core); on a GPU dequantizing is a pass over memory, and the grouped path removes the per-expert kernels.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import torch
from torch._subclasses.fake_tensor import FakeTensor
from transformers.integrations.moe import _grouped_mm  # torch's grouped GEMM where it runs, else a loop

# The most bytes of dense expert weights the grouped path dequantizes at once (a run of experts): the loop
# holds one expert's; a run of 256 MiB is ~40 of Qwen3-30B-A3B's gate/up experts, one of Mixtral's.
DEQUANTIZED_RUN_BYTES = 256 * 2**20


@dataclass
class FewExperts:
    """The planner's trace routes the picks to the first ``routed`` experts only, each with the rows it has
    in the even spread (``route``); ``capped``: some layer had more experts than that."""

    routed: int
    capped: bool = False


# Set by the planner's fake trace (memory/fake_forward.py, which extrapolates to every expert); None: all
FEW_EXPERTS: ContextVar[FewExperts | None] = ContextVar("few_experts", default=None)


@dataclass(frozen=True)
class Routing:
    """The picks of one layer in expert order: ``order`` (S,) indexes the flat (token x slot) picks,
    ``counts`` how many each expert got (its rows are consecutive), read to the host once a layer, and
    ``sizes`` the same on the picks' device: offsets made from it need no copy from the host, which from
    pageable memory waits for the GPU's queue to drain first (the launches then no longer run ahead)."""

    order: torch.Tensor
    counts: list[int]
    top_k: int
    sizes: torch.Tensor

    @property
    def routed(self) -> int:
        """Rows the experts compute (picks of an expert index past the stack, if any, are left out)."""
        return sum(self.counts)

    def offsets(self, first: int = 0, last: int | None = None) -> torch.Tensor:
        """grouped_mm's ``offs`` for experts first..last: each one's end row, from the run's first row."""
        return torch.cumsum(self.sizes[first:last], 0, dtype=torch.int32)


@torch.no_grad()
def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Sort the (T, K) picks by expert, stably (a token's slots keep their order).

    The planner traces the experts on fake tensors, which hold no routing: there the picks are spread
    evenly, as a long batch spreads them. What an expert keeps for backward grows linearly with its rows,
    plus a constant of its own (autocast's copies of its LoRA factors), and nothing for an expert with
    none. Under ``FEW_EXPERTS`` only the first few experts get their rows of that spread (the first also
    the remainder's), the other picks none: the trace's figures are then linear in the experts routed."""
    flat, k = top_k_index.reshape(-1), top_k_index.shape[-1]
    if isinstance(flat, FakeTensor):
        share, extra = divmod(flat.numel(), num_experts)
        counts = [share + (e < extra) for e in range(num_experts)]
        few = FEW_EXPERTS.get()
        if few is not None and share and few.routed < num_experts:
            few.capped = True
            counts = [share + extra] + [share] * (few.routed - 1) + [0] * (num_experts - few.routed)
        return Routing(torch.arange(flat.numel()), counts, k, torch.tensor(counts))
    sizes = torch.bincount(flat, minlength=num_experts)[:num_experts]
    # the layer's one host synchronisation: row slices (a run's, the loop's experts) need the counts in Python
    return Routing(flat.argsort(stable=True), sizes.tolist(), k, sizes)


def sum_over_slots(y: torch.Tensor, routing: Routing) -> torch.Tensor:
    """(T, H): each token's sum of its weighted picks' rows ``y`` (S, H, in expert order); the picks of an
    expert past the stack, last in that order and without a row, add nothing."""
    order, k = routing.order, routing.top_k
    if not y.is_cuda:  # one scatter into (T, H), no (S, H) copy, deterministic on the CPU
        sums = y.new_zeros(order.numel() // k, y.shape[1])
        return sums.index_put_((order[: y.shape[0]] // k,), y, accumulate=True)
    # CUDA: back to (token, slot) order and summed over the slots, as transformers' grouped_mm path does
    # (deterministic, where index_add_'s atomics with repeated tokens are not)
    unrouted = order.numel() - y.shape[0]
    if unrouted:
        y = torch.cat([y, y.new_zeros(unrouted, y.shape[1])])
    places = torch.empty_like(order)
    places[order] = torch.arange(order.numel(), device=order.device)
    return y[places].view(-1, k, y.shape[1]).sum(dim=1)


def looped(experts, name: str, x: torch.Tensor, routing: Routing, lora) -> torch.Tensor:
    """x @ W_e.T (+ each LoRA pair's scaling * x @ A_e.T @ B_e.T) over the sorted rows, expert by expert."""
    return torch.cat([y for _, y in each_expert(experts, name, x, routing, lora)])


def each_expert(experts, name: str, x, routing: Routing, lora):
    """(rows, y) for each expert with tokens, in expert order: ``rows`` the slice of the sorted rows it ran,
    ``y`` their projection (``looped`` concatenates them; the experts' sums scatter them as they come). ``x``:
    the sorted rows (S, in), or already one tensor per expert with tokens (``rows_per_expert``)."""
    weight = getattr(experts, name)
    stats = getattr(experts, f"{name}_4bit", None)
    # each expert's A_e (r, in) and B_e (out, r), views of the parameters (a contiguous copy of B would be one
    # more saved tensor of the stack's size a layer)
    active = [expert for expert, count in enumerate(routing.counts) if count]
    factors = [
        (per_expert(a, 0, active), per_expert(b, 2, active), scaling)
        for a, b, scaling in (lora or {}).get(name, ())
    ]
    # one split, whose backward is one concatenation (a slice per expert would zero an x-sized gradient each)
    pieces = x if isinstance(x, tuple) else x.split([routing.counts[expert] for expert in active])
    transposed, bias = getattr(experts, "is_transposed", False), bias_of(experts, name)
    start = 0
    for expert, rows in zip(active, pieces, strict=True):
        if stats is None:  # 16-bit: the planner's trace, or quant.bits 16 (gpt-oss stores (in, out))
            y = rows @ weight[expert] if transposed else torch.nn.functional.linear(rows, weight[expert])
        else:
            y = bnb.matmul_4bit(rows, weight[expert], quant_state=stats.state(expert))
        if bias is not None:  # gpt-oss: (E, out) biases, frozen in the compute dtype
            y = y + bias[expert].to(y.dtype)
        for a, b, scaling in factors:
            low = rows.to(a[expert].dtype) @ a[expert].t() * scaling  # (n, r): scaled at the bottleneck
            y = y + (low @ b[expert].t()).to(y.dtype)  # in the factors' dtype: B is not copied, nor saved
        yield slice(start, start + rows.shape[0]), y
        start += rows.shape[0]


def per_expert(stack: torch.Tensor, dim: int, active: list[int]):
    """Each expert's slice of a stack along ``dim``, indexed by expert: one ``unbind`` (why: the module's
    docstring). On the planner's fake tensors, where a few of hundreds of experts have rows (``route``),
    the slices of those alone: an unbind makes a fake tensor per expert, 15 ms for Qwen3-Next's 512, four
    times a layer, and a slice saves what an unbind's piece saves for backward (nothing)."""
    if isinstance(stack, FakeTensor) and len(active) < stack.shape[dim]:
        return {expert: stack.select(dim, expert) for expert in active}
    return stack.unbind(dim)


def rows_per_expert(states: torch.Tensor, tokens: torch.Tensor, routing: Routing) -> tuple:
    """The states' rows of each expert with tokens (``tokens``: the picks' tokens in expert order), one tensor
    an expert, for ``each_expert``."""
    sizes = [count for count in routing.counts if count]
    return GatherPerExpert.apply(states, tokens, sizes)


class GatherPerExpert(torch.autograd.Function):
    """``states[tokens]`` split by expert, gathered an expert at a time; backward adds each expert's gradient
    straight into the states' gradient: no (picks, hidden) tensor either way (why: the module's docstring).
    An expert's rows hold a token once, so each index_add_ is deterministic on CUDA too (a GPU below
    compute capability 8.0 runs the loop)."""

    @staticmethod
    def forward(ctx, states, tokens, sizes):
        ctx.save_for_backward(tokens)
        ctx.sizes, ctx.shape = sizes, states.shape
        return tuple(states.index_select(0, rows) for rows in tokens.split(sizes))

    @staticmethod
    def backward(ctx, *grads):
        (tokens,) = ctx.saved_tensors
        grad = None
        for rows, piece in zip(tokens.split(ctx.sizes), grads, strict=True):
            if piece is not None:
                grad = piece.new_zeros(ctx.shape) if grad is None else grad
                grad.index_add_(0, rows, piece)
        return grad, None, None


def grouped(experts, name: str, x: torch.Tensor, routing: Routing, lora) -> torch.Tensor:
    """``looped``'s result with grouped matmuls: the base weights a run of experts at a time, each LoRA
    factor over all experts at once."""
    weight = getattr(experts, name)
    stats = getattr(experts, f"{name}_4bit", None)
    offsets = routing.offsets()
    if stats is None:  # 16-bit: (E, out, in), or gpt-oss's (E, in, out) already as grouped_mm takes it
        transposed = getattr(experts, "is_transposed", False)
        y = _grouped_mm(x, weight if transposed else weight.transpose(-2, -1), offs=offsets)
    else:
        y = GroupedMatmul4bit.apply(x, weight, stats, routing)
    bias = bias_of(experts, name)
    if bias is not None:  # gpt-oss: each row gets its expert's bias
        experts_of_rows = torch.repeat_interleave(
            torch.arange(len(routing.counts), device=x.device), routing.sizes, output_size=routing.routed
        )
        y = y + bias[experts_of_rows].to(y.dtype)
    device = x.device.type
    for a, b, scaling in (lora or {}).get(name, ()):
        # grouped_mm has no autocast rule: the factors go in autocast's dtype, as the loop's matmuls do
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else a.dtype
        low = _grouped_mm(x, a.transpose(1, 2).to(dtype), offs=offsets)  # (S, r)
        up = _grouped_mm(low, b.permute(2, 1, 0).to(dtype).contiguous(), offs=offsets)  # (S, out)
        y = y + (up * scaling).to(y.dtype)
    return y


def bias_of(experts, name: str) -> torch.Tensor | None:
    """The (E, out) bias of a fused weight (gpt-oss's experts carry one), or None."""
    return getattr(experts, f"{name}_bias") if getattr(experts, "has_bias", False) else None


class GroupedMatmul4bit(torch.autograd.Function):
    """x @ W_e.T over the sorted rows for a packed 4-bit stack; backward gives x's gradient only (the
    weights are frozen), dequantizing again rather than keeping the 16-bit weights, as bitsandbytes'
    MatMul4Bit does for one matrix."""

    @staticmethod
    def forward(ctx, x, packed, stats, routing):
        ctx.stats, ctx.routing, ctx.x_dtype = stats, routing, x.dtype
        ctx.save_for_backward(packed)
        return _run_matmuls(x, packed, stats, routing, transpose=True)

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        grad_x = _run_matmuls(grad, packed, ctx.stats, ctx.routing, transpose=False)
        return grad_x.to(ctx.x_dtype), None, None, None


def _run_matmuls(x, packed, stats, routing: Routing, transpose: bool) -> torch.Tensor:
    """Over runs of consecutive experts with tokens: dequantize the run, one grouped matmul on its rows."""
    _, d_out, d_in = stats.shape
    width = d_out if transpose else d_in
    out = x.new_empty(x.shape[0], width, dtype=stats.dtype)
    row, counts = 0, routing.counts
    for first, last in expert_runs(counts, d_out * d_in * stats.dtype.itemsize):
        rows = sum(counts[first:last])
        dense = dequantize_run(packed, stats, first, last)  # (n, d_out, d_in)
        offsets = routing.offsets(first, last)
        weight = dense.transpose(-2, -1) if transpose else dense
        out[row : row + rows] = _grouped_mm(x[row : row + rows], weight, offs=offsets)
        row += rows
    return out


def expert_runs(counts: list[int], expert_bytes: int) -> list[tuple[int, int]]:
    """(first, last) ranges of experts, each within one window of at most DEQUANTIZED_RUN_BYTES of dense
    weights (one expert at least), trimmed to its first and last expert with tokens; a window without
    tokens is left out. An idle expert between two busy ones is dequantized with them: one call a window,
    however the tokens fall, costs less on a GPU than a call for each gap (an expert's dequantization is a
    pass over a few MiB, a launch ~5 us), and keeps the number of calls independent of the routing."""
    per_run = max(1, DEQUANTIZED_RUN_BYTES // expert_bytes)
    runs = []
    for start in range(0, len(counts), per_run):
        busy = [e for e in range(start, min(start + per_run, len(counts))) if counts[e]]
        if busy:
            runs.append((busy[0], busy[-1] + 1))
    return runs


def dequantize_run(packed: torch.Tensor, stats, first: int, last: int) -> torch.Tensor:
    """Experts first..last of a packed stack as (n, out, in) in the compute dtype, in one bitsandbytes call
    (the stack's experts are consecutive in memory, each a whole number of 64-value blocks)."""
    n, (_, d_out, d_in) = last - first, stats.shape
    # nested: each expert's 8-bit absmax, with its own second-level statistics and offset
    absmax = _nested_absmax(stats, first, last) if stats.nested else stats.absmax[first:last]
    state = bnbf.QuantState(
        absmax=absmax.reshape(-1),
        shape=(n * d_out, d_in),
        code=stats.code,
        blocksize=stats.blocksize,
        quant_type=stats.quant_type,
        dtype=stats.dtype,
    )
    return bnbf.dequantize_4bit(packed[first:last].reshape(-1), state).view(n, d_out, d_in)


def _nested_absmax(stats, first: int, last: int) -> torch.Tensor:
    """(n, blocks) float absmax of experts first..last, for any number of them in a fixed number of operations.

    Each expert's 8-bit absmax was quantized on its own (its own second-level blocks from its first value),
    so one bitsandbytes call over the run's flat absmax lines up only when an expert's blocks fill whole
    second-level blocks; bitsandbytes' blockwise dequantization is ``code[q] * absmax2[block]``, written
    here over the (expert, block) grid instead (exact: the same product in float32)."""
    quantized = stats.absmax[first:last]  # (n, blocks) uint8
    scales = stats.absmax2[first:last].repeat_interleave(stats.blocksize2, dim=1)[:, : quantized.shape[1]]
    return stats.code2[quantized.long()] * scales + stats.offset[first:last, None]
