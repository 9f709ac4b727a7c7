"""gpt-oss: its experts (biases, gate/up interleaved and stored transposed, the clamped SwiGLU) packed in 4 bits
and run by the routed loop as transformers runs them, its router with its bias in the compute dtype, and its
attention sinks through the kernels that take them (model/moe_experts.py, registries/attention.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from qlora_kit import Recipe
from qlora_kit.errors import RecipeError
from qlora_kit.memory.shapes import model_shape
from qlora_kit.model import loading as model
from qlora_kit.model import moe_experts, mxfp4
from qlora_kit.registries import attention

from .test_moe import batch, dequantized_16bit

TINY = "builtin:tiny-gpt-oss"


def gpt_oss_recipe(**values) -> Recipe:
    return Recipe.from_dict({"model": {"path": TINY}, **values})


@pytest.mark.slow  # two models loaded
def test_packed_experts_with_biases_compute_what_transformers_computes_dequantized():
    """The 4-bit experts, with every bias nonzero (the builtin's init leaves them at zero) and the SwiGLU's
    clamp reached, give the logits of transformers' own GptOssExperts on the same weights dequantized. In
    float32, so a bias left out, a gate read from the up half or a stack read untransposed shows."""
    recipe = gpt_oss_recipe(quant={"compute_dtype": "float32"})
    four_bit = model.load_base_model(recipe.model, recipe.quant).eval()
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in four_bit.named_parameters():
            if name.endswith(("_bias", "router.bias", "sinks")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    reference = dequantized_16bit(four_bit, recipe)
    for _, experts in [*moe_experts.fused_experts(four_bit), *moe_experts.fused_experts(reference)]:
        experts.limit = 0.05  # the clamp bites on these small activations
    ids = batch(four_bit)
    with torch.no_grad():
        ours, theirs = four_bit(ids).logits, reference(ids).logits
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()
    biases = [p for n, p in four_bit.named_parameters() if ".experts." in n and n.endswith("_bias")]
    assert len(biases) == 8 and all(p.dtype == torch.float32 and p.abs().sum() > 0 for p in biases)


def test_attention_sinks_run_on_the_kernels_that_take_them_and_the_others_are_refused():
    """auto is eager (transformers' gpt-oss has no sdpa); eager, flex_attention and the hub's vLLM
    FlashAttention-3 add the sinks; sdpa and flash_attention_2/3 (which would drop them, or be swapped for a
    hub kernel by transformers) are refused in one line naming the field, before any weight loads."""
    config = transformers.GptOssConfig()
    assert attention.resolve("auto", config) == "eager"
    for name in ("eager", "flex_attention", "kernels-community/vllm-flash-attn3"):
        assert attention.resolve(name, config) == name
    for name in ("sdpa", "flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2"):
        with pytest.raises(ValueError, match=rf"^model\.attn_implementation: {name} cannot add gpt_oss's"):
            attention.resolve(name, config)
    assert attention.resolve("sdpa", transformers.Qwen3MoeConfig()) == "sdpa"  # no sinks, no refusal
    recipe = gpt_oss_recipe(model={"path": TINY, "attn_implementation": "sdpa"})
    with pytest.raises(RecipeError, match=r"^model\.attn_implementation: sdpa cannot add .*use eager"):
        model.load_base_model(recipe.model, recipe.quant)
    with pytest.raises(RecipeError, match=r"^model\.attn_implementation: sdpa cannot add"):
        model_shape(recipe)  # qlora-kit plan refuses it as loading does


UNSLOTH_GPT_OSS_20B_GB = 12.8  # unsloth's published gpt-oss-20b QLoRA figure: 1 x 2,048, LoRA on attention


@pytest.mark.slow  # traces the 20B model's layer on fake tensors (~8 s)
def test_the_shipped_gpt_oss_20b_recipe_is_planned_beside_unsloths_figure():
    """The shipped recipe plans offline (the bundled config) on its 24 GB: every expert in NF4 (19.1B values
    at about 4.13 bits), the embeddings and head in bf16; with the chunked head a peak within 25% above
    unsloth's 12.8 GB (what is above it: eager attention's scores, the 201,088-token head's logits a chunk at
    a time, and the backward's peak while a layer is recomputed); memory.chunked_loss auto takes full logits
    in the recipe's 24 GB, and they fit it."""
    from qlora_kit.memory.loss_choice import choose_head, with_head
    from qlora_kit.memory.planner import GIB, plan
    from qlora_kit.memory.shapes import model_shape, weight_bytes

    from .conftest import ROOT

    recipe = Recipe.from_yaml(ROOT / "recipes" / "gpt-oss-20b-24gb.yaml")
    shape = model_shape(recipe)
    assert shape.expert_values == 24 * 32 * 3 * 2880 * 2880
    weights = weight_bytes(shape, recipe)
    assert 8 * weights.experts / shape.expert_values < 4.2
    chunked = with_head(recipe, True)
    peak = plan(chunked, device="cuda").chosen(chunked).peak
    assert UNSLOTH_GPT_OSS_20B_GB < peak / 1e9 < 1.25 * UNSLOTH_GPT_OSS_20B_GB
    choice = choose_head(recipe, "cuda")
    assert not choice.chunked
    full = with_head(recipe, False)
    assert peak < plan(full, device="cuda").chosen(full).peak < recipe.memory.budget_gb * GIB


HARMONY_ROW = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What sound does a cow make?"},
    {"role": "assistant", "content": "moo", "thinking": "Cows are said to say moo."},
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "And a cat?"},
    {"role": "assistant", "content": "meow", "thinking": "Cats meow."},
]


