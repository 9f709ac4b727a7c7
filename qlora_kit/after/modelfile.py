"""The Ollama ``Modelfile`` beside a GGUF export: the prompt as training wrapped it, and its stop tokens.

Ollama's templates are Go templates, not the tokenizer's Jinja, so the Jinja is not translated: it is
rendered around markers and the pieces between them become the Go template. For a run trained on a chat
template (format chat or sharegpt) that is the conversation itself (``chat_template``: each role's text
before and after its content, the conversation's head, the generation prompt), checked at export against
``apply_chat_template`` on single- and multi-turn conversations with and without a system message; a
template that is not a sequence of per-role pieces (Mistral's system prompt moved into the last user turn,
say) keeps the single-turn form. Other formats render the run's own prompt wrapping (``generate.
wrap_prompt``) around ``{{ .Prompt }}``. A model served with a different prompt than it was trained on
answers badly (the "gibberish in Ollama" of a lost template), and one with a missing stop token never stops:
the stop tokens are EOS, the generation config's end ids and the template's end-of-turn token.
"""

from __future__ import annotations

import json
from pathlib import Path

from qlora_kit.after.generate import wrap_prompt
from qlora_kit.model import loading as model
from qlora_kit.registries.formats import FORMATS

MARKER = "\x00PROMPT\x00"
S, U1, A1, U2 = (f"\x00{name}\x00" for name in ("S", "U1", "A1", "U2"))
# the conversations a derived template must render exactly as apply_chat_template does
PROBES = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And again?"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And again?"},
    ],
]


def prompt_template(recipe, tokenizer) -> str:
    """The training prompt with ``{{ .Prompt }}`` where the user's text goes."""
    wrapped = wrap_prompt(MARKER, recipe.data, tokenizer)
    if tokenizer.bos_token and wrapped.startswith(tokenizer.bos_token):
        # llama.cpp adds BOS itself when the GGUF says so; a second one in the template would double it
        wrapped = wrapped[len(tokenizer.bos_token) :]
    before, _, after = wrapped.partition(MARKER)
    return before + "{{ .Prompt }}" + after


def chat_pieces(tokenizer) -> dict[str, str] | None:
    """The chat template as the text around each message's content, for an alternating conversation
    ending in a user turn: how a conversation starts (with a system message or a user one, the template's
    default system prompt included), and what joins each role's content to the next message (``user_end``:
    the generation prompt after the last one); None where the template is not such a sequence."""

    def render(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def between(text: str, start: str | None, end: str | None) -> str:
        begin = text.index(start) + len(start) if start else 0
        return text[begin : text.index(end) if end else len(text)]

    user, assistant = ({"role": r, "content": c} for r, c in (("user", U1), ("assistant", A1)))
    try:
        one, two = render([user]), render([user, assistant, {"role": "user", "content": U2}])
        pieces = {"user_start": between(one, None, U1), "user_end": between(one, U1, None)}
        pieces["user_to_assistant"] = between(two, U1, A1)
        pieces["assistant_to_user"] = between(two, A1, U2)
        pieces["assistant_end"] = between(render([user, assistant]), A1, None)
    except Exception:  # a template that raises on a probe
        return None
    try:
        system = render([{"role": "system", "content": S}, user])
    except Exception:  # a template without a system role (Gemma's raises)
        system = ""
    if S in system:
        pieces["system_start"] = between(system, None, S)
        pieces["system_to_user"] = between(system, S, U1)
    probes = [m for m in PROBES if "system_start" in pieces or m[0]["role"] != "system"]
    if any(render(m) != render_pieces(pieces, m) for m in probes):
        return None
    return pieces


def render_pieces(pieces: dict[str, str], messages: list[dict]) -> str:
    """What the Go template of ``chat_template`` renders for ``messages``, in Python: the check, at
    export, that the pieces are the template."""
    text = pieces[f"{messages[0]['role']}_start"]
    for i, message in enumerate(messages):
        role, last = message["role"], i == len(messages) - 1
        following = {
            "system": "system_to_user",
            "user": "user_to_assistant",
            "assistant": "assistant_to_user",
        }
        text += message["content"] + pieces[f"{role}_end" if last else following[role]]
    return text


def chat_template(pieces: dict[str, str]) -> str:
    """Ollama's Go template over ``.Messages`` from the pieces (Ollama sends the whole conversation)."""

    def literal(text: str) -> str:  # Go's text/template prints a quoted string literal as is
        return "{{ " + json.dumps(text) + " }}" if text else ""

    lines = ["{{- range $i, $_ := .Messages }}", "{{- $last := eq (len (slice $.Messages $i)) 1 }}"]
    branch = "if"
    if "system_start" in pieces:
        lines.append(
            '{{- if eq .Role "system" }}{{ if eq $i 0 }}'
            + literal(pieces["system_start"])
            + "{{ end }}{{ .Content }}"
            + literal(pieces["system_to_user"])
        )
        branch = "else if"
    lines.append(
        f'{{{{- {branch} eq .Role "user" }}}}{{{{ if eq $i 0 }}}}'
        + literal(pieces["user_start"])
        + "{{ end }}{{ .Content }}{{ if $last }}"
        + literal(pieces["user_end"])
        + "{{ else }}"
        + literal(pieces["user_to_assistant"])
        + "{{ end }}"
    )
    lines.append(
        '{{- else if eq .Role "assistant" }}{{ .Content }}{{ if $last }}'
        + literal(pieces["assistant_end"])
        + "{{ else }}"
        + literal(pieces["assistant_to_user"])
        + "{{ end }}"
    )
    lines += ["{{- end }}", "{{- end }}"]
    return "\n".join(lines)


def stop_tokens(tokenizer, folder: Path | None = None, pieces: dict[str, str] | None = None) -> list[str]:
    """EOS, every end-of-generation id the generation config lists, and the chat template's end-of-turn
    token (the special token that closes an assistant turn), as token text."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = folder / "generation_config.json" if folder else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    tokens = {tokenizer.convert_ids_to_tokens(i) for i in ids}
    if pieces is not None:
        closing = pieces["assistant_to_user"].lstrip()
        special = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
        tokens |= {max((t for t in special if closing.startswith(t)), key=len, default=None)} - {None}
    return sorted(tokens)


def write_modelfile(recipe, adapter_dir: Path, folder: Path, files: dict) -> None:
    tokenizer = model.load_tokenizer(recipe.model, path=str(adapter_dir))
    lines = [f"FROM ./{files['gguf']}"]
    if "lora" in files:
        lines.append(f"ADAPTER ./{files['lora']}")
    spec = FORMATS[recipe.data.format]
    pieces = chat_pieces(tokenizer) if spec.chat_template and tokenizer.chat_template else None
    template = chat_template(pieces) if pieces else prompt_template(recipe, tokenizer)
    lines.append(f'TEMPLATE """{template}"""')
    if pieces and recipe.data.system_prompt:
        lines.append(f'SYSTEM """{recipe.data.system_prompt}"""')
    base = Path(model.resolve_model_path(recipe.model))
    for token in stop_tokens(tokenizer, base if base.is_dir() else None, pieces):
        lines.append(f"PARAMETER stop {json.dumps(token)}")
    lines.append("PARAMETER temperature 0")
    (folder / "Modelfile").write_text("\n".join(lines) + "\n", encoding="utf-8")
