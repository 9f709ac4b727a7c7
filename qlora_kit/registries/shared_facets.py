"""Facet values several families share (one architecture's linears, vision side, GGUF form or tiny
config, reused by its relatives): named here so that families.py holds the table and its look-ups."""

from __future__ import annotations

from dataclasses import replace

from qlora_kit.registries.family_traits import (
    Gguf,
    NoExport,
    Vision,
)

# the Qwen-VL builtins' vision towers (Qwen2.5-VL's and Qwen3-VL's alike): 2 layers, hidden 64, projected to
# the language model's 128
QWEN_VL_TINY_TOWER = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "out_hidden_size": 128,
}
# Qwen2.5-VL's vision side: 14-pixel patches merged 2 x 2, M-RoPE, the processor's video half optional
QWEN2_5_VL_VISION = Vision(
    processor_class="Qwen2_5_VLProcessor",
    # the processor frames it: <|vision_start|><|image_pad|> x (patches / 4)<|vision_end|>
    image_marker="<|vision_start|><|image_pad|><|vision_end|>",
    expanded_token="<|image_pad|>",
    vision_modules=("visual",),
    image_processor_class="Qwen2VLImageProcessorPil",
    tiny_vision_config={
        **QWEN_VL_TINY_TOWER,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    },
    token_ids={
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    },
    image_token="<|image_pad|>",
    image_inputs=("pixel_values", "image_grid_thw"),
    video_processor=True,
    dynamic_resolution=True,
    mrope=True,
)
# Qwen3-VL's language model's positions (dense and mixture alike): M-RoPE's 3-D positions interleaved over
# head_dim 32 (time, height and width spread across the frequencies instead of a block each)
QWEN3_VL_ROPE = {
    "rope_type": "default",
    "rope_theta": 5e6,
    "mrope_section": [6, 5, 5],
    "mrope_interleaved": True,
}
# Qwen3-VL's vision side (dense and mixture alike): Qwen2.5-VL's, with 16-pixel patches (merged 2 x 2) and
# DeepStack (the tower's features of layer 0 also join the language model's first layer)
QWEN3_VL_VISION = replace(
    QWEN2_5_VL_VISION,
    processor_class="Qwen3VLProcessor",
    tiny_vision_config={
        **QWEN_VL_TINY_TOWER,
        "patch_size": 16,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
    },
    tiny_image_processor={"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
)


# the builtin vision-language models' towers: 2 layers on 56 x 56 images in 14-pixel patches (4 x 4 of them)
TINY_TOWER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 56,
    "patch_size": 14,
}
# qlora_kit's GGUF writer writes no vision tower (llama.cpp serves one from a separate multimodal projector
# GGUF, mmproj)
VISION_NO_GGUF = NoExport(
    "qlora_kit writes no multimodal projector file (llama.cpp's mmproj GGUF) for the vision tower; "
    "export --to merged keeps the whole model"
)

# the attention linears of a mixture-of-experts layer (its MLP is the router and the fused experts)
ATTENTION_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
# a shared expert beside the routed ones (Qwen2-MoE): a dense gated MLP every token runs through, scaled by
# a sigmoid gate of its own; LoRA adapts them as the linear layers they are
SHARED_EXPERT_LINEARS = (
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate",
)
# Qwen3.5's Gated DeltaNet projections
QWEN3_5_LINEAR_ATTENTION = (
    "linear_attn.out_proj",
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
)
# the builtins' linear-attention heads (the config's defaults: 16 key and 32 value heads of 128)
LINEAR_ATTENTION_TINY = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
}
# the builtins' routed experts and shared expert
SHARED_EXPERT_TINY = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}
# DeepSeek-V3's and GLM-4.5's builtins: a dense first layer (first_k_dense_replace), then 8 routed experts
# of 64 (2 a token) and one shared expert
SHARED_EXPERTS_TINY = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}
# DeepSeek's multi-head latent attention at the builtins' width (queries and keys/values through ranks of 64)
MLA_TINY = {
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 32,
}
MLA_LINEARS = (
    "self_attn.q_a_proj",
    "self_attn.q_b_proj",
    "self_attn.kv_a_proj_with_mqa",
    "self_attn.kv_b_proj",
    "self_attn.o_proj",
)
# the dense first layers' MLP, then each later layer's shared expert
DENSE_AND_SHARED_EXPERT_LINEARS = (
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "mlp.shared_experts.gate_proj",
    "mlp.shared_experts.up_proj",
    "mlp.shared_experts.down_proj",
)
SHARED_EXPERTS_NO_GGUF = NoExport(
    "qlora_kit's GGUF writer has no form for shared experts beside routed ones yet; convert the merged folder "
    "with llama.cpp's convert_hf_to_gguf.py"
)
HYBRID_NO_GGUF = NoExport(
    "qlora_kit's GGUF writer has no form for Gated DeltaNet layers (their convolution and recurrent state); "
    "convert the merged folder with llama.cpp's convert_hf_to_gguf.py"
)
# the attention and MLP linears of a Llama-shaped layer
LLAMA_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# the transformers GGUF loader reads no head size for these: 128 unless stated
HEAD_DIM_KEY = (("attention.key_length", "head_dim"),)
LLAMA_K = "blk.1.attn_k.weight"


LLAMA_GGUF = Gguf(
    "LLAMA", "decoder+rope", permute_qk=True, unmapped_keys=HEAD_DIM_KEY, trained_layer_key=LLAMA_K
)


# llama.cpp's converter writes Mixtral as the llama architecture with expert tensors (LlamaModel)
MIXTRAL_GGUF = Gguf(
    "LLAMA", "decoder+rope", permute_qk=True, transformers_reads=False, trained_layer_key=LLAMA_K
)
