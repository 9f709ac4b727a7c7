"""What a model family's entry in the families table (families.py) is made of: its facets and the traits
the table's readers look up across families.

- ``Family``: one entry (layer names, MLP shape, export, chat template, experts, vision, sinks);
- ``Gguf`` / ``NoExport``: its GGUF form, or why it has none;
- ``Experts``: a mixture-of-experts layer's router, experts and the config keys that count them;
- ``Vision``: a vision-language family's processor, image marker, vision-side modules and builtin;
- the trait constants: ``GATED``/``PLAIN`` (an MLP's shape), ``EXPERT_COUNT_KEYS`` (config keys that say a
  model routes to experts), ``WEIGHTS_WRITTEN_IN_FORWARD`` (architectures 4 bits cannot train),
  ``MODEL_TENSORS_PER_LAYER`` (config keys for tensors as wide as the model is deep).

families.py imports them all (``families.Gguf`` is this module's), and holds the entries and the
building blocks they share. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GATED, PLAIN = "gated", "plain"


@dataclass(frozen=True)
class Gguf:
    """How llama.cpp's ``convert_hf_to_gguf.py`` writes the family, and what reading it back needs."""

    arch: str  # gguf's MODEL_ARCH member name; its lower case is the file's general.architecture
    parameters: str  # after/gguf_families.WRITERS key: the converter's set_gguf_parameters
    # llama.cpp's "llama" rope expects Q/K rows interleaved (convert_hf_to_gguf LlamaModel.permute)
    permute_qk: bool = False
    transposed: tuple[str, ...] = ()  # weights stored (in, out) by transformers (GPT-2's Conv1D)
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by 1 + w; llama.cpp's by the stored weight
    skipped: tuple[str, ...] = ()  # tensors llama.cpp does not read (Gemma-2's head is the embeddings)
    check: str | None = None  # after/gguf_families.CHECKS key: config -> why no faithful GGUF form, or None
    # (GGUF key suffix, config attribute) that transformers' GGUF loader leaves at the class default
    unmapped_keys: tuple[tuple[str, str], ...] = ()
    # llama.cpp derives the attention scale from the head size (no key holds it): the reader must too
    derives_attention_scale: bool = False
    # transformers' GGUF loader reads the file back as this family; False (Mixtral: the llama architecture,
    # which it reads as a dense Llama): llama.cpp is the parity report's one reader, and export needs it
    transformers_reads: bool = True
    tiny_overrides: dict = field(default_factory=dict)  # build overrides giving the tiny model this form
    trained_layer_key: str = "blk.1.attn_qkv.weight"  # a LoRA-adapted GGUF tensor (export tests)


