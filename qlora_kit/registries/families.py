"""Model families: one entry per transformers ``model_type`` holding what every layer needs to know of it.

Each ``Family`` says, for its architecture:

- ``config_class`` and ``tiny``/``tiny_config``: the builtin tiny model (model/builtin.py builds it);
- ``linears``: the linear layers of one decoder layer, by name (4-bit loading quantizes them, LoRA may
  target them, the planner sizes them; tests check the names against a model built from the config);
- ``attention_inputs``: the linears that read a layer's first norm, and ``mlp``: how its MLP is shaped
  (``gated``: gate, up and the activation keep three intermediate-wide tensors; ``plain``: two), and
  ``intermediate_key``: the config's name for that width (memory/shapes.py, memory/formula.py);
- ``export``: its GGUF form (``Gguf``: llama.cpp's architecture, the converter's hyperparameter writer
  and tensor transforms, the keys transformers' GGUF reader must be told) or ``NoExport`` with the
  reason (after/gguf_families.py, after/gguf_writer.py, after/parity.py);
- ``system_role``/``chat_note``: whether its usual chat templates accept a system turn
  (``data.system_prompt_mode``) and what else they do their own way;
- ``experts``: for a mixture-of-experts family, where its router and experts are and which config keys
  count them (``Experts``); None for a dense one. A family whose config counts experts must have it
  (tests/test_families.py). A mixture without an entry is read from its config's common keys
  (``experts_facet``); its experts' layout is read from the module itself (model/moe_experts.py);
- ``attention_sinks``: its attention adds a learned sink logit per head to each softmax (gpt-oss): only
  the kernels that take the sinks may run it (registries/attention.py);
- ``vision``: for a vision-language family, its processor, image marker, vision-side modules, the inputs
  its model takes beside the pixels, and how its builtin is made (``Vision``; model/vision.py,
  data/images.py, model/builtin_vision.py).

Adding a family is one entry here plus its tests: the builtin model, the planner, export and the export
tests read this table. Standard library only; the GGUF writers named by ``Gguf.parameters`` and
``Gguf.check`` live in after/gguf_families.py, since they call the gguf package.
"""

from __future__ import annotations

# the facets an entry is made of (family_traits.py: readers reach them as ``families.Gguf``...)
from qlora_kit.registries.family_traits import (
    EXPERT_COUNT_KEYS,
    GATED,
    PLAIN,
    Experts,
    Family,
    FlatExperts,
    Gguf,
    NoExport,
    Vision,
)

# facet values several entries share (shared_facets.py)
from qlora_kit.registries.shared_facets import (
    ATTENTION_LINEARS,
    DENSE_AND_SHARED_EXPERT_LINEARS,
    HEAD_DIM_KEY,
    HYBRID_NO_GGUF,
    LINEAR_ATTENTION_TINY,
    LLAMA_GGUF,
    LLAMA_K,
    LLAMA_LINEARS,
    MIXTRAL_GGUF,
    MLA_LINEARS,
    MLA_TINY,
    QKV,
    QWEN2_5_VL_VISION,
    QWEN3_5_LINEAR_ATTENTION,
    QWEN3_VL_ROPE,
    QWEN3_VL_VISION,
    SHARED_EXPERT_LINEARS,
    SHARED_EXPERT_TINY,
    SHARED_EXPERTS_NO_GGUF,
    SHARED_EXPERTS_TINY,
    TINY_TOWER,
    VISION_NO_GGUF,
)

# mixtures whose experts are flat 2-D stacks transformers does not declare, by model_type (moe_flat.py)
FLAT_EXPERTS = {
    # DbrxExperts.forward: DbrxExpertGLU(x, w1, v1, w2) = act(x @ w1_e.T) * (x @ v1_e.T) @ w2_e
    "dbrx": FlatExperts(holder="mlp", gate="w1", up="v1", down="w2", activation="activation_fn"),
}


