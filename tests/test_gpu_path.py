"""The GPU's code path, run on the CPU: accelerate's bf16 autocast with fp32 output conversion, fp16 with a
gradient scaler, several GPUs seen by one process, and the precision choices a device allows."""

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from qlora_kit import Recipe
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.errors import RecipeError
from qlora_kit.memory.accounting import OUTSIDE, SavedTensors
from qlora_kit.memory.loss_head import chunked_lm_loss
from qlora_kit.model.precision import Device, resolve_mixed_precision

from .conftest import lora_model, quick_recipe
from .probes import EXPECTED_AUTOCAST, AutocastProbe


def fresh_accelerator(precision: str) -> Accelerator:
    # accelerate keeps one state per process; TrainingArguments resets it the same way for each Trainer.
    AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(mixed_precision=precision, cpu=True)


def bf16_model(targets="all-linear"):
    return lora_model("bfloat16", targets)


def completion_batch():
    ids = torch.randint(5, 600, (3, 40), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :25] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def grads(peft_model):
    return {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "targets", ["all-linear", ["q_proj", "v_proj", "lm_head"]], ids=["all-linear", "lm_head"]
)
def test_chunked_head_under_accelerate_bf16_equals_transformers_loss(targets):
    """What the Trainer does with bf16=True: forward under autocast, outputs converted to fp32, the loss
    computed outside autocast. The chunked head crashed there (fp32 hidden states, bf16 head)."""
    accelerator = fresh_accelerator("bf16")
    peft_model = bf16_model(targets)
    prepared = accelerator.prepare_model(peft_model)
    batch = completion_batch()

    prepared.zero_grad()
    expected = prepared(**batch).loss  # transformers' own loss, under the same autocast
    expected.backward()
    expected_grads = grads(peft_model)

    prepared.zero_grad()
    loss = chunked_lm_loss(
        prepared, batch, 16, causal_lm=peft_model.get_base_model(), autocast=accelerator.autocast
    )
    loss.backward()
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, expected, rtol=1e-3), (float(loss), float(expected))
    for name, grad in expected_grads.items():
        assert torch.allclose(grads(peft_model)[name], grad, rtol=0.05, atol=1e-3), name


def test_chunked_head_keeps_16_bit_hidden_states_under_autocast():
    """accelerate's fp32 output conversion must not double what the head keeps for backward."""
    batch = completion_batch()
    kept = {}
    for precision in ("no", "bf16"):
        accelerator = fresh_accelerator(precision)
        peft_model = bf16_model()
        prepared = accelerator.prepare_model(peft_model)
        counter = SavedTensors(peft_model)
        with counter.counting():
            loss = chunked_lm_loss(
                prepared, batch, 16, causal_lm=peft_model.get_base_model(), autocast=accelerator.autocast
            )
        loss.backward()
        kept[precision] = counter.result().per_layer[OUTSIDE]
    trained = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    hidden = 128
    assert kept["bf16"] <= kept["no"] + trained * 8  # at most a label's worth of difference per position
    assert kept["bf16"] < kept["no"] + trained * hidden * 2, "fp32 copies of the hidden states were kept"


@pytest.mark.slow
def test_fp16_overflow_steps_are_left_to_the_gradient_scaler(tmp_path, monkeypatch):
    """fp16 on a GPU: GradScaler overflow steps give inf gradients that the scaler skips; the guard must
    not stop the run for them. The CPU has no fp16 scaler in accelerate, so a real torch GradScaler
    and fp16 autocast are put where accelerate puts them on CUDA."""
    from qlora_kit.training.pipeline import build

    # The run is set up as on a pre-Ampere GPU (fp16 with compute_dtype float16), on this CPU.
    monkeypatch.setattr(
        Device, "here", classmethod(lambda cls: Device(cuda=True, bf16=False, name="pre-Ampere"))
    )
    recipe = quick_recipe(
        tmp_path, **{"train.max_steps": 12, "quant.compute_dtype": "float16", "train.logging_steps": 1}
    )
    assert resolve_mixed_precision(recipe) == "fp16"
    trainer = build(recipe, tmp_path).trainer
    # the seam: the Trainer and accelerate hold fp16, not just the resolver's answer
    assert trainer.args.fp16 is True and trainer.args.bf16 is False
    assert trainer.accelerator.mixed_precision == "fp16"
    # A real GradScaler started far too high: its first steps overflow, as fp16 runs do early on.
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where accelerate put the model
    scaler = torch.amp.GradScaler(device, init_scale=2.0**40, growth_interval=1000)
    trainer.accelerator.scaler, trainer.accelerator.native_amp = scaler, True
    probe = AutocastProbe()
    trainer.add_callback(probe)
    trainer.train()
    assert probe.seen == EXPECTED_AUTOCAST["fp16"], probe.seen  # the forward ran under fp16 autocast
    assert scaler.get_scale() < 2.0**40, "the scaler skipped overflow steps"
    assert trainer.state.global_step == 12
    losses = [row["loss"] for row in trainer.metrics_log.rows if "loss" in row]
    assert losses[-1] < losses[0]


