"""The parity report: does what a user serves behave like what was trained?

The reference is the trained model itself (the 4-bit base with the adapter, computed in float32:
``floor.load_trained_exactly``) on prompts with answers (the run's validation rows, a fixed seeded sample of its training rows, or a
prompts file answered by the trained model itself): its logits at each answer position under teacher
forcing, its greedy continuation of N tokens, and the prompt as training tokenized it. Each export is
read back by a reader that shares no code with the writer (transformers' own loaders for safetensors and
for GGUF, llama.cpp itself where node-llama-cpp is installed: ``llama_cpp_reader``) and compared with it:
top-1 agreement and mean KL(trained || export) at the answer positions (what is judged), |Δ logit|, the
free-running greedy agreement (shown: one early flip there parts every later token), and the rendered chat
prompt (template and BOS) byte for byte. One model is in memory at a time; the reference's figures are
kept on the host.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from qlora_kit.after import floor
from qlora_kit.after.generate import wrap_prompt
from qlora_kit.after.image_parity import ImageInputs, folder_inputs, image_prompts
from qlora_kit.data import images, prepare, prompt_examples
from qlora_kit.errors import RecipeError
from qlora_kit.model import gguf_reads, vision
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
    source: str = "validation rows"  # where the prompts came from, named in the report
    # a vision-language run's image rows: each prompt's image files, which every reader's own processor
    # turns into its model's pixels (after/image_parity.py); None for text prompts
    images: list[tuple[str, ...]] | None = None

    def images_of(self, index: int) -> dict:
        """The keyword a reader takes for prompt ``index``'s images (none for a text prompt)."""
        return {"images": self.images[index]} if self.images and self.images[index] else {}


@dataclass
class Comparison:
    export: str  # which file or folder
    reader: str  # transformers or llama.cpp
    against: str  # trained (the adapter on the 4-bit base) or merged (the dequantized merged model)
    top1_agreement: float  # the same argmax at the decided answer positions, under teacher forcing
    mean_kl: float  # KL(reference || export) per answer position
    positions: int  # answer positions
    max_abs_logit: float
    mean_abs_logit: float
    greedy_agreement: float  # free-running: shown, not judged
    tokens: int
    greedy_prompts: int = 0  # prompts whose whole greedy continuation is the reference's
    decided: int = 0  # answer positions the reference has decided (DECIDED): where top-1 is counted
    floor: dict | None = None  # the figures of the export's own type, and what was allowed
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
    key = (*floor.adapter_state(adapter_dir), tuple(prompts or ()), count, tokens)
    if key not in _LAST_REFERENCE:
        _LAST_REFERENCE.clear()
        _LAST_REFERENCE[key] = _compute_reference(adapter_dir, recipe, prompts, count, tokens)
    return _LAST_REFERENCE[key]


def _compute_reference(
    adapter_dir: Path, recipe, prompts: list[str] | None, count: int, tokens: int
) -> Reference:
    _, tokenizer, trained = floor.load_trained_exactly(adapter_dir, recipe)
    runs = images.image_runs(recipe.model)
    reader = TransformersModel(trained, tokenizer, ImageInputs(runs) if runs else None)
    if runs is not None and not prompts:  # its rows hold images: asked through the vision path
        return _image_reference(reader, image_prompts(recipe, runs, tokenizer, count), tokens)
    pairs, source = prompt_pairs(recipe, tokenizer, prompts, count)
    ids = [training_ids(tokenizer, text) for text, _ in pairs]
    # with no reference answer (--prompts), the trained model's own greedy answer is teacher-forced
    length = max(tokens, 8)
    greedy = [
        reader.greedy(p, max(tokens, 0 if answer else length))
        for p, (_, answer) in zip(ids, pairs, strict=True)
    ]
    answers = [
        tokenizer(answer, add_special_tokens=False)["input_ids"] if answer else own[:length]
        for (_, answer), own in zip(pairs, greedy, strict=True)
    ]
    greedy = [g[:tokens] for g in greedy]
    logits = [reader.answer_logits(p, a) for p, a in zip(ids, answers, strict=True)]
    rendered = _render(tokenizer)
    del trained, reader
    floor.free_memory()
    return Reference(ids, answers, logits, greedy, [text for text, _ in pairs], rendered, source)


def _image_reference(reader: TransformersModel, asked, tokens: int) -> Reference:
    """The trained model's figures on a vision-language run's image rows (image_parity.image_prompts)."""
    logits, greedy = [], []
    for prompt, answer, files in zip(asked.prompts, asked.answers, asked.images, strict=True):
        logits.append(reader.answer_logits(prompt, answer, images=files))
        greedy.append(reader.greedy(prompt, tokens, images=files))
    rendered = _render(reader.tokenizer)
    return Reference(
        asked.prompts, asked.answers, logits, greedy, asked.texts, rendered, asked.source, asked.images
    )


