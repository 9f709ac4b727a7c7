"""The reference pages rendered from qlora_kit/registries/ (model families, data formats, optimizers,
objectives) and the index of the committed benchmark tables; scripts/docs_reference.py writes them."""

from __future__ import annotations

from pathlib import Path

from docs_markdown import GENERATED, code, page, table, yes

ROOT = Path(__file__).resolve().parents[1]


def families_page() -> str:
    from qlora_kit.registries.families import FAMILIES, Gguf
    from qlora_kit.registries.formats import FORMATS
    from qlora_kit.registries.optimizers import OPTIMIZERS

    family_rows = []
    for family in FAMILIES.values():
        export = (
            f"GGUF (`{family.export.arch.lower()}`)"
            if isinstance(family.export, Gguf)
            else f"no GGUF: {family.export.reason}"
        )
        kind = "vision-language" if family.vision else "mixture of experts" if family.experts else "dense"
        if any(name.startswith("linear_attn.") for name in family.linears):  # model/recurrent.py
            kind += ", linear-attention hybrid (rows not packed)"
        family_rows.append(
            [
                f"`{family.model_type}`",
                f"`builtin:{family.tiny}`",
                kind,
                family.mlp,
                export,
                "yes" if family.system_role else "no",
                family.chat_note,
            ]
        )
    format_rows = [
        [
            f"`{spec.name}`",
            ", ".join(f"`{name}`" for name in spec.fields),
            ", ".join(f"`{name}`" for name in sorted(spec.optional)),
            spec.rows,
            yes(spec.chat_template),
            yes(spec.checkable),
            yes(spec.multi_turn),
        ]
        for spec in FORMATS.values()
    ]
    optimizer_rows = [
        [
            f"`{spec.name}`",
            f"`{spec.class_path}`",
            "8-bit" if spec.eight_bit else "32-bit",
            yes(spec.paged),
            yes(spec.shards),
        ]
        for spec in OPTIMIZERS.values()
    ]
    return page(
        "# Model families, data formats and optimizers",
        GENERATED,
        "## Model families",
        "One entry per transformers `model_type` in `qlora_kit/registries/families.py`: the 4-bit loader, "
        "LoRA's targets, the planner, the builtin tiny models and export all read it. Each family's tiny "
        "model trains on the CPU as `model.path: builtin:<name>`; a real checkpoint of the same `model_type` "
        "loads from its folder or hub id.",
        table(
            ["model_type", "builtin", "kind", "MLP", "export", "system turn", "chat template notes"],
            family_rows,
        ),
        "A mixture of experts packs in 4 bits whatever its `model_type` where transformers declares its "
        "experts (`use_experts_implementation`), checked against the model's own forward at load; one whose "
        "experts are not declared (Llama 4's) is refused in one line naming them (docs/moe.md).",
        *support_table(),
        "## Data formats",
        "`data.format` (and each source's `format`), from `qlora_kit/registries/formats.py`; "
        "`data.fields` renames the fields. Rows are what the objective trains on (see the objectives).",
        table(FORMAT_COLUMNS, format_rows),
        "## Optimizers",
        "`optimizer.name`, from `qlora_kit/registries/optimizers.py`.",
        table(["name", "class", "state", "paged", "steps FSDP2's sharded parameters"], optimizer_rows),
    )


MATRIX = "benchmarks/results/families-matrix.md"


def support_table() -> list[str]:
    """The committed table of benchmarks/families_matrix.py, included whole from its command line on (a rerun
    that grows it moves the range: this page is then stale until regenerated)."""
    lines = (ROOT / MATRIX).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines, 1) if line.startswith("- command: "))
    return [
        "## Every causal LM in transformers",
        "Beyond the families above, `benchmarks/families_matrix.py` runs every `model_type` of transformers' "
        "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` as a tiny random model from its own config, saved into a folder as "
        "a checkpoint would be: 4-bit loading, LoRA on all linear layers, two training steps with full "
        "checkpointing, the planner against the run's saved bytes, merge, and the adapter loaded back by plain "
        "peft. Each row works, is refused in one line (and where), or fails with the first line of its error; "
        "the types that are not decoder-only text models are skipped, saying why. Rerun it to see your "
        "transformers release.",
        f'--8<-- "{MATRIX}:{start}:{len(lines)}"',
    ]


FORMAT_COLUMNS = [
    "format",
    "fields",
    "optional",
    "rows",
    "chat template",
    "exact match in eval",
    "multi-turn chat",
]
OBJECTIVE_COLUMNS = [
    "objective",
    "a row is",
    "data formats",
    "trainer",
    "its recipe section",
    "frozen reference",
    "packs rows",
    "chunked loss head",
    "splits a batch on OOM",
    "tries the worst batch first",
    "data preflight",
]


def objectives_page() -> str:
    from qlora_kit.registries.formats import FORMATS
    from qlora_kit.registries.objectives import OBJECTIVES

    rows = [
        [
            f"`{spec.name}`",
            spec.rows,
            ", ".join(f"`{name}`" for name, fmt in FORMATS.items() if fmt.rows == spec.rows)
            if spec.rows != "prompts"
            else ", ".join(
                f"`{name}`" for name, fmt in FORMATS.items() if fmt.rows == "sequences" and fmt.checkable
            ),
            f"`{spec.trainer}`",
            code(spec.section or ""),
            yes(spec.reference),
            yes(spec.packs),
            yes(spec.chunked_head),
            yes(spec.splits_on_oom),
            yes(spec.probes_worst_batch),
            yes(spec.preflight),
        ]
        for spec in OBJECTIVES.values()
    ]
    return page(
        "# Objectives",
        GENERATED,
        "`train.objective`, from `qlora_kit/registries/objectives.py`: every objective runs on the same 4-bit "
        "base, LoRA, checkpointing, guards and checkpoints; the table says what differs. "
        "[Objectives](../objectives.md) explains each one.",
        table(OBJECTIVE_COLUMNS, rows),
    )


def benchmarks_page() -> str:
    """Every committed table of benchmarks/results/, with the command that wrote it and its date, read from
    the table's own header lines (each script writes them): the pages link these, never retype them."""
    rows = []
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.md")):
        lines = path.read_text(encoding="utf-8").splitlines()
        title = lines[0].lstrip("# ").strip() if lines else path.stem
        facts = dict(line[2:].split(": ", 1) for line in lines[1:8] if line.startswith("- ") and ": " in line)
        rows.append([f"[{title}](../results/{path.name})", facts.get("command", ""), facts.get("date", "")])
    return page(
        "# Benchmark tables",
        GENERATED,
        "Every measured figure the documentation quotes comes from one of these committed tables "
        "(`benchmarks/results/`), each written by its script with its command, date and machine; the suite "
        "checks that each still has the form its script writes (`tests/e2e/test_benchmarks.py`). Rerun the "
        "command to measure again on your machine.",
        table(["table", "command", "date"], rows),
    )
