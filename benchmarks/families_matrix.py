"""Every causal LM in transformers' auto mapping, as a tiny random model, through qlora_kit: the support table.

For each ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, a tiny model is built from
its own config (tiny_configs.py: hidden 64, 2 layers or as many as its pattern of layer kinds needs, 4
heads, MLP 128, at most 4 experts, the builtin tokenizer's vocabulary) with random weights and saved with
the builtin tokenizer into a folder; then a recipe naming that folder runs through qlora_kit as a user's
would: ``pipeline.run`` loads it in 4 bits, puts LoRA on all linear layers and trains two steps with full
checkpointing on builtin:demo-facts, the planner's saved-for-backward bytes are compared with the run's own
count (its ``saved_mib``), the adapter is merged (``merge_adapter``, its drift check included) and loaded
back onto the 16-bit model by plain peft. One row each: works, refused (the one line qlora_kit gave, and where), failed (the first line of
the exception, and where), or skipped (not a decoder-only text model, and why). A vision-language model
runs where qlora_kit's families table builds it with its processor offline (its builtin); the others
are skipped. Each model runs in a process of its own (forked, with a time limit), so that a crash or a
hang costs its row only.

    python benchmarks/families_matrix.py                          # every model_type (7 minutes on 2 cores)
    python benchmarks/families_matrix.py --types llama,gpt2 --out /tmp/x
    python benchmarks/families_matrix.py --smoke --out /tmp/x     # SAMPLE, as the suite runs it
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from common import markdown_table, parser, write_result
from tiny_configs import build_model, not_decoder_only

# --smoke's sample (tests/e2e/test_benchmarks.py): one that works, one qlora_kit refuses, one skipped
SAMPLE = ("llama", "falcon", "bert")
TIME_LIMIT_S = 300  # one model's row; a hang past it is a failed row
MIB = 2**20
WORKS, REFUSED, FAILED, SKIPPED = "works", "refused", "failed", "skipped"


@dataclass
class Row:
    model_type: str
    outcome: str  # WORKS, REFUSED, FAILED or SKIPPED
    stage: str = ""  # where it stopped: build, run, plan, merge, reload
    line: str = ""  # qlora_kit's refusal, the exception's first line, or why it is skipped
    measured: int | None = None  # bytes the run saved for backward (its largest forward pass)
    planned: int | None = None  # the planner's, at that batch's shape, for full checkpointing
    four_bit: float | None = None  # the share of the trained model's weight matrices held in 4 bits
    seconds: float = 0.0

    def cells(self) -> list[str]:
        result = self.outcome if self.outcome == WORKS else f"{self.outcome} ({self.stage}): {self.line}"
        if self.outcome == SKIPPED:
            result = f"skipped: {self.line}"
        measured = f"{self.measured / MIB:.3f}" if self.measured is not None else "-"
        planned = "-"
        if self.planned is not None and self.measured:
            planned = f"{self.planned / MIB:.3f} ({self.planned / self.measured - 1:+.1%})"
        cell = result.replace("|", "/").replace("\n", " ")
        four_bit = f"{self.four_bit:.0%}" if self.four_bit is not None else "-"
        return [f"`{self.model_type}`", cell, four_bit, measured, planned, f"{self.seconds:.0f}"]


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def recipe_for(path: Path, out: Path):
    from qlora_kit import Recipe

    return Recipe.from_dict(
        {
            "model": {"path": str(path)},
            "quant": {"compute_dtype": "float32"},  # the CPU's (the demo recipes')
            "lora": {"target_modules": "all-linear", "dropout": 0.0},
            # transformers' loss head: its bytes do not hang on which positions the data trains
            "memory": {"checkpointing": "full", "chunked_loss": False},
            "data": {"path": "builtin:demo-facts", "max_seq_len": 64, "packing": False},
            "train": {
                "output_dir": str(out),
                "max_steps": 2,
                "micro_batch_size": 2,
                "logging_steps": 1,
                "mixed_precision": "no",
                "report_to": [],
                "probe_worst_batch": False,
            },
        }
    )


def shapes_callback():
    """A Trainer callback keeping the shape of each batch the model's forward takes in ``seen`` (the
    planner plans the largest)."""
    from transformers import TrainerCallback

    class Shapes(TrainerCallback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, int]] = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            def keep(module, positional, named):
                if named.get("input_ids") is not None:
                    self.seen.append(tuple(named["input_ids"].shape))

            model.register_forward_pre_hook(keep, with_kwargs=True)

    return Shapes()


def check_model_type(model_type: str, folder: Path) -> Row:
    """``model_type``'s row, computed in this process (``folder``: scratch space)."""
    from qlora_kit.errors import DataError, OutputDirError, RecipeError, TrainingGuardError

    start, row = time.perf_counter(), Row(model_type, WORKS)
    stage = "build"
    try:
        skip = not_decoder_only(model_type)
        if skip:
            return Row(model_type, SKIPPED, line=skip)
        path = build_model(model_type, folder / "model")
        stage = "run"
        recipe, shapes = recipe_for(path, folder / "run"), shapes_callback()
        from qlora_kit.training import pipeline

        result = pipeline.run(recipe, callbacks=[shapes])
        row.measured = int(result.memory["saved_mib"] * MIB)
        row.four_bit = four_bit_share(result.model.get_base_model())
        stage = "plan"
        row.planned = planned_bytes(recipe, shapes.seen)
        stage = "merge"
        from qlora_kit.after.merge import merge_adapter

        merge_adapter(result.output_dir, folder / "merged")
        stage = "reload"
        reload_with_plain_peft(path, result.output_dir)
    except (RecipeError, DataError, OutputDirError) as exc:  # what the CLI prints as one line
        row.outcome, row.stage, row.line = REFUSED, stage, _first_line(exc)
    except TrainingGuardError as exc:  # a guard's one line (the CLI's "training stopped:")
        row.outcome, row.stage, row.line = REFUSED, stage, f"training stopped: {_first_line(exc)}"
    except Exception as exc:
        row.outcome, row.stage, row.line = FAILED, stage, f"{type(exc).__name__}: {_first_line(exc)}"
        traceback.print_exc()
    row.seconds = time.perf_counter() - start
    return row


