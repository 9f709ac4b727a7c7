"""Per op and module: what a real CPU forward of a recipe's model saved for backward, and what the plan's trace counted.

The model is loaded as the run loads it (4-bit, the recipe's checkpointing, peft LoRA); the batch is
``--batch`` rows of ``--seq`` random tokens, with a padding mask when ``--padded`` (one row a quarter
shorter). The run's loss is transformers' (full logits); the trace counts the chunked head's selection in
closed form, so under ``memory.chunked_loss`` the head's rows are the run's alone. The largest
differences print first (``qlora_kit/memory/saved_by_op.py``):

    python scripts/saved_by_op.py recipes/demo.yaml --batch 2 --seq 128 --padded
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from qlora_kit import Recipe
    from qlora_kit.memory import checkpointing, saved_by_op
    from qlora_kit.model import adapters, loading

    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("recipe")
    args.add_argument("--batch", type=int, default=2)
    args.add_argument("--seq", type=int, default=256)
    args.add_argument("--padded", action="store_true", help="the run's batch carries a padding mask")
    args.add_argument("--precision", default="no", choices=["no", "bf16"], help="bf16: under bf16 autocast")
    args.add_argument("--rows", type=int, default=30, help="how many (module, op) rows to print")
    given = args.parse_args()
    recipe = Recipe.from_yaml(given.recipe)
    base = loading.load_base_model(recipe.model, recipe.quant)
    checkpointing.enable_checkpointing(base, recipe.memory)
    peft_model = adapters.attach_lora(base, recipe.lora)
    ids = torch.randint(5, base.config.get_text_config().vocab_size, (given.batch, given.seq))
    batch = {"input_ids": ids, "labels": ids}
    if given.padded:
        batch["attention_mask"] = torch.ones_like(ids)
        batch["attention_mask"][-1, given.seq * 3 // 4 :] = 0
    measured = saved_by_op.measured_by_op(peft_model, batch, given.precision)
    traced = saved_by_op.traced_by_op(
        base.config, recipe, given.batch, given.seq, padded=given.padded, precision=given.precision
    )
    print(saved_by_op.table(saved_by_op.compare(measured, traced), given.rows))


if __name__ == "__main__":
    main()
