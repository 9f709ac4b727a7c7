"""The parity report: does what a user serves behave like what was trained?

The reference is the trained model itself (the 4-bit base with the adapter, as ``load_trained`` builds
it) on held-out prompts (the run's validation rows, or a prompts file): its logits on the answer tokens,
its greedy continuation of N tokens, and the prompt as training tokenized it. Each export is read back by
a reader that shares no code with the writer (transformers' own loaders for safetensors and for GGUF,
llama.cpp through ``llama-cpp-python`` where it is installed) and compared with it: max and mean
|Δ logit| on the answer tokens, greedy-token agreement, and the rendered chat prompt (template and
BOS) byte for byte. One model is in memory at a time; the reference's figures are kept on the host.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from qlora_kit.after.generate import wrap_prompt
from qlora_kit.data import prepare
from qlora_kit.errors import RecipeError
from qlora_kit.model import adapters
from qlora_kit.registries import families

if TYPE_CHECKING:
    from pathlib import Path

PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What color is the sky?"}]


@dataclass
class Reference:
    """What the trained model does on the held-out prompts (every tensor on the host, fp32)."""

    prompts: list[list[int]]  # the prompt ids as training tokenized them
    answers: list[list[int]]  # the reference answer's ids (or the trained model's own greedy ones)
    logits: list[torch.Tensor]  # (answer length, V) per prompt
    greedy: list[list[int]]
    prompt_texts: list[str]
    rendered: str | None  # the tokenizer's chat template on PROBE, generation prompt added


@dataclass
class Comparison:
    export: str  # which file or folder
    reader: str  # transformers or llama.cpp
    against: str  # trained (the adapter on the 4-bit base) or merged (the dequantized merged model)
    max_abs_logit: float
    mean_abs_logit: float
    greedy_agreement: float
    tokens: int
    prompt_ids_match: bool | None = None
    template_match: bool | None = None
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


# The last reference computed, by what it was computed from: the 4-bit model's greedy tokens are most of
# an export's time on a CPU, and exporting one run several ways (f16, q8_0, merged) asks for the same ones.
_LAST_REFERENCE: dict[tuple, Reference] = {}


def reference_of(adapter_dir: Path, recipe, prompts: list[str] | None, count: int, tokens: int) -> Reference:
    """The trained model's figures on ``prompts`` (wrapped as training saw them) or the validation rows."""
    files = sorted(
        (p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in adapter_dir.iterdir() if p.is_file()
    )
    key = (str(adapter_dir), tuple(files), tuple(prompts or ()), count, tokens)
    if key not in _LAST_REFERENCE:
        _LAST_REFERENCE.clear()
        _LAST_REFERENCE[key] = _compute_reference(adapter_dir, recipe, prompts, count, tokens)
    return _LAST_REFERENCE[key]


def _compute_reference(
    adapter_dir: Path, recipe, prompts: list[str] | None, count: int, tokens: int
) -> Reference:
    _, tokenizer, trained = adapters.load_trained(adapter_dir, recipe)
    if prompts:
        pairs = [(wrap_prompt(text, recipe.data, tokenizer), None) for text in prompts[:count]]
    else:
        prepared = prepare.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
        examples = prepare.prompt_examples(prepared, recipe.data, tokenizer, count)
        if not examples:
            raise RecipeError(
                "export: the parity report needs validation rows in the run's recipe, or --prompts"
            )
        pairs = [(ex.prompt, ex.reference) for ex in examples]
    reader = _TransformersModel(trained, tokenizer)
    ids = [_training_ids(tokenizer, text) for text, _ in pairs]
    greedy = [reader.greedy(p, tokens) for p in ids]
    answers = [
        tokenizer(answer, add_special_tokens=False)["input_ids"] if answer else own
        for (_, answer), own in zip(pairs, greedy, strict=True)
    ]
    logits = [reader.answer_logits(p, a) for p, a in zip(ids, answers, strict=True)]
    rendered = _render(tokenizer)
    del trained, reader
    free_memory()
    return Reference(ids, answers, logits, greedy, [text for text, _ in pairs], rendered)


def reference_from_reader(reference: Reference, reader) -> Reference:
    """The same prompts and answers with another model's figures (the merged model, for a GGUF's
    quantization drift); prompt and template checks stay the trained model's."""
    logits = [reader.answer_logits(p, a) for p, a in zip(reference.prompts, reference.answers, strict=True)]
    greedy = [reader.greedy(p, len(g)) for p, g in zip(reference.prompts, reference.greedy, strict=True)]
    return Reference(
        reference.prompts, reference.answers, logits, greedy, reference.prompt_texts, reference.rendered
    )


def compare(reference: Reference, reader, export: str, against: str) -> Comparison:
    """One reader of one export against the reference's figures."""
    deltas = []
    for prompt, answer, expected in zip(reference.prompts, reference.answers, reference.logits, strict=True):
        deltas.append((reader.answer_logits(prompt, answer) - expected).abs())
    agree = total = 0
    for prompt, expected in zip(reference.prompts, reference.greedy, strict=True):
        got = reader.greedy(prompt, len(expected))
        agree += sum(a == b for a, b in zip(got, expected, strict=False))
        total += len(expected)
    every = torch.cat([d.flatten() for d in deltas])
    result = Comparison(
        export, reader.name, against, float(every.max()), float(every.mean()), agree / max(total, 1), total
    )
    if against == "trained":
        result.prompt_ids_match = all(
            reader.served_ids(text) == ids
            for text, ids in zip(reference.prompt_texts, reference.prompts, strict=True)
        )
        rendered = reader.render()
        result.template_match = None if reference.rendered is None else rendered == reference.rendered
    return result


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _training_ids(tokenizer, text: str) -> list[int]:
    # as generation.complete tokenizes a prompt: a chat template carries its own BOS
    has_bos = bool(tokenizer.bos_token) and text.startswith(tokenizer.bos_token)
    return tokenizer(text, add_special_tokens=not has_bos)["input_ids"]


def _render(tokenizer) -> str | None:
    if not tokenizer.chat_template:
        return None
    return tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)


