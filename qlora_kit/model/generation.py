"""A model's continuation of a prompt through transformers' ``generate``: greedy by default (repeatable),
sampling on request, tokens streamed to the terminal. Used for the run's sample answers, ``qlora-kit
generate``/``chat`` and exact-match evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import TextStreamer

from qlora_kit.errors import RecipeError
from qlora_kit.model.modes import in_eval_mode

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 is greedy decoding
    top_p: float = 1.0

    def __post_init__(self) -> None:
        """Settings generate would refuse with a traceback: one line naming the option (exit 2)."""
        if self.max_new_tokens < 1:
            raise RecipeError(f"--max-new-tokens: must be >= 1 (got {self.max_new_tokens})")
        if self.temperature < 0:
            raise RecipeError(f"--temperature: must be >= 0, 0 for greedy decoding (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise RecipeError(f"--top-p: must be in (0, 1] (got {self.top_p})")

    def generate_kwargs(self) -> dict:
        if self.temperature <= 0:
            return {"max_new_tokens": self.max_new_tokens, "do_sample": False}
        return {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }


def complete(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    sampling: Sampling | None = None,
    stream: bool = False,
    max_new_tokens: int | None = None,
) -> str:
    """The model's continuation of ``prompt`` (without the prompt), special tokens removed."""
    sampling = sampling or Sampling()
    kwargs = sampling.generate_kwargs()
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    # Chat templates carry their own BOS; plain prompts get the tokenizer's usual special tokens.
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=not _has_bos(prompt, tokenizer))
    inputs = inputs.to(model.device)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    with in_eval_mode(model), torch.no_grad():
        output = model.generate(
            **inputs, use_cache=True, pad_token_id=tokenizer.pad_token_id, streamer=streamer, **kwargs
        )
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new_tokens, skip_special_tokens=True).strip()


def _has_bos(prompt: str, tokenizer) -> bool:
    return bool(tokenizer.bos_token) and prompt.startswith(tokenizer.bos_token)
