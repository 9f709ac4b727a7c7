"""The chunked loss head gives transformers' loss and gradients, without keeping full logits."""

import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.data import prepare
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.memory.accounting import OUTSIDE, measure_saved_bytes
from qlora_kit.memory.loss_head import chunked_lm_loss
from qlora_kit.model import adapters
from qlora_kit.model import loading as model

from .conftest import lora_model


def fp32_model(targets="all-linear"):
    return lora_model("float32", targets)


def loss_and_grads(peft_model, batch, chunk=None, num_items=None):
    peft_model.zero_grad()
    if chunk is None:
        kwargs = {"num_items_in_batch": num_items} if num_items is not None else {}
        loss = peft_model(**batch, **kwargs).loss
    else:
        loss = chunked_lm_loss(peft_model, batch, chunk, num_items)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}


def masked_batch(batch=3, seq=40, prompt=25):
    ids = torch.randint(5, 600, (batch, seq), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :prompt] = IGNORE_INDEX  # completion-only: most positions untrained
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
@pytest.mark.parametrize("masked", [False, True], ids=["all-trained", "completion-only"])
def test_loss_and_lora_gradients_equal_the_unchunked_ones(chunk, masked):
    peft_model = fp32_model()
    batch = (
        masked_batch() if masked else {"input_ids": (ids := torch.randint(5, 600, (3, 40))), "labels": ids}
    )
    expected_loss, expected = loss_and_grads(peft_model, batch)
    loss, grads = loss_and_grads(peft_model, batch, chunk)
    assert loss == pytest.approx(float(expected_loss), rel=1e-5)
    for name, grad in expected.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-6), name


def test_lora_on_the_output_head_trains_through_the_chunks():
    peft_model = fp32_model(targets=["q_proj", "lm_head"])
    assert any("lm_head.lora_A" in n for n, _ in peft_model.named_parameters())
    batch = masked_batch()
    _, expected = loss_and_grads(peft_model, batch)
    _, grads = loss_and_grads(peft_model, batch, chunk=5)
    head_grads = [n for n in grads if "lm_head" in n]
    assert head_grads and all(grads[n].abs().sum() > 0 for n in head_grads)
    for name, grad in expected.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-6), name


def test_packed_rows_and_accumulation_normalise_per_trained_token():
    """Two packed micro-batches with the Trainer's num_items_in_batch: the same sum as one big batch."""
    peft_model = fp32_model()
    tokenizer = model.load_tokenizer(Recipe().model)
    prepared = prepare.prepare_datasets(
        Recipe.from_dict({"data": {"max_seq_len": 64, "packing": True}}).data, tokenizer, seed=0
    )
    collate = prepare.build_collator(tokenizer, packing=True)
    first, second = (
        collate([prepared.train[i] for i in range(2)]),
        collate([prepared.train[i] for i in range(2, 4)]),
    )
    items = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in (first, second))
    for chunked in (None, 3):
        peft_model.zero_grad()
        total = 0.0
        for part in (first, second):
            if chunked is None:
                loss = peft_model(**part, num_items_in_batch=items).loss
            else:
                loss = chunked_lm_loss(peft_model, part, chunked, items)
            loss.backward()
            total += float(loss)
        grads = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}
        if chunked is None:
            expected_total, expected = total, grads
    assert total == pytest.approx(expected_total, rel=1e-5)
    for name, grad in expected.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-6), name


def test_no_full_logits_are_kept_for_backward():
    recipe = Recipe.from_dict({"lora": {"dropout": 0.0}})
    peft_model = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora)
    ids = torch.randint(5, 600, (4, 64))
    batch = {"input_ids": ids, "labels": ids}
    full = measure_saved_bytes(peft_model, batch).per_layer[OUTSIDE]
    chunked = measure_saved_bytes(peft_model, batch, chunk_tokens=32).per_layer[OUTSIDE]
    vocab, hidden = peft_model.config.vocab_size, peft_model.config.hidden_size
    logits = 4 * 64 * vocab * 4  # fp32 log-probabilities of every position
    assert full == 4 * 64 * (4 * hidden + 4) + logits + 4 * 64 * 8 + 4  # norm, log-probs, labels, count
    # what is left: the final norm's input, the trained positions' 16-bit hidden states, labels and mask
    assert chunked == 4 * 64 * (4 * hidden + 4) + 4 * 63 * (hidden * 2 + 8) + 4 * 63
    assert chunked < full / 3
