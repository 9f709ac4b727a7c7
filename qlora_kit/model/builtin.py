"""The embedded default: tiny local base models, a locally trained tokenizer and the demo dataset.

Nothing here downloads. ``builtin:tiny-llama`` (and ``tiny-qwen2``, ``tiny-mistral`` and the other
architectures in ``TINY_ARCHITECTURES``, one per entry of the families table) name a small
randomly initialised causal LM built from a config with a fixed seed, saved with ``save_pretrained``
into a cache folder, and then loaded back through the ordinary 4-bit loading code like any checkpoint.
The second run finds the folder and skips the build. ``builtin:demo-facts`` is the instruction
dataset shipped in ``qlora_kit/demo`` (data/demo.py lists the demo datasets); its rows are the
tokenizer's corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from qlora_kit.errors import RecipeError
from qlora_kit.registries import families
from qlora_kit.registries.families import FAMILIES
from qlora_kit.registries.formats import ALPACA_FRAMING

BUILTIN = "builtin:"
DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"
# the tokenizer's corpus: the rows of builtin:demo-facts (data/demo.py owns the demo datasets)
CORPUS = (DEMO_DIR / "train.jsonl", DEMO_DIR / "val.jsonl")

# Bump when the build below changes, so caches from an older build are not reused.
BUILD_VERSION = 2  # 2: Qwen2's tokenizer class adds a token, which gets its embedding row
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 640
LM_HEAD_SCALE = 8.0
# ChatML-style template; {% generation %} marks assistant text so masks can be derived from it.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Sizes chosen so the demo trains in about a minute on 2 CPU cores while the layers stay real:
# every linear is a multiple of 64 wide, so 4-bit blocks (64 values) tile it exactly.
# One builtin per family of the families table (registries/families.py): name -> (config class, extras).
# The dense families, and apart from them the mixtures of experts (their LoRA takes no dropout, and the
# export tests write GGUF of the dense ones). These list the shipped builtins for tests and benchmarks; a
# build reads its family's entry from the table when it runs (``_entry``), so an entry is its builtin.
TINY_ARCHITECTURES = {
    f.tiny: (f.config_class, f.tiny_config) for f in FAMILIES.values() if not f.experts and not f.vision
}
TINY_MOE_ARCHITECTURES = {f.tiny: (f.config_class, f.tiny_config) for f in FAMILIES.values() if f.experts}
TINY_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def is_builtin(path: str) -> bool:
    return path.startswith(BUILTIN)


def builtin_name(path: str) -> str:
    return path.removeprefix(BUILTIN)


def cache_root() -> Path:
    """``$QLORA_KIT_CACHE`` or ``~/.cache/qlora_kit``."""
    return Path(os.environ.get("QLORA_KIT_CACHE", Path.home() / ".cache" / "qlora_kit"))


def ensure_tiny_model(name: str, **shape_overrides) -> Path:
    """Return the folder of builtin model ``name``, building it first if the cache has none."""
    entry = _entry(name)
    # a family's own value of a shared key (DeepSeek-V3's key/value heads, one per query head) over the
    # default shape; the caller's over both
    own = {k: v for k, v in entry.tiny_config.items() if k in TINY_SHAPE}
    shape = {**TINY_SHAPE, **own, **shape_overrides}
    key = _cache_key(entry, shape)
    folder = cache_root() / "models" / f"{name}-{key}"
    if (folder / "config.json").exists():
        return folder
    return build_into(folder, lambda staging: _build(entry, shape, staging))


def _entry(name: str) -> families.Family:
    """The families entry whose builtin is ``name``, read from the table now (an entry added after import is
    a builtin too); the vision-language ones are built by builtin_vision.py, which
    loading.resolve_model_path asks first."""
    entry = families.by_tiny_name(name)
    if entry is None or (entry.vision is not None and entry.experts is None):
        text = [f.tiny for f in FAMILIES.values() if f.vision is None or f.experts is not None]
        known = [*text, *(f.tiny for f in FAMILIES.values() if f.vision), "smollm2-135m-instruct"]
        raise RecipeError(f"model.path: unknown builtin model {name!r} (known: {', '.join(known)})")
    return entry


def build_into(folder: Path, build, marker: str = "config.json") -> Path:
    """``build(staging)`` beside ``folder``, then renamed into place: a crash or a concurrent build never
    leaves half a model (or dataset: ``marker`` is a file a whole build has) in the cache; a concurrent
    build that won the rename is as good as ours."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        build(staging)
        os.replace(staging, folder)
    except OSError:
        if not (folder / marker).exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def save_into_staging(model, staging: Path) -> None:
    """``model.save_pretrained(staging)`` on every rank: ``staging`` is this process's own folder (build_into),
    while transformers writes a model only on rank 0 once a process group exists, so rank 1 of a torchrun
    launch on a clean cache built a folder with no config or weights, and won the rename as often as not."""
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(staging)


def _cache_key(entry: families.Family, shape: dict) -> str:
    # the family's config class and values too: a builtin whose families entry changed is built again
    architecture = (entry.config_class, entry.tiny_config)
    digest = hashlib.sha256()
    digest.update(
        json.dumps(
            [BUILD_VERSION, entry.tiny, architecture, shape, TOKENIZER_VOCAB, LM_HEAD_SCALE, CHAT_TEMPLATE]
        ).encode()
    )
    for path in CORPUS:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _build(entry: families.Family, shape: dict, folder: Path) -> None:
    tokenizer = build_tokenizer()
    shape = dict(shape)
    # the tokenizer's size as the family's tokenizer class loads it (benchmarks widen it)
    vocab_size = shape.pop("vocab_size", _tokens_as_loaded(tokenizer, entry.model_type))
    # the config class transformers registers for the family's model_type (the entry's config_class for
    # every shipped family; a family registered with AutoConfig outside transformers too)
    config = transformers.AutoConfig.for_model(
        entry.model_type,
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**entry.tiny_config, **shape},  # a shape the caller asks for over the family's values
    )
    with torch.random.fork_rng():  # a fixed seed without disturbing the caller's random stream
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    # The output head is frozen in QLoRA and sees RMS-normalised states, so its row norms bound the
    # logits. At the usual init (std 0.02) no logit passes ~2.5 and no answer can be confident;
    # a wider head lets a fine-tuned tiny model reach the low losses a pretrained one would.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LM_HEAD_SCALE)
    model.generation_config.eos_token_id = [
        tokenizer.eos_token_id,
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    save_into_staging(model, folder)
    tokenizer.save_pretrained(folder)


def _tokens_as_loaded(tokenizer, model_type: str) -> int:
    """How many tokens the saved tokenizer has once AutoTokenizer loads it for this architecture: Qwen2's
    tokenizer class adds its own <|endoftext|>, which must have an embedding row too (the loader refuses
    a tokenizer larger than the embeddings, model/loading.check_vocab_fits)."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        config = transformers.AutoConfig.for_model(model_type)
        config.save_pretrained(folder)
        return max(len(tokenizer), len(transformers.AutoTokenizer.from_pretrained(folder)))


def build_tokenizer():
    """A byte-level BPE tokenizer trained on the demo dataset (deterministic), with a chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(ALPACA_FRAMING), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=TINY_SHAPE["max_position_embeddings"],
    )


def corpus_words() -> list[str]:
    """The words of the demo data, for benchmarks that need text the builtin tokenizer knows."""
    return " ".join(_corpus([])).split()


def _corpus(framing: list[str]) -> list[str]:
    texts = list(framing)
    for path in CORPUS:
        for line in path.read_text(encoding="utf-8").splitlines():
            texts.extend(value for value in json.loads(line).values() if value)
    return texts
