"""The builtin demo datasets (``data.path: builtin:<name>``): the rows shipped in ``qlora_kit/demo``.

Made by ``scripts/make_demo_data.py`` (deterministic), each as a training and a validation file:

- ``demo-facts``: one-word answers to questions (format alpaca), the validation rows in a phrasing
  training never saw; ``demo-facts-mixed``: the same rows split at random (GRPO's demo);
- ``demo-preferences``: the same questions as preference pairs, the right answer and a plausible wrong one
  (format preference_alpaca, DPO's demo);
- ``demo-feedback``: the pairs unpaired, each answer a row of its own labelled desirable or not, the
  prompt framed as alpaca frames it (format feedback, KTO's demo).

The builtin tokenizer is trained on demo-facts (model/builtin.py reads those two files for it).
"""

from __future__ import annotations

from pathlib import Path

BUILTIN = "builtin:"  # the prefix of a builtin dataset's data.path (as of a builtin model's model.path)
DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"
DEMO_DATASETS = {
    "demo-facts": (DEMO_DIR / "train.jsonl", DEMO_DIR / "val.jsonl"),
    # the same rows split at random: held-out questions in phrasings trained with other facts (GRPO's demo)
    "demo-facts-mixed": (DEMO_DIR / "mixed_train.jsonl", DEMO_DIR / "mixed_val.jsonl"),
    # the same questions as preference pairs (format preference): the right answer and a wrong one
    "demo-preferences": (DEMO_DIR / "pairs_train.jsonl", DEMO_DIR / "pairs_val.jsonl"),
    # the pairs' answers as unpaired feedback rows: prompt, completion, label (format feedback)
    "demo-feedback": (DEMO_DIR / "feedback_train.jsonl", DEMO_DIR / "feedback_val.jsonl"),
}


# images of coloured shapes and questions about them, chat rows with image parts (data/shapes.py)
SHAPES = "shapes"


def is_builtin(path: str) -> bool:
    return path.startswith(BUILTIN)


def demo_data_files(name: str) -> tuple[Path, Path]:
    """The training and validation files of builtin dataset ``name`` (``demo-facts``, or
    ``builtin:demo-facts``); ``shapes``, the vision-language demo's images, is drawn into the cache."""
    name = name.removeprefix(BUILTIN)
    if name == SHAPES:
        from qlora_kit.data.shapes import ensure_shapes
        from qlora_kit.model.builtin import cache_root

        return ensure_shapes(cache_root())
    if name not in DEMO_DATASETS:
        known = ", ".join([*DEMO_DATASETS, SHAPES])
        raise ValueError(f"data.path: unknown builtin dataset {name!r} (known: {known})")
    return DEMO_DATASETS[name]
