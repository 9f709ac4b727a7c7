"""train.objective grpo, without training: the recipe's rules, prompts from each format, every builtin reward
and a recipe-named Python reward as TRL calls them, and the zero-spread warning on real rollouts."""

import logging
import re
import textwrap

import pytest
import torch
import yaml

from qlora_kit import Recipe
from qlora_kit.data.prompts import prepare_prompts, prompt_and_reference
from qlora_kit.data.rewards import reward_functions
from qlora_kit.errors import RecipeError
from qlora_kit.registries import metric_keys as keys
from qlora_kit.training.objectives.grpo.explain import GrpoExplainer
from qlora_kit.training.pipeline import build

from .conftest import run_cli, write

CONSTANT = [{"name": "length", "max_chars": 10_000}]  # every completion scores 1: no spread anywhere


def grpo_values(output_dir, rewards=None, **train) -> dict:
    return {
        "data": {"max_seq_len": 64},
        "lora": {"dropout": 0.0},
        "train": {
            "objective": "grpo",
            "output_dir": str(output_dir),
            "micro_batch_size": 8,
            "report_to": [],
            **train,
        },
        "grpo": {
            "num_generations": 4,
            "max_completion_length": 6,
            "rewards": rewards if rewards is not None else [{"name": "exact_match"}],
        },
    }


def grpo_recipe(output_dir, rewards=None, **train) -> Recipe:
    return Recipe.from_dict(grpo_values(output_dir, rewards, **train))


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ({"name": "exact"}, "grpo.rewards[0].name: unknown reward 'exact'"),
        ({"name": "regex"}, "grpo.rewards[0].pattern: required by the regex reward"),
        ({"name": "regex", "pattern": "(a"}, "grpo.rewards[0].pattern: not a regular expression"),
        (
            {"name": "exact_match", "max_chars": 3},
            "grpo.rewards[0].max_chars: the exact_match reward does not take it",
        ),
        ({"name": "length", "min_chars": 5, "max_chars": 3}, "grpo.rewards[0].min_chars: above max_chars"),
        ({"name": "no_such_module_32:score"}, "grpo.rewards[0].name: cannot import 'no_such_module_32'"),
        ({"name": "json:no_such_function"}, "grpo.rewards[0].name: json has no function 'no_such_function'"),
    ],
)
def test_a_bad_reward_is_one_line_naming_the_field_and_exit_2(tmp_path, monkeypatch, capsys, reward, message):
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(yaml.safe_dump(grpo_values(tmp_path / "out", [reward])))
    code, err = run_cli(["train", str(recipe)], monkeypatch, capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"grpo": {"rewards": []}}, "grpo.rewards: train.objective grpo needs at least one reward"),
        ({"data": {"format": "text"}}, "data.format: train.objective grpo samples answers to prompts"),
        ({"data": {"max_seq_len": 6}}, "grpo.max_completion_length: must be below data.max_seq_len"),
        ({"data": {"packing": True}}, "data.packing: not with train.objective grpo"),
        ({"train": {"objective": "sft"}}, "grpo: only applies to train.objective: grpo"),
        # one completion per prompt is its group's mean: every advantage 0, a run that learns nothing
        (
            {"grpo": {"num_generations": 1}},
            "grpo.num_generations: must be >= 2 (got 1): each completion's advantage",
        ),
    ],
)
def test_impossible_grpo_recipes_are_refused_naming_the_field(tmp_path, values, message):
    merged = grpo_values(tmp_path / "out")
    for section, fields in values.items():
        merged[section] = {**merged[section], **fields}
    with pytest.raises(RecipeError, match=re.escape(message)):
        Recipe.from_dict(merged)


def test_a_grpo_recipe_saved_with_its_defaults_loads_back_equal(tmp_path):
    recipe = grpo_recipe(tmp_path / "out", [{"name": "regex", "pattern": "^[0-9]+$", "weight": 0.5}])
    assert Recipe.from_dict(recipe.resolved_values()) == recipe


