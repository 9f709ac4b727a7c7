"""The planner off its own grid: a sample of benchmarks/planner_accuracy.py's rows, each a real run.

Each case is a recipe a user could write (a data format, LoRA dropout, the chunked head, packing,
autocast, a policy), set up by ``pipeline.build`` and trained one step by the real ``Trainer.train``;
the bytes the run itself counted as saved for backward (its ``saved_mib``) are compared with
``plan`` at the shape of the batch it trained on. The cases are the settings that once fooled it:
Gemma-2's soft-capped head (which keeps transformers' loss, not the chunked one), a LayerNorm final
norm under the chunked head (GPT-NeoX), padded unpacked rows (their attention mask), LoRA
dropout 0 under the Trainer's bf16 autocast, mixtures of experts (4-bit experts routed per token), and
vision-language models on image rows (the vision tower's activations, packed image rows).
"""

import json

import pytest

from qlora_kit import Recipe
from qlora_kit.cli import plan_views
from qlora_kit.memory.planner import plan
from qlora_kit.training.pipeline import build

from .conftest import run_cli_output

pytestmark = pytest.mark.slow  # a grid of traced plans: the full suite runs it, the inner loop skips it

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "rain",
    "fell",
    "over",
    "hills",
    "and",
    "rivers",
    "under",
    "grey",
    "skies",
]

# (family, policy, data format, packing, LoRA dropout, chunked head, autocast, words per example)
CASES = [
    ("tiny-gemma2", "full", "text", False, 0.0, True, "no", 120),
    ("tiny-gptneox", "full", "completion", True, 0.0, True, "no", 60),
    ("tiny-llama", "every_n", "text", False, 0.05, False, "no", 30),
    ("tiny-qwen3", "none", "chat", True, 0.0, True, "bf16", 40),
    # mixtures of experts: the experts' loop traced with its picks spread evenly, the run's routed as they fall
    ("tiny-qwen3-moe", "none", "chat", True, 0.0, True, "bf16", 40),
    ("tiny-mixtral", "every_n", "text", False, 0.0, False, "no", 30),
    # a shared expert (Qwen2-MoE): a dense MLP and its gate beside the routed experts, LoRA on both
    ("tiny-qwen2-moe", "full", "chat", True, 0.0, True, "no", 40),
    # hybrid linear attention (Qwen3.5): three Gated DeltaNet layers to one attention layer, rows padded (a
    # recurrent state cannot be packed); what its chunked delta rule keeps, traced, against the run's count
    ("tiny-qwen3.5", "none", "chat", False, 0.0, True, "no", 40),
    ("tiny-qwen3.5-moe", "every_n", "text", False, 0.0, True, "bf16", 30),
    # sliding windows (OLMo-3, a 32-token window the rows exceed) and layers without RoPE (SmolLM3), packed
    ("tiny-olmo3", "full", "chat", True, 0.0, True, "no", 40),
    ("tiny-smollm3", "every_n", "completion", True, 0.05, False, "bf16", 40),
    # Gemma 4: heads of two sizes (full-attention layers' 64 against 32), per-layer embeddings outside the
    # layers as wide as the model is deep, its last two layers reusing earlier keys and values; packed, none
    # recomputed (every layer kind's figure), then padded under bf16 with every other layer checkpointed
    ("tiny-gemma4", "none", "chat", True, 0.0, True, "no", 40),
    ("tiny-gemma4", "every_n", "text", False, 0.0, False, "bf16", 30),
    # vision-language: image rows (builtin:shapes); LLaVA packed with LoRA on its vision tower too (which
    # then keeps activations), Gemma-3 under bf16 (its image tokens' both-ways mask)
    ("tiny-llava", "every_n", "images", True, 0.0, True, "no", 0),
    ("tiny-gemma3", "none", "images", False, 0.0, True, "bf16", 0),
    # Qwen2.5-VL packed: images of two sizes (4 and 6 tokens), each example's own 3-D positions; its
    # frozen tower keeps nothing under checkpointing (transformers made its patch embedding require grad)
    ("tiny-qwen2.5-vl", "every_n", "images", True, 0.0, True, "no", 0),
    # Qwen3-VL under bf16, padded, nothing recomputed: every layer's activations traced, DeepStack's
    # addition into the first layer included (a trace that fails falls back to the formula: 12.6% low here)
    ("tiny-qwen3-vl", "none", "images", False, 0.0, True, "bf16", 0),
    # and its mixture (Qwen3-VL-MoE), packed: each example's own 3-D positions through routed experts
    ("tiny-qwen3-vl-moe", "every_n", "images", True, 0.0, True, "no", 0),
    # DoRA builds its weight norm through lora_B(lora_A(eye)) and drops that branch within the forward:
    # the saved-tensor count forgot the freed storages' addresses and missed later tensors stored there
    # (plan and run 3-21% low), found off the grid (issue 59)
    ("tiny-llama", "none", "chat", False, 0.05, True, "no", 40, {"lora": {"dora": True}}),
    # a shape the builtins never take: tied embeddings, 6 layers, 6 heads on 1 KV head, an MLP 3x wide
    ("tiny-llama", "every_n", "completion", True, 0.05, False, "bf16", 40, {"model": "tied-6-layers"}),
    # Gemma 4 deeper than the planner's cut of it (5 layers: the first, then one of each kind), per-layer
    # embeddings 5x the hidden size a token: what they keep outside the layers grows with the layers (a
    # plan that counts the cut's only is 25% low; the first two cases, traced without the kind of layer
    # that reuses keys and values, are 5-6% high)
    ("tiny-gemma4", "full", "chat", True, 0.0, True, "no", 40, {"model": "gemma4-10-layers"}),
]
UNSEEN_SHAPES = {
    "tied-6-layers": {
        "hidden_size": 192,
        "intermediate_size": 576,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    },
    "gemma4-10-layers": {
        "num_hidden_layers": 10,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 3 + ["full_attention"],
        "num_kv_shared_layers": 4,
        "hidden_size_per_layer_input": 64,
    },
}


