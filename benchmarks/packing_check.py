"""Packing is free of cross-attention on every attention kernel this machine has: per-token losses of
packed examples equal the losses of the same examples run one by one.

For each kernel (sdpa, eager, flex_attention; flash_attention_2/3 where installed, on a GPU), the tiny
Llama in 4 bits with a non-zero LoRA adapter scores 24 examples of varied length once each, then packed
into rows of 64 tokens and collated the way a run collates them for that kernel (rows with restarting
positions, or for flash kernels the micro-batch flattened into one varlen sequence). Prints the largest
difference per kernel; a kernel whose examples attended to each other shows differences of order 1.

    python benchmarks/packing_check.py        # here: the kernels available; on the GPU check: all
    python benchmarks/packing_check.py --smoke --out /tmp/x   # 8 examples a kernel

Writes packing-check.json to --out (default: $OUT, else the current folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from common import parser

TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def examples(tokenizer, count: int = 24) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for i in range(count):
        length = int(torch.randint(4, 40, (1,), generator=generator))
        ids = torch.randint(5, len(tokenizer), (length,), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": list(ids), "example": i})
    return rows


def token_losses(peft_model, batch: dict) -> torch.Tensor:
    from qlora_kit.data.formats import IGNORE_INDEX

    device = peft_model.get_base_model().device
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = peft_model(**inputs).logits.float()
    labels = batch["labels"][:, 1:].flatten().to(device)
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels, reduction="none")
    return losses[labels != IGNORE_INDEX].cpu()


def check(kernel: str, compute_dtype: str, count: int) -> float:
    """The largest per-token loss difference, packed against one by one."""
    from datasets import Dataset

    from qlora_kit import Recipe
    from qlora_kit.data import prepare
    from qlora_kit.data.packing import pack_dataset
    from qlora_kit.model import adapters, builtin
    from qlora_kit.model import loading as model

    recipe = Recipe.from_dict(
        {
            "model": {"attn_implementation": kernel},
            "quant": {"compute_dtype": compute_dtype},
            "lora": {"dropout": 0.0},
        }
    )
    peft_model = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora)
    with torch.no_grad():  # a non-zero adapter, so the LoRA path is part of what is compared
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                # the generator on the weight's device: a CPU generator cannot fill a CUDA tensor (the H200 run failed)
                param.normal_(0, 0.05, generator=torch.Generator(device=param.device).manual_seed(1))
    peft_model.eval()
    tokenizer = builtin.build_tokenizer()
    rows = examples(tokenizer, count)
    dataset = Dataset.from_list([{k: r[k] for k in ("input_ids", "labels")} for r in rows])
    packed_rows = pack_dataset(dataset, capacity=64)
    collate = prepare.build_collator(tokenizer, True, kernel)
    packed = token_losses(peft_model, collate([packed_rows[i] for i in range(len(packed_rows))]))
    single = prepare.build_collator(tokenizer, packing=False)
    one_by_one = []
    for row in rows:  # the first token of each example is not predicted in packed rows either
        batch = single([{"input_ids": row["input_ids"], "labels": [-100, *row["labels"][1:]]}])
        one_by_one.append(token_losses(peft_model, batch))
    # Rows reorder examples (longest first): compare the sorted per-token losses.
    expected = torch.cat(one_by_one).sort().values
    assert packed.numel() == expected.numel(), (packed.numel(), expected.numel())
    return float((packed.sort().values - expected).abs().max())


def main() -> None:
    from qlora_kit.registries import attention

    args = parser(__doc__, out=Path(os.environ.get("OUT", "."))).parse_args()
    count = 8 if args.smoke else 24
    cuda = torch.cuda.is_available()
    results = {}
    for kernel in attention.KERNELS:
        spec = attention.kernel(kernel)
        if not spec.available() or (spec.cuda and not cuda and kernel != "flex_attention"):
            results[kernel] = {"skipped": f"needs {spec.needs}" + ("" if cuda else " and a CUDA GPU")}
        else:
            dtype = "bfloat16" if spec.half_precision else "float32"
            difference = check(kernel, dtype, count)
            results[kernel] = {
                "max_difference": difference,
                "dtype": dtype,
                "ok": difference < TOLERANCE[dtype],
            }
        print(f"packing, {kernel:18} {json.dumps(results[kernel])}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "packing-check.json").write_text(json.dumps(results, indent=2))
    if not all(r.get("ok", True) for r in results.values()):
        raise SystemExit("packing let examples attend to each other on some kernel (see above)")


if __name__ == "__main__":
    main()
