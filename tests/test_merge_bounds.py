"""merge's drift bounds (after/drift_bounds.py), derived per merge from its weights' dtype, the layers
the rounding passes through and the trained model's distributions: the model of the error against a
sampled one, the dtype read from the saved files, and builtins of every kind merged at their defaults
while a planted wrong expert is refused; on the same runs, export's bounds (after/parity_judgement.py,
derived from the same model) pass a merged export and refuse it with the update halved."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qlora_kit import Recipe, train
from qlora_kit.after import drift_bounds, merge
from qlora_kit.errors import MergeDriftError

ROOT = Path(__file__).resolve().parents[1]


def test_the_second_order_kl_matches_sampled_relative_errors():
    """kl_of_relative_error against the mean KL of log-probabilities perturbed by sampled relative errors
    (float64, 400 draws): the second-order term leaves out -(E_p[d])^2 / 2, at most max p of it, and the
    sampling's own spread is 1/sqrt(400) of the mean; the third order is variance^(1/2) smaller."""
    generator = torch.Generator().manual_seed(0)
    log_probs = (3 * torch.randn(32, 40, generator=generator, dtype=torch.float64)).log_softmax(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1, keepdim=True)
    variance = 1e-6
    sampled = torch.zeros(32, dtype=torch.float64)
    for _ in range(400):
        noise = variance**0.5 * torch.randn(log_probs.shape, generator=generator, dtype=torch.float64)
        perturbed = (log_probs + noise * (log_probs + entropy)).log_softmax(-1)
        sampled += (log_probs.exp() * (log_probs - perturbed)).sum(-1) / 400
    expected = drift_bounds.kl_of_relative_error(log_probs, variance)
    largest = log_probs.exp().max(-1).values
    assert torch.all(sampled <= expected * 1.15) and torch.all(sampled >= expected * (1 - largest) * 0.85)


def test_the_roundoff_is_the_coarsest_saved_floating_dtype(tmp_path):
    save_file(
        {"a": torch.zeros(2, dtype=torch.float32), "ids": torch.zeros(2, dtype=torch.int64)},
        tmp_path / "x.safetensors",
    )
    assert drift_bounds.weight_roundoff(tmp_path) == torch.finfo(torch.float32).eps / 2
    save_file({"b": torch.zeros(2, dtype=torch.bfloat16)}, tmp_path / "y.safetensors")  # experts saved apart
    assert drift_bounds.weight_roundoff(tmp_path) == 2.0**-8


def test_a_routing_flip_at_a_near_tie_is_left_out_and_a_decided_one_is_judged():
    """routing_ties.near_tie_flips on two routers of 4 experts (top 2), float16 weights: a position whose
    first flip swaps experts 1e-4 apart (within rounding's reach, 2.7e-3 of the scores' RMS at layer 0) is
    left out; one whose first flip drops an expert 0.7 ahead (a merge that is wrong) is judged, whatever
    flips after it; an unflipped position is judged. Red if every flip or none is left out."""
    from qlora_kit.after import routing_ties

    scores = torch.tensor([[1.0, 0.5, 0.4999, -1.0], [1.0, 0.8, 0.1, -1.0], [1.0, 0.5, 0.4999, -1.0]])
    kept = torch.tensor([[0, 1], [0, 1], [0, 1]])
    layer0_merged = torch.tensor([[0, 2], [0, 2], [0, 1]])  # position 2 flips only at layer 1
    layer1_merged = torch.tensor([[0, 2], [0, 2], [0, 2]])
    trained = [(scores, kept), (torch.tensor([[1.0, 0.9, 0.1, -1.0]] * 3), kept)]
    merged = [(scores, layer0_merged), (scores, layer1_merged)]
    tie = routing_ties.near_tie_flips(trained, merged, layers=[0, 1], roundoff=2.0**-11)
    # position 2's flip at layer 1 drops an expert 0.8 ahead: decided, so judged
    assert tie.tolist() == [True, False, False]
    assert 1e-4 < 2 * routing_ties.reach(0, 2.0**-11) * float(scores[0].square().mean().sqrt()) < 0.7
    # a router whose scores could not be read: its flips are judged
    unread = routing_ties.near_tie_flips(
        [(None, kept)], [(None, layer0_merged)], layers=[0], roundoff=2.0**-11
    )
    assert not unread.any()


