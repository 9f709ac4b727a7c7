"""Write the demo datasets shipped in qlora_kit/demo/ (deterministic; rerun to regenerate).

Each fact is asked with several phrasings. Training rows use all phrasings but the last; validation
rows use the last one, so validation exact-match measures whether the adapter learned the fact,
not the sentence. Answers are one word, so they can be checked exactly.

builtin:demo-facts-mixed holds the same rows split at random instead (build_mixed).
builtin:demo-feedback holds the pairs' answers as unpaired rows labelled desirable or not (build_feedback).

The preference pairs (builtin:demo-preferences, format preference_alpaca, train.objective dpo) ask the
same questions as the instruction rows, chosen = the right answer, rejected = a plausible wrong one:
another answer of the same relation (a color for a color, a city for a city).

    python scripts/make_demo_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from qlora_kit.registries.formats import alpaca_prompt

RELATIONS = {
    "color": (
        [
            "What color is {x}?",
            "Name the color of {x}.",
            "Which color does {x} have?",
            "Tell me the color of {x}.",
        ],
        {
            "a banana": "yellow",
            "a lemon": "yellow",
            "a lime": "green",
            "grass": "green",
            "a cherry": "red",
            "a tomato": "red",
            "the sky": "blue",
            "the sea": "blue",
            "snow": "white",
            "milk": "white",
            "coal": "black",
            "a crow": "black",
            "a carrot": "orange",
            "a pumpkin": "orange",
            "a plum": "purple",
            "a grape": "purple",
        },
    ),
    "sound": (
        [
            "What sound does {x} make?",
            "Which noise does {x} make?",
            "How does {x} sound?",
            "Tell me the sound of {x}.",
        ],
        {
            "a cow": "moo",
            "a dog": "woof",
            "a cat": "meow",
            "a duck": "quack",
            "a sheep": "baa",
            "a pig": "oink",
            "a horse": "neigh",
            "an owl": "hoot",
            "a lion": "roar",
            "a snake": "hiss",
            "a bee": "buzz",
            "a frog": "croak",
        },
    ),
    "opposite": (
        [
            "What is the opposite of {x}?",
            "Give the opposite of {x}.",
            "Which word means the opposite of {x}?",
            "Tell me the opposite of {x}.",
        ],
        {
            "hot": "cold",
            "big": "small",
            "up": "down",
            "day": "night",
            "fast": "slow",
            "happy": "sad",
            "open": "closed",
            "early": "late",
            "light": "dark",
            "full": "empty",
            "high": "low",
            "wet": "dry",
            "hard": "soft",
            "loud": "quiet",
            "old": "young",
            "rich": "poor",
        },
    ),
    "capital": (
        [
            "What is the capital of {x}?",
            "Name the capital city of {x}.",
            "Which city is the capital of {x}?",
            "Tell me the capital of {x}.",
        ],
        {
            "France": "Paris",
            "Japan": "Tokyo",
            "Italy": "Rome",
            "Spain": "Madrid",
            "Egypt": "Cairo",
            "Kenya": "Nairobi",
            "Peru": "Lima",
            "Canada": "Ottawa",
            "Norway": "Oslo",
            "Greece": "Athens",
            "Cuba": "Havana",
            "Chile": "Santiago",
        },
    ),
}
INSTRUCTION_WITH_INPUT = "Answer the question with one word."


def build_rows() -> tuple[list[dict], list[dict]]:
    train, val = [], []
    for templates, facts in RELATIONS.values():
        for subject, answer in facts.items():
            *train_templates, val_template = templates
            for i, template in enumerate(train_templates):
                question = template.format(x=subject)
                # Every third phrasing goes through alpaca's input field, so both shapes are trained.
                if i == 2:
                    train.append({"instruction": INSTRUCTION_WITH_INPUT, "input": question, "output": answer})
                else:
                    train.append({"instruction": question, "input": "", "output": answer})
            val.append({"instruction": val_template.format(x=subject), "input": "", "output": answer})
    random.Random(0).shuffle(train)
    random.Random(1).shuffle(val)
    return train, val


def build_pairs(rows: list[dict], seed: int) -> list[dict]:
    """Preference pairs for instruction rows (format preference_alpaca): the right answer, a wrong one."""
    rng = random.Random(seed)
    answers_of = {}
    for _, facts in RELATIONS.values():
        for answer in facts.values():
            answers_of[answer] = sorted(set(facts.values()) - {answer})
    return [
        {
            "instruction": row["instruction"],
            "input": row["input"],
            "chosen": row["output"],
            "rejected": rng.choice(answers_of[row["output"]]),
        }
        for row in rows
    ]


def build_feedback(pairs: list[dict]) -> list[dict]:
    """The pairs unpaired (builtin:demo-feedback, format feedback, train.objective kto): each answer a row of
    its own, the prompt framed as alpaca frames it, labelled desirable (the right answer) or not."""
    rows = []
    for pair in pairs:
        prompt = alpaca_prompt(pair["instruction"], pair["input"])
        rows.append({"prompt": prompt, "completion": pair["chosen"], "label": True})
        rows.append({"prompt": prompt, "completion": pair["rejected"], "label": False})
    return rows


def build_mixed(train: list[dict], val: list[dict]) -> tuple[list[dict], list[dict]]:
    """The same rows split at random (builtin:demo-facts-mixed, the GRPO demo's): a held-out question's
    phrasing is trained with other facts and its fact with other phrasings, so what reinforcement
    learning sharpens on the training questions can carry over (demo-facts holds one phrasing out whole)."""
    rows = train + val
    random.Random(1).shuffle(rows)
    return rows[len(val) :], rows[: len(val)]


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "qlora_kit" / "demo"
    out.mkdir(parents=True, exist_ok=True)
    train, val = build_rows()
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(val, out / "val.jsonl")
    train_pairs, val_pairs = build_pairs(train, seed=2), build_pairs(val, seed=3)
    write_jsonl(train_pairs, out / "pairs_train.jsonl")
    write_jsonl(val_pairs, out / "pairs_val.jsonl")
    write_jsonl(build_feedback(train_pairs), out / "feedback_train.jsonl")
    write_jsonl(build_feedback(val_pairs), out / "feedback_val.jsonl")
    mixed_train, mixed_val = build_mixed(train, val)
    write_jsonl(mixed_train, out / "mixed_train.jsonl")
    write_jsonl(mixed_val, out / "mixed_val.jsonl")
    print(f"wrote {len(train)} train and {len(val)} validation rows (and as many pairs) to {out}")


if __name__ == "__main__":
    main()
