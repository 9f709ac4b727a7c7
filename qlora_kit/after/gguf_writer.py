"""GGUF files for llama.cpp and Ollama, written from a merged 16-bit folder through the ``gguf`` package.

llama.cpp's own converter (``convert_hf_to_gguf.py``) is not in the ``gguf`` wheel, and building llama.cpp
to convert is what breaks for users, so this module does the converter's part for the families the
pipeline trains that llama.cpp and an independent reader know (the families table's ``Gguf`` entries,
registries/families.py: Llama and Mistral, Qwen2, Qwen3, Phi-3, Gemma-2, GPT-2, and the mixtures Qwen3-MoE
and Mixtral, whose experts after/gguf_experts.py stacks). The tensor names come from gguf's ``TensorNameMap``, the
metadata keys from ``GGUFWriter``'s own ``add_*`` methods, merges/special ids/chat template from
``gguf.SpecialVocab``; only what the converter computes itself is repeated (each family's keys and tensor
transforms, the token types, the pre-tokenizer name). ``write_lora_gguf`` writes the adapter alone, as
``convert_lora_to_gguf.py`` does, for ``llama-cli --lora`` and Ollama's ``ADAPTER``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from qlora_kit.after.gguf_experts import ExpertStacks, expert_count, stays_f32
from qlora_kit.after.gguf_families import family_of, permuted, stored, write_parameters
from qlora_kit.errors import ExportError

try:  # the optional extra: qlora-kit[export]
    import gguf
except ImportError:  # pragma: no cover - the message is the behaviour
    gguf = None

TYPES = ("f16", "bf16", "q8_0")
# Dense formats in which a 16-bit merged model is written without rounding beyond its own dtype.
LOSSLESS = ("f16", "bf16")


def require_gguf() -> None:
    if gguf is None:
        raise ExportError("export: the gguf package is not installed; pip install 'qlora-kit[export]'")


def write_model_gguf(folder: Path, out: Path, qtype: str, name: str) -> None:
    """The merged model in ``folder`` (safetensors, config, tokenizer) as one GGUF file at ``out``."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    require_gguf()
    config = AutoConfig.from_pretrained(folder)
    family = family_of(config)
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(served_name(name))
    write_parameters(writer, config, family)
    writer.add_file_type(_file_types()[qtype])
    _add_vocabulary(writer, folder, AutoTokenizer.from_pretrained(folder), config.vocab_size)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    experts = ExpertStacks(expert_count(config))
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = stored(key, tensors.get_tensor(key).float(), config, family)
                if tensor is None:
                    continue
                stacks = experts.take(key, tensor)  # a mixture's experts: one 3-D tensor a projection
                for name, data in [(key, tensor)] if stacks is None else stacks:
                    target = _gguf_name(names, name)
                    _add_tensor(writer, target, data, "f32" if stays_f32(target) else qtype)
    experts.finish()
    _write(writer)


# llama.cpp keys tokenizer rules on general.name: a name containing "phi-3" or "phi3" (any case) makes it
# strip the whitespace after every special token and look up </s>, <unk>, <s> and <|endoftext|>,
# aborting the load ("error loading model vocabulary: _Map_base::at") when one is missing (llama-vocab.cpp,
# its token attributes). Those rules are Phi-3's SentencePiece vocabulary's; the byte-level BPE
# vocabularies written here have neither the tokens nor the rule (transformers keeps that whitespace), so
# a run named after Phi-3 (a Phi-4 fine-tune called phi3-chat, say) gets a name without the trigger.
NAME_TRIGGERS = re.compile(r"phi-?3", re.IGNORECASE)


def served_name(name: str) -> str:
    """``name`` as general.name, with llama.cpp's Phi-3 trigger broken up ("phi3-chat" -> "phi 3-chat")."""
    return NAME_TRIGGERS.sub(lambda found: found.group(0)[:3] + " 3", name)


def write_lora_gguf(adapter_dir: Path, base_config, out: Path) -> None:
    """The adapter's LoRA matrices as a llama.cpp LoRA GGUF (``blk.N.attn_q.weight.lora_a``/``lora_b``)."""
    from safetensors.torch import load_file

    require_gguf()
    family = family_of(base_config)
    settings = check_lora_form(adapter_dir)
    rank, alpha = settings["r"], float(settings["lora_alpha"])
    # llama.cpp scales by alpha / rank; rsLoRA's alpha / sqrt(rank) is that with alpha * sqrt(rank).
    if settings.get("use_rslora"):
        alpha *= math.sqrt(rank)
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    names = gguf.get_tensor_name_map(arch, base_config.num_hidden_layers)
    state = load_file(adapter_dir / "adapter_model.safetensors")
    for key in sorted(state):
        if ".lora_A." not in key:
            continue
        base_key = key.replace("base_model.model.", "", 1).replace(".lora_A.weight", ".weight")
        lora_a = state[key].float()
        lora_b = state[key.replace(".lora_A.", ".lora_B.")].float()
        # Only B's rows are the weight's output rows: the rope permutation applies to B alone. B @ A is
        # already (out, in), the order llama.cpp stores every weight in (GPT-2's Conv1D ones transposed).
        lora_b = permuted(base_key, lora_b, base_config, family)
        target = _gguf_name(names, base_key)
        _add_tensor(writer, target + ".lora_a", lora_a, "f32")
        _add_tensor(writer, target + ".lora_b", lora_b, "f32")
    _write(writer)


