"""``qlora-kit doctor``: the first thing to run on a new machine, and what every GPU check runs.

It checks bitsandbytes' 4-bit dequantization on this device against a plain-torch reference (going around
a kernel known to be wrong: model/bnb_selftest.py), then proves the machine end to end through ``qlora-kit train``'s own code path (``pipeline.run``), on the
builtin tiny model, with the device's defaults: 4-bit NF4 weights, LoRA, checkpointing, the default
paged 8-bit optimizer, the chunked loss head and ``train.mixed_precision: auto`` (bf16 autocast on a
bf16 GPU). Whether torch.compile's inductor compiles and runs a small function here is a row too
(``train.compile``). Then the saved adapter is loaded back with plain peft onto a freshly loaded 4-bit base and
must give the trained model's logits, and the merge must pass its drift check. With a recipe, the
planner predicts its peak memory per checkpointing policy against this device's free memory.

Each check is one row: name, pass/fail, detail. The CLI prints the table and exits non-zero on a failure.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import psutil
import torch
from peft import PeftModel
from rich.console import Console

from qlora_kit.after.merge import merge_adapter
from qlora_kit.errors import MergeDriftError
from qlora_kit.memory.auto import choose_policy
from qlora_kit.memory.planner import GIB, plan, policy_name
from qlora_kit.model import bnb_selftest, driver
from qlora_kit.model import loading as model
from qlora_kit.model.precision import Device, resolve_mixed_precision
from qlora_kit.recipe.base import one_line
from qlora_kit.recipe.recipe import Recipe
from qlora_kit.registries import checkpointing as table
from qlora_kit.registries import metric_keys as keys
from qlora_kit.training import compiled
from qlora_kit.training.pipeline import run

PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets")
# The tiny run: long enough for the loss to fall, short enough for CI (~10 s on 2 CPU cores).
TINY_RUN = {
    "data.max_seq_len": 64,
    "lora.dropout": 0.0,
    "optimizer.lr": 1e-3,
    "optimizer.warmup_ratio": 0.0,
    "train.max_steps": 12,
    "train.micro_batch_size": 8,
    "train.logging_steps": 1,
    "train.eval_steps": None,
    "train.sample_prompts": 0,
    "memory.chunked_loss": True,  # the head large models train with (auto picks full logits for a tiny one)
}
MAX_LOGIT_DIFF = 1e-3  # the same weights in the same dtypes on the same device: equal up to kernels


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def diagnose(
    recipe: Recipe | None = None, workdir: Path | None = None, console: Console | None = None
) -> list[Check]:
    """Every check, in order; a check that raises is a failed row, and the rest still run when they can.
    ``console``: where the tiny run shows its progress (the run console of ``qlora-kit train``); none
    shows nothing of it, never the Trainer's printed log dicts and bars."""
    checks = [_versions(), _device(), _driver(), _llama_cpp(), _cuda_kernels()]
    _attempt(checks, "bitsandbytes 4-bit", _dequantization)
    # whether train.compile can compile here (auto leaves the layers eager where it cannot)
    _attempt(checks, "compiler (torch.compile)", compiled.compiler_works)
    console = console if console is not None else Console(stderr=True, quiet=True)
    with tempfile.TemporaryDirectory(prefix="qlora-kit-doctor-", dir=workdir) as folder:
        run = _attempt(checks, "train (tiny, this device)", lambda: _train(Path(folder), console))
        if run is not None:
            _attempt(checks, "reload with plain peft", lambda: _reload(run))
            _attempt(checks, "merge and drift check", lambda: _merge(run, Path(folder) / "merged"))
    if recipe is not None:
        _attempt(checks, f"plan {recipe.model.path}", lambda: _plan(recipe))
    return checks


def _attempt(checks: list[Check], name: str, work: Callable):
    """Run one check; its result is (ok, detail[, value passed on]); an exception fails the row."""
    try:
        ok, detail, *value = work()
    except Exception as exc:  # a broken machine shows as a failed row, not a traceback
        checks.append(Check(name, False, f"{exc.__class__.__name__}: {one_line(str(exc))[:300]}"))
        return None
    checks.append(Check(name, ok, detail))
    return value[0] if value and ok else None


def _versions() -> Check:

    found = [f"python {platform.python_version()}"]
    for name in PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} MISSING")
    found[1] += f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (CPU build)"
    native = _bitsandbytes_native()
    ok = "MISSING" not in " ".join(found) and native is None and sys.version_info >= (3, 10)
    return Check("versions", ok, ", ".join(found) + ("" if native is None else f"; {native}"))


def _llama_cpp() -> Check:
    """Whether llama.cpp itself can read GGUF exports in the parity report (optional: a pass either way)."""
    from qlora_kit.after import llama_cpp_reader

    return Check("llama.cpp reader", True, llama_cpp_reader.describe())


# Optional CUDA kernel packages transformers and qlora_kit use when installed, and what each makes fast;
# without one, the same layers run transformers' (or qlora_kit's) PyTorch path: correct, slower on a GPU
CUDA_KERNELS = (
    ("flash-attn", "is_flash_attn_2_available", "model.attn_implementation: flash_attention_2"),
    (
        "flash-linear-attention",
        "is_flash_linear_attention_available",
        "the chunked delta rule of Qwen3.5's Gated DeltaNet layers",
    ),
    ("causal-conv1d", "is_causal_conv1d_available", "the linear-attention layers' short convolution"),
    ("liger-kernel", "is_liger_kernel_available", "the chunked loss head, fused with its cross-entropy"),
)


