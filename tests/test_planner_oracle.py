"""The planner against an oracle of its own: bytes computed by hand from the model's config.

The accuracy cases in test_planner.py compare the tracer with ``measure_saved_bytes``, and both count
through ``SavedTensors``: a counting bug would move both sides together. Here the expected bytes are
written out from the config's numbers (hidden size, heads, intermediate size, vocabulary), tensor by
tensor, for three Llama-shaped families and three policies; nothing of qlora_kit's counting is used.
"""

import pytest
from transformers import AutoConfig

from qlora_kit import Recipe
from qlora_kit.memory.planner import activation_bytes
from qlora_kit.memory.shapes import model_shape
from qlora_kit.model.builtin import ensure_tiny_model

pytestmark = pytest.mark.slow  # traces each family and policy: full suite only

BATCH, SEQ = 2, 32
N = BATCH * SEQ  # tokens
C = 2  # bfloat16 compute
RANK = 16


def hand_layer_bytes(cfg, dropout: bool, input_grad: bool) -> int:
    """One decoder layer kept whole: what autograd keeps for backward, tensor by tensor."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = hidden // heads
    norm = N * hidden * 4 + N * 4  # fp32 input and 1/rms, per RMSNorm
    norms = 2 * norm if input_grad else norm  # the first layer's input norm needs no input gradient
    # LoRA on all seven linears: the fp32 input (N x d_in x 4) and the A output (N x r x 4); dropout's
    # CPU mask (N x d_in x 4), not for q/k/v of a layer whose input needs no gradient
    d_ins = {"q": hidden, "k": hidden, "v": hidden, "o": hidden, "gate": hidden, "up": hidden, "down": inter}
    lora = sum(N * d * 4 + N * RANK * 4 for d in d_ins.values())
    if dropout:
        lora += sum(N * d * 4 for name, d in d_ins.items() if input_grad or name not in "qkv")
    attention = N * head_dim * (2 * heads + 2 * kv_heads) * C + N * heads * 4  # q, k, v, out; fp32 lse
    # rows padded to the longest (an attention mask, as every unpacked batch has): sdpa keeps the
    # attention probabilities and the additive mask too
    attention += BATCH * heads * SEQ * SEQ * C + BATCH * SEQ * SEQ * C
    mlp = 3 * N * inter * C  # gate, act(gate), up
    return norms + lora + attention + mlp


def hand_rope_bytes(cfg) -> int:
    return 2 * SEQ * (cfg.hidden_size // cfg.num_attention_heads) * C  # cos and sin, one row (no packing)


def hand_head_bytes(cfg) -> int:
    # final norm, fp32 log-probabilities over the vocabulary, the shifted int64 labels
    return N * (4 * cfg.hidden_size + 4) + N * cfg.vocab_size * 4 + N * 8


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
@pytest.mark.parametrize(("policy", "every_n"), [("none", 1), ("full", 1), ("every_n", 2)])
def test_traced_activations_equal_the_hand_count(arch, policy, every_n):
    cfg = AutoConfig.from_pretrained(ensure_tiny_model(arch))
    recipe = Recipe.from_dict(
        {
            "model": {"path": f"builtin:{arch}"},
            "memory": {"checkpointing": policy, "every_n": every_n, "chunked_loss": False},
            "lora": {"dropout": 0.05, "rank": RANK},
            "data": {"packing": False},
        }
    )
    got = activation_bytes(model_shape(recipe), recipe, policy, every_n, BATCH, SEQ, device="cpu")
    assert got.source == "traced"
    assert len(got.per_layer) == cfg.num_hidden_layers, "one figure per decoder layer"
    checkpointed = [
        policy == "full" or (policy == "every_n" and i % every_n == 0) for i in range(len(got.per_layer))
    ]
    # the rotary tables every layer shares are saved by the first layer that keeps its ops: layer 0
    # without checkpointing, layer 1 under every_n (layer 0 recomputes), none under full
    first_kept = checkpointed.index(False) if False in checkpointed else None
    for i, (nbytes, is_checkpointed) in enumerate(zip(got.per_layer, checkpointed, strict=True)):
        if is_checkpointed:
            expected = N * cfg.hidden_size * C  # a checkpointed layer keeps its input only
        else:
            expected = hand_layer_bytes(cfg, dropout=True, input_grad=policy != "none" or i > 0)
            expected += hand_rope_bytes(cfg) if i == first_kept else 0
        assert nbytes == expected, f"layer {i}: {nbytes} != {expected}"
    assert got.head == pytest.approx(hand_head_bytes(cfg), abs=8)  # (and the fp32 loss scalar)


def test_chunked_head_keeps_the_trained_positions_hidden_states_by_hand():
    cfg = AutoConfig.from_pretrained(ensure_tiny_model("tiny-llama"))
    recipe = Recipe.from_dict({"memory": {"checkpointing": "full", "chunked_loss": True}})
    got = activation_bytes(model_shape(recipe), recipe, "full", 1, BATCH, SEQ, device="cpu")
    trained = BATCH * (SEQ - 1)  # every position but the last predicts a token
    # final norm; the trained positions' hidden states and int64 labels; the boolean mask; no logits
    expected = N * (4 * cfg.hidden_size + 4) + trained * cfg.hidden_size * C + trained * 8 + trained
    assert got.head == expected
