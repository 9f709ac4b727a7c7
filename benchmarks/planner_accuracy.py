"""The planner against what a run really saves for backward, over the settings a user can change.

Each row is one run set up by ``pipeline.build`` (real NF4 layers, peft LoRA r=16 all-linear, the run's
checkpointing, the run's loss head and collator) on one of the nine builtin families (Llama, Qwen2,
Mistral, Qwen3, Phi-3, Gemma-2, GPT-NeoX, GPT-2, OLMo-2), trained one step by the real
``Trainer.train`` (its autocast, its collator, its loss); measured is the run's own figure, the bytes
``SavedTensors`` counted in that forward pass (the ``saved_mib`` the run logs). Planned is
``plan(recipe, batch, seq, trained_share=...)`` at the batch's shape, for the recipe's policy, on the CPU,
with the data's largest trained share of an example, as the run plans; the last column is how much of
it is positions the batch does not train (prompts, padding) that the plan's share still counts: the one
error left, and an upward one.

The settings that move what is kept, varied across the rows: LoRA dropout (0, which peft runs without
a dropout module, and 0.05), the chunked loss head (off, on with its default chunk, on with a 64-token
chunk), the data format (alpaca, chat, completion, text), packing, the Trainer's autocast (none, bf16),
the checkpointing policy (none, every 2nd layer, selective, full) and the micro-batch x length (2 x 512,
4 x 256).
Each family x policy x shape is one row; the other settings rotate over the rows (``grid``: a covering
sample of the full product, which would take hours). Examples are 35-45% of ``max_seq_len`` on the
tiny models' tokenizer, so packed rows hold two and unpacked batches are padded to the longer example.

    python benchmarks/planner_accuracy.py
    python benchmarks/planner_accuracy.py --real-model   # SmolLM2-135M-Instruct, every policy x shape
    python benchmarks/planner_accuracy.py --smoke --out /tmp/x   # SMOKE_FAMILIES, every_n=2, 2 x 64 tokens
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

from common import REAL_MODEL, device_name, markdown_table, parser, write_result

POLICIES = [("none", 1), ("every_n", 2), ("selective", 1), ("full", 1)]
SHAPES = [(2, 512), (4, 256)]  # micro-batch x max_seq_len
SMOKE = ([("every_n", 2)], [(2, 64)])  # policies, shapes: does it still run?
# --smoke's families: a dense model and a hybrid one (linear attention, never packed), whose two rows take
# both packings, dropouts, autocasts and two heads. Every family's plan against its run is
# tests/test_planner_grid.py's and tests/test_tracing.py's; the smoke proves the script runs and writes
# its table of finite figures
SMOKE_FAMILIES = ["tiny-llama", "tiny-qwen3.5"]
FORMATS = ["alpaca", "chat", "completion", "text"]
HEADS = ["off", "on", "on, 64-token chunks"]  # memory.chunked_loss and memory.loss_chunk_tokens
MIB = 2**20
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
RECIPES = [
    "recipes/llama3-8b-alpaca-24gb.yaml",
    "recipes/mistral-7b-alpaca-24gb.yaml",
    "recipes/qwen2.5-7b-alpaca-24gb.yaml",
]


def grid(families: list[str], policies=POLICIES, shapes=SHAPES, unpacked=frozenset()) -> list[dict]:
    """Each family x policy x shape once. The other settings rotate with the family, the policy and the
    shape, so that each family meets every format, each family x policy both packings and both
    dropouts and two of the three heads, and each policy every head and both autocasts. The families in
    ``unpacked`` (a linear-attention model: packing is refused, model/recurrent.py) are never packed."""
    cases = []
    for f, family in enumerate(families):
        for p, (policy, every_n) in enumerate(policies):
            for s, (batch, seq) in enumerate(shapes):
                cases.append(
                    {
                        "family": family,
                        "policy": policy,
                        "every_n": every_n,
                        "batch": batch,
                        "seq": seq,
                        "format": FORMATS[(f + 2 * p + s) % 4],
                        "dropout": (0.0, 0.05)[(f + s) % 2],
                        "head": HEADS[(f + p + 2 * s) % 3],
                        "packing": (f + p + s) % 2 == 0 and family not in unpacked,
                        "precision": ("no", "bf16")[(f + p) % 2],
                    }
                )
    return cases


def write_data(folder: Path, fmt: str, seq: int) -> Path:
    """Rows of the format whose trained text is 35-45% of ``seq`` tokens (the demo tokenizer makes
    about 2.8 tokens of these words; a real one fewer)."""
    rng = random.Random(seq)
    path = folder / f"{fmt}-{seq}.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for _ in range(8):
            # of different lengths whatever the tokenizer, so that unpacked batches are padded
            words = rng.randint(int(0.35 * seq / 2.8), int(0.45 * seq / 2.8))
            answer = " ".join(rng.choice(WORDS) for _ in range(words))
            row = {
                "alpaca": {"instruction": "Continue.", "input": "", "output": answer},
                "chat": {
                    "messages": [
                        {"role": "user", "content": "Continue."},
                        {"role": "assistant", "content": answer},
                    ]
                },
                "completion": {"prompt": "Continue:", "completion": answer},
                "text": {"text": answer},
            }[fmt]
            out.write(json.dumps(row) + "\n")
    return path


def recipe_for(case: dict, folder: Path):
    from qlora_kit import Recipe

    return Recipe.from_dict(
        {
            "model": {"path": f"builtin:{case['family']}"},
            "memory": {
                "checkpointing": case["policy"],
                "every_n": case["every_n"],
                "chunked_loss": case["head"] != "off",
                **({"loss_chunk_tokens": 64} if "64" in case["head"] else {}),
            },
            "lora": {"dropout": case["dropout"]},
            "data": {
                "path": str(write_data(folder, case["format"], case["seq"])),
                "format": case["format"],
                "packing": case["packing"],
                "max_seq_len": case["seq"],
            },
            "train": {
                "output_dir": str(folder / "out"),
                "micro_batch_size": case["batch"],
                "mixed_precision": case["precision"],
                "max_steps": 1,
            },
        }
    )


def measure(case: dict, folder: Path) -> tuple[int, int, int, tuple[int, int]]:
    """(measured, planned, of the planned the untrained positions the plan counts as trained, batch
    shape): the run's saved bytes in its one training step, and the plan."""
    from qlora_kit.memory.formula import chunked_head, selected_positions_bytes
    from qlora_kit.memory.planner import plan
    from qlora_kit.training.pipeline import build

    recipe = recipe_for(case, folder)
    setup = build(recipe)
    trainer, batches = setup.trainer, []
    compute_loss = trainer.compute_loss

    def seen(model, inputs, *args, **kwargs):  # the micro-batch the step trains on, as collated
        batches.append(inputs)
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = seen
    # Trainer.train, not a hand-called training_step: only train() wraps the forward pass in
    # accelerate's autocast (accelerator.prepare), as a run does.
    trainer.train()
    measured = trainer.memory_monitor.largest.total
    labels = batches[0]["labels"]
    rows, length = labels.shape
    if case["packing"] and rows == 1:  # a flash kernel's flattened batch: plan the rows it came from
        rows, length = case["batch"], length // case["batch"]
    # as the run plans: with its data's largest trained share (pipeline.build, resolve_checkpointing)
    share = setup.data.largest_trained_share()
    the_plan = plan(recipe, batch=rows, seq=length, device="cpu", trained_share=share)
    untrained = 0
    if chunked_head(the_plan.shape, recipe):  # it keeps trained positions only; the plan bounds how many
        trained = int((labels[:, 1:] != -100).sum())
        untrained = selected_positions_bytes(
            the_plan.shape, recipe, rows, length, the_plan.trained_positions
        ) - selected_positions_bytes(the_plan.shape, recipe, rows, length, trained)
    return measured, the_plan.chosen(recipe).activations, untrained, (rows, length)


