"""Generation with a (possibly adapted) model through transformers' ``generate``; greedy by default."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def complete(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> str:
    """The model's continuation of ``prompt`` (without the prompt), special tokens removed."""
    import torch

    was_training = model.training
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_p": top_p}
        if temperature > 0
        else {"do_sample": False}
    )
    try:
        with torch.no_grad():
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                use_cache=True,
                pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )
    finally:
        model.train(was_training)
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new_tokens, skip_special_tokens=True).strip()