def test_each_format_gives_a_prompt_and_the_reference_a_reward_compares_with(tokenizer):
    data = Recipe().data
    alpaca = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    prompt, reference = prompt_and_reference(alpaca, "alpaca", tokenizer, data)
    assert prompt == "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n"
    assert reference == "5"
    completion = {"prompt": "2 + 3 =", "completion": " 5"}
    assert prompt_and_reference(completion, "completion", tokenizer, data) == ("2 + 3 =", "5")
    chat = {
        "messages": [
            {"role": "user", "content": "2 + 3?"},
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "and 4 + 4?"},
            {"role": "assistant", "content": "8"},
        ]
    }
    prompt, reference = prompt_and_reference(chat, "chat", tokenizer, data)
    assert prompt == chat["messages"][:3] and reference == "8"  # TRL renders it with the chat template


def test_prompts_that_leave_no_room_for_the_completion_are_left_out_and_counted(tmp_path, tokenizer):
    rows = [{"prompt": "short", "completion": "a"}, {"prompt": "word " * 40, "completion": "b"}]
    data = Recipe.from_dict(
        {
            "data": {
                "path": str(write(tmp_path / "rows.jsonl", rows)),
                "format": "completion",
                "max_seq_len": 32,
            }
        }
    ).data
    prepared = prepare_prompts(data, tokenizer, seed=0, completion_tokens=8)
    assert prepared.train["prompt"] == ["short"] and prepared.train["reference"] == ["a"]
    assert prepared.reports[0].dropped == 1 and prepared.reports[0].rows == 2
    # what trains is sampled later: the report does not claim "0 trained tokens"
    assert (
        prepared.reports[0].summary().endswith("the trained tokens are the completions sampled in training")
    )


def test_builtin_rewards_score_each_completion_as_the_registry_says():
    entries = Recipe.from_dict(
        grpo_values(
            "out",
            [
                {"name": "exact_match"},
                {"name": "exact_match", "field": "alias"},
                {"name": "regex", "pattern": "^[0-9]+$"},
                {"name": "length", "min_chars": 2, "max_chars": 3},
                {"name": "number_match"},
            ],
        )
    ).grpo.rewards
    exact, exact_alias, regex, length, number = reward_functions(entries)
    completions = [" 12 ", "12x", "7", [{"role": "assistant", "content": "12"}]]
    columns = {"prompts": ["p"] * 4, "reference": ["12", "12", "7", "12"], "alias": ["12x"] * 4}
    assert exact(completions=completions, **columns) == [1.0, 0.0, 1.0, 1.0]
    assert exact_alias(completions=completions, **columns) == [0.0, 1.0, 0.0, 0.0]
    assert regex(completions=completions, **columns) == [0.0, 0.0, 1.0, 1.0]  # " 12 " is not all digits
    assert length(completions=completions, **columns) == [1.0, 1.0, 0.0, 1.0]
    assert number(
        completions=["so 1,200.", "it is 12 or 7", "7.0", "none"], reference=["#### 1200"] + ["7"] * 3
    ) == [
        1.0,
        1.0,
        1.0,
        0.0,
    ]  # the last number counts: gsm8k's "#### 1200"
    assert exact.__name__ == "exact_match"  # TRL logs rewards/<function name>/mean


