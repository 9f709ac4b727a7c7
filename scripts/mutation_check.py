"""Mutation check: break, on purpose, each behaviour the test suite claims to guard, and see it go red.

    python scripts/mutation_check.py              # every mutation, two at a time
    python scripts/mutation_check.py --only NAME  # one (repeatable); --list shows the names
    python scripts/mutation_check.py --jobs 1     # one at a time
    python scripts/mutation_check.py --table tests/MUTATIONS.md   # and each row's verdict and seconds

Each row of MUTATIONS is (name, file, exact old snippet, new snippet, the pytest node ids that must turn
red). The tracked (and untracked, not ignored) files are copied to a temporary folder once per job; the
snippet is replaced there, only the named tests run against the copy (PYTHONPATH and the tests' own
subprocesses point at it), and the file is put back. A mutation "survives" when those tests pass: that
is a finding to fix in the tests. The script exits 1 when any mutation survives, a snippet is not found
exactly once, or a node id is not collected; CI runs it after the whole suite has passed (.ci/run), so a
red test here is the mutation's doing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name, file, old snippet, new snippet, tests that must fail. Fast tests only: the whole table runs in a
# few minutes on two cores. (Paths are the package's as of this script; move them with the modules.)
MUTATIONS = [
    (
        "precision resolution always says no",
        "qlora_kit/model/precision.py",
        "    return wanted\n",
        '    return "no"\n',
        [
            "tests/test_precision_seam.py::test_build_hands_the_resolved_precision_to_the_trainer_and_accelerate"
        ],
    ),
    (
        "bf16 never reaches the Trainer",
        "qlora_kit/training/step/arguments.py",
        'bf16=precision == "bf16",',
        "bf16=False,",
        [
            "tests/test_precision_seam.py::test_dpo_build_hands_bf16_to_the_trainer_and_accelerate",
            "tests/e2e/test_formats.py::test_sharegpt_and_tool_call_chats_train_on_the_tiny_model",
        ],
    ),
    (
        "resume restarts from step 0",
        "qlora_kit/training/pipeline.py",
        "trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)",
        "trainer.train(resume_from_checkpoint=None)",
        ["tests/e2e/test_cli.py::test_resume_from_the_shell_continues_the_newest_checkpoint"],
    ),
    (
        "a resumed run's group_by_length order drawn from the global random state",
        "qlora_kit/training/step/trainer.py",
        "        if type(sampler) is LengthGroupedSampler:\n",
        "        if False:\n",
        ["tests/test_after_training.py::test_resumed_run_ends_with_the_same_adapter_bit_for_bit[grouped]"],
    ),
    (
        "export takes a parity report of no prompts or no tokens",
        "qlora_kit/after/export.py",
        "        if value < 1:\n",
        "        if False:\n",
        ["tests/test_export.py::test_bad_input_gets_one_line"],
    ),
    (
        "the kill switch never fires",
        "qlora_kit/training/step/interrupts.py",
        "        self.received = signum\n",
        "        pass\n",
        ["tests/test_interrupts.py::test_sigterm_stops_after_its_step_with_that_steps_checkpoint"],
    ),
    (
        "the loss guard never stops",
        "qlora_kit/training/step/guards.py",
        "        if loss_bad:\n",
        "        if False:\n",
        ["tests/test_after_training.py::test_nonfinite_loss_stops_at_that_step"],
    ),
    (
        "check_output_holds_no_input returns early",
        "qlora_kit/model/paths.py",
        '    deletes them once the run has its own."""\n',
        '    deletes them once the run has its own."""\n    return\n',
        ["tests/test_bad_input.py::test_an_output_folder_that_holds_the_runs_data_is_refused"],
    ),
    (
        "packing leaks position ids across examples",
        "qlora_kit/data/packing.py",
        'positions += range(len(batch["input_ids"][i]))',
        'positions += range(len(positions), len(positions) + len(batch["input_ids"][i]))',
        ["tests/test_data.py::test_packed_batch_gives_the_same_token_losses_as_one_by_one[sdpa]"],
    ),
    (
        "the chunked head keeps fp32 hidden states",
        "qlora_kit/memory/loss_head.py",
        "kept_hidden = hidden[:, :-1][trained].to(head.weight.dtype)",
        "kept_hidden = hidden[:, :-1][trained]",
        ["tests/test_gpu_path.py::test_chunked_head_keeps_16_bit_hidden_states_under_autocast"],
    ),
    (
        "the preflight passes everything",
        "qlora_kit/data/preflight.py",
        "    failed = next((c for c in checks if not c.passed), None)\n",
        "    failed = None\n",
        ["tests/test_preflight.py::test_a_failed_check_is_one_line_naming_it_and_its_fix"],
    ),
    (
        "the planner counts one layer fewer",
        "qlora_kit/memory/checkpointing.py",
        "    return [policy] * layers\n",
        "    return [policy] * (layers - 1)\n",
        ["tests/test_planner_oracle.py::test_traced_activations_equal_the_hand_count[full-1-tiny-llama]"],
    ),
    (
        "the tracer runs the layer types but not the first layer apart",
        "qlora_kit/memory/tracing.py",
        "return (0, *first.values())",
        "return tuple(first.values())",
        ["tests/test_tracing.py::test_a_65b_plan_traces_two_layers_not_eighty"],
    ),
    (
        "train never asks the disk for room",
        "qlora_kit/training/run_folder/outputs.py",
        "check_writable(output_dir, _output_bytes(peft_model, recipe.optimizer.name))",
        "check_writable(output_dir, 0)",
        ["tests/e2e/test_faults.py::test_full_disk_is_refused_by_train_before_training"],
    ),
    (
        "a family's linears drift from the model transformers builds",
        "qlora_kit/registries/families.py",
        'linears=("self_attn.o_proj", "self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"),',
        'linears=("self_attn.o_proj", "self_attn.qkv_proj", "mlp.down_proj"),',
        ["tests/test_families.py::test_the_facets_hold_for_the_model_built_from_the_config[phi3]"],
    ),
    (
        "a module outside the objective modules asks for an objective by name",
        "qlora_kit/memory/planner.py",
        "rollout_bytes(shape, recipe) if objectives.of(recipe).rollouts else 0",
        'rollout_bytes(shape, recipe) if recipe.train.objective == "grpo" else 0',
        ["tests/test_objectives.py::test_no_module_outside_the_objective_modules_asks_which_objective_it_is"],
    ),
    (
        "the planner counts one sequence per KTO row (no KL twin)",
        "qlora_kit/registries/objectives.py",
        "sequences_per_row=2,  # each answer, and the mismatched answer of the KL baseline",
        "sequences_per_row=1,",
        ["tests/test_kto.py::test_the_planner_counts_each_row_and_its_kl_twin"],
    ),
    (
        "after imports its sibling training",
        "qlora_kit/after/grpo_eval.py",
        "from qlora_kit.data.rewards import reward_functions\n",
        "from qlora_kit.data.rewards import reward_functions\nfrom qlora_kit.training.objectives import sft  # noqa: F401\n",
        ["tests/test_architecture.py::test_imports_follow_the_allowed_arrows_between_packages"],
    ),
    (
        "a cross-field error names the wrong field",
        "qlora_kit/recipe/data.py",
        '"data.group_by_length: pointless',
        '"data: group_by_length is pointless',
        ["tests/test_bad_input.py::test_every_bad_recipe_is_one_line_and_exit_2"],
    ),
    # --- round four (issue 47): this round's features, and the fixes of its bad inputs ---
    (
        "the OOM split scales each part's loss by its own tokens",
        "qlora_kit/training/step/oom_recovery.py",
        "loss = forward_backward(model, chunk, num_items_in_batch)",
        "loss = forward_backward(model, chunk, None)",
        ["tests/e2e/test_oom.py::test_the_split_keeps_steps_examples_and_losses"],
    ),
    (
        "the OOM split redoes the step with the random state moved on",
        "qlora_kit/training/step/oom_recovery.py",
        "            set_rng_state(self.step_rng)\n",
        "            pass\n",
        [
            "tests/e2e/test_oom.py::test_an_out_of_memory_error_in_the_second_micro_batch_of_an_accumulating_step"
        ],
    ),
    (
        "the OOM split keeps the partial gradients of the step's earlier micro-batches",
        "qlora_kit/training/step/oom_recovery.py",
        "        model.zero_grad(set_to_none=True)  # the step's partial gradients, from every micro-batch so far\n",
        "        pass\n",
        [
            "tests/e2e/test_oom.py::test_an_out_of_memory_error_in_the_second_micro_batch_of_an_accumulating_step"
        ],
    ),
    (
        "selective recomputes the 4-bit matmuls",
        "qlora_kit/memory/selective.py",
        "if func in ATTENTION or func in BATCHED_MATMULS or _is_4bit_matmul(func):",
        "if func in ATTENTION or func in BATCHED_MATMULS:",
        [
            "tests/test_selective.py::test_a_selective_layer_keeps_at_least_its_4bit_matmuls_and_attention_outputs_counted_by_hand"
        ],
    ),
    (
        "auto's layer choice takes the costliest fit",
        "qlora_kit/memory/layer_choice.py",
        "return list(min(states.values(), key=lambda state: state[:2])[2])",
        "return list(max(states.values(), key=lambda state: state[:2])[2])",
        ["tests/test_selective.py::test_cheapest_fit_is_the_optimum_of_a_small_case"],
    ),
    (
        "the GGUF's name trips llama.cpp's Phi-3 tokenizer rules",
        "qlora_kit/after/gguf_writer.py",
        "    writer.add_name(served_name(name))\n",
        "    writer.add_name(name)\n",
        ["tests/test_export.py::test_llama_cpp_reads_every_family_as_transformers_does[tiny-phi3]"],
    ),
    (
        "the LoRA GGUF's scale ignores rsLoRA",
        "qlora_kit/after/gguf_writer.py",
        "        alpha *= math.sqrt(rank)\n",
        "        pass\n",
        ["tests/test_export.py::test_the_lora_gguf_carries_the_adapters_scale_as_llama_cpp_reads_it[True]"],
    ),
    (
        "the GGUF keeps Q/K rows in Hugging Face's order",
        "qlora_kit/registries/shared_facets.py",
        '"LLAMA", "decoder+rope", permute_qk=True, unmapped_keys=HEAD_DIM_KEY,',
        '"LLAMA", "decoder+rope", permute_qk=False, unmapped_keys=HEAD_DIM_KEY,',
        ["tests/test_export.py::test_gguf_reads_back_as_the_model_it_was_written_from[tiny-llama]"],
    ),
    (
        "the Modelfile stops on EOS only",
        "qlora_kit/after/modelfile.py",
        "        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])\n",
        "        pass\n",
        ["tests/test_export.py::test_gguf_export_files_and_modelfile"],
    ),
    (
        "exact_match compares unstripped text",
        "qlora_kit/data/rewards.py",
        "float(completion_text(c).strip() == str(r).strip())",
        "float(completion_text(c) == str(r))",
        ["tests/test_grpo.py::test_builtin_rewards_score_each_completion_as_the_registry_says"],
    ),
    (
        "grpo.seed_each_completion is ignored",
        "qlora_kit/training/objectives/grpo/grpo.py",
        "            if not self.seed_each_completion:",
        "            if True:",
        ["tests/test_grpo.py::test_seed_each_completion_samples_a_prompt_alike_alone_or_beside_others"],
    ),
    (
        "the chunked head drops a mixture's auxiliary loss",
        "qlora_kit/memory/loss_head.py",
        "    if aux is not None:  #",
        "    if False:  #",
        ["tests/test_moe.py::test_the_chunked_head_adds_the_auxiliary_loss_as_transformers_does"],
    ),
    (
        "image tokens are trained",
        "qlora_kit/data/images.py",
        "        out_labels += [IGNORE_INDEX] * len(run)",
        "        out_labels += run",
        ["tests/test_vision.py::test_an_image_row_is_what_the_processor_makes_and_trains_its_answer_only"],
    ),
    (
        "Gemma-3's images attend causally (no token types in the batch)",
        "qlora_kit/data/images.py",
        "        if self.vision.token_type_ids and pictures:",
        "        if False:",
        ["tests/test_vision.py::test_an_image_row_is_what_the_processor_makes_and_trains_its_answer_only"],
    ),
    (
        "Gemma-3's image rows packed (transformers' sliding-window mask leaks between their examples)",
        "qlora_kit/data/images.py",
        "    if facet is not None and facet.token_type_ids:",
        "    if False:",
        ["tests/test_vision.py::test_packed_image_rows_give_every_example_its_own_loss"],
    ),
    (
        "a packed VLM run's held-out rows asked whole (a packed row's prompt, every example's images)",
        "qlora_kit/after/evaluate.py",
        "    data = images.one_example_a_row(recipe.data) if runs is not None else recipe.data",
        "    data = recipe.data",
        ["tests/test_vision.py::test_a_packed_run_is_evaluated_one_held_out_row_at_a_time"],
    ),
    (
        "packed image rows attend across examples (the nested text config keeps its KV cache)",
        "qlora_kit/model/loading.py",
        "    for config in {id(c): c for c in (base.config, base.config.get_text_config())}.values():",
        "    for config in (base.config,):",
        ["tests/test_vision.py::test_packed_image_rows_give_every_example_its_own_loss"],
    ),
    (
        "every_n counts a vision tower's layers before the decoder's",
        "qlora_kit/memory/checkpointing.py",
        "    model.activation_checkpointing_enable(kwargs)\n    _vision_side_without_input_grads(model)\n"
        "    if len(set(policies)) > 1:\n",
        "    model.activation_checkpointing_enable(kwargs, every_n_layers=memory.every_n)\n"
        "    _vision_side_without_input_grads(model)\n    if False:\n",
        ["tests/test_planner_grid.py::test_plan_matches_what_the_run_saves[tiny-llava-every_n-images]"],
    ),
    (
        "a cut splits an image's tokens",
        "qlora_kit/data/images.py",
        "        if start < end < stop:",
        "        if False:",
        ["tests/test_vision.py::test_a_cut_never_falls_inside_an_image_and_takes_the_images_past_it"],
    ),
    (
        "the recipe dump leaves out the grpo section",
        "qlora_kit/recipe/recipe.py",
        '        return self.model_dump(mode="json")\n',
        '        return self.model_dump(mode="json", exclude={"grpo"})\n',
        ["tests/test_recipe_round_trip.py::test_a_saved_recipe_loads_back_as_the_same_recipe"],
    ),
    (
        "a pair's end token must be its very last token",
        "qlora_kit/data/row_tokens.py",
        "        if tokenizer.decode([token]).strip():\n",
        "        if True:\n",
        [
            "tests/test_preflight.py::test_every_format_trains_an_end_token_on_every_template[qwen2.5-preference_chat]"
        ],
    ),
    (
        "--set hands YAML's reading to a text field",
        "qlora_kit/recipe/overrides.py",
        "    return raw if takes_text and not takes_parsed else parsed\n",
        "    return parsed\n",
        ["tests/test_recipe.py::test_a_literal_field_gets_its_choice_and_other_fields_keep_yaml_types"],
    ),
    (
        "--set reaches one level only",
        "qlora_kit/recipe/overrides.py",
        "        if not sections or not all(sections) or not field:\n",
        "        if len(sections) != 1 or not all(sections) or not field:\n",
        ["tests/test_recipe.py::test_set_reaches_a_field_at_any_depth"],
    ),
    (
        "a view reads a user's text as rich markup",
        "qlora_kit/cli/views.py",
        "    return Text(str(value))\n",
        "    return str(value)\n",
        ["tests/test_markup.py::test_the_run_summary_and_the_answers_before_and_after"],
    ),
    (
        "a reward that raises reaches TRL unchecked",
        "qlora_kit/training/objectives/grpo/reward_checks.py",
        "    if inspect.iscoroutinefunction(function):\n",
        "    if True:\n",
        [
            "tests/test_grpo.py::test_a_reward_that_raises_is_one_line_naming_the_entry_the_function_and_the_completion"
        ],
    ),
    (
        "one completion per prompt is allowed",
        "qlora_kit/recipe/grpo.py",
        "        if value < 2:\n",
        "        if value < 1:\n",
        ["tests/test_grpo.py::test_impossible_grpo_recipes_are_refused_naming_the_field"],
    ),
    (
        "a smoke benchmark writes over the committed tables",
        "benchmarks/common.py",
        "parsed.out = SMOKE_OUT if parsed.smoke and at_tables else self.full_out",
        "parsed.out = self.full_out",
        [
            "tests/test_benchmark_options.py::test_a_smoke_run_writes_outside_the_committed_tables_unless_out_says_so"
        ],
    ),
    (
        "a GRPO rollout's tokens are not counted (issue 50's AttributeError, then KeyError)",
        "qlora_kit/training/step/oom/rows.py",
        'if "prompt_mask" in inputs:',
        "if False:",
        ["tests/test_grpo_oom.py::test_a_rollout_is_measured_and_split_like_a_micro_batch"],
    ),
    (
        "a split GRPO policy step's parts are not weighted by their share",
        "qlora_kit/training/objectives/grpo/oom.py",
        "return rows_of(part) / rows_of(whole)",
        "return 1.0",
        [
            "tests/test_grpo_oom.py::test_the_parts_losses_weighted_by_their_share_add_up_to_the_micro_batchs[grpo]"
        ],
    ),
    (
        "the generation cap is never read",
        "qlora_kit/testing/oom_faults.py",
        "INJECTOR.generation_cap = cap_from_env(GENERATION_ENV)",
        "INJECTOR.generation_cap = None",
        [
            "tests/test_grpo_oom.py::test_the_generation_cap_raises_a_real_out_of_memory_error_as_the_cache_grows"
        ],
    ),
    (
        "the generation split is not written into a checkpoint",
        "qlora_kit/training/step/oom/split_file.py",
        "if generation_parts > 1:",
        "if False:",
        ["tests/test_grpo_oom.py::test_the_generation_split_is_written_into_a_checkpoint_and_read_back"],
    ),
    (
        "GRPO never probes its worst batch",
        "qlora_kit/registries/objectives.py",
        "            probes_worst_batch=True,\n            preflight=False,",
        "            preflight=False,",
        ["tests/test_grpo.py::test_grpo_probes_and_splits_as_the_recipe_says"],
    ),
    (
        "packing auto ignores the timed speeds",
        "qlora_kit/data/layout.py",
        "        layout = max(allowed, key=lambda name: (speeds[name], -LAYOUTS.index(name)))\n",
        "        layout = choose_layout(shares, allowed)\n",
        ["tests/test_layout.py::test_timed_speeds_outrank_padding"],
    ),
    (
        "group_by_length orders from the global random state",
        "qlora_kit/training/step/trainer.py",
        "        self.generator = torch.Generator().manual_seed(self.seed + self.epoch)\n",
        "        self.generator = None\n",
        ["tests/test_layout.py::test_group_by_length_orders_each_epoch_from_the_seed_alone"],
    ),
    (
        "KTO's desirable share from the probabilities themselves",
        "qlora_kit/after/preference_eval.py",
        "        (torch.logsumexp(good.double(), 0) - torch.logsumexp(torch.cat([good, bad]).double(), 0)).exp()\n",
        "        good.exp().sum() / torch.cat([good, bad]).exp().sum()\n",
        ["tests/test_kto.py::test_desirable_share_is_finite_where_the_answers_probabilities_underflow"],
    ),
    (
        "KTO's reference share from the evaluated model's log-probabilities",
        "qlora_kit/after/preference_eval.py",
        "        reference_share.append(desirable_share(reference[good], reference[bad]))\n",
        "        reference_share.append(desirable_share(logps[good], logps[bad]))\n",
        ["tests/test_kto.py::test_kto_trains_from_a_recipe_and_reports_its_margins"],
    ),
    (
        "lora.dropout auto keeps 0.05 on a mixture's experts",
        "qlora_kit/recipe/recipe.py",
        "        return 0.0 if experts_get_lora else self.AUTO_DROPOUT\n",
        "        return self.AUTO_DROPOUT\n",
        ["tests/test_defaults.py::test_a_recipe_naming_only_the_model_validates_plans_and_configures_lora"],
    ),
    (
        "a union field's error names one branch",
        "qlora_kit/recipe/base.py",
        "    if not isinstance(tag, str) or not UNION_BRANCH.match(tag):\n",
        "    if True:\n",
        ["tests/test_bad_input.py::test_round_four_fields_and_overrides_given_wrong_are_one_line"],
    ),
    (
        "a saved storage stays counted after autograd lets it go",
        "qlora_kit/memory/accounting.py",
        "        if self.read is not None:\n            return\n        self.held[key] -= 1\n",
        "        return\n",
        ["tests/test_planner_grid.py::test_plan_matches_what_the_run_saves[tiny-llama-none-chat-dora]"],
    ),
    (
        "the expert loop gathers every pick's states into one (picks, hidden) tensor",
        "qlora_kit/model/moe_experts.py",
        '    if path == "looped":  # each expert\'s states gathered for it\n',
        "    if False:\n",
        ["tests/test_expert_matmul.py::test_the_loop_makes_no_tensor_of_every_pick_by_the_hidden_size"],
    ),
    (
        "a linear-attention hybrid's rows are packed",
        "qlora_kit/model/recurrent.py",
        "    if not kinds:\n",
        "    if True:\n",
        [
            "tests/test_hybrid.py::test_packing_a_hybrid_is_refused_in_one_line[tiny-qwen3.5]",
            "tests/test_hybrid.py::test_auto_does_not_pack_a_hybrid_and_says_why[tiny-qwen3.5]",
        ],
    ),
    (
        "every routing flip of a mixture's merge is left out as a near-tie",
        "qlora_kit/after/routing_ties.py",
        "            tie[position] = bool(margin <= allowed)\n",
        "            tie[position] = True\n",
        [
            "tests/test_merge_bounds.py::test_a_routing_flip_at_a_near_tie_is_left_out_and_a_decided_one_is_judged"
        ],
    ),
]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: list[str]


