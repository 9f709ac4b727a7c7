"""The embedded default: the tiny model is built once, deterministically, and the shipped data is current."""

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file

from qlora_kit.data import demo
from qlora_kit.model import builtin, builtin_vision
from qlora_kit.registries import families

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_model_is_cached_and_deterministic(tmp_path, monkeypatch):
    first = builtin.ensure_tiny_model("tiny-llama")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert builtin.ensure_tiny_model("tiny-llama") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp, "second call must not rebuild"
    monkeypatch.setenv("QLORA_KIT_CACHE", str(tmp_path))
    second = builtin.ensure_tiny_model("tiny-llama")
    assert second != first
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert not [p for p in tmp_path.rglob(".tiny-*")], "no staging folder left behind"


@pytest.mark.slow  # builds a tiny model (~3 s)
@pytest.mark.parametrize(
    "ensure", ["tiny-llama", "tiny-qwen2.5-vl"]
)  # builtin.py's build and builtin_vision's
def test_a_builtin_built_by_rank_one_of_a_launch_holds_its_model(tmp_path, monkeypatch, ensure):
    """Each rank of a launch on a clean cache may build the builtin: rank 1's build holds its config and
    weights too (red without builtin._build's own save rule: transformers saves only on rank 0 once a
    process group exists, and rank 1's tokenizer-only folder could win the rename)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.setenv("QLORA_KIT_CACHE", str(tmp_path))
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        if ensure == "tiny-llama":
            folder = builtin.ensure_tiny_model(ensure)
        else:
            folder = builtin_vision.ensure_tiny_vlm(ensure)
    finally:
        dist.destroy_process_group()
    assert (folder / "config.json").exists() and load_file(folder / "model.safetensors")


def test_a_builtin_whose_families_entry_changed_is_built_again(tmp_path, monkeypatch):
    """The cache's folder name covers the family's config values, so a changed entry is not served the
    model built from the old one (red with the key of name and shape alone: a tiny-gemma4 built before its
    entry was written kept transformers' default sizes)."""
    monkeypatch.setenv("QLORA_KIT_CACHE", str(tmp_path))
    before = builtin.ensure_tiny_model("tiny-llama")
    llama = families.FAMILIES["llama"]
    monkeypatch.setitem(
        families.FAMILIES, "llama", replace(llama, tiny_config={**llama.tiny_config, "head_dim": 64})
    )
    after = builtin.ensure_tiny_model("tiny-llama")
    assert after != before
    assert json.loads((after / "config.json").read_text())["head_dim"] == 64


def test_tokenizer_round_trips_the_demo_text_and_has_a_chat_template():
    tokenizer = builtin.build_tokenizer()
    text = "### Instruction:\nWhat sound does a cow make?\n\n### Response:\nmoo"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_shipped_demo_data_matches_its_generator():
    spec = importlib.util.spec_from_file_location("make_demo_data", ROOT / "scripts" / "make_demo_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    train, val = module.build_rows()
    train_file, val_file = demo.demo_data_files("demo-facts")
    assert [json.loads(line) for line in train_file.read_text().splitlines()] == train
    assert [json.loads(line) for line in val_file.read_text().splitlines()] == val
    questions = lambda rows: {r["instruction"] + r["input"] for r in rows}  # noqa: E731
    assert not questions(train) & questions(val), "validation phrasings never appear in training"
    # demo-facts-mixed (GRPO's demo): the same rows, split at random; no question in both halves
    mixed_train, mixed_val = module.build_mixed(train, val)
    train_file, val_file = demo.demo_data_files("demo-facts-mixed")
    assert [json.loads(line) for line in train_file.read_text().splitlines()] == mixed_train
    assert [json.loads(line) for line in val_file.read_text().splitlines()] == mixed_val
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    assert sorted(map(key, mixed_train + mixed_val)) == sorted(map(key, train + val))
    assert not questions(mixed_train) & questions(mixed_val) and len(mixed_val) == len(val)


def test_the_real_models_file_is_checked_against_its_pinned_hash(tmp_path):
    """builtin:smollm2-135m-instruct converts only the GGUF file whose SHA-256 is pinned: any other file
    (a changed upload, a truncated cache) is one line before conversion (the real file: test_preflight's
    fixture and tests/e2e/test_real_model.py go through the same check)."""
    import hashlib

    import pytest

    from qlora_kit.errors import RecipeError
    from qlora_kit.model.pretrained import PINNED_SHA256, PRETRAINED, check_pinned

    assert set(PINNED_SHA256) == {gguf for _, _, gguf in PRETRAINED.values()}
    assert all(len(sha) == 64 for sha in PINNED_SHA256.values())
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    check_pinned(file, hashlib.sha256(file.read_bytes()).hexdigest(), "builtin:x")
    with pytest.raises(RecipeError, match=r"^model\.path: builtin:x: .*model\.gguf is not the pinned file"):
        check_pinned(file, "0" * 64, "builtin:x")