@pytest.mark.slow  # builds a run and samples from it (no training): tens of seconds on 2 busy cores
def test_rollouts_are_scored_by_a_recipe_named_python_function_and_each_builtin(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_32.py").write_text(
        textwrap.dedent(
            """
            def first_letter(prompts, completions, reference, instruction, **kwargs):
                # every data column arrives as a keyword: the reference and alpaca's instruction
                assert len(reference) == len(completions) == len(instruction)
                return [float(c[:1] == r[:1]) for c, r in zip(completions, reference)]
            """
        )
    )
    monkeypatch.chdir(tmp_path)  # imported from the working directory, as the CLI would
    rewards = [
        {"name": "my_rewards_32:first_letter"},
        {"name": "exact_match", "weight": 2.0},
        {"name": "regex", "pattern": "a"},
        {"name": "length", "max_chars": 4},
    ]
    setup = build(grpo_recipe(tmp_path / "out", rewards, mixed_precision="bf16"))
    trainer = setup.trainer
    assert trainer.reward_func_names == ["first_letter", "exact_match", "regex", "length"]
    # the explaining callback (built before the Trainer, step/callbacks.py) names the rewards as TRL logs them
    [explainer] = [c for c in trainer.callback_handler.callbacks if isinstance(c, GrpoExplainer)]
    assert explainer.reward_names == trainer.reward_func_names
    assert trainer.reward_weights.tolist() == [1.0, 2.0, 1.0, 1.0]
    batch = [setup.data.train[i] for i in range(2) for _ in range(4)]  # 2 prompts x num_generations
    setup.model.train()
    torch.manual_seed(0)
    scored = trainer._generate_and_score_completions(batch)
    completions = trainer.processing_class.batch_decode(
        [
            ids[mask.bool()]
            for ids, mask in zip(scored["completion_ids"], scored["completion_mask"], strict=True)
        ],
        skip_special_tokens=True,
    )
    references = [row["reference"] for row in batch]
    expected = {
        "first_letter": [float(c[:1] == r[:1]) for c, r in zip(completions, references, strict=True)],
        "exact_match": [float(c.strip() == r) for c, r in zip(completions, references, strict=True)],
        "regex": [float("a" in c) for c in completions],
        "length": [float(len(c.strip()) <= 4) for c in completions],
    }
    logged = trainer._logs["rewards"]
    for name, values in expected.items():
        assert list(logged[name]) == values, name
        assert trainer._metrics["train"][keys.reward_key(name)][-1] == pytest.approx(
            sum(values) / len(values)
        )


SPREAD = [{"name": "spread_32:characters"}]  # the completion's length in characters: rarely alike in a group