def tree_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    # links too (qlora_kit/recipes -> ../recipes), copied as links
    return [
        name
        for name in listed.split("\0")
        if name and ((ROOT / name).is_file() or (ROOT / name).is_symlink())
    ]


def copy_tree(destination: Path, files: list[str]) -> None:
    for name in files:
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target, follow_symlinks=False)


def check_snippets(mutations: list[Mutation]) -> list[str]:
    problems = []
    for m in mutations:
        source = (ROOT / m.path).read_text(encoding="utf-8") if (ROOT / m.path).is_file() else None
        count = source.count(m.old) if source is not None else 0
        if count != 1:
            problems.append(f"{m.name}: the snippet occurs {count} times in {m.path}, not once")
    return problems


def run_tests(tree: Path, tests: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONWARNINGS": "ignore"}
    if (
        ROOT / ".llama-cpp"
    ).is_dir():  # git-ignored, so not in the copy: the llama.cpp reader's tests need it
        env.setdefault("QLORA_KIT_LLAMA_CPP", str(ROOT / ".llama-cpp"))
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider"]
    command += ["-o", "addopts=", "--no-header", *tests]
    return subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=900)


def try_mutation(tree: Path, m: Mutation) -> tuple[str, float, str]:
    """(verdict, seconds, the tail of pytest's output): caught, survived or error."""
    path = tree / m.path
    original = path.read_text(encoding="utf-8")
    path.write_text(original.replace(m.old, m.new, 1), encoding="utf-8")
    started = time.monotonic()
    try:
        result = run_tests(tree, m.tests)
    finally:
        path.write_text(original, encoding="utf-8")
    # pytest's exit codes: 1 tests failed, 0 all passed; anything else (2 interrupted, 4 usage, 5 nothing
    # collected) means the mutation was never judged.
    verdict = {0: "survived", 1: "caught"}.get(result.returncode, f"error (pytest exit {result.returncode})")
    if result.returncode == 0 and " passed" not in result.stdout:  # skipped: never judged either
        verdict = "error (the tests were skipped)"
    return verdict, time.monotonic() - started, (result.stdout + result.stderr)[-1500:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run only the mutation of this name (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--jobs", type=int, default=2, help="mutations tested at once (default 2)")
    parser.add_argument(
        "--table", type=Path, help="also write each row's verdict and seconds to this markdown file"
    )
    args = parser.parse_args()
    mutations = [Mutation(*row) for row in MUTATIONS]
    if args.list:
        for m in mutations:
            print(f"{m.name}: {m.path} -> {' '.join(m.tests)}")
        return 0
    if args.only:
        unknown = set(args.only) - {m.name for m in mutations}
        if unknown:
            print(f"error: --only: no mutation named {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        mutations = [m for m in mutations if m.name in args.only]
    problems = check_snippets(mutations)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1

    files = tree_files()
    jobs = max(1, min(args.jobs, len(mutations)))
    with tempfile.TemporaryDirectory(prefix="qlora-kit-mutants-") as scratch:
        trees = [Path(scratch) / f"tree-{i}" for i in range(jobs)]
        for tree in trees:
            copy_tree(tree, files)
        # The named tests must pass on the unmutated copy first: a copy they fail on (a file the copy
        # lacks, a broken fixture) would have every mutation "caught" for nothing.
        named = sorted({test for m in mutations for test in m.tests})
        baseline = run_tests(trees[0], named)
        if baseline.returncode != 0:
            tail = (baseline.stdout + baseline.stderr)[-3000:]
            print(f"error: the named tests fail on the unmutated copy:\n{tail}", file=sys.stderr)
            return 1
        skipped = re.search(r"(\d+) skipped", baseline.stdout)
        if skipped:  # a test skipped on the copy (a reader it cannot find) would let its mutation survive
            print(
                f"error: {skipped.group(1)} named tests skip on the unmutated copy:\n{baseline.stdout[-3000:]}",
                file=sys.stderr,
            )
            return 1
        print(f"baseline: the {len(named)} named tests pass on the unmutated copy", flush=True)
        queue = list(enumerate(mutations))

        def worker(tree: Path) -> list[tuple[int, str, float, str]]:
            done = []
            while True:
                try:
                    index, m = queue.pop(0)  # atomic: the two threads never take the same mutation
                except IndexError:
                    return done
                verdict, seconds, tail = try_mutation(tree, m)
                print(f"{verdict:>9}  {seconds:5.0f} s  {m.name}", flush=True)
                done.append((index, verdict, seconds, tail))

        started = time.monotonic()
        with ThreadPoolExecutor(jobs) as pool:
            results = sorted(r for rs in pool.map(worker, trees) for r in rs)
    failed = [(mutations[i], verdict, tail) for i, verdict, _, tail in results if verdict != "caught"]
    for m, verdict, tail in failed:
        print(f"\n--- {verdict}: {m.name} ({m.path}; {' '.join(m.tests)})\n{tail}", file=sys.stderr)
    caught = len(results) - len(failed)
    elapsed = time.monotonic() - started
    print(f"{caught} of {len(results)} mutations caught in {elapsed:.0f} s")
    if args.table:
        write_table(
            args.table,
            [(mutations[i], verdict, seconds) for i, verdict, seconds, _ in results],
            elapsed,
            jobs,
        )
    return 1 if failed else 0


def write_table(path: Path, rows: list[tuple[Mutation, str, float]], elapsed: float, jobs: int) -> None:
    """Each row's verdict and seconds (its named tests' run on the mutated copy), as markdown."""
    lines = [
        "# Mutation check: each row's verdict and time",
        "",
        f"- command: `python scripts/mutation_check.py --table {path}`",
        f"- date: {time.strftime('%Y-%m-%d')}; {jobs} jobs; {len(rows)} rows in {elapsed:.0f} s wall",
        "",
        "| mutation | file | verdict | seconds | tests that must turn red |",
        "|---|---|---|---|---|",
    ]
    for m, verdict, seconds in rows:
        tests = "<br>".join(f"`{t}`" for t in m.tests)
        lines.append(f"| {m.name} | `{m.path}` | {verdict} | {seconds:.0f} | {tests} |")
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