def _family(model_type: str, config_class: str, tiny: str, **facets) -> Family:
    return Family(model_type, config_class, tiny, **facets)


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        _family(
            "llama",
            "LlamaConfig",
            "tiny-llama",
            tiny_config={},
            linears=LLAMA_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=LLAMA_GGUF,
        ),
        _family(
            "qwen2",
            "Qwen2Config",
            "tiny-qwen2",
            tiny_config={"use_sliding_window": False},
            linears=LLAMA_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=Gguf("QWEN2", "decoder", unmapped_keys=HEAD_DIM_KEY, trained_layer_key=LLAMA_K),
        ),
        _family(
            "mistral",
            "MistralConfig",
            "tiny-mistral",
            tiny_config={"sliding_window": None},
            linears=LLAMA_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=LLAMA_GGUF,
            chat_note="v0.3's template moves the system prompt into the last user turn",
        ),
        # Layers of other shapes, for the planner's tracing and the pipeline's breadth: q/k norms (Qwen3),
        # fused qkv and gate-up projections (Phi-3), post-norms, soft-capping and alternating sliding
        # attention (Gemma-2), parallel residual with a plain MLP and LayerNorm (GPT-NeoX), Conv1D
        # projections and learned positions (GPT-2), post-norms with q/k norms (OLMo-2).
        _family(
            "qwen3",
            "Qwen3Config",
            "tiny-qwen3",
            tiny_config={"head_dim": 32},
            linears=LLAMA_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=Gguf("QWEN3", "decoder", unmapped_keys=HEAD_DIM_KEY, trained_layer_key=LLAMA_K),
        ),
        _family(
            "phi3",
            "Phi3Config",
            "tiny-phi3",
            tiny_config={},
            linears=("self_attn.o_proj", "self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"),
            attention_inputs=("self_attn.qkv_proj",),
            mlp=GATED,
            # fused qkv_proj and gate_up_proj stay fused (attn_qkv, ffn_up)
            export=Gguf("PHI3", "phi3", unmapped_keys=HEAD_DIM_KEY),
            chat_note="its template appends EOS after the whole conversation",
        ),
        _family(
            "gemma2",
            "Gemma2Config",
            "tiny-gemma2",
            tiny_config={"head_dim": 32, "sliding_window": 32},
            linears=LLAMA_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=Gguf(
                "GEMMA2",
                "gemma2",
                norm_offset=1.0,
                skipped=("lm_head.weight",),
                check="gemma2",
                unmapped_keys=(
                    *HEAD_DIM_KEY,
                    ("attn_logit_softcapping", "attn_logit_softcapping"),
                    ("final_logit_softcapping", "final_logit_softcapping"),
                ),
                derives_attention_scale=True,
                # llama.cpp's Gemma-2 ties its head to the embeddings and scales attention by
                # 1/sqrt(head size), which the builtin (untied, query_pre_attn_scalar 256) does not
                tiny_overrides={"tie_word_embeddings": True, "query_pre_attn_scalar": 32},
                trained_layer_key=LLAMA_K,
            ),
            system_role=False,
            chat_note="its templates raise on a system turn (data.system_prompt_mode: merge_into_first_user)",
        ),
        _family(
            "gpt_neox",
            "GPTNeoXConfig",
            "tiny-gptneox",
            tiny_config={},
            linears=(
                "attention.query_key_value",
                "attention.dense",
                "mlp.dense_h_to_4h",
                "mlp.dense_4h_to_h",
            ),
            attention_inputs=("attention.query_key_value",),
            mlp=PLAIN,
            export=NoExport(
                "transformers' GGUF loader cannot read a gptneox GGUF back, so the parity report would "
                "have no independent reader"
            ),
        ),
        _family(
            "gpt2",
            "GPT2Config",
            "tiny-gpt2",
            tiny_config={},
            linears=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
            attention_inputs=("attn.c_attn",),
            mlp=PLAIN,
            intermediate_key="n_inner",  # None: 4 x hidden
            export=Gguf(
                "GPT2",
                "gpt2",
                transposed=("c_attn.weight", "c_proj.weight", "c_fc.weight"),
                skipped=(".attn.bias", ".attn.masked_bias"),
                check="gpt2",
                # transformers maps these to n_ctx, which GPT2Config no longer reads
                unmapped_keys=(
                    *HEAD_DIM_KEY,
                    ("context_length", "n_positions"),
                    ("feed_forward_length", "n_inner"),
                ),
            ),
        ),
        _family(
            "olmo2",
            "Olmo2Config",
            "tiny-olmo2",
            tiny_config={},
            linears=LLAMA_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=NoExport(
                "transformers' GGUF loader cannot read an olmo2 GGUF back, so the parity report would "
                "have no independent reader"
            ),
        ),
        # SmolLM3: Llama's layers with RoPE left out of every fourth (no_rope_layers); OLMo-3: OLMo-2's with
        # three sliding-window layers to each full one (layer_types), a window the builtin's rows exceed.
        # Packed rows keep their examples apart in both (tests/test_hybrid.py: sliding windows)
        _family(
            "smollm3",
            "SmolLM3Config",
            "tiny-smollm3",
            tiny_config={},
            linears=LLAMA_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=NoExport(
                "qlora_kit's GGUF writer has no smollm3 form yet (its layers without RoPE); convert the merged "
                "folder with llama.cpp's convert_hf_to_gguf.py"
            ),
        ),
        _family(
            "olmo3",
            "Olmo3Config",
            "tiny-olmo3",
            tiny_config={"sliding_window": 32},
            linears=LLAMA_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=NoExport(
                "qlora_kit's GGUF writer has no olmo3 form yet (transformers' GGUF loader cannot read one "
                "back); convert the merged folder with llama.cpp's convert_hf_to_gguf.py"
            ),
        ),
        # Gemma 4's language model: heads of 64 in its full-attention layers against 32 in its sliding ones,
        # and one key/value head of their own there whose keys are also its values (attention_k_eq_v, as
        # the 26B and 31B: transformers' heterogeneous config, model/layer_sizes.py); per-layer embeddings
        # beside the main ones (PLE, as E2B and E4B: tokens x layers x 128, gated into each layer; 128 wide,
        # as a real model's 256: the planner's trace keeps a matmul's output under selective only from 128
        # inputs, memory/selective.py, where a run keeps every 4-bit one's); its last two layers reuse the
        # keys and values of the last earlier layer of their type (num_kv_shared_layers)
        _family(
            "gemma4_text",
            "Gemma4TextConfig",
            "tiny-gemma4",
            tiny_config={
                "head_dim": 32,
                "global_head_dim": 64,
                "num_global_key_value_heads": 1,
                "attention_k_eq_v": True,
                "sliding_window": 32,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "num_kv_shared_layers": 2,
                "hidden_size_per_layer_input": 128,
                "vocab_size_per_layer_input": 640,  # the builtin tokenizer's (model/builtin.py)
            },
            linears=(*LLAMA_LINEARS, "per_layer_input_gate", "per_layer_projection"),
            attention_inputs=QKV,
            mlp=GATED,
            export=NoExport(
                "qlora_kit's GGUF writer has no gemma4 form yet (its layers of two head sizes and shared keys "
                "and values); convert the merged folder with llama.cpp's convert_hf_to_gguf.py"
            ),
        ),
        # Vision-language models: a vision tower and projector (16 bits) in front of a decoder (4 bits)
        _family(
            "llava",
            "LlavaConfig",
            "tiny-llava",
            tiny_config={"model_type": "llama"},  # the language model's config (the nested text_config)
            linears=LLAMA_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=VISION_NO_GGUF,
            vision=Vision(
                processor_class="LlavaProcessor",
                image_marker="<image>",
                vision_modules=("vision_tower", "multi_modal_projector"),
                image_processor_class="CLIPImageProcessorPil",
                tiny_vision_config={"model_type": "clip_vision_model", **TINY_TOWER, "projection_dim": 64},
                tiny_model_config={"vision_feature_layer": -1, "vision_feature_select_strategy": "full"},
                tiny_image_processor={
                    "size": {"shortest_edge": 56},
                    "crop_size": {"height": 56, "width": 56},
                },
                tiny_processor={
                    "patch_size": 14,
                    "vision_feature_select_strategy": "full",
                    "num_additional_image_tokens": 1,  # CLIP's class token, which "full" keeps
                    "image_token": "<image>",
                },
                token_ids={"image_token_id": "<image>"},
            ),
        ),
        _family(
            "gemma3",
            "Gemma3Config",
            "tiny-gemma3",
            # the language model's config: Gemma-3's sliding-window and global layers, query norms
            tiny_config={
                "model_type": "gemma3_text",
                "head_dim": 32,
                "sliding_window": 32,
                "query_pre_attn_scalar": 32,
            },
            linears=LLAMA_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=VISION_NO_GGUF,
            vision=Vision(
                processor_class="Gemma3Processor",
                image_marker="<start_of_image>",  # the processor frames it: \n\n<boi><soft tokens><eoi>\n\n
                vision_modules=("vision_tower", "multi_modal_projector"),
                image_processor_class="Gemma3ImageProcessorPil",
                tiny_vision_config={"model_type": "siglip_vision_model", **TINY_TOWER},
                tiny_model_config={"mm_tokens_per_image": 4},  # 4 x 4 patches pooled to 2 x 2
                tiny_image_processor={"size": {"height": 56, "width": 56}},
                tiny_processor={"image_seq_length": 4},
                named_tokens={
                    "boi_token": "<start_of_image>",
                    "eoi_token": "<end_of_image>",
                    "image_token": "<image_soft_token>",
                },
                token_ids={
                    "boi_token_index": "<start_of_image>",
                    "eoi_token_index": "<end_of_image>",
                    "image_token_index": "<image_soft_token>",
                },
                image_token="<image_soft_token>",
                token_type_ids=True,
            ),
        ),
        _family(
            "qwen2_5_vl",
            "Qwen2_5_VLConfig",
            "tiny-qwen2.5-vl",
            # the language model's config: M-RoPE's 3-D positions (time, height, width) over head_dim 32
            tiny_config={
                "model_type": "qwen2_5_vl_text",
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
            },
            linears=LLAMA_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=VISION_NO_GGUF,
            vision=QWEN2_5_VL_VISION,
        ),
        _family(
            "qwen3_vl",
            "Qwen3VLConfig",
            "tiny-qwen3-vl",
            tiny_config={
                "model_type": "qwen3_vl_text",
                "head_dim": 32,
                "rope_parameters": QWEN3_VL_ROPE,
            },
            linears=LLAMA_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=VISION_NO_GGUF,
            vision=QWEN3_VL_VISION,
        ),
        _family(
            "qwen3_vl_moe",
            "Qwen3VLMoeConfig",
            "tiny-qwen3-vl-moe",
            # Qwen3-VL's with a mixture of experts in every layer (Qwen3-VL-30B-A3B's layout), 8 experts here
            tiny_config={
                "model_type": "qwen3_vl_moe_text",
                "head_dim": 32,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 128,
                "rope_parameters": QWEN3_VL_ROPE,
            },
            linears=ATTENTION_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            intermediate_key="moe_intermediate_size",
            export=VISION_NO_GGUF,
            experts=Experts(count_key="num_experts"),
            vision=QWEN3_VL_VISION,
        ),
        # Mixtures of experts (builtins of 8 experts, 2 per token): fused 3-D experts behind a router
        _family(
            "qwen3_moe",
            "Qwen3MoeConfig",
            "tiny-qwen3-moe",
            tiny_config={
                "head_dim": 32,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 128,
            },
            linears=ATTENTION_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            intermediate_key="moe_intermediate_size",
            export=Gguf(
                "QWEN3MOE",
                "decoder",
                check="qwen3moe",
                # transformers' loader maps no expert width (the config class's 768 otherwise)
                unmapped_keys=(*HEAD_DIM_KEY, ("expert_feed_forward_length", "moe_intermediate_size")),
                # llama.cpp's qwen3moe renormalises the top-k weights (Qwen3-30B-A3B's own setting);
                # the builtin keeps Qwen3MoeConfig's default, false
                tiny_overrides={"norm_topk_prob": True},
                trained_layer_key=LLAMA_K,
            ),
            experts=Experts(count_key="num_experts"),
        ),
        _family(
            "mixtral",
            "MixtralConfig",
            "tiny-mixtral",
            tiny_config={"sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2},
            linears=ATTENTION_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=MIXTRAL_GGUF,
            experts=Experts(count_key="num_local_experts"),
        ),
        _family(
            "qwen2_moe",
            "Qwen2MoeConfig",
            "tiny-qwen2-moe",
            tiny_config={
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 128,
                "shared_expert_intermediate_size": 256,
                "use_sliding_window": False,
            },
            linears=(*ATTENTION_LINEARS, *SHARED_EXPERT_LINEARS),
            attention_inputs=QKV,
            mlp=GATED,
            intermediate_key="moe_intermediate_size",
            export=NoExport(
                "qlora_kit's GGUF writer has no qwen2moe form yet (its shared expert and gate); convert the "
                "merged folder with llama.cpp's convert_hf_to_gguf.py"
            ),
            experts=Experts(count_key="num_experts"),
        ),
        _family(
            "olmoe",
            "OlmoeConfig",
            "tiny-olmoe",
            tiny_config={"num_experts": 8, "num_experts_per_tok": 2},
            linears=ATTENTION_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=NoExport(
                "qlora_kit's GGUF writer has no olmoe form yet (transformers' GGUF loader cannot read one "
                "back); convert the merged folder with llama.cpp's convert_hf_to_gguf.py"
            ),
            experts=Experts(count_key="num_experts"),
        ),
        # gpt-oss: experts with biases, gate/up interleaved and stored transposed (in x out), a clamped
        # SwiGLU, a router with a bias, and a learned attention sink per head (model/gpt_oss.py)
        _family(
            "gpt_oss",
            "GptOssConfig",
            "tiny-gpt-oss",
            tiny_config={
                "head_dim": 32,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "sliding_window": 32,
                # gpt-oss's YaRN, its factor matching the tiny context (4 x 128 = 512 positions)
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 4.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 128,
                },
            },
            linears=ATTENTION_LINEARS,
            attention_inputs=QKV,
            mlp=GATED,
            export=NoExport(
                "qlora_kit's GGUF writer has no gpt-oss form yet (biased, interleaved experts and attention "
                "sinks); convert the merged folder with llama.cpp's convert_hf_to_gguf.py"
            ),
            experts=Experts(count_key="num_local_experts", router="mlp.router"),
            attention_sinks=True,
        ),
        # Hybrid linear attention (Qwen3.5, Qwen3-Next): three Gated DeltaNet
        # layers to each full-attention one (layer_types). A DeltaNet layer keeps a recurrent state, not keys
        # and values: its projections load in 4 bits and take LoRA like any linear layer (all-linear takes
        # them all), but packing is refused (model/recurrent.py: the state runs on across a packed row's
        # examples)
        _family(
            "qwen3_5_text",
            "Qwen3_5TextConfig",
            "tiny-qwen3.5",
            tiny_config={"head_dim": 32, **LINEAR_ATTENTION_TINY},
            linears=(
                *QWEN3_5_LINEAR_ATTENTION,
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
                *ATTENTION_LINEARS,
            ),
            attention_inputs=QKV,
            mlp=GATED,
            export=HYBRID_NO_GGUF,
        ),
        _family(
            "qwen3_5_moe_text",
            "Qwen3_5MoeTextConfig",
            "tiny-qwen3.5-moe",
            tiny_config={"head_dim": 32, **LINEAR_ATTENTION_TINY, **SHARED_EXPERT_TINY},
            linears=(*QWEN3_5_LINEAR_ATTENTION, *SHARED_EXPERT_LINEARS, *ATTENTION_LINEARS),
            attention_inputs=QKV,
            mlp=GATED,
            intermediate_key="moe_intermediate_size",
            export=HYBRID_NO_GGUF,
            experts=Experts(count_key="num_experts"),
        ),
        # Shared experts beside the routed ones, and dense first layers (first_k_dense_replace): their linears
        # take LoRA by name, which peft 0.21.2 would move onto the fused experts (model/peft_3711.py)
        _family(
            "deepseek_v3",
            "DeepseekV3Config",
            "tiny-deepseek-v3",
            # DeepSeek-V3's layout (Kimi K2's too): multi-head latent attention, a dense first layer, then 8
            # routed experts (2 a token, in 2 groups) and one shared expert
            # (its attention keeps a key and value head per query head: MLA's keys come from one latent)
            tiny_config={
                **SHARED_EXPERTS_TINY,
                **MLA_TINY,
                "n_group": 2,
                "topk_group": 1,
                "num_key_value_heads": 4,
            },
            linears=(
                *MLA_LINEARS,
                *DENSE_AND_SHARED_EXPERT_LINEARS,
            ),
            attention_inputs=("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
            mlp=GATED,
            intermediate_key="moe_intermediate_size",
            export=SHARED_EXPERTS_NO_GGUF,
            experts=Experts(count_key="n_routed_experts"),
        ),
        _family(
            "glm4_moe",
            "Glm4MoeConfig",
            "tiny-glm4-moe",
            # GLM-4.5 / 4.6 / 4.7's layout: a dense first layer, then routed experts and a shared expert
            tiny_config={**SHARED_EXPERTS_TINY, "head_dim": 32, "n_group": 1, "topk_group": 1},
            linears=(*ATTENTION_LINEARS, *DENSE_AND_SHARED_EXPERT_LINEARS),
            attention_inputs=QKV,
            mlp=GATED,
            intermediate_key="moe_intermediate_size",
            export=SHARED_EXPERTS_NO_GGUF,
            experts=Experts(count_key="n_routed_experts"),
        ),
        _family(
            "qwen3_next",
            "Qwen3NextConfig",
            "tiny-qwen3-next",
            # Qwen3-Next-80B-A3B's layout: Qwen3.5's hybrid (three Gated DeltaNet layers to each attention one)
            # with routed experts and a gated shared expert in every layer
            tiny_config={"head_dim": 32, **LINEAR_ATTENTION_TINY, **SHARED_EXPERT_TINY},
            linears=(
                "linear_attn.in_proj_qkvz",
                "linear_attn.in_proj_ba",
                "linear_attn.out_proj",
                *SHARED_EXPERT_LINEARS,
                *ATTENTION_LINEARS,
            ),
            attention_inputs=QKV,
            mlp=GATED,
            intermediate_key="moe_intermediate_size",
            export=HYBRID_NO_GGUF,
            experts=Experts(count_key="num_experts"),
        ),
    )
}


