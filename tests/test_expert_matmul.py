"""The two ways the routed experts run their matmuls (model/expert_matmul.py): the loop (the CPU's path) and
grouped matmuls (CUDA's path: torch's grouped GEMM, whose CPU kernel runs it here) each give the outputs and
gradients of an independent reference (the weights dequantized by a few lines of plain torch, every product
in float64), on 4-bit and 16-bit experts with LoRA on them, with an idle expert and uneven loads."""

from __future__ import annotations

import collections

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from qlora_kit import Recipe
from qlora_kit.model import adapters, bnb_selftest, expert_matmul, moe_experts

from .probes import OperatorCount

EXPERTS, TOP_K, HIDDEN, WIDTH, RANK, TOKENS = 6, 2, 64, 64, 4, 20
# Each path computes in float32 what the reference computes in float64. Every value is a chain of float32 sums
# of products: the gate/up projection (HIDDEN terms, + RANK for LoRA), the down projection (2 * WIDTH at
# most, + RANK), the sum over a token's TOP_K picks, and in backward the sums over the picks' rows of each
# expert (TOKENS * TOP_K at most); the weights' own float32 rounding adds one more. A sum of n products in
# float32 is within n * eps of the sum of their magnitudes (Higham's bound), which these small random
# matrices keep of the order of the largest output: so each result is within (the chain's terms) * eps of
# max |reference|. A wrong 4-bit block scale is off by a fraction of the weights: 0.3% of the outputs.
CHAIN = HIDDEN + 2 * 48 + 2 * RANK + TOP_K + TOKENS * TOP_K + 1  # widths 48 and 64 are tested
TOLERANCE = CHAIN * torch.finfo(torch.float32).eps  # ~2.4e-5 of max |reference|


def tiny_experts(bits: int, family: str = "qwen3_moe", width: int = WIDTH):
    """One layer's experts module (fp32), packed in 4 bits with double quantization or not: Qwen3-MoE's, or
    gpt-oss's (stored transposed, (experts, in, out), with a bias per expert, here random and nonzero)."""
    shape = {"vocab_size": 64, "hidden_size": HIDDEN, "num_experts_per_tok": TOP_K, "num_hidden_layers": 1}
    shape |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
    if family == "gpt_oss":
        config = transformers.GptOssConfig(intermediate_size=width, num_local_experts=EXPERTS, **shape)
    else:
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=width, num_experts=EXPERTS, **shape)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            if hasattr(experts, name):
                getattr(experts, name).normal_(0, 0.5)
    if bits == 4:
        assert moe_experts.quantize_experts(model, torch.float32, "nf4", double_quant=True) == 1
        assert bnb_selftest.guard(model).ok  # as loading.load_base_model does after packing
    return model.model.layers[0].mlp.experts


def dense_weights(experts, name: str) -> torch.Tensor:
    """(E, out, in) float64 weights of one stack: unpacked by plain torch (bnb_selftest.reference_dequantize),
    not by bitsandbytes, or the 16-bit stack itself."""
    stats = getattr(experts, f"{name}_4bit", None)
    if stats is None:
        weight = getattr(experts, name).detach().double()
        return weight.transpose(1, 2) if getattr(experts, "is_transposed", False) else weight
    packed = getattr(experts, name)
    return torch.stack(
        [bnb_selftest.reference_dequantize(packed[e], stats.state(e)) for e in range(stats.shape[0])]
    )


def reference_step(experts, states, index, weights, lora):
    """routed_step's output and gradients in float64, token by token and pick by pick: each pick's expert
    projects the token (its LoRA pairs added), the gate applied, the down projection weighted and summed."""
    dense = {name: dense_weights(experts, name) for name in moe_experts.stacks_of(experts)}
    states = states.double().requires_grad_()
    lora = {
        n: [
            (a.detach().double().requires_grad_(), b.detach().double().requires_grad_(), s)
            for a, b, s in pairs
        ]
        for n, pairs in lora.items()
    }

    def project(name, x, e):
        y = x @ dense[name][e].T
        if getattr(experts, "has_bias", False):
            y = y + getattr(experts, f"{name}_bias")[e].double()
        for a, b, scaling in lora.get(name, ()):
            y = y + (x @ a[e].T) @ b[:, :, e].T * scaling
        return y

    rows = []
    for token in range(states.shape[0]):
        picks = [
            weights[token, k].double()
            * project(
                "down_proj",
                experts._apply_gate(project("gate_up_proj", states[token], int(index[token, k]))),
                int(index[token, k]),
            )
            for k in range(index.shape[1])
        ]
        rows.append(torch.stack(picks).sum(0))
    out = torch.stack(rows)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape))
    return out.detach(), [states.grad] + [
        p.grad for pairs in lora.values() for a, b, _ in pairs for p in (a, b)
    ]