def plan_seconds() -> list[list[str]]:
    from qlora_kit import Recipe
    from qlora_kit.memory.planner import plan

    root = Path(__file__).resolve().parents[1]  # the recipes' folder, wherever this is run from
    recipes = [(path, Recipe.from_yaml(root / path)) for path in RECIPES]
    recipes.append(
        ("huggyllama/llama-65b, 1 x 2048", Recipe.from_dict({"model": {"path": "huggyllama/llama-65b"}}))
    )
    rows = []
    for name, recipe in recipes:
        start = time.perf_counter()
        the_plan = plan(recipe, batch=1 if "65b" in name else None, seq=2048 if "65b" in name else None)
        seconds = time.perf_counter() - start
        rows.append([name, str(the_plan.shape.layers), the_plan.activation_source, f"{seconds:.2f}"])
    return rows


def unpackable(families: list[str]) -> frozenset[str]:
    """The builtin families whose rows cannot be packed (their layers carry a state along the row)."""
    from transformers import AutoConfig

    from qlora_kit.model import builtin, recurrent

    return frozenset(
        name
        for name in families
        if name in builtin.TINY_ARCHITECTURES
        and recurrent.packing_refusal(AutoConfig.from_pretrained(builtin.ensure_tiny_model(name)))
    )


def main() -> None:
    from qlora_kit.model import builtin

    args = parser(__doc__).parse_args()
    policies, shapes = SMOKE if args.smoke else (POLICIES, SHAPES)
    if args.real_model:
        families = [REAL_MODEL]
    else:
        families = SMOKE_FAMILIES if args.smoke else sorted(builtin.TINY_ARCHITECTURES)
    rows, errors, exact = [], [], []
    # planning time first: a mistake there must not cost the grid's quarter of an hour
    seconds = None if args.real_model else plan_seconds()
    with tempfile.TemporaryDirectory() as tmp:
        for case in grid(families, policies, shapes, unpackable(families)):
            measured, planned, untrained, (batch, seq) = measure(case, Path(tmp))
            errors.append(planned / measured - 1)
            exact.append((planned - untrained) / measured - 1)
            policy = case["policy"] if case["policy"] != "every_n" else f"every_n={case['every_n']}"
            rows.append(
                [
                    case["family"],
                    policy,
                    f"{batch} x {seq}",
                    case["format"],
                    "on" if case["packing"] else "off",
                    f"{case['dropout']:g}",
                    case["head"],
                    case["precision"],
                    f"{measured / MIB:.2f}",
                    f"{planned / MIB:.2f} ({errors[-1]:+.2%})",
                    f"{untrained / MIB:.2f} ({exact[-1]:+.2%})",
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
    headers = ["model", "policy", "batch x tokens", "format", "packing", "LoRA dropout", "chunked head"]
    headers += ["autocast", "measured MiB", "planned MiB (error)"]
    headers += ["of which untrained positions, MiB (error without them)"]
    table = markdown_table(headers, rows)
    summary = (
        f"{len(rows)} runs; planned against measured: from {min(errors):+.2%} to {max(errors):+.2%} "
        "(target: every row within +-5%, none under -2%). Without the positions the chunked head skips "
        f"that the plan counts as trained: from {min(exact):+.2%} to {max(exact):+.2%}."
    )
    if args.real_model:
        timing, models = (
            "",
            f"the model is the pretrained SmolLM2-135M-Instruct (builtin:{REAL_MODEL}: 30 layers, hidden 576)",
        )
        name, title = (
            f"planner-accuracy-real-{device_name()}",
            "Planner on a real model: predicted vs measured saved-for-backward bytes",
        )
    else:
        timing = markdown_table(["recipe", "layers", "activations", "plan seconds"], seconds)
        timing, models = (
            f"\n\n## Planning time, offline\n\n{timing}",
            "models are the builtin tiny configs (hidden 128, 4 layers)",
        )
        name = f"planner-accuracy-{device_name()}"
        title = (
            "Planner: predicted vs measured saved-for-backward bytes, over the settings that move them (CPU)"
        )
    write_result(
        name,
        title,
        f"{table}\n\n{summary}{timing}",
        "NF4 + double quant, LoRA r=16 all-linear; each architecture's default attention implementation; "
        f"{models}. Measured: the run's own count "
        "(accounting.SavedTensors in GuardedTrainer.compute_loss, the saved_mib it logs) in one "
        "step of Trainer.train of a run set up by pipeline.build. Planned: "
        "memory.planner.plan at that batch's shape, device cpu, the recipe's policy, with the data's largest "
        "trained share of an example as the run plans (PreparedData.largest_trained_share): it counts that "
        "share of the batch's positions as trained, an upper bound, so the prompt and padding positions the "
        "chunked head skips beyond it make it over-predict, by hidden x 2 + 8 bytes each (the last column).",
        args.out,
    )


if __name__ == "__main__":
    main()