@dataclass(frozen=True)
class NoExport:
    """A family that has no GGUF export, and why (``--to merged`` still works for it)."""

    reason: str


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts layer: its router linear, its experts' module and the config's counts."""

    count_key: str  # e.g. "num_local_experts"
    active_key: str = "num_experts_per_tok"  # experts each token is routed to
    # a parameter module (never a linear layer): it stays in 16/32 bits; None: not known (no table entry)
    router: str | None = "mlp.gate"
    experts: str = "mlp.experts"  # the fused 3-D expert stacks (model/moe_experts.py packs them)


@dataclass(frozen=True)
class Vision:
    """A vision-language family: its processor, the image marker its chat template writes, the modules that
    stay out of 4 bits and LoRA by default (the vision tower and the projector), and how its builtin is
    made. Families differ in how an image enters the text: LLaVA repeats one placeholder per patch feature;
    Gemma-3 frames a few pooled soft tokens between start/end markers and lets them attend to each other
    both ways (``token_type_ids``)."""

    processor_class: str  # transformers' processor class, e.g. "LlavaProcessor"
    image_marker: str  # what the chat template writes for an image part; the processor expands it
    vision_modules: tuple[str, ...]  # top-level names under the model's ``model`` (kept in 16 bits)
    image_processor_class: str  # the builtin's image processor (a PIL one: no torchvision needed)
    tiny_vision_config: dict = field(default_factory=dict)  # the builtin's vision tower
    tiny_model_config: dict = field(default_factory=dict)  # the builtin config's own values (not text/vision)
    tiny_image_processor: dict = field(default_factory=dict)  # the builtin image processor's arguments
    tiny_processor: dict = field(default_factory=dict)  # the builtin processor's arguments
    named_tokens: dict = field(default_factory=dict)  # tokenizer attributes the processor reads (boi_token)
    token_ids: dict = field(default_factory=dict)  # config key -> the token whose id it holds
    image_token: str = ""  # the token each image feature replaces (default: the marker itself)
    # the one token of the marker that the processor expands into the image's run (default: the marker);
    # Qwen's marker frames it: <|vision_start|><|image_pad|><|vision_end|>, the pad becoming the run
    expanded_token: str = ""
    # what the model's forward takes of its image processor's outputs (Gemma-3's processor also returns
    # num_crops, which only the processor reads; generate refuses a keyword the model does not take)
    image_inputs: tuple[str, ...] = ("pixel_values",)
    # the model takes token_type_ids, 1 on image tokens (Gemma-3: an image's tokens attend both ways); a
    # batch without them trains every image causally, which the model never saw and inference never does
    token_type_ids: bool = False
    # its processor has a video half, which needs torchvision: without it, the processor is made of the image
    # processor and tokenizer alone (model/vision.py), and video parts are refused
    video_processor: bool = False
    # an image's token count follows its size (Qwen: 14-pixel patches merged 2 x 2, the image resized to
    # between min_pixels and max_pixels): model.max_pixels bounds it, the planner reads the images' sizes
    dynamic_resolution: bool = False
    # 3-D rotary positions (M-RoPE: time, height, width) that the model's get_rope_index computes from the
    # token types and image grids; a packed row carries them per example (data/mrope.py)
    mrope: bool = False

    @property
    def feature_token(self) -> str:
        return self.image_token or self.image_marker


@dataclass(frozen=True)
class FlatExperts:
    """A mixture whose experts transformers keeps undeclared, as 2-D stacks (experts x rows, columns) on one
    module, run by the block's own loop (model/moe_flat.py packs them and runs them in 4 bits). What each
    stack is cannot be read from the module: which is the gate and which the up projection, and that the
    down stack is stored (in, out) per expert."""

    holder: str  # the block's child holding the stacks
    gate: str  # (experts x intermediate, hidden): x @ W_e.T, through the activation
    up: str  # (experts x intermediate, hidden): x @ W_e.T
    down: str  # (experts x intermediate, hidden): h @ W_e, stored (in, out) per expert
    activation: str  # the holder's activation module


@dataclass(frozen=True)
class Family:
    model_type: str
    config_class: str  # transformers' config class
    tiny: str  # the builtin model's name (builtin:<tiny>)
    tiny_config: dict  # config values beyond the shared tiny shape
    linears: tuple[str, ...]  # of one decoder layer
    attention_inputs: tuple[str, ...]
    mlp: str  # GATED or PLAIN
    export: Gguf | NoExport
    system_role: bool = True
    chat_note: str = ""  # what its usual chat template does that others do not
    intermediate_key: str = "intermediate_size"
    experts: Experts | None = None
    vision: Vision | None = None  # a vision-language model: its config_class nests a text config
    # a learned sink logit per head joins each softmax (gpt-oss): only the kernels that take it may run
    attention_sinks: bool = False


# config keys that say a model routes tokens to experts (a family with one needs an Experts facet)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# Architectures whose code writes into a linear layer's weight during the forward pass, which a 4-bit
# (uint8-packed) weight cannot take: refused in one line at quant.bits 4 (benchmarks/results/families-matrix.md)
WEIGHTS_WRITTEN_IN_FORWARD = {
    "gemma3n_text": "its AltUp clamps altup.prediction_coefs.weight in place on every training forward pass",
}
# Config keys that, set, make a model keep tensors outside its decoder layers as wide as it is deep (Gemma 4's
# per-layer embeddings: tokens x layers x hidden_size_per_layer_input): the planner's trace of a few layers
# counts them for every layer (memory/tracing.py)
MODEL_TENSORS_PER_LAYER = ("hidden_size_per_layer_input",)
