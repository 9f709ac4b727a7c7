"""Data: sources, formats, masking token by token, length policy, packing, caching, and bad rows."""

import json

import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.data import demo, prepare
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.data.packing import FlattenedRowsCollator, best_fit_decreasing, pack_dataset
from qlora_kit.errors import DataError
from qlora_kit.model import adapters
from qlora_kit.model import loading as model

from .conftest import write

ROWS = [
    {"instruction": "What color is a lime?", "input": "", "output": "green"},
    {"instruction": "Answer in one word.", "input": "What sound does a cat make?", "output": "meow"},
    {"instruction": "Name the capital of Peru.", "input": "", "output": "Lima"},
    {"instruction": "What is the opposite of hot?", "input": "", "output": "cold"},
]
CHATS = [
    {
        "messages": [
            {"role": "system", "content": "Answer with one word."},
            {"role": "user", "content": "What color is snow?"},
            {"role": "assistant", "content": "white"},
            {"role": "user", "content": "And coal?"},
            {"role": "assistant", "content": "black"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Capital of Japan?"},
            {"role": "assistant", "content": "Tokyo"},
        ]
    },
]


def section(**fields):
    return Recipe.from_dict({"data": fields}).data


def prepared_data(tokenizer, **fields):
    """Examples one per row unless a test asks for packing."""
    return prepare.prepare_datasets(section(**{"packing": False, **fields}), tokenizer, seed=0)


def make_source(kind, rows, folder):
    import datasets

    table = datasets.Dataset.from_list(rows)
    if kind == "jsonl":
        return write(folder / "rows.jsonl", rows)
    if kind == "json":
        (folder / "rows.json").write_text(json.dumps(rows))
        return folder / "rows.json"
    if kind == "csv":
        table.to_csv(folder / "rows.csv", index=False)
        return folder / "rows.csv"
    if kind == "parquet":
        table.to_parquet(folder / "rows.parquet")
        return folder / "rows.parquet"
    table.save_to_disk(folder / "saved")
    return folder / "saved"


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "save_to_disk"])
def test_every_source_gives_the_same_tokens(kind, tokenizer, tmp_path):
    reference = prepared_data(tokenizer, path=str(write(tmp_path / "ref.jsonl", ROWS))).train
    got = prepared_data(tokenizer, path=str(make_source(kind, ROWS, tmp_path))).train
    assert got["input_ids"] == reference["input_ids"]
    assert got["labels"] == reference["labels"]


def test_alpaca_labels_are_ignored_exactly_on_prompt_tokens(tokenizer, tmp_path):
    train = prepared_data(tokenizer, path=str(write(tmp_path / "r.jsonl", ROWS))).train
    for row, ids, labels in zip(ROWS, train["input_ids"], train["labels"], strict=True):
        prompt = "### Instruction:\n" + row["instruction"] + "\n\n"
        prompt += f"### Input:\n{row['input']}\n\n" if row["input"] else ""
        prompt_ids = tokenizer(prompt + "### Response:\n")["input_ids"]
        answer_ids = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        assert ids == prompt_ids + answer_ids
        assert labels == [IGNORE_INDEX] * len(prompt_ids) + answer_ids


def test_train_on_inputs_trains_every_token(tokenizer, tmp_path):
    train = prepared_data(tokenizer, path=str(write(tmp_path / "r.jsonl", ROWS)), train_on_inputs=True).train
    assert train["labels"] == train["input_ids"]


