"""train.compile: auto decides before step 1, by the planned steps and a timed step, and says why; the
compiler check doctor shows. (The compiled layers themselves: tests/e2e/test_compile_layers.py.)"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from qlora_kit.memory import experts_on_host
from qlora_kit.training import compile_choice, compiled
from qlora_kit.training.pipeline import build
from tests.conftest import quick_recipe

pytestmark = pytest.mark.slow  # each builds a run (seconds); the compiler check compiles


def _built(tmp_path, caplog, **overrides):
    with caplog.at_level(logging.INFO, logger="qlora_kit.training.compile_choice"):
        setup = build(quick_recipe(tmp_path / "out", **overrides))
    decisions = [r for r in caplog.records if r.name == "qlora_kit.training.compile_choice"]
    (line,) = [r.getMessage() for r in decisions if r.getMessage().startswith("train.compile: ")]
    return setup, line


def test_auto_leaves_a_short_run_eager_without_measuring(tmp_path, caplog):
    setup, line = _built(tmp_path, caplog, **{"train.max_steps": 6})
    assert line == "train.compile: off (auto: 6 planned steps, fewer than 50 never repay a compile)"
    assert not compiled.decoder_layers_compiled(setup.model)


def test_auto_times_a_step_and_decides_by_its_figures(tmp_path, caplog):
    # 50 steps of one row of up to 32 tokens: milliseconds a step on an idle machine, far from repaying a
    # compile (on a loaded one the step may time long enough that a compile is timed too)
    overrides = {"train.max_steps": 50, "train.micro_batch_size": 1, "data.max_seq_len": 32}
    probes = compiled.compiler_works.cache_info()
    setup, line = _built(tmp_path, caplog, **overrides)
    started = compiled.compiler_works.cache_info() != probes
    assert_decided_by_its_figures(line, setup.model, steps=50, compiler_started=started)
    # the measurement left no gradient behind
    assert all(p.grad is None for p in setup.model.parameters())


def test_auto_leaves_a_mixture_with_its_experts_on_the_host_eager_without_measuring(tmp_path, caplog):
    # a mixture's layers compile but for their routed experts; with the experts kept on the host, the copies
    # are the step's time, and each timed step would copy them too (memory.experts_on_host counts every copy)
    overrides = {
        "model.path": "builtin:tiny-qwen3-moe",
        "memory.experts_on_host": True,
        "train.max_steps": 50,
        "train.micro_batch_size": 1,
        "data.max_seq_len": 32,
    }
    setup, line = _built(tmp_path, caplog, **overrides)
    assert line == f"train.compile: off ({compile_choice.HOST_EXPERTS_REASON})"
    assert not compiled.decoder_layers_compiled(setup.model)
    layers = experts_on_host.layers_on_host(setup.model)
    assert layers and not any(layer.copies for layer in layers)  # no step ran


def test_a_compile_timed_below_a_compiled_step_is_logged_as_the_nothing_it_costs():
    """A compile served from inductor's cache (an earlier run's, or an earlier test's) can time below a
    compiled step: it costs nothing, and the line gives the figure the choice used (CI read "2 compiles of
    -0.0 s" in a test that compiled after another had)."""
    choice = compile_choice.timed_choice(1000, 0.040, -0.003, 0.018)
    compiles = compile_choice.EXPECTED_COMPILES
    assert choice.enabled and choice.reason.endswith(f"against {compiles} compiles of 0.0 s"), choice.reason


def assert_decided_by_its_figures(line: str, model, steps: int, compiler_started: bool) -> None:
    """The logged decision of auto follows from the figures it logs, and the layers are as it says; a run
    refused at a decoder layer's least compile never asked for the compiler (its first start: 12-15 s)."""
    bounded = re.fullmatch(
        rf"train\.compile: off \(auto: {steps} steps of ([\d.]+) s save at most ([\d.]+) s, under the "
        r"(\d) compiles of at least ([\d.]+) s the run would make\)",
        line,
    )
    timed = re.fullmatch(
        rf"train\.compile: (on|off) \(auto: {steps} steps x \(([\d.]+) s eager - ([\d.]+) s compiled\) = "
        r"(-?[\d.]+) s saved against (\d) compiles of ([\d.]+) s\)",
        line,
    )
    assert bounded or timed, line
    if bounded:
        eager_s, bound, compiles, floor = (float(v) for v in bounded.groups())
        # the bound is the planned steps' largest saving, the floor the compile timed in this process or a
        # decoder layer's least, whichever is more
        assert bound == pytest.approx(
            steps * eager_s * compile_choice.LARGEST_SAVING, abs=steps * 5e-4 + 0.005
        )
        assert bound < compiles * floor
        if bound < compiles * compile_choice.LAYER_COMPILE_FLOOR_S:
            assert floor == compile_choice.LAYER_COMPILE_FLOOR_S and not compiler_started
            assert not compiled.decoder_layers_compiled(model)
            return
        least = max(compiled.least_compile_seconds(), compile_choice.LAYER_COMPILE_FLOOR_S)
        assert floor == pytest.approx(least, abs=0.005)
        assert not compiled.decoder_layers_compiled(model)
        return
    state, eager_s, compiled_s, saving, compiles, compile_s = timed.groups()
    assert float(saving) == pytest.approx(
        steps * (float(eager_s) - float(compiled_s)), abs=steps * 1e-3 + 0.1
    )
    cost = int(compiles) * float(compile_s)
    if abs(float(saving) - cost) > 0.1 * (int(compiles) + 1):  # beyond the figures' rounding
        assert (state == "on") == (float(saving) > cost)
    assert compiled.decoder_layers_compiled(model) == (state == "on")


def test_the_compiler_check_passes_here_and_fails_without_a_cpp_compiler():
    ok, detail = compiled.compiler_works.__wrapped__()
    assert ok and detail.startswith("inductor on cpu"), detail
    torch._dynamo.reset()
    # inductor's C++ compiler on the CPU, as its config names it; no cached kernel may stand in for it
    broken = {"cpp.cxx": (None, "/nonexistent/g++"), "fx_graph_cache": False}
    with torch._inductor.config.patch(broken):
        ok, detail = compiled.compiler_works.__wrapped__()
    torch._dynamo.reset()
    assert not ok and "failed" in detail, detail


def test_auto_runs_eager_when_the_compiler_fails_on_the_layers(tmp_path, caplog):
    # the compiler check passed earlier in the process (cached), then inductor's C++ compiler goes missing:
    # the timed compile of the layers fails, and the run goes on eager with the error's first line
    compiled.compiler_works()
    compiled.least_compile_seconds()
    torch._dynamo.reset()
    broken = {"cpp.cxx": (None, "/nonexistent/g++"), "fx_graph_cache": False}
    overrides = {"train.max_steps": 100_000, "train.micro_batch_size": 1, "data.max_seq_len": 32}
    with torch._inductor.config.patch(broken):
        setup, line = _built(tmp_path, caplog, **overrides)
    torch._dynamo.reset()
    assert line.startswith("train.compile: off (auto: compiling the layers failed: "), line
    assert not compiled.decoder_layers_compiled(setup.model)
    assert all(p.grad is None for p in setup.model.parameters())