@pytest.mark.parametrize("train_reasoning", [False, True])
def test_harmony_trains_the_final_answers_and_the_reasoning_only_when_asked(tokenizer, train_reasoning):
    """gpt-oss's harmony rendering (tests/chat_templates.HARMONY): system, developer and user turns and the
    channel headers never train; each final answer trains with its end (<|end|>, the last one <|return|>);
    the analysis channel (the last turn's `thinking`, the only one the template keeps) trains with
    data.train_reasoning alone."""
    import copy

    from qlora_kit.data.chat import render_chat

    from .chat_templates import HARMONY, HARMONY_TOKENS

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = HARMONY
    segments = render_chat(HARMONY_ROW, tokenizer, train_reasoning=train_reasoning)
    trained = [s.text for s in segments if s.trained]
    reasoning = ["Cats meow.<|end|>"] if train_reasoning else []
    assert trained == ["moo<|end|>", *reasoning, "meow<|return|>"]
    untrained = "".join(s.text for s in segments if not s.trained)
    assert "Be brief." in untrained and "<|channel|>final<|message|>" in untrained
    assert ("Cats meow." in untrained) != train_reasoning  # context, when it does not train
    assert "Cows are said" not in untrained + "".join(trained)  # the template dropped it: never trained


def test_train_reasoning_is_refused_where_no_chat_row_has_reasoning():
    with pytest.raises(ValueError, match=r"data\.train_reasoning: only applies to formats chat and sharegpt"):
        Recipe.from_dict({"data": {"format": "alpaca", "train_reasoning": True}})