def test_chat_trains_only_assistant_turns_token_by_token(tokenizer, tmp_path):
    """Checked against the template's own {% generation %} mask, computed by transformers."""
    train = prepared_data(tokenizer, path=str(write(tmp_path / "c.jsonl", CHATS)), format="chat").train
    for chat, ids, labels in zip(CHATS, train["input_ids"], train["labels"], strict=True):
        oracle = tokenizer.apply_chat_template(
            chat["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids == oracle["input_ids"]
        expected = [t if m else IGNORE_INDEX for t, m in zip(ids, oracle["assistant_masks"], strict=True)]
        assert labels == expected
    trained = [tokenizer.decode([t for t in lab if t != IGNORE_INDEX]) for lab in train["labels"]]
    assert trained == ["white<|im_end|>black<|im_end|>", "Tokyo<|im_end|>"]


def test_completion_text_and_renamed_fields(tokenizer, tmp_path):
    rows = [{"question": "2+2=", "answer": "4"}]
    got = prepared_data(
        tokenizer,
        path=str(write(tmp_path / "q.jsonl", rows)),
        format="completion",
        fields={"prompt": "question", "completion": "answer"},
    ).train
    prompt_len = len(tokenizer("2+2=")["input_ids"])
    assert got["labels"][0][:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert tokenizer.decode(got["labels"][0][prompt_len:]) == "4</s>"
    text = prepared_data(
        tokenizer, path=str(write(tmp_path / "t.jsonl", [{"text": "hello world"}])), format="text"
    ).train
    assert text["labels"] == text["input_ids"]


@pytest.mark.parametrize("packing", [False, True])
def test_largest_trained_share_bounds_every_row(tokenizer, tmp_path, packing):
    """The planner counts this share of a micro-batch's positions as what the chunked head keeps: it
    must be the largest example's, so that no row, packed or padded, trains more."""
    rows = [{"prompt": "word " * 40, "completion": "yes"}, {"prompt": "Say:", "completion": " no" * 30}]
    rows += [{"prompt": "word " * n, "completion": " ok" * (20 - n)} for n in range(2, 18, 3)]
    data = prepared_data(
        tokenizer, path=str(write(tmp_path / "r.jsonl", rows)), format="completion", packing=packing
    )
    shares = [sum(t != IGNORE_INDEX for t in labels) / len(labels) for labels in data.train["labels"]]
    assert data.largest_trained_share() >= max(shares)
    if not packing:  # one example a row: the bound is the largest one, not a looser figure
        assert data.largest_trained_share() == pytest.approx(max(shares))
        assert min(shares) < 0.2 < 0.8 < max(shares)


def test_truncate_and_drop_are_counted(tokenizer, tmp_path):
    rows = [*ROWS, {"instruction": "word " * 80, "input": "", "output": "long"}]
    path = str(write(tmp_path / "r.jsonl", rows))
    cut = prepared_data(tokenizer, path=path, max_seq_len=40)
    assert (cut.reports[0].truncated, cut.reports[0].dropped, cut.reports[0].untrainable) == (1, 0, 1)
    assert len(cut.train) == 4  # the truncated row lost its whole response: nothing left to train
    assert max(len(ids) for ids in cut.train["input_ids"]) <= 40
    dropped = prepared_data(tokenizer, path=path, max_seq_len=40, overlong="drop")
    assert (dropped.reports[0].truncated, dropped.reports[0].dropped) == (0, 1)
    assert len(dropped.train) == 4


def test_val_fraction_split_is_seeded(tokenizer, tmp_path):
    path = str(write(tmp_path / "r.jsonl", ROWS * 5))
    first = prepared_data(tokenizer, path=path, val_fraction=0.25)
    again = prepared_data(tokenizer, path=path, val_fraction=0.25)
    assert len(first.val) == 5 and len(first.train) == 15
    assert first.val["input_ids"] == again.val["input_ids"]


def test_second_preparation_reads_the_tokenization_cache(tokenizer, tmp_path):
    path = str(write(tmp_path / "r.jsonl", ROWS))
    first = prepared_data(tokenizer, path=path).train
    files = [f["filename"] for f in first.cache_files]
    stamps = [__import__("os").stat(f).st_mtime_ns for f in files]
    second = prepared_data(tokenizer, path=path).train
    assert [f["filename"] for f in second.cache_files] == files
    assert [__import__("os").stat(f).st_mtime_ns for f in files] == stamps


# Rows, and "flattened": the flash kernels' collator (one sequence per micro-batch), checked here through
# sdpa, which reads the same restarting position ids at batch size 1. Every kernel this machine has
# (eager and flex_attention too) goes through benchmarks/packing_check.py (tests/e2e/test_gpu_check.py),
# the flash ones on a GPU (gpu_check.sh).
@pytest.mark.parametrize("kernel", ["sdpa", "flattened"])
def test_packed_batch_gives_the_same_token_losses_as_one_by_one(tokenizer, tmp_path, kernel):
    implementation = "sdpa" if kernel == "flattened" else kernel
    recipe = Recipe.from_dict(
        {
            "model": {"attn_implementation": implementation},
            "quant": {"compute_dtype": "float32"},
            "lora": {"dropout": 0.0},
        }
    )
    peft_model = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora)
    with torch.no_grad():  # a non-zero adapter, so the LoRA path is part of what is compared
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    peft_model.eval()
    train = prepared_data(tokenizer, path=str(write(tmp_path / "r.jsonl", ROWS)), train_on_inputs=True).train
    features = [train[i] for i in range(len(train))]

    def token_losses(batch):
        with torch.no_grad():
            logits = peft_model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), reduction="none"
        )
        return losses[batch["labels"][:, 1:].flatten() != IGNORE_INDEX]

    rows = pack_dataset(train, capacity=64)
    assert len(rows) < len(train), "several examples share a row"
    if kernel == "flattened":
        packed = FlattenedRowsCollator()([rows[i] for i in range(len(rows))])
        assert packed["input_ids"].shape[0] == 1, "the whole micro-batch is one sequence"
        lengths = sorted(len(f["input_ids"]) for f in features)
        assert sorted(packed["cu_seq_lens_q"].diff().tolist()) == lengths, "one varlen segment per example"
        assert packed["max_length_q"] == max(lengths)
    else:
        packed = prepare.build_collator(tokenizer, True, implementation)([rows[i] for i in range(len(rows))])
        assert packed["input_ids"].shape[0] == len(rows)
    assert "attention_mask" not in packed
    assert (packed["position_ids"] == 0).sum() > len(rows), "positions restart inside rows"
    one_by_one = torch.cat(
        [token_losses(prepare.build_collator(tokenizer, packing=False)([f])) for f in features]
    )
    # Rows reorder examples (longest first): compare the multiset of per-token losses.
    assert torch.allclose(token_losses(packed).sort().values, one_by_one.sort().values, atol=1e-4)
    padded = token_losses(prepare.build_collator(tokenizer, packing=False)(features))
    assert torch.allclose(padded, one_by_one, atol=1e-4)