def prompt_pairs(recipe, tokenizer, prompts: list[str] | None, count: int) -> tuple[list, str]:
    """(prompt text, reference answer or None) pairs, and where they came from: ``--prompts`` first, then
    the validation rows; a run without either has its own training prompts, a fixed seeded sample (the
    report measures the export's fidelity to the trained model, not generalization)."""
    if prompts:
        return [(wrap_prompt(text, recipe.data, tokenizer), None) for text in prompts[:count]], "--prompts"
    prepared = prepare.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
    examples = prompt_examples.prompt_examples(prepared, recipe.data, tokenizer, count)
    source = "validation rows"
    if not examples:
        examples, source = prompt_examples.training_prompt_examples(
            recipe.data, tokenizer, count, recipe.train.seed
        )
    if not examples:
        raise RecipeError(
            "export: the run's recipe names no rows to take parity prompts from; pass --prompts"
        )
    return [(ex.prompt, ex.reference) for ex in examples], source


def reference_from_reader(reference: Reference, reader) -> Reference:
    """The same prompts and answers with another model's figures (the merged model, for a GGUF's
    quantization drift); prompt and template checks stay the trained model's."""
    logits, greedy = [], []
    for i, (p, a, g) in enumerate(zip(reference.prompts, reference.answers, reference.greedy, strict=True)):
        logits.append(reader.answer_logits(p, a, **reference.images_of(i)))
        greedy.append(reader.greedy(p, len(g), **reference.images_of(i)))
    return Reference(
        reference.prompts,
        reference.answers,
        logits,
        greedy,
        reference.prompt_texts,
        reference.rendered,
        reference.source,
        reference.images,
    )


def compare(reference: Reference, reader, export: str, against: str) -> Comparison:
    """One reader of one export against the reference's figures."""
    deltas, kl, agree, decided = [], [], 0, 0
    for i, (prompt, answer, expected) in enumerate(
        zip(reference.prompts, reference.answers, reference.logits, strict=True)
    ):
        got = reader.answer_logits(prompt, answer, **reference.images_of(i)).float()
        deltas.append((got - expected).abs().flatten())
        kl.append(kl_per_position(expected, got))
        sure = decided_positions(expected)
        agree += int(((got.argmax(-1) == expected.argmax(-1)) & sure).sum())
        decided += int(sure.sum())
    greedy_agree = total = whole = 0
    for i, (prompt, expected) in enumerate(zip(reference.prompts, reference.greedy, strict=True)):
        got = reader.greedy(prompt, len(expected), **reference.images_of(i))
        greedy_agree += sum(a == b for a, b in zip(got, expected, strict=False))
        total += len(expected)
        whole += list(got) == list(expected)
    every, kls = torch.cat(deltas), torch.cat(kl)
    result = Comparison(
        export,
        reader.name,
        against,
        top1_agreement=agree / decided if decided else 1.0,
        mean_kl=float(kls.mean()),
        positions=len(kls),
        decided=decided,
        max_abs_logit=float(every.max()),
        mean_abs_logit=float(every.mean()),
        greedy_agreement=greedy_agree / max(total, 1),
        tokens=total,
        greedy_prompts=whole,
    )
    if against == "trained" and hasattr(reader, "served_ids") and not reference.images:
        # an image row's ids hold its image runs, which a prompt's text alone cannot make: the reader's
        # processor is judged through the logits it gives on the row instead
        result.prompt_ids_match = all(
            reader.served_ids(text) == ids
            for text, ids in zip(reference.prompt_texts, reference.prompts, strict=True)
        )
        rendered = reader.render()
        result.template_match = (
            None if reference.rendered is None or rendered is None else rendered == reference.rendered
        )
    return result


# Top-1 agreement counts only the positions where the reference's choice leads its runner-up by DECIDED
# nats: an export's rounding (q8_0's weights, llama.cpp's 8-bit activations, f16's) moves logits by
# hundredths of a nat, so a flip there is an error, while a near-tie flips under any rounding (the real
# model's q8_0 file read by llama.cpp: 3 of 24 answer positions flipped, every one a near-tie, at a KL
# inside its bound; benchmarks/results/export-calibration-real-cpu.md: 100% at every correct export's
# decided positions).
DECIDED = 1.0


def decided_positions(logits: torch.Tensor) -> torch.Tensor:
    """(T,) booleans: where the log-probability of ``logits``' top-1 leads its top-2 by >= DECIDED."""
    top2 = torch.log_softmax(logits.float(), dim=-1).topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1] >= DECIDED


def kl_per_position(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) at each position, (T,), from two (T, V) logit tensors."""
    p = torch.log_softmax(reference_logits.float(), dim=-1)
    q = torch.log_softmax(logits.float(), dim=-1)
    return torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1)


def training_ids(tokenizer, text: str) -> list[int]:
    """A prompt's ids as generation.complete tokenizes it: a chat template carries its own BOS."""
    has_bos = bool(tokenizer.bos_token) and text.startswith(tokenizer.bos_token)
    return tokenizer(text, add_special_tokens=not has_bos)["input_ids"]


