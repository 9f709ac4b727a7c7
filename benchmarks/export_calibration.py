"""Calibration of merge's drift check and the export parity report: their statistics over correct and wrong exports of many adapters.

Each adapter is trained on the sweep's chat set (the demo facts as conversations) with the recipe's
defaults but for the grid's layout, rank, learning rate, steps and seed. Its reference is the trained
model as both checks compute it (the 4-bit base with the adapter, in the recipe's compute dtype). Every
candidate is a model of the same architecture whose weights are the dequantized base plus an update:

- correct: the whole update, read as merge's check reads the merged folder (rounded into float16 and
  computed in float16; in bfloat16 likewise, the merged dtype of a family whose activations overflow
  f16), and rounded into q8_0 (the GGUF's floor, read in float32);
- wrong: the update scaled by 0.5 or 0.9, or one layer's update dropped (the middle decoder layer), each
  read as the merged folder is.

For each (adapter, candidate): mean KL(reference || candidate) and top-1 agreement over every position
(what merge judged), over the answer positions (what the parity report judges), and top-1 over the
answer positions whose reference top-1 leads its top-2 by at least a margin (the positions a rounding
cannot flip). With llama.cpp installed (scripts/install_llama_cpp.sh), each adapter's q8_0 GGUF is also
exported and its report's llama.cpp rows kept, and a q8_0 GGUF of the 0.9 update is checked the same
way. The summary gives, per statistic, the worst correct and the best wrong candidate: a bound belongs in
between, with margin.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REAL_MODEL, markdown_table, parser, write_result

MARGINS = (0.5, 1.0)  # nats between the reference's top-1 and top-2 log-probabilities
PROMPTS = 16
# the trained model as the checks computed it (the recipe's compute dtype: bf16 by default), and the same
# weights computed in float32: the bf16 reference's own rounding is most of a correct merge's distance
REFERENCES = {"as trained": None, "fp32": "float32"}


@dataclass(frozen=True)
class Adapter:
    layout: str  # padding, group_by_length, packing or auto
    rank: int
    lr: float
    steps: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.layout} r{self.rank} lr {self.lr:g} {self.steps} steps seed {self.seed}"


GRID = [
    Adapter("padding", 16, 1e-3, 8, 42),
    Adapter("group_by_length", 16, 1e-3, 8, 42),
    Adapter("packing", 16, 1e-3, 8, 42),
    Adapter("auto", 8, 2e-4, 30, 42),
    Adapter("auto", 64, 1e-3, 16, 1),
    Adapter("padding", 32, 5e-4, 60, 1),
]
SMOKE_GRID = [Adapter("padding", 8, 5e-3, 2, 42)]
LAYOUT_FIELDS = {
    "padding": {"data.packing": False},
    "group_by_length": {"data.packing": False, "data.group_by_length": True},
    "packing": {"data.packing": True},
    "auto": {},
}


def chat_files(folder: Path) -> tuple[Path, Path]:
    """The real-model sweep's data: the demo facts as one-turn chats, 16 held-out rows."""
    from qlora_kit.data.demo import demo_data_files

    train_file, val_file = demo_data_files("demo-facts")

    def chat(row: dict) -> dict:
        question = row["instruction"] + (("\n" + row["input"]) if row.get("input") else "")
        return {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": row["output"]},
            ]
        }

    paths = []
    for name, source, rows in (("train", train_file, None), ("val", val_file, 16)):
        lines = [json.loads(line) for line in Path(source).read_text().splitlines()][:rows]
        path = folder / f"chat_{name}.jsonl"
        path.write_text("".join(json.dumps(chat(r)) + "\n" for r in lines))
        paths.append(path)
    return paths[0], paths[1]


def train_adapter(adapter: Adapter, folder: Path, data: tuple[Path, Path], model: str) -> Path:
    """The adapter's run in ``folder``: trained there, or the one a run with the same --work left."""
    from qlora_kit import train

    if (folder / "adapter_model.safetensors").is_file():
        return folder
    return train(adapter_recipe(adapter, folder, data, model)).output_dir


