"""A finished (or running) run read back from its folder: ``qlora-kit show DIR`` and the notebooks.

A run folder holds ``recipe.yaml``, ``manifest.json`` and ``metrics.jsonl`` (training/pipeline.py writes them);
this module reads them into a ``RunRecord``, says what the recipe changed from the defaults, and draws
the losses and the learning rate into ``loss.png`` (matplotlib, the ``plot`` extra). ``cli/views.show_run``
prints it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from qlora_kit.errors import OutputDirError
from qlora_kit.recipe.recipe import Recipe
from qlora_kit.registries import metric_keys as keys
from qlora_kit.registries import objectives


@dataclass
class RunRecord:
    folder: Path
    recipe: dict[str, Any]  # the resolved recipe as the run wrote it
    manifest: dict[str, Any]
    metrics: list[dict[str, Any]]

    def rows_with(self, key: str) -> list[dict[str, Any]]:
        return [row for row in self.metrics if key in row]

    @property
    def finished(self) -> bool:
        return "finished_at" in self.manifest


def read_run(folder: str | Path) -> RunRecord:
    """The run in ``folder``; an OutputDirError naming the file when it is not a run folder or a file is unreadable."""
    folder = Path(folder).expanduser().resolve()
    if not (folder / "manifest.json").is_file():
        raise OutputDirError(f"{folder}: not a qlora-kit run folder (no manifest.json)")
    manifest = _read_json(folder / "manifest.json")
    recipe = manifest.get("recipe") or {}
    if (folder / "recipe.yaml").is_file():
        try:
            recipe = yaml.safe_load((folder / "recipe.yaml").read_text(encoding="utf-8")) or recipe
        except yaml.YAMLError as exc:
            raise OutputDirError(
                f"{folder / 'recipe.yaml'}: not valid YAML ({exc.__class__.__name__})"
            ) from None
    metrics = []
    path = folder / "metrics.jsonl"
    if path.is_file():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                metrics.append(json.loads(line))
            except json.JSONDecodeError:
                raise OutputDirError(f"{path}:{number}: not a JSON object") from None
    return RunRecord(folder, recipe, manifest, metrics)


def recipe_changes(recipe: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, default, value) for every field the run's recipe sets to something else than the default."""
    # only the fields the run's recipe holds are compared (an older run's recipe.yaml may lack newer ones)
    default_values = _flatten(Recipe().resolved_values())
    return [
        (name, default_values.get(name), value)
        for name, value in _flatten(recipe).items()
        if default_values.get(name) != value
    ]


def summary_rows(record: RunRecord) -> list[tuple[str, str]]:
    """(what, value) rows for a run read from its folder (views.show_record prints them)."""
    rows = [("run", str(record.folder))]
    manifest = record.manifest
    state = "finished" if record.finished else "not finished (running, stopped or failed)"
    rows.append(("state", f"{state}, {manifest.get('steps', _last_step(record))} steps"))
    seconds = _seconds(manifest.get("started_at"), manifest.get("finished_at"))
    if seconds is not None:
        rows.append(("wall time", f"{seconds:.0f} s (start to finished, loading and saving included)"))
    rows += metric_rows(record.metrics)
    if "best" in manifest:
        best = manifest["best"]
        rows.append(
            (
                "final adapter (train.keep_best)",
                f"step {best['step']}'s, {best['metric']} {best['value']:.4g}",
            )
        )
    rows += speed_rows(record.metrics)
    rows += oom_rows(record.metrics)
    rows += expert_rows(record.rows_with(keys.TOKENS_PER_EXPERT))
    peaks = [row[key] for row in record.metrics for key in keys.PEAK_KEYS if key in row]
    rows += memory_rows(peaks, [row[keys.SAVED_MIB] for row in record.rows_with(keys.SAVED_MIB)])
    if manifest.get("weight_bytes"):  # the loaded model by kind: experts kept in 16 bits would show here
        sizes = manifest["weight_bytes"]
        rows.append(
            ("weights (MiB)", ", ".join(f"{kind} {size / 2**20:,.2f}" for kind, size in sizes.items()))
        )
    versions = manifest.get("versions", {})
    if versions:
        rows.append(("versions", ", ".join(f"{name} {version}" for name, version in versions.items())))
    if manifest.get("git_commit"):
        rows.append(("git commit", str(manifest["git_commit"])))
    return rows


