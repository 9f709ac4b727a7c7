"""Prompts for ``train.objective: grpo``: each row as the prompt the model answers and the reference a reward
may check, in the formats that have both (alpaca, completion, chat, sharegpt).

TRL's GRPOTrainer samples the completions itself, so the rows stay text: ``prompt`` (the text a model
continues, framed as SFT framed it: alpaca's template, data.system_prompt; for a conversation, the
messages before its last assistant turn, which TRL renders with the chat template and its generation
prompt), ``reference`` (the answer the format trains on: alpaca's output, the completion, the last
assistant message) and every column of the row, which TRL passes to the reward functions as keywords.

The length policy: a prompt must leave ``grpo.max_completion_length`` tokens of ``data.max_seq_len``
for its completion; longer prompts are left out and counted in the length report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from datasets import Dataset

from qlora_kit.data import format_hints, formats, sources
from qlora_kit.data.chat import apply_system_prompt_mode, sharegpt_messages, with_system_prompt
from qlora_kit.data.mixture import DIGEST, LengthReport, PreparedData, mix_sources, text_digest
from qlora_kit.data.row_tokens import check_columns
from qlora_kit.data.segments import RowError
from qlora_kit.errors import DataError
from qlora_kit.registries.formats import FORMATS

if TYPE_CHECKING:
    from qlora_kit.recipe.data import DataSection

PROMPT, REFERENCE = "prompt", "reference"  # the columns TRL reads and the builtin rewards compare with


def prepare_prompts(data: DataSection, tokenizer, seed: int, completion_tokens: int) -> PreparedData:
    """Training and validation prompts (with references) from the recipe's data, each source in its own
    format; ``completion_tokens``: the room each prompt leaves for its completion."""
    budget = data.max_seq_len - completion_tokens

    def prompts(rows: Dataset, fmt: str, source: str) -> tuple[Dataset, LengthReport]:
        return _prompts(rows, fmt, data, tokenizer, source, budget)

    mixture = mix_sources(data, seed, prompts, common_columns=True)
    train = mixture.train.shuffle(seed=seed) if data.sources else mixture.train
    lengths = list(train["length"])
    made = ["length", DIGEST]  # what only the data path reads: TRL would pass them to the rewards
    val = mixture.val.remove_columns(made) if mixture.val is not None else None
    return mixture.prepared(train.remove_columns(made), val, lengths)


def prompt_and_reference(row: dict[str, Any], fmt: str, tokenizer, data: DataSection) -> tuple[Any, str]:
    """(the prompt: text, or for a conversation its messages before the last assistant turn; the
    reference answer as text); a RowError for a row that has neither."""
    if FORMATS[fmt].chat_template:
        if "conversations" in row and "messages" not in row:
            messages = sharegpt_messages(row["conversations"], data.roles)
        else:
            messages = row["messages"]
        messages = with_system_prompt(messages or [], data.system_prompt)
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None or last == 0:
            raise RowError("no assistant message after a prompt: nothing to compare an answer with")
        prompt = apply_system_prompt_mode(
            [{"role": m["role"], "content": m["content"]} for m in messages[:last]], data.system_prompt_mode
        )
        return prompt, str(messages[last]["content"]).strip()
    segments = formats.render(row, fmt, tokenizer, data)
    answer = next((s.text for s in segments if s.trained), "")
    return formats.prompt_text(segments), answer.removesuffix(tokenizer.eos_token).strip()


def prompt_length(prompt: Any, tokenizer) -> int:
    """The prompt's tokens as TRL tokenizes it: text with the tokenizer's special tokens, a conversation
    with the chat template and its generation prompt."""
    if isinstance(prompt, str):
        return len(tokenizer(prompt)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    return len(ids["input_ids"])


def _prompts(
    rows: Dataset, fmt: str, data: DataSection, tokenizer, source: str, budget: int
) -> tuple[Dataset, LengthReport]:
    if len(rows) == 0:
        raise DataError(f"{source}: no rows")
    check_columns(rows, fmt, source)

    def convert(row: dict[str, Any], index: int) -> dict[str, Any]:
        try:
            prompt, reference = prompt_and_reference(row, fmt, tokenizer, data)
        except (RowError, KeyError, TypeError) as exc:
            raise DataError(f"{source}: row {index + 1}: {exc}{format_hints.row_hint(row, fmt)}") from None
        length = prompt_length(prompt, tokenizer)
        return {
            PROMPT: prompt,
            REFERENCE: reference,
            "length": length,
            DIGEST: text_digest(prompt, reference),
        }

    with sources.quiet_datasets():
        converted = rows.map(convert, with_indices=True, desc="prompts")
    lengths = list(converted["length"])
    keep = [i for i, n in enumerate(lengths) if n <= budget]
    report = LengthReport(
        source=source,
        rows=len(lengths),
        lengths=lengths,
        dropped=len(lengths) - len(keep),
        trained_tokens=None,
    )
    if not keep:
        raise DataError(
            f"{source}: every prompt is over data.max_seq_len - grpo.max_completion_length = {budget} tokens "
            f"(shortest {min(lengths)})"
        )
    return (converted.select(keep) if len(keep) < len(lengths) else converted), report