def assert_matches_reference(results, reference):
    """Each of a path's output and gradients within TOLERANCE of max |reference| (see TOLERANCE)."""
    for got, expected in zip(results, reference, strict=True):
        scale = expected.abs().max()
        assert scale > 0 and (got.double() - expected).abs().max() <= TOLERANCE * scale


def lora_factors(generator, width: int = WIDTH):
    """{parameter: [(A (E, r, in), B (out, r, E), scaling)]}, peft's layout, as LoraExperts passes them."""
    factors = {}
    for name, (d_out, d_in) in {"gate_up_proj": (2 * width, HIDDEN), "down_proj": (HIDDEN, width)}.items():
        a = torch.randn(EXPERTS * RANK, d_in, generator=generator).reshape(EXPERTS, RANK, d_in)
        b = torch.randn(d_out, RANK * EXPERTS, generator=generator).reshape(d_out, RANK, EXPERTS)
        factors[name] = [(a.requires_grad_(), b.requires_grad_(), 0.5)]
    return factors


def routed_step(experts, path: str, states, index, weights, lora):
    experts.matmul_path = path
    states = states.clone().requires_grad_()
    out = moe_experts.experts_forward(experts, states, index, weights, lora=lora)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    grads = [states.grad] + [p.grad for pairs in lora.values() for a, b, _ in pairs for p in (a, b)]
    result = out.detach(), [g.clone() for g in grads]
    for pairs in lora.values():
        for a, b, _ in pairs:
            a.grad = b.grad = None
    return result


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("bits", [4, 16])
def test_grouped_matmuls_give_the_loops_outputs_and_gradients(bits, family):
    """Expert 3 gets no token, the others uneven loads: the grouped path (runs of consecutive experts with
    tokens, dequantized a run at a time) computes what the loop computes, forward and backward; gpt-oss's
    transposed, biased stacks too."""
    experts = tiny_experts(bits, family)
    generator = torch.Generator().manual_seed(1)
    tokens = TOKENS
    states = torch.randn(tokens, HIDDEN, generator=generator)
    choices = torch.tensor([0, 1, 2, 4, 5, 5, 0, 0])  # expert 3 idle; 0 and 5 the busiest
    index = torch.stack([choices[torch.arange(tokens) % 8], choices[(torch.arange(tokens) + 3) % 8]], 1)
    index[index[:, 0] == index[:, 1], 1] = 1  # a token's two picks differ, as top-k's do
    weights = torch.rand(tokens, TOP_K, generator=generator)
    lora = lora_factors(generator)
    looped_out, looped_grads = routed_step(experts, "looped", states, index, weights, lora)
    grouped_out, grouped_grads = routed_step(experts, "grouped", states, index, weights, lora)
    reference_out, reference_grads = reference_step(experts, states, index, weights, lora)
    assert_matches_reference([looped_out, *looped_grads], [reference_out, *reference_grads])
    assert_matches_reference([grouped_out, *grouped_grads], [reference_out, *reference_grads])
    for grads in (looped_grads, grouped_grads):
        a_grad = grads[1]  # gate_up's A, (E, r, in)
        assert a_grad[3].abs().max() == 0 and a_grad[0].abs().max() > 0


def test_runs_are_byte_windows_trimmed_to_their_experts_with_tokens(monkeypatch):
    """The grouped path dequantizes a window of at most DEQUANTIZED_RUN_BYTES (one expert at least) in one
    call, trimmed to its first and last expert with tokens, an idle one between them included: the number of
    calls does not follow the routing; a window without tokens is skipped."""
    monkeypatch.setattr(expert_matmul, "DEQUANTIZED_RUN_BYTES", 300)
    assert expert_matmul.expert_runs([2, 1, 0, 3, 4, 5, 0], expert_bytes=100) == [(0, 2), (3, 6)]
    assert expert_matmul.expert_runs([2, 0, 1, 1, 0], expert_bytes=100) == [(0, 3), (3, 4)]
    assert expert_matmul.expert_runs([0, 0, 0, 1], expert_bytes=100) == [(3, 4)]
    assert expert_matmul.expert_runs([1, 1], expert_bytes=1000) == [(0, 1), (1, 2)]


def test_the_auto_path_is_the_loop_on_the_cpu():
    experts = tiny_experts(4)
    assert not moe_experts.grouped_mm_runs(torch.zeros(1))
    with pytest.raises(ValueError, match="matmul path"):
        moe_experts.set_matmul_path(experts, "fast")