def test_best_fit_decreasing_fills_rows_without_overflow():
    lengths = [50, 10, 40, 30, 60, 20, 5]
    rows = best_fit_decreasing(lengths, capacity=64)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert len(rows) == 4  # 215 tokens need at least ceil(215 / 64) = 4 rows


def test_pad_share_counts_padding(tokenizer):
    assert prepare.pad_share([4, 4, 4, 4], batch_size=2, group_by_length=False) == 0
    assert prepare.pad_share([2, 4], batch_size=2, group_by_length=False) == pytest.approx(0.25)
    # grouped as the Trainer groups: sorted within megabatches, so the batches mostly pair equals
    lengths = [1, 9] * 64
    grouped = prepare.pad_share(lengths, batch_size=2, group_by_length=True)
    assert grouped < 0.1 < prepare.pad_share(lengths, batch_size=2, group_by_length=False)


def test_builtin_demo_has_its_own_validation_set(tokenizer):
    prepared = prepared_data(tokenizer)
    train_file, val_file = demo.demo_data_files("demo-facts")
    assert len(prepared.train) == len(train_file.read_text().splitlines())
    assert len(prepared.val) == len(val_file.read_text().splitlines())


BAD_FILES = {
    "missing field": (
        '{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n',
        "row 2: missing field 'output'",
    ),
    "wrong type": (
        '{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": 3}\n',
        "row 2: field 'output' must be text (got int 3)",
    ),
    "malformed json": (
        '{"instruction": "a", "output": "b"}\n{"instruction": "c", output: 3}\n',
        "row 2: malformed JSON",
    ),
    "empty file": ("", "the file is empty"),
    "not utf-8": (
        b'{"instruction": "a", "output": "b"}\n{"instruction": "\xff", "output": "b"}\n',
        "row 2: not UTF-8 text",
    ),
    "misnamed field": ('{"question": "a", "output": "b"}\n', "row 1: missing field 'instruction'"),
    "all too long": (
        '{"instruction": "' + "word " * 100 + '", "output": "b"}\n',
        "every row is over data.max_seq_len=32",
    ),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=list(BAD_FILES))