def two_steps(tmp_path: Path, recipe_file: str, model: str | None) -> Path:
    """An adapter trained 2 steps at the recipe's shipped defaults (no evaluation or samples between)."""
    sets = {"train.output_dir": str(tmp_path / "run"), "train.max_steps": 2, "train.sample_prompts": 0}
    sets |= {"train.eval_steps": None} | ({"model.path": model} if model else {})
    return train(Recipe.from_yaml(ROOT / "recipes" / recipe_file, overrides=sets)).output_dir


@pytest.mark.slow  # trains 2 steps, merges (twice with the planted expert) and exports (~2-3 min on 2 cores)
def test_a_mixture_merges_at_its_defaults_and_a_planted_wrong_expert_is_refused(tmp_path):
    """builtin:tiny-qwen3.5-moe from recipes/demo.yaml (red at the bounds calibrated on dense models: mean
    KL 0.0005911 at the answers, max 0.0005, from this CPU's float16 experts, its weights' own drift
    1.0e-7); its merged folder with layer 0's experts 0 and 1 swapped is refused."""
    adapter = two_steps(tmp_path, "demo.yaml", "builtin:tiny-qwen3.5-moe")
    result = merge.merge_adapter(adapter, tmp_path / "merged")
    assert result.drift.positions > 0 and result.drift.mean_kl <= result.drift.max_kl
    wrong = tmp_path / "wrong"
    shutil.copytree(tmp_path / "merged", wrong)
    file = next(wrong.glob("*.safetensors"))
    tensors = load_file(file)
    first, second = (f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in (0, 1))
    tensors[first], tensors[second] = tensors[second], tensors[first]
    save_file(tensors, file, metadata={"format": "pt"})
    from qlora_kit.model.adapters import recipe_of

    drift = merge.measure_drift(recipe_of(adapter), adapter, wrong)
    assert not drift.within(drift.max_kl, merge.MIN_TOP1, drift.max_all_kl), drift
    an_export_passes_and_its_update_halved_is_refused(adapter, tmp_path)


@pytest.mark.slow  # trains 2 steps, merges and exports (~2 min each on 2 cores)
@pytest.mark.parametrize(
    ("recipe_file", "model"),
    [("demo.yaml", "builtin:tiny-qwen3.5"), ("demo-vlm.yaml", None)],
    ids=["hybrid", "vision"],
)
def test_a_hybrid_and_a_vision_builtin_merge_at_their_defaults(tmp_path, recipe_file, model):
    adapter = two_steps(tmp_path, recipe_file, model)
    try:
        result = merge.merge_adapter(adapter, tmp_path / "merged")
    except MergeDriftError as refused:
        pytest.fail(str(refused))
    assert result.drift.positions > 0
    an_export_passes_and_its_update_halved_is_refused(adapter, tmp_path)


def an_export_passes_and_its_update_halved_is_refused(adapter: Path, tmp_path: Path) -> None:
    """Export's bounds on the same run (after/parity_judgement.py, derived from this module's error
    model): its merged float16 export passes the parity report, and that folder with the update halved
    (base + 0.5 x update, computed from the fp32 merge) is refused against the trained model and against
    its floor. The report's reference and floor are computed once, for both."""
    from qlora_kit import export
    from qlora_kit.after.export import check_export
    from qlora_kit.model.adapters import recipe_of

    small = {"prompt_count": 2, "tokens": 1}
    result = export(adapter, "merged", out=tmp_path / "export", **small)
    assert result.report["failures"] == []
    wrong = shutil.copytree(tmp_path / "export", tmp_path / "halved")
    recipe = recipe_of(adapter)
    merge.write_merged(recipe, adapter, tmp_path / "full", "dequantized", "float32")
    merge.write_merged(recipe, None, tmp_path / "base", "dequantized", "float32")
    for file in wrong.glob("*.safetensors"):
        full, base, saved = (
            load_file(folder / file.name) for folder in (tmp_path / "full", tmp_path / "base", wrong)
        )
        halved = {key: (base[key] + 0.5 * (full[key] - base[key])).to(saved[key].dtype) for key in saved}
        save_file(halved, file, metadata={"format": "pt"})
    failures = check_export(adapter, wrong, **small)["failures"]
    for against in ("trained", "floor"):
        assert any(f"against the {against} model: mean KL" in line for line in failures), failures