def check_lora_form(adapter_dir: Path) -> dict:
    """The adapter's settings, or ExportError where it has no llama.cpp LoRA GGUF form written here."""
    settings = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    if settings.get("use_dora"):
        raise ExportError("export --lora-only: a DoRA adapter has no llama.cpp LoRA form; export it merged")
    if settings.get("target_parameters"):
        # peft's target_parameters LoRA is one (A, B) pair over a whole 3-D expert stack; llama.cpp's
        # LoRA GGUF holds per-matrix pairs, and this writer writes no expert form of them
        raise ExportError(
            "export --lora-only: LoRA on a mixture's experts has no LoRA GGUF form here; "
            "export it merged (--to gguf without --lora-only)"
        )
    return settings


def _file_types() -> dict:
    return {
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }


def _add_vocabulary(writer, folder: Path, tokenizer, vocab_size: int) -> None:
    """Byte-level BPE ("gpt2"): every id with its type, as convert_hf_to_gguf.py's get_vocab_base does;
    merges, special ids and the chat template through gguf.SpecialVocab; whether BOS/EOS are added
    from what the tokenizer does, so llama.cpp neither drops nor doubles them."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    if backend["model"]["type"] != "BPE" or backend["model"].get("byte_fallback"):
        raise ExportError(
            "export --to gguf: only byte-level BPE tokenizers are supported (this one is "
            f"{backend['model']['type']}{' with byte fallback' if backend['model'].get('byte_fallback') else ''})"
        )
    reverse = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in reverse:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(reverse[index])
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[index])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(backend.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    probe = tokenizer("a")["input_ids"]
    special.add_special_token["bos"] = (
        tokenizer.bos_token_id is not None and probe[0] == tokenizer.bos_token_id
    )
    special.add_special_token["eos"] = (
        tokenizer.eos_token_id is not None and probe[-1] == tokenizer.eos_token_id
    )
    if special.chat_template is None and tokenizer.chat_template:
        special.chat_template = tokenizer.chat_template
    special.add_to_gguf(writer, quiet=True)


def _pre_tokenizer(spec: dict | None) -> str:
    """llama.cpp's name for how text is split before BPE (tokenizer.ggml.pre). The converter hashes a
    probe text's tokens; here the split itself is read, and matched against the splits transformers'
    GGUF reader knows by name (so both readers split the same way)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    if spec and spec["type"] == "ByteLevel" and spec.get("use_regex", True):
        return "gpt-2"
    steps = spec.get("pretokenizers", []) if spec else []
    splits = [s["pattern"].get("Regex") for s in steps if s["type"] == "Split"]
    preferred = ("llama-bpe", "qwen2")  # the names llama.cpp's converter gives Llama 3 and Qwen2
    named = [n for n, regex in GGUF_PRE_TOKENIZER_SPLITS.items() if splits and regex == splits[0]]
    if named:
        return next((n for n in preferred if n in named), named[0])
    raise ExportError(
        "export --to gguf: the tokenizer's pre-tokenizer matches none llama.cpp knows by name; "
        "--to merged works for it"
    )


def _gguf_name(names, key: str) -> str:
    name = names.get_name(key, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ExportError(f"export --to gguf: tensor {key} has no GGUF name for this architecture")
    return name


def _add_tensor(writer, name: str, tensor: torch.Tensor, qtype: str) -> None:
    """1-D tensors (norms) stay F32, as llama.cpp keeps them; matrices (a mixture's 3-D expert stacks
    too) take the export's type, or F16 where a row does not tile Q8_0's 32-value blocks (llama.cpp's
    own fallback)."""
    data = tensor.numpy()
    kind = gguf.GGMLQuantizationType.F32
    if data.ndim > 1 and qtype != "f32":
        kind = getattr(gguf.GGMLQuantizationType, qtype.upper())
        if kind == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % 32:
            kind = gguf.GGMLQuantizationType.F16
    # a quantized tensor arrives as bytes (uint8); the writer turns its byte shape into the element shape
    writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)


def _write(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
