"""Each architecture's GGUF form: what llama.cpp's ``convert_hf_to_gguf.py`` does for it, repeated.

Per family (transformers' ``model_type``), the families table (registries/families.py) holds gguf's
architecture and the few tensor transforms the converter's ``modify_tensors`` applies (Llama's Q/K row
permutation, GPT-2's Conv1D weights transposed to (out, in), Gemma's norms stored as 1 + w, tensors
llama.cpp never reads dropped); here are the metadata writers (the converter's ``set_gguf_parameters``)
and the checks the table names, and the transforms applied. A family whose model llama.cpp would compute differently than
transformers (an untied Gemma-2 head, say) is refused with the reason, as is one transformers' GGUF
loader cannot read back: without that loader the parity report has no independent reader.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from qlora_kit.after import gguf_experts
from qlora_kit.errors import ExportError
from qlora_kit.registries import families
from qlora_kit.registries.families import Gguf


def _rope(config) -> dict:
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ExportError(f"export --to gguf: rope scaling {rope.get('rope_type')!r} is not supported")
    return rope


def _rope_theta(config) -> float:
    return float(_rope(config).get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _heads(config) -> tuple[int, int, int]:
    """(heads, key/value heads, head size)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim


def _decoder(writer, config, rope_dims: bool) -> None:
    """TextModel.set_gguf_parameters, as LlamaModel, Qwen2Model and Qwen3Model inherit it."""
    heads, kv_heads, head_dim = _heads(config)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if rope_dims:
        writer.add_rope_dimension_count(head_dim)


def _phi3(writer, config) -> None:
    """Phi3MiniModel.set_gguf_parameters; fused qkv_proj and gate_up_proj stay fused (attn_qkv, ffn_up)."""
    heads, kv_heads, _ = _heads(config)
    partial = _rope(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    writer.add_context_length(config.max_position_embeddings)
    if getattr(config, "original_max_position_embeddings", None):
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(int(partial * config.hidden_size) // heads)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_sliding_window(config.sliding_window or 0)  # 0: no sliding window (the converter's rule)


def _gemma2(writer, config) -> None:
    """Gemma2Model.set_gguf_parameters (with the rope base, which llama.cpp reads when present)."""
    heads, kv_heads, head_dim = _heads(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    if config.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)


def _gemma2_refusal(config) -> str | None:
    """What llama.cpp's gemma2 graph fixes that a Gemma2Config may set otherwise (llama-model.cpp)."""
    heads, _, head_dim = _heads(config)
    if not config.tie_word_embeddings:
        return "llama.cpp's gemma2 takes its output head from the token embeddings, and this model's lm_head is a separate matrix"
    # f_attention_scale: 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 46-layer (27B) model
    expected = config.hidden_size // heads if config.num_hidden_layers == 46 else head_dim
    if not math.isclose(config.query_pre_attn_scalar, expected):
        return (
            f"llama.cpp's gemma2 scales attention by 1/sqrt({expected}), and this model's "
            f"query_pre_attn_scalar is {config.query_pre_attn_scalar}"
        )
    if config.sliding_window is None:
        return "llama.cpp's gemma2 needs a sliding window, and this model has none"
    # llama.cpp: swa pattern 2, the even layers sliding (transformers' default layer_types)
    alternating = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)
    ]
    if list(getattr(config, "layer_types", None) or alternating) != alternating:
        return (
            "llama.cpp's gemma2 alternates sliding and full attention from layer 0, and this model does not"
        )
    return None


def _gpt2(writer, config) -> None:
    """GPT2Model.set_gguf_parameters."""
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)


def _gpt2_refusal(config) -> str | None:
    """What llama.cpp's gpt2 graph fixes: tanh-approximated GELU, attention scaled by 1/sqrt(head size)."""
    if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        return f"llama.cpp's gpt2 uses the tanh GELU, and this model's activation is {config.activation_function!r}"
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        return (
            "llama.cpp's gpt2 scales attention by 1/sqrt(head size) alone, and this model scales it otherwise"
        )
    return None


def _qwen3moe_refusal(config) -> str | None:
    """What llama.cpp's qwen3moe graph fixes (src/models/qwen3moe.cpp): every layer a mixture, the top-k
    routing weights renormalised to sum to 1."""
    if not getattr(config, "norm_topk_prob", True):
        return "llama.cpp's qwen3moe renormalises the chosen experts' weights, and this model's norm_topk_prob is false"
    dense = list(getattr(config, "mlp_only_layers", None) or [])
    if dense or getattr(config, "decoder_sparse_step", 1) != 1:
        return "llama.cpp's qwen3moe routes every layer through its experts, and this model has dense layers"
    return None


# The writers and checks the families table (registries/families.py) names by key.
WRITERS: dict[str, Callable] = {
    "decoder+rope": lambda w, c: _decoder(w, c, rope_dims=True),
    "decoder": lambda w, c: _decoder(w, c, rope_dims=False),
    "phi3": _phi3,
    "gemma2": _gemma2,
    "gpt2": _gpt2,
}
CHECKS: dict[str, Callable] = {
    "gemma2": _gemma2_refusal,
    "gpt2": _gpt2_refusal,
    "qwen3moe": _qwen3moe_refusal,
}


def family_of(config) -> Gguf:
    """The GGUF form of ``config``'s architecture, or ExportError saying why it has none."""
    model_type = config.model_type
    entry = families.family(model_type)
    if entry is not None and isinstance(entry.export, families.NoExport):
        raise ExportError(
            f"export --to gguf: architecture {model_type!r} is not supported: {entry.export.reason}"
            + ("" if "--to merged" in entry.export.reason else "; --to merged works for it")
        )
    if entry is None:
        raise ExportError(
            f"export --to gguf: architecture {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(families.exportable()))}); --to merged works for every architecture"
        )
    form = entry.export
    why = CHECKS[form.check](config) if form.check else None
    if why:
        raise ExportError(f"export --to gguf: this {model_type} model has no faithful GGUF form: {why}")
    return form


def write_parameters(writer, config, form: Gguf) -> None:
    """The converter's set_gguf_parameters for ``form``'s family (a mixture's expert counts too)."""
    WRITERS[form.parameters](writer, config)
    entry = families.family(config.model_type)
    if entry is not None and entry.experts is not None:
        gguf_experts.write_parameters(writer, config, entry)


def stored(key: str, tensor: torch.Tensor, config, family: Gguf) -> torch.Tensor | None:
    """A merged model's tensor as llama.cpp stores it, or None for one it does not read."""
    if key.endswith(family.skipped):
        return None
    if family.norm_offset and key.endswith("norm.weight"):
        tensor = tensor + family.norm_offset
    if key.endswith(family.transposed):
        tensor = tensor.T.contiguous()
    return permuted(key, tensor, config, family)


def permuted(key: str, tensor: torch.Tensor, config, family: Gguf) -> torch.Tensor:
    """Q/K rows reordered for llama.cpp's ``llama`` rope (convert_hf_to_gguf.py's LlamaModel.permute)."""
    if not family.permute_qk or not key.endswith(("q_proj.weight", "k_proj.weight")):
        return tensor
    heads = config.num_attention_heads
    if key.endswith("k_proj.weight"):
        heads = getattr(config, "num_key_value_heads", None) or heads
    return (
        tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, *tensor.shape[1:])
        .swapaxes(1, 2)
        .reshape(tensor.shape)
    )
