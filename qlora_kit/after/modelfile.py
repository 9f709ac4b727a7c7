"""The Ollama ``Modelfile`` beside a GGUF export: the prompt as training wrapped it, and its stop tokens.

Ollama's templates are Go templates, not the tokenizer's Jinja, so the template is not translated: the
run's own prompt wrapping (``generate.wrap_prompt``: the data format, its system prompt, the chat
template for chat formats) is rendered around a marker and the marker replaced by ``{{ .Prompt }}``.
A model served with a different prompt than it was trained on answers badly (the "gibberish in Ollama"
of a lost template), and one with a missing stop token never stops.
"""

from __future__ import annotations

import json
from pathlib import Path

from qlora_kit.after.generate import wrap_prompt
from qlora_kit.model import loading as model

MARKER = "\x00PROMPT\x00"


def prompt_template(recipe, tokenizer) -> str:
    """The training prompt with ``{{ .Prompt }}`` where the user's text goes."""
    wrapped = wrap_prompt(MARKER, recipe.data, tokenizer)
    if tokenizer.bos_token and wrapped.startswith(tokenizer.bos_token):
        # llama.cpp adds BOS itself when the GGUF says so; a second one in the template would double it
        wrapped = wrapped[len(tokenizer.bos_token) :]
    before, _, after = wrapped.partition(MARKER)
    return before + "{{ .Prompt }}" + after


def stop_tokens(tokenizer, folder: Path | None = None) -> list[str]:
    """EOS and every end-of-generation id the generation config lists, as token text."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = folder / "generation_config.json" if folder else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted({tokenizer.convert_ids_to_tokens(i) for i in ids})


def write_modelfile(recipe, adapter_dir: Path, folder: Path, files: dict) -> None:
    tokenizer = model.load_tokenizer(recipe.model, path=str(adapter_dir))
    lines = [f"FROM ./{files['gguf']}"]
    if "lora" in files:
        lines.append(f"ADAPTER ./{files['lora']}")
    lines.append(f'TEMPLATE """{prompt_template(recipe, tokenizer)}"""')
    base = Path(model.resolve_model_path(recipe.model))
    for token in stop_tokens(tokenizer, base if base.is_dir() else None):
        lines.append(f"PARAMETER stop {json.dumps(token)}")
    lines.append("PARAMETER temperature 0")
    (folder / "Modelfile").write_text("\n".join(lines) + "\n", encoding="utf-8")