@pytest.mark.slow  # builds a run and samples from it (no training): tens of seconds on 2 busy cores
@pytest.mark.parametrize(("rewards", "warned"), [(CONSTANT, True), (SPREAD, False)])
def test_the_zero_spread_warning_fires_when_most_groups_score_alike(
    tmp_path, monkeypatch, caplog, rewards, warned
):
    (tmp_path / "spread_32.py").write_text(
        "def characters(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    setup = build(grpo_recipe(tmp_path / "out", rewards, mixed_precision="bf16"))
    trainer = setup.trainer
    batch = [setup.data.train[i] for i in range(2) for _ in range(4)]
    setup.model.train()
    torch.manual_seed(0)
    trainer._generate_and_score_completions(batch)
    share = trainer._metrics["train"][keys.FRAC_REWARD_ZERO_STD][-1]
    assert share == (1.0 if warned else 0.0)
    with caplog.at_level(logging.INFO, logger="qlora_kit"):
        trainer.log({})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    steps = [r.getMessage() for r in caplog.records if "grpo rewards:" in r.getMessage()]
    assert len(steps) == 1 and "same-reward prompts" in steps[0] and "completion" in steps[0]
    if warned:
        assert len(warnings) == 1 and "all 4 completions got the same reward" in warnings[0]
        assert "grpo.temperature" in warnings[0] and "grpo.num_generations" in warnings[0]
    else:
        assert warnings == []


def test_the_explainer_warns_once_and_only_above_half():
    explainer = GrpoExplainer(["exact_match"], beta=0.0, num_iterations=1, generations=8)

    class State:
        is_world_process_zero = True
        global_step = 3

    for share, warned in [(0.5, False), (0.51, True), (0.9, True)]:
        explainer.on_log(None, State(), None, logs={keys.REWARD: 0.2, keys.FRAC_REWARD_ZERO_STD: share})
        assert explainer.warned is warned


@pytest.mark.slow  # traces a plan: the full suite runs it
def test_the_plan_counts_the_rollouts_kv_cache_and_logits():
    from qlora_kit.memory.planner import plan

    recipe = grpo_recipe("out", grad_accum=256)  # 2,048 sequences sampled per step: the rollouts dominate
    the_plan = plan(recipe)
    shape = the_plan.shape
    sequences, tokens, c = 8 * 256, 64, 2  # micro_batch_size x grad_accum, data.max_seq_len, bf16
    expected = 2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * sequences * c
    expected += sequences * shape.vocab * 8
    assert the_plan.rollout == expected
    assert all(p.peak == the_plan.static + expected for p in the_plan.policies)
    sft = plan(Recipe.from_dict({"data": {"max_seq_len": 64}, "train": {"grad_accum": 256}}))
    assert sft.rollout == 0 and all(p.peak < the_plan.static + expected for p in sft.policies)


def test_the_dead_gradient_guard_waits_for_a_step_with_a_reward_signal():
    from qlora_kit.errors import TrainingGuardError
    from qlora_kit.training.objectives.grpo.grpo import RewardGuard
    from qlora_kit.training.step.guards import TrainingGuard

    from .conftest import lora_model

    peft_model = lora_model()  # B drawn non-zero: every LoRA tensor is due at the first step
    lora = [p for n, p in peft_model.named_parameters() if p.requires_grad and ".lora_" in n]
    for parameter in lora:  # a step whose groups all scored alike (beta 0): every gradient exactly zero
        parameter.grad = torch.zeros_like(parameter)
    with pytest.raises(TrainingGuardError, match="got no gradient"):
        TrainingGuard(peft_model)._check_dead(1)  # SFT's guard: dead gradients
    guard = RewardGuard(peft_model)
    guard._check_dead(1)  # no signal: nothing is judged, every tensor still waits
    assert guard.unchecked == set(guard.lora)
    lora[0].grad = torch.ones_like(lora[0])  # a signal that reaches one tensor only: the rest are dead
    with pytest.raises(TrainingGuardError, match="got no gradient"):
        guard._check_dead(2)


def test_grpo_probes_and_splits_as_the_recipe_says(tmp_path):
    # GRPO splits its rollouts and its policy step and probes its worst batch (training/objectives/grpo/oom.py)
    from qlora_kit.training.step.oom.policy import oom_policy, probes_worst_batch

    recipe = grpo_recipe(tmp_path / "out", probe_worst_batch=True)
    assert probes_worst_batch(recipe)
    assert oom_policy(recipe).on_oom == "split"
    assert "grpo.max_completion_length" in oom_policy(recipe).levers
    stop = grpo_recipe(tmp_path / "out", probe_worst_batch=False, on_oom="stop")
    assert not probes_worst_batch(stop) and oom_policy(stop).on_oom == "stop"


@pytest.mark.slow  # builds a run and samples from it (no training): tens of seconds on 2 busy cores
def test_seed_each_completion_samples_a_prompt_alike_alone_or_beside_others(tmp_path):
    values = grpo_values(tmp_path / "out", mixed_precision="bf16")
    values["grpo"]["seed_each_completion"] = True
    trainer = build(Recipe.from_dict(values)).trainer
    trainer.model.train()  # as in training: TRL samples from the model in training mode
    first, second = trainer._tokenize_prompts([trainer.train_dataset[i]["prompt"] for i in range(2)])[0]

    def sample(rows: list[list[int]]) -> list[list[int]]:
        torch.manual_seed(0)  # the process's own random state, which the option must not read or move
        before = torch.get_rng_state()
        completions, _ = trainer._generate_single_turn(rows, None, {}, 4)
        moved = not torch.equal(torch.get_rng_state(), before)
        assert moved is not trainer.seed_each_completion, "the option leaves the process's random state"
        return completions

    alone = sample([second] * 4)
    assert sample([first] * 4 + [second] * 4)[4:] == alone  # beside another prompt's group: the same
    assert len({tuple(c) for c in alone}) > 1, "each copy of a prompt draws its own completion"
    trainer.state.global_step = 1
    assert sample([second] * 4) != alone, "a later step samples anew"
    trainer.state.global_step = 0
    # TRL's batched sampling (the option off): a completion depends on the rows sampled beside it
    trainer.seed_each_completion = False
    assert sample([first] * 4 + [second] * 4)[4:] != sample([second] * 4)


def raises_on_nine(prompts, completions, **kwargs):
    return [float(int(c)) if c != "9" else float(int("nine")) for c in completions]


def one_reward_for_all(completions, **kwargs):
    return [1.0]


def test_a_reward_that_raises_is_one_line_naming_the_entry_the_function_and_the_completion():
    from qlora_kit.training.objectives.grpo.reward_checks import checked

    reward = checked(raises_on_nine, "grpo.rewards[1]")
    assert reward.__name__ == "raises_on_nine"  # TRL logs rewards/<function name>/mean
    assert reward(prompts=["a", "b"], completions=["1", "2"]) == [1.0, 2.0]
    with pytest.raises(RecipeError) as info:
        reward(prompts=["one?", "two?", "nine?"], completions=["1", "2", "9"], reference=["1", "2", "9"])
    line = str(info.value)
    assert line.startswith("grpo.rewards[1]: raises_on_nine raised ValueError: invalid literal for int()")
    assert "on completion 3 of 3 (prompt 'nine?')" in line and "\n" not in line


def test_a_reward_that_returns_the_wrong_count_is_one_line():
    from qlora_kit.training.objectives.grpo.reward_checks import checked

    with pytest.raises(
        RecipeError, match=re.escape("grpo.rewards[0]: one_reward_for_all returned 1 rewards for 4")
    ):
        checked(one_reward_for_all, "grpo.rewards[0]")(prompts=["p"] * 4, completions=["c"] * 4)


@pytest.mark.slow  # builds a run and samples from it (no training): tens of seconds on 2 busy cores
def test_a_reward_that_raises_inside_trls_scoring_loop_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "failing_47.py").write_text(
        "def boom(completions, **kwargs):\n    raise ValueError('my reward broke')\n"
    )
    monkeypatch.chdir(tmp_path)
    rewards = [{"name": "exact_match"}, {"name": "failing_47:boom"}]
    setup = build(grpo_recipe(tmp_path / "out", rewards))
    batch = [setup.data.train[i] for i in range(2) for _ in range(4)]
    with pytest.raises(
        RecipeError,
        match=re.escape("grpo.rewards[1]: boom raised ValueError: my reward broke on completion 1 of 8"),
    ):
        setup.trainer._generate_and_score_completions(batch)