def four_bit_share(model) -> float:
    """Of the weight matrices a 4-bit load should quantize, the share it did: every matrix but the embeddings,
    the output head, a vision-language model's vision side and LoRA's own (a tied matrix counted once). A
    model's own subclass of nn.Linear, or experts qlora_kit does not pack, stay in 16 bits."""
    import bitsandbytes as bnb
    import torch

    from qlora_kit.model import expert_stacks, vision

    facet, head = vision.vision_of(model.config), model.get_output_embeddings()
    four_bit = sixteen_bit = 0
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            four_bit += module.in_features * module.out_features
        elif isinstance(module, expert_stacks.ExpertStats):  # a packed stack's (experts, out, in)
            four_bit += module.shape[0] * module.shape[1] * module.shape[2]
        elif not (
            module is head or isinstance(module, torch.nn.Embedding) or vision.on_vision_side(name, facet)
        ):
            for param_name, param in module.named_parameters(recurse=False):
                packed = hasattr(module, f"{param_name}_4bit")  # a packed stack in its storage dtype
                if param.dim() < 2 or not param.is_floating_point() or packed or param.requires_grad:
                    continue
                if id(param) not in seen:
                    seen.add(id(param))
                    sixteen_bit += param.numel()
    return four_bit / (four_bit + sixteen_bit)


def planned_bytes(recipe, shapes: list[tuple[int, int]]) -> int:
    """The planner's saved-for-backward bytes at the largest batch the run trained on."""
    from qlora_kit.memory.planner import plan

    batch, seq = max(shapes, key=lambda shape: shape[0] * shape[1])
    return plan(recipe, batch=batch, seq=seq, device="cpu").chosen(recipe).activations


