"""The format registry: one ``FormatSpec`` per ``data.format``, read by everything else.

A spec says which fields a row has, whether a reference answer can be checked exactly (``qlora-kit eval``),
whether a conversation keeps its history (``qlora-kit chat``) and whether rows are preference pairs (and
how their prompt is asked). The recipe's choices, data preparation, generation, evaluation and the CLI
all read it, so adding a format is one entry here plus its two functions and their line in
``data/formats.py``'s ``RENDERINGS`` (which refers to them, so a search finds every caller; this table,
standard library only, sits below data/ and cannot), and its tests. Standard library only: the recipe
reads it.

It also owns the plain-text prompt conventions every format shares: the Stanford Alpaca template and
how ``data.system_prompt`` goes before a plain prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

# The label of a position that is not trained: PyTorch's cross_entropy default ignore_index. The data
# writes it, the loss head and the throughput count read it.
IGNORE_INDEX = -100

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
# the template's fixed text, in order (the builtin tokenizer learns it as words)
ALPACA_FRAMING = ["### Instruction:\n", "\n\n### Input:\n", "\n\n### Response:\n"]


def alpaca_prompt(instruction: str, input_text: str | None = None) -> str:
    """Alpaca's prompt (the Stanford Alpaca template), as format alpaca renders it for SFT."""
    if input_text:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return ALPACA_PROMPT.format(instruction=instruction)


def system_text(system_prompt: str | None) -> str:
    """data.system_prompt as the text before a plain prompt (alpaca, completion, text pairs)."""
    return f"{system_prompt}\n\n" if system_prompt else ""


@dataclass(frozen=True)
class FormatSpec:
    """One data format: its fields and traits (its functions: ``data/formats.py``'s ``RENDERINGS``)."""

    name: str
    fields: tuple[str, ...]  # what a row has (data.fields may rename them)
    optional: frozenset[str] = frozenset()  # fields that may be absent or empty
    checkable: bool = True  # has a reference answer to compare exactly (eval's exact match)
    multi_turn: bool = False  # a conversation: `qlora-kit chat` keeps the history
    chat_template: bool = False  # rendered by the tokenizer's chat template, which adds its own BOS
    # preference pairs (train.objective: dpo): how the prompt is asked (text, alpaca or chat); render
    # gives the prompt and the chosen answer
    pair_kind: str | None = None
    # one answer with a ``label`` field, true for a desirable answer (train.objective: kto); render gives
    # the prompt and the answer
    labelled: bool = False

    @property
    def pairs(self) -> bool:
        return self.pair_kind is not None

    @property
    def rows(self) -> str:
        """What a row is, as the objective table (registries/objectives.py) names it: formats of pairs
        serve only the objectives whose rows are pairs."""
        return "pairs" if self.pairs else "unpaired" if self.labelled else "sequences"


def _chat_format(name: str, conversation: str) -> FormatSpec:
    """A conversation (``messages``, or ShareGPT's ``conversations``) with optional ``tools``, rendered by
    the tokenizer's chat template."""
    return FormatSpec(
        name,
        (conversation, "tools", "images"),  # images: a ShareGPT row's image paths (data/images.py)
        optional=frozenset({"tools", "images"}),
        multi_turn=True,
        chat_template=True,
    )


def _pair_format(name: str, asked: tuple[str, ...], kind: str) -> FormatSpec:
    """Preference pairs (data/preference.py): what is asked, a chosen and a rejected answer."""
    return FormatSpec(
        name,
        (*asked, "chosen", "rejected"),
        optional=frozenset({"input"}),
        chat_template=kind == "chat",
        pair_kind=kind,
    )


def _feedback_format(name: str, chat: bool) -> FormatSpec:
    """Labelled answers (train.objective kto), TRL's unpaired shape: a prompt, one answer (texts; with
    ``chat``, a conversation and the assistant's reply, as TRL's conversational rows) and a label."""
    return FormatSpec(
        name,
        ("prompt", "completion"),  # and the label (labelled), which data/preference.py checks
        checkable=False,  # an undesirable answer is no reference
        chat_template=chat,
        labelled=True,
    )


FORMATS: dict[str, FormatSpec] = {
    spec.name: spec
    for spec in (
        FormatSpec("alpaca", ("instruction", "input", "output"), optional=frozenset({"input"})),
        _chat_format("chat", "messages"),
        _chat_format("sharegpt", "conversations"),
        FormatSpec("completion", ("prompt", "completion")),
        FormatSpec("text", ("text",), checkable=False),
        _pair_format("preference", ("prompt",), "text"),
        _pair_format("preference_alpaca", ("instruction", "input"), "alpaca"),
        _pair_format("preference_chat", ("prompt",), "chat"),
        _feedback_format("feedback", chat=False),
        _feedback_format("feedback_chat", chat=True),
    )
}