@pytest.mark.slow  # loads the tiny model twice and answers 3 prompts 3 times each
def test_grpo_evaluation_scores_each_answer_against_its_own_rows_reference(tmp_path, monkeypatch):
    """A reward that is 1 exactly when the reference it is handed belongs to the prompt it is handed: each
    sampled answer lined up with its own row, it scores 1; with the references shuffled across rows, 0."""
    import json

    from qlora_kit.after.grpo_eval import reward_metrics
    from qlora_kit.model.adapters import load_for_inference

    (tmp_path / "aligned_47.py").write_text(
        "def own_reference(prompts, completions, reference, **kwargs):\n"
        "    assert len(prompts) == len(completions) == len(reference)\n"
        "    return [float(f'number {r}.' in str(p)) for p, r in zip(prompts, reference)]\n"
    )
    monkeypatch.chdir(tmp_path)
    numbers = [11, 23, 37]
    scores = {}
    for name, answers in (("aligned", numbers), ("shuffled", numbers[1:] + numbers[:1])):
        rows = [
            {"instruction": f"Repeat the number {n}.", "input": "", "output": str(a)}
            for n, a in zip(numbers, answers, strict=True)
        ]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        values = grpo_values(tmp_path / "out", [{"name": "aligned_47:own_reference"}])
        values["data"] |= {"path": str(path), "val_path": str(path), "max_seq_len": 64}
        values["grpo"] |= {"num_generations": 2, "max_completion_length": 2}
        recipe, tokenizer, lm = load_for_inference(None, Recipe.from_dict(values))
        scores[name] = reward_metrics(lm, tokenizer, recipe)
    assert scores["aligned"]["reward_sampled"] == scores["aligned"]["reward_greedy"] == 1.0
    assert scores["shuffled"]["reward_sampled"] == scores["shuffled"]["reward_greedy"] == 0.0
    assert scores["aligned"]["reward_prompts"] == 3