def test_one_process_on_several_gpus_trains_with_the_recipes_batch(tmp_path, caplog):
    """transformers multiplies the batch by every visible GPU; the 4-bit model sits on one."""
    from qlora_kit.training.step.arguments import pin_to_one_device, training_arguments

    recipe = quick_recipe(tmp_path, **{"train.micro_batch_size": 4})
    args = training_arguments(recipe, tmp_path, has_eval=False, precision="no")
    args._n_gpu = 4  # what TrainingArguments counts on a host with four visible GPUs
    assert args.train_batch_size == 16
    pin_to_one_device(args)
    assert args.train_batch_size == 4
    assert "accelerate launch --num_processes 4" in caplog.text


def test_ddp_does_not_search_for_unused_parameters(tmp_path):
    from qlora_kit.training.step.arguments import training_arguments

    args = training_arguments(quick_recipe(tmp_path), tmp_path, has_eval=False, precision="bf16")
    assert args.ddp_find_unused_parameters is False  # the Trainer's default for a PeftModel is True
    assert args.bf16 and args.use_cpu is not torch.cuda.is_available()


@pytest.mark.parametrize(
    ("wanted", "compute", "device", "expected"),
    [
        ("auto", "bfloat16", Device(cuda=False, bf16=True), "no"),
        ("auto", "bfloat16", Device(cuda=True, bf16=True, name="H200"), "bf16"),
        ("auto", "float16", Device(cuda=True, bf16=False, name="T4"), "fp16"),
        ("auto", "float32", Device(cuda=True, bf16=True, name="H200"), "no"),
        ("bf16", "bfloat16", Device(cuda=False, bf16=True), "bf16"),
        ("bf16", "float32", Device(cuda=False, bf16=True), "bf16"),
        ("no", "bfloat16", Device(cuda=True, bf16=True, name="H200"), "no"),
    ],
)
def test_mixed_precision_resolves_per_device(wanted, compute, device, expected):
    recipe = Recipe.from_dict({"train": {"mixed_precision": wanted}, "quant": {"compute_dtype": compute}})
    assert resolve_mixed_precision(recipe, device) == expected


def test_impossible_precisions_are_refused_with_the_field_named():
    cpu, t4 = Device(cuda=False, bf16=True), Device(cuda=True, bf16=False, name="Tesla T4")
    fp16 = Recipe.from_dict({"train": {"mixed_precision": "fp16"}, "quant": {"compute_dtype": "float16"}})
    with pytest.raises(RecipeError, match=r"^train\.mixed_precision: fp16 needs a CUDA GPU"):
        resolve_mixed_precision(fp16, cpu)
    with pytest.raises(RecipeError, match=r"^quant\.compute_dtype: Tesla T4 has no native bfloat16"):
        resolve_mixed_precision(Recipe(), t4)
    with pytest.raises(
        RecipeError, match=r"^train\.mixed_precision: fp16 autocast with quant\.compute_dtype bfloat16"
    ):
        Recipe.from_dict({"train": {"mixed_precision": "fp16"}})


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_pissa_and_olora_are_refused_on_a_4_bit_base(init):
    with pytest.raises(RecipeError, match=rf"^lora\.init: {init} needs full-precision base weights"):
        Recipe.from_dict({"lora": {"init": init}})
    assert Recipe.from_dict({"lora": {"init": init}, "quant": {"bits": 16}}).lora.init == init


def test_fp16_refuses_trainable_base_biases():
    """peft keeps LoRA matrices in fp32, but lora.bias trains the base's fp16 biases: GradScaler raises
    "Attempting to unscale FP16 gradients" at the first step."""
    h100 = Device(cuda=True, bf16=True, name="H100")
    biased = Recipe.from_dict({"quant": {"compute_dtype": "float16"}, "lora": {"bias": "all"}})
    with pytest.raises(RecipeError, match=r"^lora\.bias: all trains the base model's float16 biases"):
        resolve_mixed_precision(biased, h100)
    assert resolve_mixed_precision(biased.with_overrides({"lora.bias": "none"}), h100) == "fp16"