def _cuda_kernels() -> Check:
    """Which optional CUDA kernel packages are installed (a pass either way: each is a speed, not a need)."""
    from transformers.utils import import_utils

    found = []
    for package, probe, speeds_up in CUDA_KERNELS:
        installed = getattr(import_utils, probe)()
        found.append(f"{package} {'installed' if installed else 'not installed'} ({speeds_up})")
    where = "" if torch.cuda.is_available() else "none runs on a CPU; "
    return Check("CUDA kernels", True, where + "; ".join(found))


def _bitsandbytes_native() -> str | None:
    """None when bitsandbytes' native library loaded, else what went wrong."""
    try:
        from bitsandbytes import cextension
    except Exception as exc:
        return f"bitsandbytes does not import: {exc.__class__.__name__}: {one_line(str(exc))[:300]}"
    if isinstance(cextension.lib, cextension.ErrorHandlerMockBNBNativeLibrary):
        return "bitsandbytes' native library did not load"
    return None


def _device() -> Check:

    if not torch.cuda.is_available():
        return Check(
            "device", True, f"CPU, {os.cpu_count()} cores (no CUDA device: training runs on the CPU)"
        )
    free, total = torch.cuda.mem_get_info()
    major, minor = torch.cuda.get_device_capability()
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    return Check(
        "device",
        True,
        f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}, bf16 {'yes' if bf16 else 'no'}), "
        f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free, {torch.cuda.device_count()} visible",
    )


def _dequantization():
    """bitsandbytes' 4-bit dequantization on this device against a plain-torch reference: a pass where it is
    right, or wrong and gone around (bnb_selftest.py); a failure where the weights would be wrong."""
    verdict = bnb_selftest.check("cuda" if torch.cuda.is_available() else "cpu")
    return verdict.ok, verdict.describe()


def _driver() -> Check:
    """The NVIDIA driver against the CUDA torch was built for: fails, with the ways out, when torch
    cannot use the GPU nvidia-smi sees."""
    found = driver.report()
    problem = found.problem()
    return Check("NVIDIA driver", problem is None, problem or found.summary())


def _train(folder: Path, console: Console):

    # The device's own defaults: bf16 where the GPU has it, fp16 (with its gradient scaler) before Ampere.
    compute = "bfloat16" if Device.here().bf16 else "float16"
    settings = {**TINY_RUN, "quant.compute_dtype": compute, "train.output_dir": str(folder / "run")}
    recipe = Recipe.from_dict({}, settings)
    started = time.perf_counter()
    result = run(recipe, console=console)
    seconds = time.perf_counter() - started
    losses = result.train_losses
    falling = len(losses) >= 2 and losses[-1] < losses[0]
    usage = result.memory
    detail = (
        f"{recipe.train.max_steps} steps in {seconds:.1f} s, mixed precision "
        f"{resolve_mixed_precision(recipe)}, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"{usage.get(keys.TOKENS_PER_S, 0):,.0f} tokens/s"
    )
    if keys.PEAK_BACKWARD in usage:
        detail += (
            f"; peaks forward {usage[keys.PEAK_FORWARD]:.2f} / backward {usage[keys.PEAK_BACKWARD]:.2f} / "
            f"optimizer {usage[keys.PEAK_OPTIMIZER]:.2f} GiB"
        )
    return falling, detail + ("" if falling else " (the loss did not fall)"), result


def _reload(result):
    """The saved adapter, loaded with plain peft onto a freshly loaded 4-bit base: the same logits."""
    recipe = Recipe.from_yaml(result.output_dir / "recipe.yaml")
    base = model.load_base_model(recipe.model, recipe.quant)
    reloaded = PeftModel.from_pretrained(base, str(result.output_dir)).eval()
    trained = result.model.eval()
    ids = result.tokenizer("What sound does a cow make?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = trained(input_ids=ids.to(trained.device)).logits.float()
        got = reloaded(input_ids=ids.to(reloaded.device)).logits.float()
    diff = float((expected - got.to(expected.device)).abs().max())
    return diff <= MAX_LOGIT_DIFF, f"max logit difference {diff:.2e} (at most {MAX_LOGIT_DIFF:g})"


def _merge(result, out: Path):

    try:
        merged = merge_adapter(result.output_dir, out)
    except MergeDriftError as exc:
        return False, str(exc)
    drift = merged.drift
    return True, f"answers' mean KL {drift.mean_kl:.2e}, decided top-1 agreement {drift.top1_agreement:.1%}"


def _plan(recipe: Recipe):

    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0] / GIB
        device = "cuda"
    else:
        free = psutil.virtual_memory().available / GIB
        device = "cpu"
    the_plan = plan(recipe, device=device)
    chosen = the_plan.chosen(recipe) if not table.planned(recipe.memory.checkpointing) else None
    policy, every_n, why = choose_policy(recipe, free, the_plan)
    fits = bool(the_plan.fitting(free))
    label = policy_name(policy, every_n)
    detail = f"{free:.1f} GiB free on the {device}: " + (
        f"fits with checkpointing {label} ({why})" if fits else why
    )
    if chosen is not None:
        detail += f"; the recipe's {chosen.policy} needs {chosen.peak / GIB:.2f} GiB"
    if the_plan.rollout:  # train.objective grpo: which knob moves which of its two peaks
        detail += "; " + the_plan.grpo_peaks(chosen or min(the_plan.policies, key=lambda r: r.peak))
    return fits, detail