def write_rows(path, fmt: str, words: int) -> None:
    """Eight rows of different lengths (so unpacked batches are padded)."""
    with path.open("w", encoding="utf-8") as out:
        for index in range(8):
            answer = " ".join(WORDS[(index + i) % len(WORDS)] for i in range(words + 7 * index))
            row = {
                "text": {"text": answer},
                # a long prompt: the positions the chunked head skips, that a plan without the data counts
                "completion": {"prompt": " ".join(WORDS * 2), "completion": answer},
                "chat": {
                    "messages": [
                        {"role": "user", "content": "Go on."},
                        {"role": "assistant", "content": answer},
                    ]
                },
            }[fmt]
            out.write(json.dumps(row) + "\n")


def case_id(case: tuple) -> str:
    extra = case[8] if len(case) > 8 else {}
    names = [extra["model"]] if "model" in extra else []
    names += [k for k, v in extra.get("lora", {}).items() if v is True]
    return "-".join([*case[:3], *names])


@pytest.mark.slow  # trains one step per case
@pytest.mark.parametrize(
    ("family", "policy", "fmt", "packing", "dropout", "chunked", "precision", "words", "extra"),
    [(*c, {}) if len(c) == 8 else c for c in CASES],
    ids=[case_id(c) for c in CASES],
)
def test_plan_matches_what_the_run_saves(
    tmp_path, family, policy, fmt, packing, dropout, chunked, precision, words, extra
):
    from qlora_kit.model import builtin

    data = tmp_path / "rows.jsonl"
    if fmt == "images":
        data, fmt = "builtin:shapes", "chat"
    else:
        write_rows(data, fmt, words)
    shape = UNSEEN_SHAPES.get(extra.get("model"))
    model = str(builtin.ensure_tiny_model(family, **shape)) if shape else f"builtin:{family}"
    recipe = Recipe.from_dict(
        {
            "model": {"path": model},
            "memory": {"checkpointing": policy, "every_n": 2, "chunked_loss": chunked},
            "lora": {"dropout": dropout, "vision": family == "tiny-llava", **extra.get("lora", {})},
            "data": {"path": str(data), "format": fmt, "packing": packing, "max_seq_len": 256},
            "train": {
                "output_dir": str(tmp_path / "out"),
                "micro_batch_size": 2,
                "mixed_precision": precision,
                "max_steps": 1,
            },
        }
    )
    setup = build(recipe)
    shapes = []
    setup.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    setup.trainer.train()  # train(), not training_step: only train() runs the forward under autocast
    measured = setup.trainer.memory_monitor.largest
    batch, seq = shapes[0]
    # as the run plans: with its data's largest trained share (the prompt positions the head skips)
    the_plan = plan(
        recipe,
        batch=batch,
        seq=seq,
        device="cpu",
        trained_share=setup.data.largest_trained_share(),
        images_per_row=setup.data.most_images_per_row(),
    )
    planned = the_plan.chosen(recipe).activations
    # over-predicting a little is allowed (the share is an upper bound); under-predicting is not
    print(f"planned {planned}, measured {measured.total}: {planned / measured.total - 1:+.2%}")
    assert -0.02 <= planned / measured.total - 1 <= 0.05, (planned, measured.per_layer)