class OutputShapes(TorchDispatchMode):
    """Every shape an aten op returns while the mode is on."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.shapes.add(tuple(tensor.shape))
        return out


@pytest.mark.parametrize("bits", [4, 16])
def test_the_loop_makes_no_tensor_of_every_pick_by_the_hidden_size(bits):
    """At 128 experts top-8 a (picks, hidden) tensor is 8 times the states, and on a CPU its fresh pages cost
    more than the copy into them: the loop gathers each expert's states for it and adds each expert's rows
    into the tokens' sums, forward and backward (LoRA on the experts too), with the grouped path's outputs."""
    experts = tiny_experts(bits, width=48)  # not a whole number of 64-value blocks a row: bnb_selftest.py
    generator = torch.Generator().manual_seed(3)
    tokens = TOKENS
    states = torch.randn(tokens, HIDDEN, generator=generator)
    index = torch.stack([torch.arange(tokens) % EXPERTS, (torch.arange(tokens) + 1) % EXPERTS], 1)
    weights = torch.rand(tokens, TOP_K, generator=generator)
    lora = lora_factors(generator, width=48)
    with OutputShapes() as seen:
        looped_out, looped_grads = routed_step(experts, "looped", states, index, weights, lora)
    assert (tokens * TOP_K, HIDDEN) not in seen.shapes and (tokens, HIDDEN) in seen.shapes
    grouped_out, grouped_grads = routed_step(experts, "grouped", states, index, weights, lora)
    reference = reference_step(experts, states, index, weights, lora)
    assert_matches_reference([looped_out, *looped_grads], [reference[0], *reference[1]])
    assert_matches_reference([grouped_out, *grouped_grads], [reference[0], *reference[1]])


def mixture_block(experts: int, top_k: int, bits: int, family: str = "qwen3_moe"):
    """One mixture block (router, experts, LoRA r=8 on every expert through LoraExperts and on a shared
    expert's linears), at equal active weights for any expert count: 384 intermediate values a token, over
    top_k experts; each expert's absmax fills no whole second-level block (the alignment the stacked
    statistics must not need). Qwen3-MoE's, or DeepSeek-V3's (a shared expert beside the routed ones, grouped
    routing; its own decorated experts class)."""
    shape = {"vocab_size": 64, "hidden_size": HIDDEN, "num_hidden_layers": 1, "num_attention_heads": 2}
    shape |= {"num_experts_per_tok": top_k, "moe_intermediate_size": 384 // top_k}
    if family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **shape,
            num_key_value_heads=2,
            n_routed_experts=experts,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
    else:
        config = transformers.Qwen3MoeConfig(**shape, num_key_value_heads=1, head_dim=32, num_experts=experts)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if bits == 4:
        moe_experts.quantize_experts(model, torch.float32, "nf4", double_quant=True)
    lora = Recipe.from_dict({"lora": {"dropout": 0.0, "rank": 8}}).lora
    peft_model = adapters.attach_lora(model, lora).train()  # shared experts' LoRA kept (peft#3711)
    return peft_model.base_model.model.model.layers[0].mlp


def block_operators(block, states) -> collections.Counter:
    states = states.detach().requires_grad_()
    with OperatorCount() as count:
        out = block(states)
        (out[0] if isinstance(out, tuple) else out).square().mean().backward()
    return count.ops


@pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"),
    reason="torch before 2.8 has no grouped GEMM: runs there take the loop (moe_experts.grouped_mm_runs)",
)
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("bits", [4, 16])
def test_a_grouped_mixture_step_dispatches_as_many_operators_at_8_64_and_128_experts(bits, family):
    """Forward + backward of one mixture block on the grouped path (CUDA's, here on torch's CPU grouped GEMM)
    at equal active weights: the same operators at 8 experts top-2, 64 and 128 top-8 (every expert with
    tokens), so no Python loop, dequantization call or index operation per expert is left, and nothing is
    copied from the host; the loop, for contrast, grows."""
    states = torch.randn(1, 512, HIDDEN, generator=torch.Generator().manual_seed(0))
    counts = {}
    for experts, top_k in ((8, 2), (64, 8), (128, 8)):
        block = mixture_block(experts, top_k, bits, family)
        moe_experts.set_matmul_path(block, "grouped")
        counts[experts] = block_operators(block, states)
    assert counts[8]["aten._grouped_mm"] > 0
    # no tensor made from host values (offsets from a Python list): on CUDA a copy from pageable memory
    # waits for the queue to drain, so the launches stop running ahead; one read of the counts a layer stays
    assert counts[128]["aten.lift_fresh"] == 0 and counts[128]["aten._local_scalar_dense"] == 0
    assert counts[64] == counts[8] and counts[128] == counts[8], {
        op: [counts[e][op] for e in counts] for op in counts[128] if counts[128][op] != counts[8][op]
    }
    moe_experts.set_matmul_path(block, "looped")
    assert sum(block_operators(block, states).values()) > 2 * sum(counts[128].values())
