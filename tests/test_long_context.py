"""Long context: offloaded checkpoints and the tiled MLP give the run without them, bit for bit where the
arithmetic allows, and keep what they promise off the device; eager attention is refused where its scores
would not fit."""

import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.errors import RecipeError
from qlora_kit.memory import checkpointing, max_length, tiled_mlp
from qlora_kit.memory.accounting import SavedTensors
from qlora_kit.model import adapters
from qlora_kit.model import loading as model
from qlora_kit.registries import attention
from qlora_kit.testing import model_state
from qlora_kit.training import pipeline

BATCH, SEQ = 2, 64


def batch_of() -> dict[str, torch.Tensor]:
    # packed, as long rows are: restarting position ids, no attention mask
    ids = torch.randint(5, 600, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).repeat(BATCH, 1)
    positions[:, SEQ // 2 :] -= SEQ // 2
    return {"input_ids": ids, "labels": ids, "position_ids": positions}


def run_once(
    arch: str, dropout: float = 0.1, **memory
) -> tuple[float, dict[str, torch.Tensor], object, torch.nn.Module]:
    """One forward and backward of a fresh 4-bit model with LoRA under the Trainer's bf16 autocast; the
    same seeds every time, so only ``memory`` differs between calls."""
    recipe = Recipe.from_dict(
        {
            "model": {"path": f"builtin:{arch}"},
            "memory": {"chunked_loss": False, **memory},
            "lora": {"dropout": dropout},
        }
    )
    base = model.load_base_model(recipe.model, recipe.quant)
    checkpointing.enable_checkpointing(base, recipe.memory)
    torch.manual_seed(0)
    peft_model = adapters.attach_lora(base, recipe.lora)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # as after some steps: peft starts B at zero, where A would get no gradient
            param.data.normal_(0, 0.05)
    if dropout == 0:  # the model's own dropout too (GPT-2's MLP has one)
        for module in peft_model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    peft_model.train()
    torch.manual_seed(1)
    counter = SavedTensors(peft_model)
    with counter.counting(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = peft_model(**batch_of()).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    return loss.item(), grads, counter.result(), peft_model


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_offloaded_checkpoints_give_the_same_loss_and_gradients_bit_for_bit(policy):
    loss, grads, saved, peft_model = run_once("tiny-llama", checkpointing=policy)
    offloaded_loss, offloaded_grads, offloaded, offloaded_model = run_once(
        "tiny-llama", checkpointing=policy, offload_activations=True
    )
    layers = len(checkpointing.decoder_layers(offloaded_model))
    assert checkpointing.offloaded_layers(offloaded_model) == list(range(layers))
    assert checkpointing.offloaded_layers(peft_model) == []
    assert checkpointing.applied_policies(offloaded_model) == [policy] * layers
    assert offloaded_loss == loss
    for name, grad in grads.items():
        assert torch.equal(offloaded_grads[name], grad), name
    # each layer's input (B, T, hidden) in bf16 left the device's count for the host's
    hidden = offloaded_model.config.hidden_size
    layer_input = BATCH * SEQ * hidden * 2
    assert saved.host == 0
    assert offloaded.host == layers * layer_input
    assert offloaded.total == saved.total - layers * layer_input


# One family per MLP shape: gated (Llama; Gemma-2 with post-norms and GeLU), fused gate-up (Phi-3), plain
# with a Conv1D (GPT-2) and with a Linear and LayerNorm (GPT-NeoX); the other gated families repeat Llama's.
MLP_SHAPES = ["tiny-llama", "tiny-gemma2", "tiny-phi3", "tiny-gpt2", "tiny-gptneox"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", MLP_SHAPES)
def test_a_tiled_mlp_gives_the_same_loss_and_lora_gradients_on_every_mlp_shape(arch):
    # without dropout: tiles draw their dropout masks tile by tile, so with it the masks differ (as valid)
    loss, grads, saved, _ = run_once(arch, dropout=0.0, checkpointing="full")
    tiled_loss, tiled_grads, tiled, tiled_model = run_once(
        arch, dropout=0.0, checkpointing="full", mlp_tiles=4
    )
    assert model_state.tiled_mlps(tiled_model) == len(checkpointing.decoder_layers(tiled_model))
    assert tiled_loss == pytest.approx(loss, rel=1e-3)
    for name, grad in grads.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        assert (tiled_grads[name] - grad).abs().max().item() <= 2e-2 * scale, (
            name
        )  # bf16 matmuls of other shapes
    assert tiled.total == saved.total  # a full layer keeps its input either way


def tiles_under_autograd(run, hidden):
    """The tiles run once, autograd keeping every intermediate: nothing recomputed, nothing replayed."""
    return torch.cat(
        [run.mlp._untiled_forward(part, *run.args, **run.kwargs) for part in run.parts(hidden)], -2
    )


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "none"])
def test_each_tile_replays_the_dropout_masks_of_its_forward(policy, monkeypatch):
    """With dropout on, the tiles recomputed in backward must draw the masks their forward drew: the same
    loss, bit for bit, and the same gradients as the tiles run once under autograd with nothing recomputed.
    The gradients to bf16's rounding, not bit for bit: autograd sums a weight's per-tile gradients in bf16
    (autocast casts the weight once for every tile), the tiles' backward sums them in float32; a mask drawn
    anew moves them by tens of percent."""
    loss, grads, _, _ = run_once("tiny-llama", checkpointing=policy, mlp_tiles=4)
    monkeypatch.setattr(tiled_mlp, "run_tiles", tiles_under_autograd)
    plain_loss, plain_grads, _, _ = run_once("tiny-llama", checkpointing=policy, mlp_tiles=4)
    assert loss == plain_loss
    for name, grad in grads.items():
        scale = plain_grads[name].abs().max().item()
        assert (plain_grads[name] - grad).abs().max().item() <= 2e-2 * scale, name


@pytest.mark.slow
def test_a_checkpointed_layers_recompute_stops_before_its_tiled_mlp(monkeypatch):
    """Under full checkpointing a tiled MLP runs twice a step, as an untiled one does: once in the forward
    pass, once in backward tile by tile; the layer's recompute stops at the MLP's saved input (tiles under
    their own checkpoints ran a third time there: 1.19x full's step on the real model)."""
    from transformers.models.llama import modeling_llama

    tile_calls = []
    forward = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(
        modeling_llama.LlamaMLP, "forward", lambda self, x: tile_calls.append(x.shape[-2]) or forward(self, x)
    )
    _, _, _, peft_model = run_once("tiny-llama", checkpointing="full", mlp_tiles=4)
    layers = len(checkpointing.decoder_layers(peft_model))
    assert tile_calls == [SEQ // 4] * (layers * 2 * 4)


@pytest.mark.slow
def test_tiles_keep_the_mlp_intermediate_out_of_an_unchecked_layer():
    """Without layer checkpointing a tiled MLP keeps only its tiles' inputs: the gate/up intermediate
    (3 x intermediate values a token) no longer counts among the bytes saved for backward."""
    _, _, untiled, base = run_once("tiny-llama", checkpointing="none")
    _, _, tiled, _ = run_once("tiny-llama", checkpointing="none", mlp_tiles=4)
    config = base.config
    layers = config.num_hidden_layers
    intermediate = BATCH * SEQ * config.intermediate_size * 2  # one bf16 (B, T, intermediate) tensor
    assert untiled.total - tiled.total >= layers * 2 * intermediate


def test_tile_count_auto_follows_the_sequence():
    assert tiled_mlp.tile_count("auto", 4096, 576) == 8
    assert tiled_mlp.tile_count("auto", 100, 576) == 1
    assert tiled_mlp.tile_count(16, 8, 576) == 8  # never more tiles than tokens
    with pytest.raises(ValueError, match=r"memory\.mlp_tiles"):
        Recipe.from_dict({"memory": {"mlp_tiles": 0}})


def test_eager_attention_is_refused_where_its_scores_would_not_fit():
    line = attention.quadratic_refusal("eager", batch=1, heads=32, seq=65536, budget_bytes=80 * 1024**3)
    assert line is not None and "model.attn_implementation: eager" in line and "sdpa" in line
    assert (
        attention.quadratic_refusal("eager", batch=1, heads=32, seq=2048, budget_bytes=80 * 1024**3) is None
    )
    assert (
        attention.quadratic_refusal("sdpa", batch=1, heads=32, seq=65536, budget_bytes=80 * 1024**3) is None
    )


@pytest.mark.slow
def test_a_run_with_eager_attention_too_long_for_its_budget_stops_in_one_line(tmp_path):
    fields = {
        "model": {"path": "builtin:tiny-llama", "attn_implementation": "eager"},
        # padded rows: the layout does not decide the refusal, and auto would time packed 64K-token rows
        "data": {"max_seq_len": 65536, "packing": False},
        "memory": {"budget_gb": 8},
        "train": {"output_dir": str(tmp_path)},
    }
    with pytest.raises(RecipeError, match=r"model\.attn_implementation: eager attention materializes"):
        pipeline.build(Recipe.from_dict(fields))
    fields["model"]["attn_implementation"] = "sdpa"
    pipeline.build(Recipe.from_dict(fields))  # linear in the sequence: builds


@pytest.mark.slow
def test_the_longest_fit_fits_and_one_step_more_does_not():
    recipe = Recipe.from_dict({"model": {"path": "builtin:tiny-llama"}, "data": {"packing": False}})
    fit = max_length.longest_fit(recipe, "full + offload + tiles", budget_gb=0.02)
    fields = max_length.WAYS["full + offload + tiles"]
    assert fit.seq > 0 and fit.seq % max_length.STEP == 0
    assert max_length.planned_at(recipe, fields, fit.seq, "cuda").peak <= 0.02 * 1024**3
    assert max_length.planned_at(recipe, fields, fit.seq + max_length.STEP, "cuda").peak > 0.02 * 1024**3
    full = max_length.longest_fit(recipe, "full", budget_gb=0.02)
    assert fit.seq > full.seq  # offload and tiles leave room for longer rows than full checkpointing alone
    assert fit.host == 4 * fit.seq * 128 * 2  # every layer's input (hidden 128, bf16) waits in host memory


@pytest.mark.slow
def test_plan_max_seq_len_from_the_shell(monkeypatch, capsys):
    """The ways' table from the command line, and the refusal without a budget, both in this process (the
    real typer app, conftest.run_cli_output): their claims are the command's table and its one line, not a
    process's start (a second interpreter cost ~8 CPU s of imports)."""
    from qlora_kit.cli import app
    from tests.conftest import run_cli, run_cli_output

    # rich wraps a narrower terminal's table. A Console made while COLUMNS was set keeps that width
    # (rich reads it once, into _width): cli/app.py's console was made at its first import, by whichever
    # test of this process came first, so the width is set on it, restored as it was afterwards
    monkeypatch.setattr(app.console, "_width", 200)
    code, out, err = run_cli_output(
        ["plan", "demo", "--max-seq-len", "--budget-gb", "0.02"], monkeypatch, capsys
    )
    assert code == 0, err
    for way in max_length.WAYS:
        assert way in out
    code, err = run_cli(["plan", "demo", "--max-seq-len"], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        "error: plan --max-seq-len: give --budget-gb or set memory.budget_gb (the GiB to fit)"
    ]