def test_bad_rows_name_the_file_row_and_problem(case, tokenizer, tmp_path):
    content, message = BAD_FILES[case]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError) as info:
        prepared_data(tokenizer, path=str(path), max_seq_len=32, overlong="drop")
    text = str(info.value)
    assert text.startswith(str(path)) and message in text, text
    assert "\n" not in text


def test_chat_without_assistant_turn_is_named(tokenizer, tmp_path):
    rows = [CHATS[1], {"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(DataError, match=r"row 2: conversation has no assistant turn"):
        prepared_data(tokenizer, path=str(write(tmp_path / "c.jsonl", rows)), format="chat")


def test_mapping_to_a_column_that_does_not_exist_is_named(tokenizer, tmp_path):
    with pytest.raises(DataError, match=r"missing field 'answer' \(data.fields.output"):
        prepared_data(tokenizer, path=str(write(tmp_path / "r.jsonl", ROWS)), fields={"output": "answer"})


@pytest.mark.parametrize(
    ("kind", "fmt", "rows"),
    [
        ("jsonl", "alpaca", ROWS),
        ("json", "chat", CHATS),
        ("csv", "completion", [{"prompt": r["instruction"], "completion": r["output"]} for r in ROWS]),
        ("parquet", "text", [{"text": r["instruction"] + " " + r["output"]} for r in ROWS]),
        ("save_to_disk", "alpaca", ROWS),
    ],
)
@pytest.mark.slow  # trains: the fast tier (-m 'not slow') trains nothing
def test_each_source_and_format_trains_end_to_end(kind, fmt, rows, tmp_path):
    from qlora_kit import train

    source = make_source(kind, rows, tmp_path)
    recipe = Recipe.from_dict(
        {
            "data": {"path": str(source), "format": fmt, "val_path": str(source)},
            "train": {
                "output_dir": str(tmp_path / "out"),
                "max_steps": 2,
                "micro_batch_size": 2,
                "eval_steps": 2,
            },
        }
    )
    result = train(recipe)
    assert len(result.eval_losses) == 2 and all(loss > 0 for loss in result.eval_losses)
    assert (result.output_dir / "adapter_model.safetensors").is_file()


def test_packing_keeps_every_token_and_restarts_positions(tokenizer, tmp_path):
    path = str(write(tmp_path / "r.jsonl", ROWS * 8))
    plain = prepared_data(tokenizer, path=path)
    packed = prepared_data(tokenizer, path=path, packing=True, max_seq_len=96)
    assert packed.example_lengths == [len(ids) for ids in plain.train["input_ids"]]
    assert len(packed.train) < len(plain.train)
    assert all(len(ids) <= 96 for ids in packed.train["input_ids"])
    flat = sorted(t for ids in packed.train["input_ids"] for t in ids)
    assert flat == sorted(t for ids in plain.train["input_ids"] for t in ids)
    starts = sum(row.count(0) for row in packed.train["position_ids"])
    assert starts == len(plain.train), "one position-0 per example"
    shares = prepare.pad_shares(packed, section(packing=True, max_seq_len=96), batch_size=4, seed=0)
    assert shares["packing"] < shares["padding"]