def reload_with_plain_peft(path: Path, adapter: Path) -> None:
    """The adapter onto the 16-bit model by plain transformers and peft: every tensor it saved lands."""
    import torch
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from qlora_kit.model import peft_3711, vision

    base = vision.auto_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32)
    with peft_3711.targets_kept(base):  # peft 0.21.2 would move shared experts' LoRA (model/peft_3711.py)
        model = PeftModel.from_pretrained(base, str(adapter))
    saved = load_file(adapter / "adapter_model.safetensors")
    loaded = get_peft_model_state_dict(model)
    if saved.keys() != loaded.keys():
        missing = sorted(set(saved) ^ set(loaded))
        raise AssertionError(
            f"plain peft's adapter differs from the saved one in {len(missing)} tensors: {missing[:3]}"
        )
    differing = [
        name for name, tensor in saved.items() if not torch.equal(loaded[name].to(tensor.dtype), tensor)
    ]
    if differing:
        raise AssertionError(f"plain peft loaded other values for {len(differing)} tensors: {differing[:3]}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def _child(model_type: str, folder: str, log: str, send) -> None:
    with open(log, "w") as out:  # its output (the Trainer's, a traceback) goes to its log
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    send.send(check_model_type(model_type, Path(folder)))
    send.close()


def row_in_own_process(model_type: str, logs: Path, limit_s: float = TIME_LIMIT_S) -> Row:
    """``check_model_type`` in a forked process, its output in LOGS/MODEL_TYPE.log: a crash or a hang is a
    failed row, not the table's end."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    start = time.perf_counter()
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{model_type}.log"
    with tempfile.TemporaryDirectory(prefix=f"matrix-{model_type}-") as folder:
        process = context.Process(target=_child, args=(model_type, folder, str(log), send))
        process.start()
        send.close()
        try:
            row = receive.recv() if receive.poll(limit_s) else None
        except EOFError:  # the child died without a row (a crash): its log says how
            row = None
        process.join(5 if row is not None else 0)
        if process.is_alive():
            process.kill()
            process.join()
    if row is None:
        why = (
            f"killed after {limit_s:.0f} s" if process.exitcode in (None, -9) else f"exit {process.exitcode}"
        )
        row = Row(model_type, FAILED, "process", f"the process ended without a row ({why})")
        row.seconds = time.perf_counter() - start
    return row


NOTES = (
    "Each row: a tiny random model of that model_type (hidden 64, 2 layers or as many as its pattern of "
    "layer kinds needs, the builtin tokenizer; benchmarks/families_matrix.py), loaded in 4 bits (NF4), LoRA r=16 "
    "on all linear layers, two steps of pipeline.run with full checkpointing on builtin:demo-facts (2 x 64 "
    "tokens at most), the planner at the largest batch's shape against the run's own saved-for-backward count, "
    "merge_adapter (its drift check included), and the adapter loaded back onto the 16-bit model by plain peft. "
    "works: every step passed; refused: qlora_kit's one-line error (where: run is pipeline.run, which loads, "
    "attaches LoRA, trains and saves); failed: the exception's first line (where; build: the tiny model could "
    "not be made from transformers' config); skipped: why it is not run. Weights in 4 bits: of the weight "
    "matrices but the embeddings, the output head and a vision tower, the share the run held in 4 bits."
)


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--types", default=None, help="comma-separated model_types (default: all)")
    options.add_argument("--logs", type=Path, default=None, help="keep each model's output in LOGS/TYPE.log")
    args = options.parse_args()
    # the parent imports what every row needs, once: each forked row starts with it loaded
    import transformers

    from qlora_kit.training import pipeline  # noqa: F401

    types = args.types.split(",") if args.types else list(SAMPLE) if args.smoke else model_types()
    with tempfile.TemporaryDirectory(prefix="families-matrix-logs-") as scratch:
        rows = []
        for model_type in types:
            rows.append(row_in_own_process(model_type, args.logs or Path(scratch)))
            print(" | ".join(rows[-1].cells()), flush=True)
    header = ["model_type", "result", "weights in 4 bits", "saved for backward, measured (MiB)"]
    header += ["planned (MiB, error)", "s"]
    write_result(
        "families-matrix",
        "Every causal LM in transformers, tiny and random, through qlora_kit",
        f"{summary(rows, transformers.__version__)}\n\n{markdown_table(header, [r.cells() for r in rows])}",
        NOTES,
        args.out,
    )


def summary(rows: list[Row], version: str) -> str:
    counts = {kind: sum(r.outcome == kind for r in rows) for kind in (WORKS, REFUSED, FAILED, SKIPPED)}
    partly = [
        f"`{r.model_type}` ({r.four_bit:.0%})" for r in rows if r.four_bit is not None and r.four_bit < 0.9
    ]
    text = (
        f"transformers {version}, {len(rows)} model types: {counts[WORKS]} work, {counts[REFUSED]} refused in one "
        f"line, {counts[FAILED]} failed with an error, {counts[SKIPPED]} skipped."
    )
    if partly:
        text += f" Of those that work, these keep more than a tenth of their weights in 16 bits: {', '.join(partly)}."
    return text


if __name__ == "__main__":
    main()
