"""qlora-kit export of a mixture of experts to GGUF: a trained Qwen3-MoE run written with llama.cpp's expert
tensors (after/gguf_experts.py), read back by transformers and llama.cpp itself and held to the same parity
report as a dense model's export (tests/test_export.py)."""

from __future__ import annotations

import pytest

from qlora_kit.registries import families as table
from tests.test_export import llama_cpp_installed, require_llama_cpp

gguf = pytest.importorskip("gguf")

MIXTURE = "tiny-qwen3-moe"


@pytest.mark.slow
def test_a_trained_mixture_exports_a_gguf_llama_cpp_reads_as_the_trained_model(tmp_path):
    import numpy as np
    import torch

    from qlora_kit import export, train
    from qlora_kit.after import floor
    from qlora_kit.model import adapters
    from qlora_kit.model.builtin import ensure_tiny_model
    from tests.conftest import quick_recipe

    path = ensure_tiny_model(MIXTURE, **table.by_tiny_name(MIXTURE).export.tiny_overrides)
    # two steps at a high rate: the experts' LoRA moves (the update checked below), the run stays short
    overrides = {"model.path": str(path), "train.max_steps": 2, "optimizer.lr": 1e-2}
    run = train(quick_recipe(tmp_path / "run", **overrides))
    result = export(run.output_dir, "gguf", out=tmp_path / "gguf", qtype="f16", prompt_count=2, tokens=4)
    report = result.report
    assert report["failures"] == [], report["failures"]
    rows = {(c["reader"], c["against"]) for c in report["comparisons"]}
    assert {("transformers", "trained"), ("transformers", "floor")} <= rows
    if llama_cpp_installed():  # llama.cpp read it too, within the same bounds as a dense export
        assert {("llama.cpp", "trained"), ("llama.cpp", "floor")} <= rows
    else:
        require_llama_cpp()  # CI: a failure; elsewhere the rows above are the report
    folder = result.output_dir
    assert sorted(p.name for p in folder.iterdir()) == ["Modelfile", "export_report.json", "model.gguf"]
    assert "FROM ./model.gguf" in (folder / "Modelfile").read_text()

    # llama.cpp's expert form: the counts and the experts' own width as its converter writes them, each
    # projection one (experts, out, in) stack (GGUF lists dimensions innermost first), the router in F32
    written = gguf.GGUFReader(folder / "model.gguf")
    fields = {k: written.fields[k].contents() for k in written.fields if k.startswith("qwen3moe.expert")}
    assert fields == {
        "qwen3moe.expert_count": 8,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.expert_feed_forward_length": 128,
    }
    tensors = {t.name: t for t in written.tensors}
    for projection in ("gate", "up", "down"):
        assert tuple(tensors[f"blk.3.ffn_{projection}_exps.weight"].shape) == (128, 128, 8)
        assert tensors[f"blk.3.ffn_{projection}_exps.weight"].tensor_type.name == "F16"
    assert tensors["blk.3.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert not any(".experts." in name or "ffn_gate.weight" in name for name in tensors)

    # the experts' trained update is in the file: the stacks differ from the 4-bit base's own experts
    recipe = adapters.recipe_of(run.output_dir)
    base = floor.merged_model(recipe, None, "dequantized").model.layers[1].mlp.experts
    gate_up = torch.cat([_stack(tensors, "blk.1.ffn_gate_exps"), _stack(tensors, "blk.1.ffn_up_exps")], dim=1)
    for stack, base_stack in (
        (gate_up, base.gate_up_proj),
        (_stack(tensors, "blk.1.ffn_down_exps"), base.down_proj),
    ):
        moved = (stack - base_stack.detach().half().float()).abs()
        assert np.prod(stack.shape) == base_stack.numel() and moved.max() > 1e-3  # f16's step here: ~1e-5


def _stack(tensors, name: str):
    import torch

    return torch.from_numpy(tensors[f"{name}.weight"].data.astype("float32"))  # (experts, out, in)


# the families whose GGUF llama.cpp alone reads back (Mixtral: the llama architecture with experts, which
# transformers' GGUF loader reads as a dense Llama)
LLAMA_CPP_ONLY = [f.tiny for f in table.exportable().values() if not f.export.transformers_reads]


@pytest.mark.slow
@pytest.mark.parametrize("name", LLAMA_CPP_ONLY)
def test_llama_cpp_reads_a_mixtral_gguf_as_transformers_computes_the_model(name, tmp_path):
    """The writer's Mixtral file (q/k rows permuted for llama's rope, each layer's w1/w3/w2 stacked into
    ffn_gate_exps/ffn_up_exps/ffn_down_exps, the router in F32), read by llama.cpp itself: its logits under
    teacher forcing are transformers' on the checkpoint the file was written from."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qlora_kit.after import gguf_writer, llama_cpp_reader
    from qlora_kit.after.parity import kl_per_position
    from qlora_kit.model.builtin import ensure_tiny_model

    require_llama_cpp()
    folder = ensure_tiny_model(name)
    gguf_writer.write_model_gguf(folder, tmp_path / "m.gguf", "f16", name)
    written = gguf.GGUFReader(tmp_path / "m.gguf")
    assert written.fields["llama.expert_count"].contents() == 8
    assert written.fields["llama.expert_used_count"].contents() == 2
    types = {t.name: t.tensor_type.name for t in written.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "F16" and types["blk.0.ffn_gate_inp.weight"] == "F32"
    source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(folder)("### Instruction:\nWhat color is the sky?\n\n### Response:\n")
    ids = ids["input_ids"]
    reading = llama_cpp_reader.read(tmp_path / "m.gguf", [(ids[:1], ids[1:], 4)], [])
    with torch.no_grad():
        expected = source(input_ids=torch.tensor([ids])).logits[0, :-1]
    got = reading.answer_logits(ids[:1], ids[1:])
    kl = float(kl_per_position(expected, got).mean())
    # the same weights (only f16 storage and the kernels' float order differ): KL ~5e-7 measured; the q/k
    # rows left unpermuted for llama's rope, on this barely trained tiny model, are 1.6e-3
    assert kl < 1e-5 and (expected.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9, kl


@pytest.mark.slow
def test_a_mixtral_export_without_llama_cpp_is_refused_in_one_line(
    finished_run, tmp_path, monkeypatch, capsys
):
    """Without llama.cpp a Mixtral GGUF would have no reader in its parity report: refused before anything
    is loaded or written."""
    from tests.conftest import copy_run, run_cli

    run = copy_run(finished_run, tmp_path)
    recipe = run / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("builtin:tiny-llama", "builtin:tiny-mixtral"))
    monkeypatch.setenv("PATH", "")  # no node: llama.cpp's reader is not available
    code, stderr = run_cli(
        ["export", "--adapter", str(run), "--to", "gguf", "--out", str(tmp_path / "out")], monkeypatch, capsys
    )
    assert code == 2, stderr
    assert "llama.cpp is the parity report's one reader, and it is not installed" in stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_per_expert_and_fused_checkpoints_stack_into_the_same_llama_cpp_tensors():
    """A checkpoint's per-expert matrices (what transformers saves) and transformers 5's fused stacks
    (gate rows first in gate_up_proj) give the same (experts, out, in) tensors under the converter's names;
    a layer missing an expert is refused."""
    import torch

    from qlora_kit.after.gguf_experts import ExpertStacks
    from qlora_kit.errors import ExportError

    gate, up, down = torch.randn(3, 4, 6), torch.randn(3, 4, 6), torch.randn(3, 6, 4)  # 3 experts
    layer = "model.layers.0.mlp.experts"
    stacks, got = ExpertStacks(3), {}
    for expert in (2, 0, 1):  # any order: safetensors lists experts.10 before experts.2
        for name, tensor in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            got.update(stacks.take(f"{layer}.{expert}.{name}.weight", tensor[expert]))
    stacks.finish()
    fused = dict(ExpertStacks(3).take(f"{layer}.gate_up_proj", torch.cat([gate, up], dim=1)))
    fused.update(ExpertStacks(3).take(f"{layer}.down_proj", down))
    assert (
        got.keys() == fused.keys() == {f"{layer}.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    )
    for name, expected in zip(sorted(got), (down, gate, up), strict=True):
        assert torch.equal(got[name], expected) and torch.equal(fused[name], expected), name
    assert ExpertStacks(3).take("model.layers.0.mlp.gate.weight", gate[0]) is None  # the router: not stacked
    partial = ExpertStacks(3)
    partial.take(f"{layer}.0.gate_proj.weight", gate[0])
    with pytest.raises(ExportError, match=r"experts\.gate_proj\.weight has 1 of 3 experts"):
        partial.finish()


def test_lora_on_experts_is_refused_as_a_lora_gguf_in_one_line(tmp_path):
    import json

    from qlora_kit.after import gguf_writer
    from qlora_kit.errors import ExportError

    settings = {"r": 16, "lora_alpha": 32, "target_parameters": ["mlp.experts.gate_up_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(settings))
    with pytest.raises(ExportError, match="LoRA on a mixture's experts has no LoRA GGUF form") as refusal:
        gguf_writer.check_lora_form(tmp_path)
    assert len(str(refusal.value).splitlines()) == 1
