"""Mixture-of-experts QLoRA: the experts' bytes in 4 bits, and the step time of 4-bit experts against 16-bit
experts and against transformers' own experts implementation, with LoRA on the experts at equal settings.

One Qwen3-MoE decoder layer at a realistic size (hidden 2048, 128 experts of intermediate 768, top-8: the
shape of Qwen3-30B-A3B's layers), random weights saved to a folder and loaded through qlora_kit's loading
path (``loading.load_base_model``: transformers + bitsandbytes, then ``moe_experts.quantize_experts``), LoRA
r=16 by ``adapters.attach_lora`` (attention and every expert). Three settings, stepped in turn on the same
tokens (forward + backward):

- 4-bit experts: NF4 + double quant, each routed expert dequantized for its tokens only (moe_experts.py);
- 16-bit experts, the same loop: quant.bits 16, the experts' LoRA in low-rank form as above;
- transformers' experts: quant.bits 16, transformers' experts implementation (grouped_mm where it runs)
  with peft's own ParamWrapper, which adds B @ A to the whole stack at every forward.

Then ``plan`` on the configs of real mixtures (bundled, so no download): the experts' 4-bit bytes and the
planned peak on a GPU, beside the figures their trainers publish.

    python benchmarks/moe.py [--tokens 512 --steps 3]
    python benchmarks/moe.py --smoke --out /tmp/x   # hidden 128, 8 experts, 64 tokens, one step each
    python benchmarks/moe.py --compute-dtype float32  # on CPUs without AVX512-BF16 (bf16 matmuls emulated)

``--expert-counts``: the cost of the expert loop as the experts grow at equal active weights and tokens
(8 experts top-2 of intermediate 3072, 64 and 128 top-8 of 768: Qwen3-30B-A3B's layer has the last). One
layer's mixture block (router, experts, LoRA r=16 on every expert), forward + backward on the same random
states, for each expert count side by side: 4-bit experts looped (the CPU's path) and grouped (CUDA's path,
torch's grouped GEMM, here on its CPU kernel), and 16-bit experts looped (no dequantization: what is left is
the loop's own cost). Timed in process CPU seconds with one torch thread on a CPU, so that other work on a
shared machine does not enter the ratios; on CUDA in wall-clock seconds between two synchronisations (a
GPU's small kernels are launch-bound, which CPU seconds do not show), with 16-bit experts grouped too.
Writes moe-expert-count-DEVICE.md.

    python benchmarks/moe.py --expert-counts --tokens 512 2048 4096
    python benchmarks/moe.py --expert-counts --tokens 512 2048 8192 --out $OUT   # on an H200: ~1-2 min
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import device_name, markdown_table, parser, write_result

REALISTIC = {
    "hidden_size": 2048,
    "num_experts": 128,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
}
SMOKE = {
    "hidden_size": 128,
    "num_experts": 8,
    "moe_intermediate_size": 64,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
SETTINGS = (
    "4-bit experts (qlora_kit)",
    "16-bit experts, same loop",
    "transformers' experts + peft's ParamWrapper",
)


def save_layer(shape: dict, folder: Path) -> None:
    import transformers

    from qlora_kit.model import builtin

    tokenizer = builtin.build_tokenizer()
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer) + 1,
        num_hidden_layers=1,
        intermediate_size=shape["moe_intermediate_size"],
        **shape,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def load(setting: str, folder: Path, compute_dtype: str):
    from qlora_kit import Recipe
    from qlora_kit.model import adapters, moe_experts
    from qlora_kit.model import loading as model

    bits = 4 if setting.startswith("4-bit") else 16
    recipe = Recipe.from_dict(
        {
            "model": {"path": str(folder)},
            "quant": {"bits": bits, "compute_dtype": compute_dtype},
            "lora": {"dropout": 0.0},
        }
    )
    base = model.load_base_model(recipe.model, recipe.quant)
    expert_bytes = moe_experts.bytes_by_kind(base)["experts"]  # before LoRA is attached
    if setting.startswith("transformers"):
        config = adapters.lora_config(recipe.lora, base)
        config._custom_modules = None  # peft's own ParamWrapper on the experts
        from peft import get_peft_model

        return expert_bytes, get_peft_model(base, config).train()
    return expert_bytes, adapters.attach_lora(base, recipe.lora).train()


# (model, what its trainers publish for a QLoRA run of it)
PLANNED = (
    ("Qwen/Qwen3-30B-A3B", "17.5 GB (unsloth's QLoRA)"),
    ("mistralai/Mixtral-8x7B-v0.1", "-"),
)
PLAN_BATCH, PLAN_SEQ = 1, 2048
GIB = 1024**3


def planned_rows() -> list[list[str]]:
    """``plan`` of each real mixture under full checkpointing, LoRA r=16 on attention and every expert, and
    on attention alone (``lora.experts: false``)."""
    from qlora_kit import Recipe
    from qlora_kit.memory.planner import plan

    rows = []
    for (path, published), experts in itertools.product(PLANNED, (True, False)):
        recipe = Recipe.from_dict(
            {
                "model": {"path": path},
                "lora": {"dropout": 0.0, "experts": experts},
                "memory": {"checkpointing": "full"},
            }
        )
        the_plan = plan(recipe, batch=PLAN_BATCH, seq=PLAN_SEQ, device="cuda")
        shape, weights = the_plan.shape, the_plan.weights
        rows.append(
            [
                path,
                "attention and experts" if experts else "attention",
                f"{shape.expert_values / 1e9:.1f} B ({shape.active_expert_values / 1e9:.1f} B active)",
                f"{weights.experts / GIB:.2f}",
                f"{(weights.quantized + weights.unquantized) / GIB:.2f}",
                f"{weights.lora_values / 1e6:,.0f} M",
                f"{the_plan.chosen(recipe).peak / GIB:.2f}",
                published,
            ]
        )
    return rows


# (experts, experts per token): equal active weights when the intermediate width is ACTIVE_WIDTH / top-k
EXPERT_COUNTS = ((8, 2), (64, 8), (128, 8))
ACTIVE_WIDTH = 6144  # Qwen3-30B-A3B: 8 experts of 768 a token
COUNT_SETTINGS = (("4-bit", "looped"), ("4-bit", "grouped"), ("16-bit", "looped"))


def expert_count_blocks(shape: dict, compute_dtype: str, folder: Path) -> dict:
    """{(experts, top-k, bits): the LoRA-wrapped mixture block of a one-layer model}."""
    from qlora_kit import Recipe
    from qlora_kit.model import adapters
    from qlora_kit.model import loading as model

    blocks = {}
    for experts, top_k in EXPERT_COUNTS:
        layer = {**shape, "num_experts": experts, "num_experts_per_tok": top_k}
        layer["moe_intermediate_size"] = active_width(shape) // top_k
        save_layer(layer, folder / f"{experts}")
        for bits in ("4-bit", "16-bit"):
            recipe = Recipe.from_dict(
                {
                    "model": {"path": str(folder / f"{experts}")},
                    "quant": {"bits": int(bits.split("-")[0]), "compute_dtype": compute_dtype},
                    "lora": {"dropout": 0.0},
                }
            )
            peft_model = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora)
            blocks[experts, top_k, bits] = peft_model.train().base_model.model.model.layers[0].mlp
    return blocks


def active_width(shape: dict) -> int:
    """The intermediate values a token runs through: ACTIVE_WIDTH at the realistic hidden size, scaled."""
    return ACTIVE_WIDTH * shape["hidden_size"] // REALISTIC["hidden_size"]


def block_step(block, states) -> float:
    """Seconds of one forward + backward of a mixture block: process CPU seconds on the CPU, wall clock
    between two synchronisations on CUDA."""
    states = states.detach().requires_grad_(True)
    cuda = states.is_cuda
    clock = time.perf_counter if cuda else time.process_time
    if cuda:
        torch.cuda.synchronize(states.device)
    start = clock()
    out = block(states)
    (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
    block.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(states.device)
    return clock() - start


def expert_count_table(args, shape: dict, token_counts: list[int], steps: int) -> str:
    from qlora_kit.model import moe_experts

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        blocks = expert_count_blocks(shape, args.compute_dtype, Path(tmp))
        dtype = getattr(torch, args.compute_dtype)
        device = next(next(iter(blocks.values())).parameters()).device  # where loading put the model
        settings = COUNT_SETTINGS + ((("16-bit", "grouped"),) if device.type == "cuda" else ())
        rows = []
        for tokens in token_counts:
            states = torch.randn(1, tokens, shape["hidden_size"], generator=torch.Generator().manual_seed(0))
            states = states.to(device=device, dtype=dtype)
            runs = [(e, k, bits, path) for e, k in EXPERT_COUNTS for bits, path in settings]
            times = {run: [] for run in runs}
            for repeat in range(steps + 1):  # the first a warm-up step each
                for e, k, bits, path in runs:
                    moe_experts.set_matmul_path(blocks[e, k, bits], path)
                    seconds = block_step(blocks[e, k, bits], states)
                    if repeat:
                        times[e, k, bits, path].append(seconds)
            medians = {run: statistics.median(t) for run, t in times.items()}
            for bits, path in settings:
                first = medians[(*EXPERT_COUNTS[0], bits, path)]
                cells = [
                    f"{medians[(e, k, bits, path)]:.3f} ({medians[(e, k, bits, path)] / first:.2f}x)"
                    for e, k in EXPERT_COUNTS
                ]
                rows.append([str(tokens), f"{bits} experts, {path}", *cells])
    headers = ["tokens", "experts", *(f"{e} experts top-{k} (s)" for e, k in EXPERT_COUNTS)]
    return markdown_table(headers, rows)


def expert_counts_main(args) -> None:
    shape, tokens, steps = (SMOKE, [64], 1) if args.smoke else (REALISTIC, args.tokens, args.steps)
    table = expert_count_table(args, shape, tokens, steps)
    cuda = torch.cuda.is_available()
    clock = "CUDA-synchronised wall-clock seconds" if cuda else "process CPU seconds, one torch thread"
    write_result(
        f"moe-expert-count-{device_name()}",
        "Mixture-of-experts QLoRA: the expert loop's cost as the experts grow, at equal active weights",
        table,
        f"One Qwen3-MoE layer's mixture block: hidden {shape['hidden_size']}, {active_width(shape)} active "
        f"intermediate values a token ({', '.join(f'{e} experts top-{k}' for e, k in EXPERT_COUNTS)}); "
        f"LoRA r=16 on every expert; {args.compute_dtype} weights and compute; forward + backward in {clock}, median of {steps} steps after one warm-up, settings stepped in turn; "
        "in brackets, the ratio to 8 experts top-2 in the same row.",
        args.out,
    )


def step(peft_model, ids) -> float:
    start = time.perf_counter()
    peft_model(input_ids=ids, labels=ids).loss.backward()
    peft_model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--tokens", type=int, nargs="+", default=[512])
    options.add_argument("--steps", type=int, default=3)
    options.add_argument(
        "--compute-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the weights' and LoRA's compute dtype for all three settings",
    )
    options.add_argument(
        "--expert-counts",
        action="store_true",
        help="the expert loop's cost at 8, 64 and 128 experts (equal active weights) instead",
    )
    args = options.parse_args()
    if args.expert_counts:
        return expert_counts_main(args)
    shape, tokens, steps = (SMOKE, 64, 1) if args.smoke else (REALISTIC, args.tokens[0], args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        save_layer(shape, Path(tmp))
        models = {setting: load(setting, Path(tmp), args.compute_dtype) for setting in SETTINGS}
        packed, unpacked = models[SETTINGS[0]][0], models[SETTINGS[1]][0]
        bf16 = unpacked * 2 // getattr(torch, args.compute_dtype).itemsize  # the 16-bit setting's, as bf16
        ids = torch.randint(5, 600, (1, tokens), generator=torch.Generator().manual_seed(0))
        times = {setting: [] for setting in SETTINGS}
        for setting in SETTINGS:  # a warm-up step each
            step(models[setting][1], ids)
        for _ in range(steps):
            for setting in SETTINGS:
                times[setting].append(step(models[setting][1], ids))
    medians = {setting: statistics.median(t) for setting, t in times.items()}
    rows = [
        [
            setting,
            f"{medians[setting]:.3f}",
            f"{medians[setting] / medians[SETTINGS[1]]:.2f}x",
            f"{medians[setting] / medians[SETTINGS[2]]:.2f}x",
        ]
        for setting in SETTINGS
    ]
    table = markdown_table(
        ["experts", "median forward+backward (s)", "vs 16-bit, same loop", "vs transformers'"], rows
    )
    size = (
        f"Expert bytes: {packed / 2**20:,.1f} MiB in 4 bits (packed values and their statistics) vs "
        f"{bf16 / 2**20:,.1f} MiB in bf16 (quant.bits 16's experts at 2 bytes a value): {packed / bf16:.3f}x."
    )
    plans = markdown_table(
        [
            "model",
            "LoRA on",
            "expert weights",
            "experts in 4 bits (GiB)",
            "other weights (GiB)",
            "LoRA parameters",
            "planned peak (GiB)",
            "published",
        ],
        planned_rows(),
    )
    plans_note = (
        f"Planned by `qlora-kit plan` for a GPU: micro-batch {PLAN_BATCH} x {PLAN_SEQ} tokens, full checkpointing, "
        "LoRA r=16 (fp32, with its fp32 gradients and 8-bit state), paged 8-bit AdamW; the CUDA context and allocator "
        "fragmentation come on top. gpt-oss-20b is refused at plan and load alike (its experts carry biases "
        "and a transposed layout qlora_kit does not pack), as the families table says."
    )
    write_result(
        "moe-cpu",
        "Mixture-of-experts QLoRA: 4-bit experts, bytes and step time (CPU)",
        f"{size}\n\n{table}\n\n{plans}\n\n{plans_note}",
        f"One Qwen3-MoE layer: hidden {shape['hidden_size']}, {shape['num_experts']} experts of intermediate "
        f"{shape['moe_intermediate_size']}, top-{shape['num_experts_per_tok']}; {tokens} tokens a step; LoRA r=16 on "
        f"attention and every expert; {args.compute_dtype} weights and compute, no autocast; median of {steps} "
        "steps after one warm-up, settings stepped in turn.",
        args.out,
    )


if __name__ == "__main__":
    main()