@pytest.mark.parametrize(
    ("family", "chunked", "head_from"),
    [
        ("tiny-llama", True, "traced, the trained positions closed form"),
        ("tiny-gemma2", True, "traced"),  # soft-capped: the run keeps transformers' loss
        ("tiny-llama", False, "traced"),
    ],
)
def test_plan_says_which_head_figures_are_closed_form(family, chunked, head_from):
    recipe = Recipe.from_dict({"model": {"path": f"builtin:{family}"}, "memory": {"chunked_loss": chunked}})
    the_plan = plan(recipe, device="cpu")
    assert the_plan.head_source == head_from
    assert plan_views.plan_tables_as_dict(the_plan, recipe, None)["loss_head_from"] == head_from


def test_plan_with_data_counts_only_the_trained_share_of_the_head(monkeypatch, capsys):
    """The demo's alpaca prompts are untrained: with its data (plan's default for builtin data, or
    --with-data) the chunked head's figure drops to the data's largest trained share, and the plan says
    so; with --no-data every position counts. The chunked head is
    set: auto picks full logits for the demo on a CPU's memory, and full logits keep every position."""

    def full_policy(*flags: str) -> tuple[int, str]:
        argv = ["plan", "recipes/demo.yaml", "--json", "--device", "cpu", "--set", "memory.chunked_loss=true"]
        argv += flags
        code, out, err = run_cli_output(argv, monkeypatch, capsys)
        assert code == 0, err[-2000:]
        printed = json.loads(out[out.index("{") :])
        (full,) = [p for p in printed["policies"] if p["policy"] == "full"]
        return full["activations"], printed["loss_head_from"]

    blind, blind_from = full_policy("--no-data")
    seen, seen_from = full_policy("--with-data")
    assert full_policy() == (seen, seen_from)
    assert blind_from == "traced, the trained positions closed form"
    assert seen_from.startswith("traced, the trained positions closed form (at most ")
    assert seen < blind


def rows_of(path, lengths: list[int]) -> None:
    """Text rows of ``lengths`` words each (a word is a token or two of the builtin tokenizer)."""
    with path.open("w", encoding="utf-8") as out:
        for index, words in enumerate(lengths):
            out.write(
                json.dumps({"text": " ".join(WORDS[(index + i) % len(WORDS)] for i in range(words))}) + "\n"
            )


# Five shapes outside the grid above (issue 82): a plan of padded rows kept their mask where rows cut to
# one length have none (+5% to +17% on five of seven), and rows of several lengths do keep it
BATCH_SHAPES = ["tiny-llama", "tiny-phi3", "tiny-gptneox", "tiny-qwen3", "tiny-olmo2"]


