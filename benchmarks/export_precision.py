"""Where an export loses agreement with the trained model, step by step: the merge in fp32, then rounded once into each export type.

The trained model (4-bit base + adapter, as it ran) is the reference; each row is a model whose weights
are the trained model's effective weights (dequantized base + (alpha / r) * B @ A, in fp32) rounded as an
export stores them (``after/floor.round_into``), read under teacher forcing on the run's validation rows:
top-1 agreement and mean KL(trained || row) at the answer positions (what the parity report judges) and
at every position (what ``merge``'s drift check judges). The rows "via bf16" are what export did before
the merge went to fp32 (the merged folder written in bf16, the GGUF rounded again from it); the rows "update
x 0.5" are a wrong export, the report's negative control. ``--run`` reuses a trained run's folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REAL_MODEL, markdown_table, parser, scratch_folder, write_result

PROMPTS = 16


def trained_run(folder: Path, real: bool, smoke: bool) -> Path:
    """A short chat run: the real model on definitions (tests/e2e/test_real_model.py's set), or tiny-llama."""
    import json

    from qlora_kit import Recipe, train
    from tests.e2e.test_real_model import WORDS, conversation

    rows = [conversation(word, meaning) for word, meaning in WORDS.items()]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:22]))
    (folder / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[22:]))
    overrides = {
        "model.path": f"builtin:{REAL_MODEL}" if real else "builtin:tiny-llama",
        "lora.rank": 8,
        "lora.dropout": 0.0,
        "memory.checkpointing": "none",
        "optimizer.lr": 1e-3 if real else 5e-3,
        "optimizer.warmup_ratio": 0.0,
        "data.path": str(folder / "train.jsonl"),
        "data.val_path": str(folder / "val.jsonl"),
        "data.format": "chat",
        "data.max_seq_len": 96,
        "data.packing": False,
        "train.output_dir": str(folder / "out"),
        "train.max_steps": 2 if smoke else 8,
        "train.micro_batch_size": 4,
        "train.eval_steps": None,
        "train.sample_prompts": 0,
        "train.mixed_precision": "no",
    }
    return train(Recipe.from_yaml(Path(__file__).parents[1] / "recipes" / "demo.yaml", overrides)).output_dir


def sequence_logits(lm, sequences: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [
            lm(input_ids=torch.tensor([ids], device=lm.device)).logits[0].float().cpu() for ids in sequences
        ]


def agreement(reference: list[torch.Tensor], other: list[torch.Tensor], starts: list[int]) -> list[float]:
    """(answer top-1, answer mean KL, all top-1, all mean KL): next-token predictions, positions T-1."""
    from qlora_kit.after.parity import kl_per_position

    figures = {"answer": [[], []], "all": [[], []]}
    for ref, got, start in zip(reference, other, starts, strict=True):
        ref, got = ref[:-1], got[:-1]  # the last position predicts past the sequence
        kl = kl_per_position(ref, got)
        same = (ref.argmax(-1) == got.argmax(-1)).float()
        figures["all"][0].append(same)
        figures["all"][1].append(kl)
        figures["answer"][0].append(same[start - 1 :])
        figures["answer"][1].append(kl[start - 1 :])
    out = []
    for part in ("answer", "all"):
        out += [float(torch.cat(figures[part][0]).mean()), float(torch.cat(figures[part][1]).mean())]
    return out


def main() -> None:
    from qlora_kit.after import floor, parity
    from qlora_kit.model import adapters

    args = PARSER.parse_args()
    if args.run is None:
        args.run = trained_run(scratch_folder("export-precision-"), args.real_model, args.smoke)
    recipe, tokenizer, trained = adapters.load_trained(args.run)
    pairs, source = parity.prompt_pairs(recipe, tokenizer, None, 2 if args.smoke else PROMPTS)
    prompts = [parity.training_ids(tokenizer, text) for text, _ in pairs]
    answers = [tokenizer(answer, add_special_tokens=False)["input_ids"] for _, answer in pairs]
    sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
    starts = [len(p) for p in prompts]
    reference = sequence_logits(trained.eval(), sequences)
    del trained
    merged = floor.merged_model(recipe, args.run, "dequantized")
    base = floor.merged_model(recipe, None, "dequantized")
    effective = {name: p.detach().clone() for name, p in merged.named_parameters()}
    halved = {name: b.detach() + 0.5 * (effective[name] - b.detach()) for name, b in base.named_parameters()}
    del base
    rows = []
    steps = [
        ("fp32 merge", effective, ["float32"]),
        ("rounded into bf16 (merged folder before)", effective, ["bfloat16"]),
        ("rounded into f16", effective, ["float16"]),
        ("f16 GGUF via bf16 (before)", effective, ["bfloat16", "f16"]),
        ("q8_0 GGUF from fp32", effective, ["q8_0"]),
        ("q8_0 GGUF via bf16 (before)", effective, ["bfloat16", "q8_0"]),
        ("update x 0.5, fp32", halved, ["float32"]),
        ("update x 0.5, f16", halved, ["f16"]),
        ("update x 0.5, q8_0", halved, ["q8_0"]),
    ]
    for label, weights, kinds in steps:
        with torch.no_grad():
            for name, parameter in merged.named_parameters():
                parameter.copy_(weights[name])
        for kind in kinds:
            floor.round_into(merged, kind)
        figures = agreement(reference, sequence_logits(merged, sequences), starts)
        rows.append(
            [label, f"{figures[0]:.1%}", f"{figures[1]:.3g}", f"{figures[2]:.1%}", f"{figures[3]:.3g}"]
        )
        print(rows[-1], flush=True)
    positions = sum(len(a) for a in answers)
    model = REAL_MODEL if args.real_model or "smollm" in recipe.model.path else recipe.model.path
    table = markdown_table(
        ["weights", "answer top-1", "answer mean KL", "all-position top-1", "all-position mean KL"], rows
    )
    notes = (
        f"{model}, run {args.run.name}: {len(sequences)} prompts from the {source}, {positions} answer "
        f"positions, {sum(len(s) - 1 for s in sequences)} positions in all; reference: the trained model "
        "(NF4 base + LoRA, compute in bf16 on the CPU). Each row's weights are read by transformers in fp32."
    )
    device = "cpu" if not torch.cuda.is_available() else "gpu"
    name = f"export-precision{'-real' if args.real_model else ''}-{device}"
    write_result(
        name, "Export precision: where agreement with the trained model is lost", table, notes, args.out
    )


PARSER = parser(__doc__)
PARSER.add_argument("--run", type=Path, help="a trained run's folder to measure (else one is trained)")

if __name__ == "__main__":
    main()
