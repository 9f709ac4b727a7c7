"""The ShareGPT and tool-call formats end to end: a real run on the tiny model under bf16 autocast (the
GPU's path), through the preflight, with a chat template that renders tools."""

import json
import math
import shutil

import pytest
from transformers import AutoTokenizer

from qlora_kit import Recipe, train
from qlora_kit.model.builtin import ensure_tiny_model
from tests.chat_templates import TOOLS_CHATML
from tests.probes import EXPECTED_AUTOCAST, AutocastProbe
from tests.test_chat import TOOL, TOOL_CHAT

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it


def run(tmp_path, model_path, rows, fmt):
    data = tmp_path / f"{fmt}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    recipe = Recipe.from_dict(
        {
            "model": {"path": str(model_path)},
            "data": {"path": str(data), "format": fmt, "max_seq_len": 256},
            "train": {
                "output_dir": str(tmp_path / f"out-{fmt}"),
                "max_steps": 3,
                "logging_steps": 1,
                "micro_batch_size": 4,
                "mixed_precision": "bf16",
                "sample_prompts": 0,
            },
        }
    )
    probe = AutocastProbe()
    result = train(recipe, callbacks=[probe])
    assert probe.seen == EXPECTED_AUTOCAST["bf16"], probe.seen  # the GPU's path, as the docstring says
    return result


def test_sharegpt_and_tool_call_chats_train_on_the_tiny_model(tmp_path):
    folder = tmp_path / "tiny-tools"
    shutil.copytree(ensure_tiny_model("tiny-llama"), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOOLS_CHATML  # its special tokens are the demo tokenizer's own
    tokenizer.save_pretrained(folder)

    cities = ["Lima", "Quito", "Oslo", "Cairo", "Hanoi", "Perth", "Accra", "Sucre"]
    calls = [json.loads(json.dumps(TOOL_CHAT).replace("Lima", city)) for city in cities]
    result = run(tmp_path, folder, [{"messages": m, "tools": [TOOL]} for m in calls], "chat")
    assert len(result.train_losses) == 3 and all(math.isfinite(x) for x in result.train_losses)

    conversations = [
        [{"from": "human", "value": f"Capital of {city}?"}, {"from": "gpt", "value": city}] for city in cities
    ]
    result = run(tmp_path, folder, [{"conversations": c} for c in conversations], "sharegpt")
    assert len(result.train_losses) == 3 and (result.output_dir / "adapter_model.safetensors").exists()
