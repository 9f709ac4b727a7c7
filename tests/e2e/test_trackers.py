"""train.report_to: each tracker in its offline/local mode, through the real CLI, read back from its files:
the run name, the resolved recipe, and the metrics qlora_kit adds (which only reach a tracker placed
after its memory and throughput callbacks)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "demo.yaml"
RUN_NAME = "tracked-run-42"


def train(tmp_path: Path, tracker: str, env: dict[str, str]) -> Path:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "qlora_kit", "train", str(DEMO), "--output-dir", str(out)]
    for setting in (
        "train.max_steps=4",
        "train.logging_steps=2",
        "train.eval_steps=null",
        "train.sample_prompts=0",
        f"train.report_to=[{tracker}]",
        f"train.run_name={RUN_NAME}",
    ):
        command += ["--set", setting]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TRACKIO_"))}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**clean, **env}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


# The installed trackers of the tests below, all in one run (a run each cost a process start and a
# training run; a tracker placed before qlora_kit's callbacks misses their metrics however many report)
TRACKED_TOGETHER = ["tensorboard", "wandb", "mlflow"]


@pytest.fixture(scope="session")
def tracked_run(tmp_path_factory, worker_id) -> tuple[Path, Path]:
    """(the run's folder, its output folder): one run reporting to every tracker of TRACKED_TOGETHER,
    each in its offline/local mode under the folder, once per session whichever worker asks first."""
    from tests.conftest import once_per_session

    def make(folder: Path) -> dict:
        env = {"WANDB_MODE": "offline", "WANDB_DIR": str(folder), "WANDB_CACHE_DIR": str(folder / "cache")}
        env |= {"WANDB_CONFIG_DIR": str(folder / "config"), "WANDB_DATA_DIR": str(folder / "data")}
        env |= {"MLFLOW_DISABLE_TELEMETRY": "true"}
        return {"out": str(train(folder, ", ".join(TRACKED_TOGETHER), env))}

    folder, made = once_per_session(tmp_path_factory, worker_id, "tracked-run", make)
    return folder, Path(made["out"])


def test_tensorboard_gets_the_metrics_and_the_recipe(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = tracked_run
    (events,) = (out / "tensorboard").glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0, "scalars": 0})
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    assert "train/loss" in scalars and "train/throughput/tokens_per_s" in scalars, scalars
    assert "train/memory/saved_mib" in scalars
    recipe = accumulator.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0].decode()
    assert f"output_dir: {out}" in recipe
    assert "report_to:\n" + "".join(f"  - {tracker}\n" for tracker in TRACKED_TOGETHER) in recipe


def test_wandb_offline_run_holds_the_name_recipe_and_metrics(tracked_run):
    folder, out = tracked_run
    (record,) = (folder / "wandb").glob("offline-run-*/run-*.wandb")
    # the offline run's record log holds every value as UTF-8 JSON inside its protobuf records
    data = record.read_bytes()
    assert RUN_NAME.encode() in data
    assert b'"qlora-kit"' in data or b"qlora-kit" in data  # the project
    assert json.dumps(str(out)).encode() in data  # the recipe's train.output_dir, from the logged recipe
    assert b"throughput/tokens_per_s" in data and b"memory/saved_mib" in data and b"loss" in data


def test_mlflow_local_store_in_the_output_folder_holds_the_run(tracked_run, tmp_path):
    from mlflow.tracking import MlflowClient

    _, out = tracked_run
    store = (out / "mlruns").as_uri()  # the default qlora_kit gives a recipe that names no tracking URI
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("qlora-kit")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == RUN_NAME
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == [2, 4]
    assert client.get_metric_history(run.info.run_id, "throughput/tokens_per_s")
    recipe = json.loads(
        Path(client.download_artifacts(run.info.run_id, "recipe.json", str(tmp_path))).read_text()
    )
    assert recipe == yaml.safe_load((out / "recipe.yaml").read_text())


@pytest.mark.skipif(
    importlib.util.find_spec("trackio") is None,
    reason="trackio is not installed (the dev extra leaves it out: trackio 0.43 caps pillow below the lock's 13)",
)
def test_trackio_local_database_holds_the_run(tmp_path):
    import sqlite3

    train(tmp_path, "trackio", {"TRACKIO_DIR": str(tmp_path / "trackio")})
    (database,) = (tmp_path / "trackio").glob("qlora-kit.db")
    with sqlite3.connect(database) as connection:
        text = "\n".join(
            str(row)
            for table in ("metrics", "configs")
            for row in connection.execute(f"select * from {table}")
        )
    assert RUN_NAME in text and "throughput/tokens_per_s" in text and "output_dir" in text


def test_a_tracker_that_is_not_installed_is_one_line_at_validation(tmp_path):
    code = (
        "import sys; sys.modules['wandb'] = None; from qlora_kit.cli.app import main; "
        f"sys.argv = ['qlora-kit', 'validate', {str(DEMO)!r}, '--set', 'train.report_to=[tensorboard, wandb]']; main()"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "error: train.report_to: wandb is not installed (pip install 'qlora-kit[wandb]')"
    )