def mxfp4_checkpoint(folder, source) -> dict:
    """The builtin's checkpoint with its experts stored as the released gpt-oss stores them: MXFP4 blocks
    (experts x out x in/32 x 16 bytes, two FP4 values a byte) and a power-of-two scale per block of 32
    (experts x out x in/32, exponent + 127), and the config saying so. transformers writes no MXFP4 on the
    CPU (its quantize_to_mxfp4 needs the triton kernels), so the blocks are random bytes: any byte is two
    valid FP4 values. Returns the blocks and scales by tensor name."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    tensors = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    stored = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, d_in, d_out = tensors.pop(name).shape  # transformers' (experts, in, out)
        stored[f"{name}_blocks"] = torch.randint(
            0, 256, (experts, d_out, d_in // 32, 16), generator=generator
        )
        stored[f"{name}_scales"] = torch.randint(118, 124, (experts, d_out, d_in // 32), generator=generator)
    stored = {n: t.to(torch.uint8) for n, t in stored.items()}
    save_file({**tensors, **stored}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return stored


@pytest.mark.slow  # three loads of the tiny model, one through transformers MXFP4 code
def test_an_mxfp4_checkpoint_is_dequantized_once_and_its_experts_packed_in_4_bits(tmp_path, caplog):
    """A checkpoint stored in MXFP4 loads: dequantized once by transformers' own MXFP4 code into a 16-bit
    folder in the cache (exactly convert_moe_packed_tensors' values), its experts then packed in NF4 at
    <= 0.30x their bf16 bytes, the bytes stated in the log; a second load reuses the folder."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source = model.resolve_model_path(gpt_oss_recipe().model)
    stored = mxfp4_checkpoint(tmp_path / "mxfp4", source)
    recipe = Recipe.from_dict({"model": {"path": str(tmp_path / "mxfp4")}})
    with caplog.at_level("INFO", logger="qlora_kit"):
        base = model.load_base_model(recipe.model, recipe.quant)
    assert "dequantized once" in caplog.text and "MiB in MXFP4" in caplog.text
    folder = mxfp4.dequantized_folder(str(tmp_path / "mxfp4"), recipe.model.revision, trust_remote_code=False)
    dequantized = load_file(f"{folder}/model.safetensors")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    expected = convert_moe_packed_tensors(stored[f"{name}_blocks"], stored[f"{name}_scales"])
    assert torch.equal(dequantized[name], expected)
    assert "quantization_config" not in json.loads(Path(folder, "config.json").read_text())
    experts = dict(moe_experts.fused_experts(base))["model.layers.1.mlp.experts"]
    assert experts.gate_up_proj.dtype == torch.uint8
    moe_experts.dequantize_experts(base)
    nf4 = experts.gate_up_proj.float()
    assert (nf4 - expected.float()).norm() < 0.15 * expected.float().norm()  # NF4 of the MXFP4 values
    caplog.clear()
    with caplog.at_level("INFO", logger="qlora_kit"):
        again = model.load_base_model(recipe.model, recipe.quant)
    assert "its dequantized copy" in caplog.text and "dequantized once" not in caplog.text
    bf16 = sum(2 * 2 * t.numel() for n, t in stored.items() if n.endswith("_blocks"))  # two values a byte
    assert moe_experts.bytes_by_kind(again)["experts"] <= 0.30 * bf16


@pytest.mark.slow  # trains 2 steps and merges
def test_gpt_oss_trains_merges_and_reloads_with_plain_transformers(tmp_path):
    """The run's path, in-process and short (the shell's is the MoE demo's e2e test, and `qlora-kit train`
    on builtin:tiny-gpt-oss was run by hand): 4-bit experts with their LoRA train, merge's drift check
    passes, and plain transformers loads the folder, its experts back in their transposed, biased layout."""
    from transformers import AutoModelForCausalLM

    from qlora_kit import train
    from qlora_kit.after.merge import merge_adapter

    recipe = gpt_oss_recipe(
        quant={"compute_dtype": "float32"},  # bf16 is emulated on these CPUs
        data={"max_seq_len": 32, "packing": True},
        train={
            "output_dir": str(tmp_path / "out"),
            "max_steps": 2,
            "micro_batch_size": 2,
            "sample_prompts": 0,
            "eval_steps": None,
        },
    )
    out = train(recipe).output_dir
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    # float32: exact (mean KL ~1e-8); rounded to 16 bits, the tiny model's wide head (builtin.LM_HEAD_SCALE)
    # turns rounding into KL past merge's bounds at these few steps (float16: 0.0024 at every position
    # against 0.002; bfloat16 0.13 at the answers against 0.05)
    result = merge_adapter(out, tmp_path / "merged", dtype="float32")
    assert result.drift.positions > 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    experts, config = merged.model.layers[0].mlp.experts, merged.config
    assert experts.gate_up_proj.shape == (8, config.hidden_size, 2 * config.intermediate_size)  # (E, in, out)
    assert experts.gate_up_proj.dtype == torch.float32 and experts.down_proj_bias.shape == (
        8,
        config.hidden_size,
    )