def expert_rows(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """A mixture of experts' routing over the whole run: tokens per expert, fewest and most, per layer."""
    if not rows:
        return []
    layers = [[0] * len(counts) for counts in rows[0][keys.TOKENS_PER_EXPERT]]
    for row in rows:
        for layer, counts in enumerate(row[keys.TOKENS_PER_EXPERT]):
            layers[layer] = [total + n for total, n in zip(layers[layer], counts, strict=True)]
    text = "; ".join(f"layer {i}: {min(counts):,}-{max(counts):,}" for i, counts in enumerate(layers))
    idle = sum(counts.count(0) for counts in layers)
    aux = [row[keys.AUX_LOSS] for row in rows if keys.AUX_LOSS in row]
    rows_out = [
        ("tokens per expert (fewest-most)", text + (f"; {idle} experts never routed to" if idle else ""))
    ]
    if aux:
        rows_out.append(("auxiliary load-balancing loss", f"{aux[0]:.4f} -> {aux[-1]:.4f}"))
    return rows_out


def oom_rows(metrics: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """One row per out-of-memory split (training/step/oom_recovery.py): where, and the micro-batch before and after."""
    rows = []
    for row in metrics:
        split = row.get(keys.OOM_SPLIT)
        if split:
            what = "evaluation batch" if split["phase"] == "eval" else "micro-batch"
            rows.append(
                (
                    "out of memory",
                    f"step {row['step']}: {what} {split[keys.MICRO_BATCH_BEFORE]} -> "
                    f"{split[keys.MICRO_BATCH]} ({split[keys.MICRO_BATCH_PARTS]} parts), the same global batch",
                )
            )
    return rows


def tokens_per_s(metrics: list[dict[str, Any]]) -> float | None:
    """The run's tokens/s: the median of its logged windows (Throughput's, summed over processes; evaluation
    time excluded). The one figure the train summary, doctor and ``qlora-kit show`` print."""
    speeds = sorted(row[keys.TOKENS_PER_S] for row in metrics if keys.TOKENS_PER_S in row)
    return speeds[len(speeds) // 2] if speeds else None


def speed_rows(metrics: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The tokens/s row (with the mean MFU where a peak is known)."""
    speed = tokens_per_s(metrics)
    if speed is None:
        return []
    mfu = [row[keys.MFU] for row in metrics if keys.MFU in row]
    utilisation = f", MFU {sum(mfu) / len(mfu):.1%}" if mfu else ""
    return [("tokens/s (median of the logged steps)", f"{speed:,.0f}{utilisation}")]


def metric_rows(metrics: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(what, value) rows of what a run logged: loss first -> last, eval loss first -> best (its step) ->
    last, and each objective's own figures first -> last (registries/objectives.py: summary)."""
    rows = []
    losses = [row["loss"] for row in metrics if "loss" in row]
    if losses:
        rows.append(("loss, first -> last", f"{losses[0]:.4f} -> {losses[-1]:.4f}"))
    evals = [row for row in metrics if "eval_loss" in row]
    if evals:
        best = min(evals, key=lambda row: row["eval_loss"])
        first, last = evals[0]["eval_loss"], evals[-1]["eval_loss"]
        rows.append(
            (
                "eval loss, first -> best -> last",
                f"{first:.4f} -> {best['eval_loss']:.4f} (step {best['step']}) -> {last:.4f}",
            )
        )
    for key, label in objectives.lines("summary"):  # dpo: eval preference accuracy; grpo: reward
        values = [row[key] for row in metrics if key in row]
        if values:
            rows.append((f"{label}, first -> last", f"{values[0]:.3f} -> {values[-1]:.3f}"))
    return rows


def memory_rows(peaks_gib: list[float], saved_mib: list[float]) -> list[tuple[str, str]]:
    """The run's memory as one row: CUDA's peak allocated memory, or on a CPU the most saved for backward."""
    if peaks_gib:
        return [("peak GPU memory (allocated)", f"{max(peaks_gib):.2f} GiB")]
    if saved_mib:
        return [("most saved for backward", f"{max(saved_mib):.1f} MiB")]
    return []


def plot_run(record: RunRecord, path: str | Path | None = None) -> Path:
    """Draw training and validation loss against the step, with the learning rate on a second axis, into
    ``path`` (default: the run folder's loss.png). Needs matplotlib (``pip install 'qlora-kit[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window: works over ssh, in CI and in Docker
    import matplotlib.pyplot as plt

    path = Path(path) if path is not None else record.folder / "loss.png"
    reward_rows = record.rows_with(keys.REWARD)  # train.objective grpo: the reward curves below the loss
    reward_axis = None
    if reward_rows:
        fig, (loss_axis, reward_axis) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
        _plot_rewards(reward_axis, reward_rows)
    else:
        fig, loss_axis = plt.subplots(figsize=(7, 4))
    train_rows, eval_rows = record.rows_with("loss"), record.rows_with("eval_loss")
    loss_axis.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="training loss")
    loss_axis.plot(
        [r["step"] for r in eval_rows], [r["eval_loss"] for r in eval_rows], "o-", label="validation loss"
    )
    if all(r["loss"] > 0 for r in train_rows) and all(r["eval_loss"] > 0 for r in eval_rows):
        loss_axis.set_yscale("log")  # a fine-tune's loss falls by orders of magnitude
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("loss")
    lr_rows = record.rows_with("lr")
    if lr_rows:
        lr_axis = loss_axis.twinx()
        lr_axis.plot(
            [r["step"] for r in lr_rows], [r["lr"] for r in lr_rows], ":", color="gray", label="learning rate"
        )
        lr_axis.set_ylabel("learning rate")
        lr_axis.set_ylim(bottom=0)
    handles = [line for axis in fig.axes for line in axis.get_lines() if axis is not reward_axis]
    loss_axis.legend(handles, [line.get_label() for line in handles], loc="upper right")
    loss_axis.set_title(record.folder.name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_rewards(axis, rows: list[dict[str, Any]]) -> None:
    """GRPO's figures per logging step: the summed reward, each reward function's mean, and the share of
    prompts whose completions all scored alike (which teach nothing)."""
    steps = [r["step"] for r in rows]
    names = sorted({k for r in rows for k in r if keys.is_reward_key(k) and k.endswith(keys.MEAN)})
    axis.plot(steps, [r[keys.REWARD] for r in rows], label="reward (weighted sum)")
    for name in (n for n in names if not n.startswith("eval_")):
        axis.plot(steps, [r.get(name) for r in rows], "--", label=name.removeprefix(keys.REWARDS))
    same = [r.get(keys.FRAC_REWARD_ZERO_STD) for r in rows]
    axis.plot(steps, same, ":", color="gray", label="prompts with one reward for all")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("reward")
    axis.legend(loc="upper left")


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and prefix == "":
            flat |= _flatten(value, f"{name}.")
        else:
            flat[name] = value
    return flat


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OutputDirError(f"{path}: cannot read ({exc.__class__.__name__})") from None
    if not isinstance(value, dict):
        raise OutputDirError(f"{path}: not a JSON object")
    return value


def _last_step(record: RunRecord) -> int:
    return max((row.get("step", 0) for row in record.metrics), default=0)


def _seconds(started: str | None, finished: str | None) -> float | None:
    if not started or not finished:
        return None
    return (datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds()