def adapter_recipe(adapter: Adapter, folder: Path, data: tuple[Path, Path], model: str):
    """The recipe the sweep trains ``adapter`` by: the defaults but for the grid's choices and the data."""
    from qlora_kit import Recipe

    values = {
        "model": {"path": model},
        "lora": {"rank": adapter.rank, "alpha": 2.0 * adapter.rank},
        "optimizer": {"lr": adapter.lr},
        "data": {"path": str(data[0]), "val_path": str(data[1]), "format": "chat", "max_seq_len": 64},
        "train": {
            "output_dir": str(folder),
            "max_steps": adapter.steps,
            "micro_batch_size": 4,
            "seed": adapter.seed,
            "logging_steps": max(adapter.steps // 2, 1),
            "sample_prompts": 0,
        },
    }
    return Recipe.from_dict(values, LAYOUT_FIELDS[adapter.layout])


def logits_of(lm, sequences: list[list[int]]) -> list[torch.Tensor]:
    lm.eval()
    with torch.no_grad():
        return [
            lm(input_ids=torch.tensor([ids], device=lm.device)).logits[0, :-1].float().cpu()
            for ids in sequences
        ]


def statistics(reference: list[torch.Tensor], other: list[torch.Tensor], starts: list[int]) -> dict:
    """KL and top-1 over every position and over the answers, top-1 at the answers' decided positions."""
    from qlora_kit.after.parity import kl_per_position

    kl_all, same_all, kl_answer, same_answer, margin_answer = [], [], [], [], []
    for ref, got, start in zip(reference, other, starts, strict=True):
        kl = kl_per_position(ref, got)
        same = (ref.argmax(-1) == got.argmax(-1)).float()
        top2 = torch.log_softmax(ref, -1).topk(2, -1).values
        kl_all.append(kl)
        same_all.append(same)
        kl_answer.append(kl[start - 1 :])
        same_answer.append(same[start - 1 :])
        margin_answer.append((top2[:, 0] - top2[:, 1])[start - 1 :])
    answer_same, margins = torch.cat(same_answer), torch.cat(margin_answer)
    figures = {
        "all KL": float(torch.cat(kl_all).mean()),
        "all top-1": float(torch.cat(same_all).mean()),
        "answer KL": float(torch.cat(kl_answer).mean()),
        "answer top-1": float(answer_same.mean()),
    }
    for margin in MARGINS:
        decided = margins >= margin
        figures[f"top-1 at margin {margin:g}"] = float(answer_same[decided].mean()) if decided.any() else 1.0
    figures["answer positions"] = len(answer_same)
    return figures


def candidates(recipe, adapter_dir: Path):
    """(label, correct?, model) for every candidate, one model reused: its weights set for each."""
    from qlora_kit.after import floor

    merged = floor.merged_model(recipe, adapter_dir, "dequantized")
    base = {
        n: p.detach().clone() for n, p in floor.merged_model(recipe, None, "dequantized").named_parameters()
    }
    effective = {n: p.detach().clone() for n, p in merged.named_parameters()}
    layers = merged.config.get_text_config().num_hidden_layers
    middle = f".layers.{layers // 2}."

    def weights(scale: float = 1.0, dropped: str | None = None) -> dict:
        return {
            n: base[n] if dropped and dropped in n else base[n] + scale * (effective[n] - base[n])
            for n in effective
        }

    for label, correct, chosen, kind in (
        ("merged folder (f16)", True, weights(), "float16"),
        ("merged folder (bf16)", True, weights(), "bfloat16"),  # merge's dtype for Gemma's families
        ("q8_0 floor", True, weights(), "q8_0"),
        ("update x 0.9", False, weights(0.9), "float16"),
        ("update x 0.5", False, weights(0.5), "float16"),
        (f"layer {layers // 2}'s update dropped", False, weights(dropped=middle), "float16"),
    ):
        merged.float()
        with torch.no_grad():
            for name, parameter in merged.named_parameters():
                parameter.copy_(chosen[name])
        floor.round_into(merged, kind)
        # read in the merged folder's dtype, as merge's check reads it (dtype "auto")
        yield label, correct, merged.to(getattr(torch, kind)) if kind in ("float16", "bfloat16") else merged


# The q8_0 GGUFs each adapter's report reads: the right one and wrong merges of it (scale of the update)
GGUF_CANDIDATES = (("q8_0 GGUF", True, 1.0), ("q8_0 GGUF, update x 0.9", False, 0.9))


def gguf_rows(
    adapter_dir: Path, work: Path, readers: tuple[str, ...], scales
) -> list[tuple[str, bool, dict]]:
    """The q8_0 GGUF's comparisons by ``readers`` from its own report, and those of q8_0 GGUFs of wrong
    merges (the update scaled), each with the bound the report derived for it (its ``floor``)."""
    from qlora_kit import export
    from qlora_kit.after import parity
    from qlora_kit.after.export import check_export
    from tests.test_export import write_scaled_gguf

    if "llama.cpp" in readers and not parity.llama_cpp_installed():
        readers = tuple(r for r in readers if r != "llama.cpp")
    settings = {"prompt_count": PROMPTS, "tokens": 1}
    right = work / "q8"
    if not (right / "model.gguf").is_file():
        export(adapter_dir, "gguf", out=right, qtype="q8_0", force=True, **settings)
    rows = []
    for label, correct, scale in scales:
        folder = right if scale == 1.0 else work / f"q8-x{scale:g}"
        if not (folder / "model.gguf").is_file():  # written once per --work folder, read with this code
            folder.mkdir()
            for source in right.iterdir():
                if source.name != "model.gguf":
                    (folder / source.name).write_bytes(source.read_bytes())
            write_scaled_gguf(adapter_dir, folder / "model.gguf", "q8_0", scale)
        report = check_export(adapter_dir, folder, **settings)
        rows += [(label, correct, c) for c in report["comparisons"] if c["reader"] in readers]
    return rows


def llama_cpp_rows(adapter_dir: Path, work: Path) -> list[tuple[str, bool, dict]]:
    """The q8_0 GGUF's llama.cpp comparisons from its own report, and a q8_0 GGUF of the 0.9 update's."""
    return gguf_rows(adapter_dir, work, ("llama.cpp",), GGUF_CANDIDATES)


def main() -> None:
    from qlora_kit.after import floor, parity
    from qlora_kit.model import adapters, loading

    args = PARSER.parse_args()
    model = f"builtin:{REAL_MODEL}" if args.real_model else "builtin:tiny-llama"
    work = args.work or Path(tempfile.mkdtemp(prefix="export-calibration-"))
    print(f"runs and exports in {work} (--work reuses them)", flush=True)
    data = chat_files(work)
    rows, llama_rows, figures, llama_figures, held_out = [], [], [], [], 0
    for index, adapter in enumerate(SMOKE_GRID if args.smoke else GRID):
        run = train_adapter(adapter, work / f"run-{index}", data, model)
        recipe = adapters.recipe_of(run)
        tokenizer = loading.load_tokenizer(recipe.model, path=str(run))
        pairs, _ = parity.prompt_pairs(recipe, tokenizer, None, 2 if args.smoke else PROMPTS)
        prompts = [parity.training_ids(tokenizer, text) for text, _ in pairs]
        answers = [tokenizer(answer, add_special_tokens=False)["input_ids"] for _, answer in pairs]
        sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
        starts = [len(p) for p in prompts]
        held_out = len(sequences)
        references = {}
        for name, dtype in REFERENCES.items():  # the same 4-bit weights and adapter, two arithmetics
            computed = recipe.with_overrides({"quant.compute_dtype": dtype or recipe.quant.compute_dtype})
            references[name] = logits_of(adapters.load_trained(run, computed)[2], sequences)
            floor.free_memory()
        for label, correct, lm in candidates(recipe, run):
            got = logits_of(lm, sequences)
            for name, reference in references.items():
                stats = statistics(reference, got, starts)
                figures.append((name, label, correct, stats))
                rows.append([adapter.name, label, name, *format_figures(stats)])
                print(" | ".join(map(str, rows[-1])), flush=True)
        floor.free_memory()
        if not args.smoke:
            for label, correct, c in llama_cpp_rows(run, work / f"export-{index}"):
                llama_figures.append((f"llama.cpp against the {c['against']}", correct, c))
                llama_rows.append([adapter.name, label, c["against"], f"{c['top1_agreement']:.1%}"])
                llama_rows[-1] += [f"{c['mean_kl']:.4f}", c["positions"]]
                print(" | ".join(map(str, llama_rows[-1])), flush=True)
    columns = ["adapter", "candidate", "reference", "all KL", "all top-1", "answer KL", "answer top-1"]
    columns += [f"top-1 at margin {m:g}" for m in MARGINS] + ["answer positions"]
    tables = [
        markdown_table(columns, rows),
        markdown_table(["reference", "statistic", "worst correct", "best wrong"], summary(figures)),
    ]
    if llama_rows:
        tables.append(
            markdown_table(
                ["reader", "worst correct (top-1, KL)", "best wrong (top-1, KL)"],
                llama_summary(llama_figures),
            )
        )
        tables.append(
            markdown_table(["adapter", "export", "against", "top-1", "mean KL", "positions"], llama_rows)
        )
    notes = (
        f"{model.removeprefix('builtin:')}: {len(rows) // (6 * len(REFERENCES))} adapters on the demo facts as chats (max_seq_len 64, "
        f"micro-batch 4, the recipe's defaults otherwise: bf16 compute, LoRA dropout auto); {held_out} held-out "
        "rows per adapter; references: the trained model as the checks compute it, and in float32. Margins are the reference's "
        "top-1 minus top-2 log-probability at an answer position."
    )
    device = "cpu" if not torch.cuda.is_available() else "gpu"
    write_result(
        f"export-calibration{'-real' if args.real_model else ''}-{device}",
        "Export calibration: merge and parity statistics over correct and wrong exports",
        "\n\n".join(tables),
        notes,
        args.out,
    )


def format_figures(stats: dict) -> list[str]:
    kl = [
        f"{stats['all KL']:.4f}",
        f"{stats['all top-1']:.1%}",
        f"{stats['answer KL']:.4f}",
        f"{stats['answer top-1']:.1%}",
    ]
    return kl + [f"{stats[f'top-1 at margin {m:g}']:.1%}" for m in MARGINS] + [str(stats["answer positions"])]


def summary(figures: list[tuple[str, str, bool, dict]]) -> list[list[str]]:
    """Per reference and statistic: the worst value over correct candidates and the best over wrong ones
    (KL: lower is better; top-1: higher)."""
    rows = []
    for reference in REFERENCES:
        for key in [
            "all KL",
            "all top-1",
            "answer KL",
            "answer top-1",
            *[f"top-1 at margin {m:g}" for m in MARGINS],
        ]:
            correct = [s[key] for ref, _, ok, s in figures if ok and ref == reference]
            wrong = [s[key] for ref, _, ok, s in figures if not ok and ref == reference]
            worst, best = (max(correct), min(wrong)) if "KL" in key else (min(correct), max(wrong))
            show = (lambda v: f"{v:.4f}") if "KL" in key else (lambda v: f"{v:.1%}")
            rows.append([reference, key, show(worst), show(best)])
    return rows


def llama_summary(figures: list[tuple[str, bool, dict]]) -> list[list[str]]:
    """Per comparison (llama.cpp against the trained model, against the floor): the worst correct export's
    top-1 and KL, and the best wrong one's."""
    rows = []
    for reader in dict.fromkeys(name for name, _, _ in figures):
        cells = [reader]
        for ok in (True, False):
            chosen = [c for name, correct, c in figures if name == reader and correct == ok]
            if not chosen:
                cells.append("-")
                continue
            top1 = (min if ok else max)(c["top1_agreement"] for c in chosen)
            kl = (max if ok else min)(c["mean_kl"] for c in chosen)
            cells.append(f"{top1:.1%}, {kl:.4f}")
        rows.append(cells)
    return rows


PARSER = parser(__doc__)
PARSER.add_argument(
    "--work",
    type=Path,
    help="the folder of an earlier run's adapters and exports: measured again, not retrained",
)

if __name__ == "__main__":
    main()