def _render(tokenizer) -> str | None:
    if not tokenizer.chat_template:
        return None
    return tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)


class TransformersModel:
    """A transformers model and its tokenizer as a reader: logits, greedy tokens, served prompt ids; for a
    vision-language model, ``inputs`` makes an image prompt's pixels (image_parity.ImageInputs)."""

    name = "transformers"

    def __init__(self, lm, tokenizer, inputs: ImageInputs | None = None) -> None:
        self.lm, self.tokenizer, self.inputs = lm.eval(), tokenizer, inputs

    @torch.no_grad()
    def _logits(self, ids: list[int], images: tuple[str, ...] = ()) -> torch.Tensor:
        batch = torch.tensor([ids], device=self.lm.device)
        if images:
            return self.lm(**self.inputs(batch, images)).logits[0].float().cpu()
        return self.lm(input_ids=batch).logits[0].float().cpu()  # (T, V)

    def answer_logits(
        self, prompt: list[int], answer: list[int], images: tuple[str, ...] = ()
    ) -> torch.Tensor:
        """The logits that predict each answer token, (len(answer), V)."""
        logits = self._logits(prompt + answer, images)
        return logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)]

    @torch.no_grad()
    def greedy(self, prompt: list[int], count: int, images: tuple[str, ...] = ()) -> list[int]:
        # N argmax steps with no stop token, the same for every reader (llama.cpp's and transformers'
        # generate differ in how they stop, not in what they predict); the KV cache carries the prefix
        if images:
            # the whole row again each step: an image row's positions follow its image (Qwen-VL's M-RoPE
            # grid), which a cached step would have to carry as generate does
            tokens: list[int] = []
            for _ in range(count):
                tokens.append(int(self._logits(prompt + tokens, images)[-1].argmax()))
            return tokens
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
    """transformers' own loader for a merged folder or a GGUF file in it; a vision-language model's folder
    with its own auto class and its own processor's pixels."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if gguf_file is None:
        config = AutoConfig.from_pretrained(folder)
        lm = vision.auto_class(config).from_pretrained(folder, dtype=dtype)
        return TransformersModel(lm, AutoTokenizer.from_pretrained(folder), folder_inputs(folder, config))
    with gguf_reads.parsed_once():  # its config, tokenizer and weights from one parse of the file
        kwargs = {"gguf_file": gguf_file, "config": _gguf_config(folder, gguf_file)}
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    return TransformersModel(lm, tokenizer)


# Keys the GGUF states that transformers' GGUF loader (integrations/ggml.py) does not map to the config, or
# maps to an attribute the config class no longer reads: without them it takes the config class's
# defaults, right only when the model happens to use those. (key suffix, config attribute) per GGUF arch,
# from the families table (registries/families.py: Gguf.unmapped_keys).
UNMAPPED_KEYS = {
    f.export.arch.lower(): list(f.export.unmapped_keys)
    for f in families.exportable().values()
    if f.export.transformers_reads  # Mixtral's llama-architecture file is llama.cpp's alone to read
}


def _gguf_config(folder: Path, gguf_file: str):
    """transformers' GGUF config, with the values the file states that its loader does not read."""
    from transformers import AutoConfig
    from transformers.integrations.gguf import read_gguf_metadata

    config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    # transformers' own metadata reader, which walks past the vocabulary's strings (gguf.GGUFReader makes
    # an array of each: 2.7 s of the real model's 49,152 tokens, for keys that are single numbers)
    metadata, _ = read_gguf_metadata(str(folder / gguf_file))
    arch = metadata["general.architecture"]
    for suffix, attribute in UNMAPPED_KEYS.get(arch, []):
        value = metadata.get(f"{arch}.{suffix}")
        if value is not None:
            setattr(config, attribute, value)
    if families.by_gguf_arch(arch).derives_attention_scale:
        # no key holds Gemma-2's attention scale: llama.cpp derives it (1/sqrt(head size), or of
        # hidden/heads at 46 layers), where transformers' loader keeps the config class's 256
        heads = config.num_attention_heads
        wide = config.num_hidden_layers == 46
        config.query_pre_attn_scalar = config.hidden_size // heads if wide else config.head_dim
    return config


def llama_cpp_installed() -> bool:
    from qlora_kit.after import llama_cpp_reader

    return llama_cpp_reader.entry_point() is not None


def llama_cpp_reader(path: Path, reference: Reference, lora: Path | None = None):
    """llama.cpp itself (node-llama-cpp) reading the GGUF at ``path`` (with a LoRA GGUF applied) on the
    reference's prompts; None where it is not installed."""
    from qlora_kit.after import llama_cpp_reader as reader

    items = [
        (p, a, len(g)) for p, a, g in zip(reference.prompts, reference.answers, reference.greedy, strict=True)
    ]
    return reader.read(path, items, reference.prompt_texts, lora)