# Checkpoints whose config is the multimodal model's while qlora_kit trains their language model alone, built
# from the text config (model/text_only.py): the text model_type, and the prefix its weights carry in the
# checkpoint (Gemma 4's: model.language_model.*; its vision and audio towers are not loaded)
LANGUAGE_MODEL_ALONE = {"gemma4": ("gemma4_text", "language_model")}
# A Qwen3.5 checkpoint's config is the vision-language one; AutoModelForCausalLM loads its language model,
# whose config is the text one (the vision tower is not loaded: image rows are refused as for any text model)
TEXT_OF = {
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    **{model_type: text for model_type, (text, _) in LANGUAGE_MODEL_ALONE.items()},
}


def family(model_type: str) -> Family | None:
    """The table's entry for ``model_type``, or None for an architecture it does not list."""
    return FAMILIES.get(TEXT_OF.get(model_type, model_type))


def experts_facet(config) -> Experts | None:
    """A model's experts facet: its table entry's, else one read from the config's common keys (a count
    key of EXPERT_COUNT_KEYS and num_experts_per_tok; its router's name unknown); None for a dense model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    entry = family(getattr(text, "model_type", "")) or family(getattr(config, "model_type", ""))
    if entry is not None and entry.experts is not None:
        return entry.experts
    count_key = next((key for key in EXPERT_COUNT_KEYS if getattr(text, key, None)), None)
    if count_key is None or not getattr(text, "num_experts_per_tok", None):
        return None
    return Experts(count_key=count_key, router=None)


def by_tiny_name(name: str) -> Family | None:
    """The family whose builtin tiny model is ``name`` (``tiny-llama``)."""
    return next((f for f in FAMILIES.values() if f.tiny == name), None)


def exportable() -> dict[str, Family]:
    """The families with a GGUF form, by model_type."""
    return {t: f for t, f in FAMILIES.items() if isinstance(f.export, Gguf)}


def by_gguf_arch(arch: str) -> Gguf | None:
    """The GGUF form transformers reads from a file saying ``general.architecture: arch`` (``llama``,
    ``gemma2``; Mixtral's llama-architecture file is read by llama.cpp alone)."""
    forms = (f.export for f in exportable().values() if f.export.transformers_reads)
    return next((form for form in forms if form.arch.lower() == arch), None)
