"""The chunked loss head gives transformers' loss and gradients, without keeping full logits."""

import collections
import inspect
import sys
import types

import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.data import prepare
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.memory.accounting import OUTSIDE, measure_saved_bytes
from qlora_kit.memory.loss_head import chunked_lm_loss, fused_loss
from qlora_kit.model import adapters
from qlora_kit.model import loading as model

from .conftest import lora_model
from .probes import OperatorCount


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


# What one chunk must dispatch with a frozen fp32 head, forward + backward: the head's matmul, log-softmax and
# gathered loss in the forward pass, the same three again when backward recomputes the chunk under its
# checkpoint, then the three backward operators (the head's weight is frozen: no weight gradient)
ONE_CHUNK = {
    "aten.mm": 3,
    "aten._log_softmax": 2,
    "aten.nll_loss_forward": 2,
    "aten._log_softmax_backward_data": 1,
    "aten.nll_loss_backward": 1,
}
HOST_SYNCS = ("aten.nonzero", "aten._local_scalar_dense", "aten.item")


def test_each_chunk_dispatches_the_heads_operators_and_nothing_else():
    """A step at 1, 4 and 16 chunks of the same 64 trained positions: every chunk past the first adds exactly
    the head's own operators (red if the chunks are sliced one by one, whose gradients are summed at full size
    once per chunk, or if the losses are added chunk by chunk), and no host sync (red on an ``.item()`` or a
    ``nonzero`` per chunk: on CUDA each stalls the launch queue); the losses and gradients equal full logits'."""
    peft_model = fp32_model()
    ids = torch.randint(5, 600, (2, 33), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}  # 2 x 32 = 64 trained positions
    expected_loss, expected = loss_and_grads(peft_model, batch)
    counts = {}
    for chunks in (1, 4, 16):
        with OperatorCount() as count:
            loss, grads = loss_and_grads(peft_model, batch, chunk=64 // chunks)
        counts[chunks] = count.ops
        # fp32 throughout; chunking only regroups the sums over the 64 positions, whose rounding is bounded
        # by 64 units in the last place of the sum (n * eps, the worst case of a sum of n terms)
        tolerance = 64 * torch.finfo(torch.float32).eps
        assert loss == pytest.approx(float(expected_loss), rel=tolerance)
        for name, grad in expected.items():
            assert torch.allclose(grads[name], grad, rtol=0, atol=tolerance * float(grad.abs().max())), name
    per_chunk = counts[16] - counts[4]
    assert per_chunk == collections.Counter({op: 12 * n for op, n in ONE_CHUNK.items()}), per_chunk
    assert counts[4] - counts[1] == collections.Counter({op: 3 * n for op, n in ONE_CHUNK.items()})
    assert counts[1] - counts[16] == collections.Counter()  # nothing is done fewer times with more chunks
    # and the step's host syncs are as many at 16 chunks as at 1 (an .item() per chunk would add one each)
    assert [sum(counts[c][op] for op in HOST_SYNCS) for c in counts] == [
        sum(counts[1][op] for op in HOST_SYNCS)
    ] * 3


class StubLigerLoss(torch.nn.Module):
    """Stands in for an installed ``liger_kernel``, whose Triton kernels cannot run on this CPU."""

    def __init__(self, ignore_index, reduction):
        super().__init__()
        assert ignore_index == IGNORE_INDEX and reduction == "sum"


def test_liger_runs_the_head_only_on_cuda_and_a_plain_linear_head(monkeypatch):
    """With liger_kernel importable: a plain linear head on CUDA gets Liger's summed loss; the CPU still runs
    ours (Liger's kernels are Triton's), and so does a head with LoRA on it (Liger takes the weight alone)."""
    stub = types.ModuleType("liger_kernel.transformers.fused_linear_cross_entropy")
    stub.LigerFusedLinearCrossEntropyLoss = StubLigerLoss
    monkeypatch.setitem(sys.modules, stub.__name__, stub)
    # the selection reads the hidden states' device alone, so a CUDA one can be named without a GPU
    on_cuda = types.SimpleNamespace(device=torch.device("cuda"))
    head = torch.nn.Linear(8, 16, bias=False)
    assert isinstance(fused_loss(head, on_cuda), StubLigerLoss)
    assert fused_loss(head, torch.zeros(4, 8)) is None
    lora_head = fp32_model(targets=["lm_head"]).base_model.model.lm_head
    assert fused_loss(lora_head, on_cuda) is None


def test_liger_takes_the_arguments_the_head_passes():
    """Where liger_kernel imports (its extra, with Triton): the loss module's forward takes the head's
    weight, the kept hidden states, their labels and the bias, in that order, and sums over positions."""
    liger = pytest.importorskip("liger_kernel.transformers.fused_linear_cross_entropy")
    loss = liger.LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
    assert list(inspect.signature(loss.forward).parameters) == ["lin_weight", "_input", "target", "bias"]
    assert loss.ignore_index == IGNORE_INDEX and loss.reduction == "sum"
