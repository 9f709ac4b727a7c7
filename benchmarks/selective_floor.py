"""Why selective checkpointing steps as slowly as full checkpointing on the CPU: the decoder layers alone,
timed under each policy and under selective's floor.

The realistic shape of checkpointing_frontier.py (SmolLM widths: hidden 576, intermediate 1536, 9 heads,
3 KV heads) with 4 layers, NF4 + double quant, LoRA r=16 on every linear, 1 x 128 tokens under bf16
autocast; one forward and backward pass of the layers (the head left out: the same under every policy),
CPU seconds of one thread (``torch.set_num_threads(1)``: on a machine other jobs share, the wall clock of
two threads measures them too). Settings:
- none, full, selective: the run's policies;
- selective, bare policy: selective's choice of ops without its observers and byte accounting (is the
  Python policy itself what costs?);
- selective floor: a policy that keeps every op's output (``checkpointing_frontier.floor_policy``), so
  its backward recomputes nothing and pays only the dispatch mode and the replay of the layer's Python:
  the fastest any op-level selective policy can be on these layers.
Each with LoRA dropout 0.05 and without (the dropout's random draws are replayed in a recompute).

    python benchmarks/selective_floor.py [--rounds 7]
    python benchmarks/selective_floor.py --smoke --out /tmp/x   # builtin shape, one round, no warm-up, dropout only
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
from checkpointing_frontier import MODELS, floor_policy
from common import markdown_table, parser, write_result
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

LAYERS = 4


def bare_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    from qlora_kit.memory import selective

    return CheckpointPolicy.MUST_SAVE if selective.keeps(func, args) else CheckpointPolicy.PREFER_RECOMPUTE


SETTINGS = {  # name -> (memory.checkpointing, a policy in place of selective's)
    "none": ("none", None),
    "full": ("full", None),
    "selective": ("selective", None),
    "selective, bare policy": ("selective", bare_policy),
    "selective floor (saves every op)": ("selective", floor_policy),
}


def layers_of(model_name: str, dropout: float, policy: str, replacement):
    from qlora_kit import Recipe
    from qlora_kit.memory import checkpointing
    from qlora_kit.memory.accounting import decoder_layers
    from qlora_kit.model import adapters, builtin
    from qlora_kit.model import loading as model

    shape = {**MODELS[model_name][0], "num_hidden_layers": LAYERS}
    folder = builtin.ensure_tiny_model("tiny-llama", **shape)
    recipe = Recipe.from_dict(
        {"model": {"path": str(folder)}, "memory": {"checkpointing": policy}, "lora": {"dropout": dropout}}
    )
    base = model.load_base_model(recipe.model, recipe.quant)
    checkpointing.enable_checkpointing(base, recipe.memory)
    if replacement is not None:
        context_fn = functools.partial(create_selective_checkpoint_contexts, replacement)
        for layer in decoder_layers(base):
            func = layer._gradient_checkpointing_func
            keywords = {**func.keywords, "context_fn": context_fn}
            layer._gradient_checkpointing_func = functools.partial(func.func, *func.args, **keywords)
    torch.manual_seed(0)
    peft_model = adapters.attach_lora(base, recipe.lora)
    peft_model.train()
    return peft_model, base


def step(peft_model, base, ids) -> tuple[float, float]:
    """(forward, backward) CPU seconds of the layers."""
    from qlora_kit.memory.loss_head import final_hidden_states

    start = time.process_time()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = final_hidden_states(peft_model, {"input_ids": ids}, base)
    forward = time.process_time() - start
    hidden.float().square().mean().backward()
    return forward, time.process_time() - start - forward


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--rounds", type=int, default=7)
    args = options.parse_args()
    # --smoke: the builtin model's shape (the realistic one's 576-wide bf16 matmuls are emulated, seconds each,
    # on CPUs without AVX512-BF16) and no warm-up round: its figures need only be finite
    model_name, rounds, dropouts = (
        ("builtin", 1, (0.05,)) if args.smoke else ("realistic", args.rounds, (0.05, 0.0))
    )
    torch.set_num_threads(1)
    rows = []
    for dropout in dropouts:
        runs = {name: layers_of(model_name, dropout, *setting) for name, setting in SETTINGS.items()}
        vocab = runs["none"][1].config.vocab_size
        ids = torch.randint(0, vocab, (1, 128), generator=torch.Generator().manual_seed(1))
        times = {name: [] for name in runs}
        for round_index in range(1 if args.smoke else 0, rounds + 1):  # round 0 warms up; settings interleave
            for name, (peft_model, base) in runs.items():
                timed = step(peft_model, base, ids)
                if round_index:
                    times[name].append(timed)
        median = {
            name: tuple(statistics.median(t[k] for t in timed) for k in (0, 1))
            for name, timed in times.items()
        }
        none = sum(median["none"])
        full_extra = sum(median["full"]) - none
        for name, (forward, backward) in median.items():
            total = forward + backward
            rows.append([
                f"{dropout:g}", name, f"{forward * 1000:.1f}", f"{backward * 1000:.1f}", f"{total * 1000:.1f}",
                f"{total / none:.3f}x", f"{(total - none) / full_extra:.2f}" if name != "none" else "-",
            ])  # fmt: skip
        print(markdown_table(["dropout", "setting", "..."], rows), flush=True)
    header = [
        "LoRA dropout", "setting", "forward (ms)", "backward (ms)", "layers' step (ms)", "vs none",
        "extra vs full's extra",
    ]  # fmt: skip
    write_result(
        "selective-floor-cpu",
        "Selective checkpointing's floor: the decoder layers alone under each policy (CPU, one thread)",
        markdown_table(header, rows),
        f"{LAYERS} layers of the {model_name} shape (checkpointing_frontier.py), 1 x 128 tokens, bf16 autocast, "
        f"NF4 + double quant, LoRA r=16 all-linear; median CPU seconds of one thread over {rounds} "
        f"interleaved rounds{'' if args.smoke else ' after a warm-up'}; no head, no optimizer step. "
        "The floor keeps every op's output, so "
        "its extra time over none is the dispatch mode (forward) and the layer's Python replayed (backward), "
        "with nothing recomputed but the in-place ops (the dropout's draws).",
        args.out,
    )


if __name__ == "__main__":
    main()