@pytest.mark.parametrize("family", BATCH_SHAPES)
@pytest.mark.parametrize("one_length", [True, False], ids=["rows-of-one-length", "padded-rows"])
def test_the_recipes_own_plan_plans_the_batch_its_data_makes(tmp_path, family, one_length):
    """``qlora-kit plan RECIPE``'s plan (training/recipe_plan.py, no flag): from the recipe's data, rows
    all cut to data.max_seq_len plan no attention mask and rows of several lengths (one micro-batch of
    all eight, the longest cut) plan theirs; each within -2..+5% of the bytes the Trainer's step saved
    (red when the plan assumed padded rows: +17.3% over on the Llama shape's rows of one length)."""
    from qlora_kit.training.recipe_plan import plan_recipe

    rows_of(tmp_path / "rows.jsonl", [600] * 8 if one_length else [600, 12, 30, 7, 50, 90, 20, 3])
    recipe = Recipe.from_dict(
        {
            "model": {"path": f"builtin:{family}"},
            "memory": {"checkpointing": "none", "chunked_loss": False},
            "lora": {"dropout": 0.0},
            "data": {
                "path": str(tmp_path / "rows.jsonl"),
                "format": "text",
                "packing": False,
                "max_seq_len": 256,
            },
            "train": {
                "output_dir": str(tmp_path / "out"),
                "micro_batch_size": 2 if one_length else 8,
                "max_steps": 1,
                "sample_prompts": 0,
                "eval_steps": None,
            },
        }
    )
    planned = plan_recipe(recipe, device="cpu", with_data=None)
    assert planned.plan.padded is not one_length and planned.plan.seq == 256, planned.batch
    assert ("no attention mask" if one_length else "their attention mask") in planned.batch
    setup = build(recipe)
    setup.trainer.train()
    measured = setup.trainer.memory_monitor.largest.total
    activations = planned.plan.chosen(planned.recipe).activations
    print(f"{family}: planned {activations}, measured {measured}: {activations / measured - 1:+.2%}")
    assert -0.02 <= activations / measured - 1 <= 0.05, planned.batch


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3", "tiny-gemma2", "tiny-phi3"])
def test_every_n_under_bf16_with_dropout_on_rows_of_one_length_is_never_under(tmp_path, family):
    """memory.checkpointing every_n (layer 0 checkpointed, layer 1 kept), the Trainer's bf16 autocast, LoRA
    dropout, rows all cut to one length: the first kept layer holds the tensors every layer shares (the
    rotary tables), which a checkpointed layer 0 does not; each layer's planned bytes equal the run's
    (red when the trace gave them to no layer: layer 1 32 KiB short on the Llama shape, and the issue's
    shapes 2.4-5.4% under in all)."""
    from qlora_kit.memory import tracing
    from qlora_kit.memory.planner import layer_plan
    from qlora_kit.training.recipe_plan import plan_recipe

    rows_of(tmp_path / "rows.jsonl", [600] * 8)
    recipe = Recipe.from_dict(
        {
            "model": {"path": f"builtin:{family}"},
            "quant": {"compute_dtype": "bfloat16"},
            "memory": {"checkpointing": "every_n", "every_n": 2, "chunked_loss": False},
            "lora": {"dropout": 0.05},
            "data": {
                "path": str(tmp_path / "rows.jsonl"),
                "format": "text",
                "packing": False,
                "max_seq_len": 256,
            },
            "train": {
                "output_dir": str(tmp_path / "out"),
                "micro_batch_size": 2,
                "max_steps": 1,
                "mixed_precision": "bf16",
                "sample_prompts": 0,
                "eval_steps": None,
            },
        }
    )
    planned = plan_recipe(recipe, device="cpu", with_data=None)
    setup = build(recipe)
    setup.trainer.train()
    measured = setup.trainer.memory_monitor.largest
    config = setup.model.config
    layers = layer_plan("every_n", 2, config.num_hidden_layers, recipe)
    traced = tracing.trace_layers(config, recipe, 2, 256, "bf16", 1, "cpu", False).per_layer(layers)
    assert traced == [measured.per_layer[f"layer {i}"] for i in range(len(layers))]
    activations = planned.plan.chosen(planned.recipe).activations
    assert -0.02 <= activations / measured.total - 1 <= 0.05, (activations, measured.per_layer)


def test_plan_says_which_layout_and_mask_it_planned(monkeypatch, capsys):
    """Without the data the batch is planned padded (the larger plan) unless --no-padded, and the plan says
    which; with the demo's builtin data (read by default) it says the layout the data makes."""

    def planned(*flags: str) -> dict:
        argv = ["plan", "recipes/demo.yaml", "--json", "--device", "cpu", *flags]
        code, out, err = run_cli_output(argv, monkeypatch, capsys)
        assert code == 0, err[-2000:]
        return json.loads(out[out.index("{") :])

    padded, one_length = planned("--no-data"), planned("--no-data", "--no-padded")
    assert padded["padded"] and "--no-padded plans rows of one length" in padded["batch_layout"]
    assert not one_length["padded"] and "rows of one length, no mask" in one_length["batch_layout"]
    assert planned()["batch_layout"].startswith("planned the batch from the data: ")