class _TransformersModel:
    """A transformers model and its tokenizer as a reader: logits, greedy tokens, served prompt ids."""

    name = "transformers"

    def __init__(self, lm, tokenizer) -> None:
        self.lm, self.tokenizer = lm.eval(), tokenizer

    @torch.no_grad()
    def _logits(self, ids: list[int]) -> torch.Tensor:
        batch = torch.tensor([ids], device=self.lm.device)
        return self.lm(input_ids=batch).logits[0].float().cpu()  # (T, V)

    def answer_logits(self, prompt: list[int], answer: list[int]) -> torch.Tensor:
        """The logits that predict each answer token, (len(answer), V)."""
        logits = self._logits(prompt + answer)
        return logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)]

    @torch.no_grad()
    def greedy(self, prompt: list[int], count: int) -> list[int]:
        # N argmax steps with no stop token, the same for every reader (llama.cpp's and transformers'
        # generate differ in how they stop, not in what they predict); the KV cache carries the prefix
        output = self.lm(input_ids=torch.tensor([prompt], device=self.lm.device), use_cache=True)
        tokens: list[int] = []
        for _ in range(count):
            tokens.append(int(output.logits[0, -1].argmax()))
            step = torch.tensor([[tokens[-1]]], device=self.lm.device)
            output = self.lm(input_ids=step, past_key_values=output.past_key_values, use_cache=True)
        return tokens

    def served_ids(self, text: str) -> list[int]:
        """The ids a server sends for a prompt text: the tokenizer's own special-token rule."""
        return self.tokenizer(text)["input_ids"]

    def render(self) -> str | None:
        return _render(self.tokenizer)


def transformers_reader(folder: Path, gguf_file: str | None = None, dtype: torch.dtype = torch.float32):
    """transformers' own loader for a merged folder or a GGUF file in it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file, "config": _gguf_config(folder, gguf_file)} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file) if gguf_file else None
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(folder)
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    return _TransformersModel(lm, tokenizer)


# Keys the GGUF states that transformers' GGUF loader (integrations/ggml.py) does not map to the config, or
# maps to an attribute the config class no longer reads: without them it takes the config class's
# defaults, right only when the model happens to use those. (key suffix, config attribute) per GGUF arch,
# from the families table (registries/families.py: Gguf.unmapped_keys).
UNMAPPED_KEYS = {f.export.arch.lower(): list(f.export.unmapped_keys) for f in families.exportable().values()}


def _gguf_config(folder: Path, gguf_file: str):
    """transformers' GGUF config, with the values the file states that its loader does not read."""
    import gguf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    reader = gguf.GGUFReader(folder / gguf_file)
    arch = reader.fields["general.architecture"].contents()
    for suffix, attribute in UNMAPPED_KEYS.get(arch, []):
        value = reader.fields.get(f"{arch}.{suffix}")
        if value is not None:
            setattr(config, attribute, value.contents())
    if families.by_gguf_arch(arch).derives_attention_scale:
        # no key holds Gemma-2's attention scale: llama.cpp derives it (1/sqrt(head size), or of
        # hidden/heads at 46 layers), where transformers' loader keeps the config class's 256
        heads = config.num_attention_heads
        wide = config.num_hidden_layers == 46
        config.query_pre_attn_scalar = config.hidden_size // heads if wide else config.head_dim
    return config


def llama_cpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_reader(path: Path, lora: Path | None = None):
    """llama.cpp itself, through llama-cpp-python (with a LoRA GGUF applied); None where it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return _LlamaCppModel(llama_cpp, path, lora)


class _LlamaCppModel:
    name = "llama.cpp"

    def __init__(self, llama_cpp, path: Path, lora: Path | None) -> None:
        self.llm = llama_cpp.Llama(
            str(path),
            n_ctx=512,
            logits_all=True,
            verbose=False,
            n_threads=2,
            lora_path=str(lora) if lora else None,
        )

    def _logits(self, ids: list[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(ids)
        return torch.tensor(self.llm.scores[: len(ids)], dtype=torch.float32)

    def answer_logits(self, prompt: list[int], answer: list[int]) -> torch.Tensor:
        logits = self._logits(prompt + answer)
        return logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)]

    def greedy(self, prompt: list[int], count: int) -> list[int]:
        ids = list(prompt)
        for _ in range(count):
            ids.append(int(self._logits(ids)[-1].argmax()))
        return ids[len(prompt) :]

    def served_ids(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=self.llm._model.add_bos_token(), special=True)

    def render(self) -> str | None:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = self.llm.metadata.get("tokenizer.chat_template")
        if template is None:
            return None
        formatter = Jinja2ChatFormatter(template, eos_token="", bos_token="", add_generation_prompt=True)
        return formatter(messages=PROBE).prompt
