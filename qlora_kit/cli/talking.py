"""``qlora-kit generate`` and ``qlora-kit chat``: a trained adapter answering, streamed token by token.

Both load the run's own recipe with the adapter (``adapters.load_trained``), so a prompt is wrapped in the
format the rows trained on; with ``--image`` a vision-language model sees the images' runs beside the text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from qlora_kit.cli.exits import errors, user_errors
from qlora_kit.cli.exporting import AdapterOpt
from qlora_kit.cli.logging_setup import configure_logging
from qlora_kit.errors import RecipeError
from qlora_kit.recipe.options import Checked

console = Console()

# checked by model/generation.Sampling, which the Python API shares, each naming its option
MaxTokensOpt = Annotated[
    int,
    typer.Option("--max-new-tokens", help="Longest answer, in tokens."),
    Checked("--max-new-tokens", by="Sampling"),
]
TemperatureOpt = Annotated[
    float,
    typer.Option(help="0 decodes greedily (repeatable); above 0 samples."),
    Checked("--temperature", by="Sampling"),
]
TopPOpt = Annotated[
    float,
    typer.Option("--top-p", help="Nucleus sampling mass, with --temperature > 0."),
    Checked("--top-p", by="Sampling"),
]


def register(app: typer.Typer) -> None:
    app.command()(user_errors(generate))
    app.command()(user_errors(chat))


def generate(
    adapter: AdapterOpt,
    # positional like ollama run and llm ("qlora-kit generate --adapter RUN 'a question'"); --prompt too
    prompts: Annotated[
        list[str] | None, typer.Argument(help="Prompts to answer.", show_default=False)
    ] = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="A prompt (repeatable).")] = None,
    file: Annotated[
        Path | None, typer.Option("--file", help='JSONL file, one {"prompt": ...} per line.')
    ] = None,
    raw: Annotated[
        bool, typer.Option(help="Send prompts as they are, without the training prompt format.")
    ] = False,
    max_new_tokens: MaxTokensOpt = 64,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    image: Annotated[
        list[Path] | None,
        typer.Option(
            "--image", help="An image shown with each prompt (repeatable; a vision-language model)."
        ),
    ] = None,
) -> None:
    """Answer prompts with the trained adapter, streaming tokens as they come."""
    configure_logging(errors)
    from qlora_kit.after.generate import Sampling, complete, complete_with_images, image_prompt, wrap_prompt
    from qlora_kit.data import images
    from qlora_kit.data.sources import read_prompts
    from qlora_kit.model import adapters

    prompts = [*(prompts or []), *(prompt or [])] + (read_prompts(str(file)) if file is not None else [])
    if not prompts:
        raise RecipeError("generate: give a prompt (TEXT or --prompt TEXT) or --file prompts.jsonl")
    sampling = Sampling(max_new_tokens, temperature, top_p)  # its mistakes before the weights load
    recipe, tokenizer, lm = adapters.load_trained(adapter)
    if image:  # a vision-language model: the images' runs and pixels beside each prompt
        runs = images.image_runs(recipe.model)
        for text in prompts:
            console.print(f"> {text}", style="bold", highlight=False, markup=False)
            prompt_text = wrap_prompt(image_prompt(text, image, runs), recipe.data, tokenizer)
            complete_with_images(lm, runs, prompt_text, list(image), sampling, stream=True)
        return
    for text in prompts:
        console.print(f"> {text}", style="bold", highlight=False, markup=False)
        complete(
            lm,
            tokenizer,
            text if raw else wrap_prompt(text, recipe.data, tokenizer),
            sampling,
            stream=True,
        )


def chat(
    adapter: AdapterOpt,
    max_new_tokens: MaxTokensOpt = 128,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    image: Annotated[
        list[Path] | None,
        typer.Option(
            "--image",
            help="An image the conversation is about, shown with its first turn (repeatable; a "
            "vision-language model).",
        ),
    ] = None,
) -> None:
    """Talk to the trained adapter; an empty line or Ctrl-D ends the session."""
    configure_logging(errors)
    from qlora_kit.after.generate import Sampling, complete, complete_with_images, image_prompt, wrap_prompt
    from qlora_kit.data import images
    from qlora_kit.model import adapters
    from qlora_kit.registries.formats import FORMATS

    sampling = Sampling(max_new_tokens, temperature, top_p)  # its mistakes before the weights load
    recipe, tokenizer, lm = adapters.load_trained(adapter)
    files = list(image or [])
    runs = images.image_runs(recipe.model) if files else None
    if files:
        image_prompt("", files, runs)  # a text-only model or a missing file: one line before the first turn
    history: list[dict[str, str]] = []
    keeps_history = FORMATS[recipe.data.format].multi_turn
    console.print("chat with the adapter; an empty line ends it", style="dim")
    while True:
        try:
            text = input("you> ").strip()
        except EOFError:
            break
        if not text:
            break
        if files and not history:  # the images lead the first turn, as the training rows put them
            text = image_prompt(text, files, runs)
        console.print("model> ", end="")
        prompt_text = wrap_prompt(text, recipe.data, tokenizer, history)
        if files:  # every turn sees the images: the history keeps their markers
            answer = complete_with_images(lm, runs, prompt_text, files, sampling, stream=True)
        else:
            answer = complete(lm, tokenizer, prompt_text, sampling, stream=True)
        if keeps_history:
            history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
