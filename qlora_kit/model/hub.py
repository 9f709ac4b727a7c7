"""Base models and datasets named by a hub id: checked before any slow work, every failure one line.

huggingface_hub (through transformers and datasets) does the downloading, with its own progress bars,
into its cache (``HF_HOME``; models under ``$HF_HOME/hub``). What can go wrong is found first where it is
cheap: ``check_model`` asks for the model's ``config.json`` metadata (one request, no retries) and the
size of the weight files still to download; ``check_dataset`` asks for the dataset's info. Failures
later in a download (a connection cut mid-file, a full disk) surface inside transformers or datasets as
a chain of exceptions (transformers' OSError over the hub's GatedRepoError over an httpx error);
``hub_errors`` reads the chain for its cause and raises one line naming the field, what happened and
what to do.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from qlora_kit.errors import RecipeError
from qlora_kit.model import builtin
from qlora_kit.model.paths import first_line
from qlora_kit.recipe.paths import data_paths

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import DataSection, ModelSection

log = logging.getLogger(__name__)

GB = 1e9  # download sizes in the units the hub's pages show
_TRANSFORMERS_SAFETENSORS = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")
_TRANSFORMERS_BIN = re.compile(r"^pytorch_model(-\d+-of-\d+)?\.bin$")
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
# httpx's names for a connection that broke mid-transfer or never opened (matched by name: the hub's
# HTTP client module is vendored under different names across huggingface_hub versions).
_CUT_OFF = {"RemoteProtocolError", "ReadError", "ReadTimeout", "WriteError", "ChunkedEncodingError"}
_UNREACHABLE = {"ConnectError", "ConnectTimeout", "ConnectionRefusedError", "gaierror", "ProxyError"}


def is_hub_id(path: str) -> bool:
    """Neither a builtin name nor an existing local path, and shaped like ``org/name``."""
    if builtin.is_builtin(path) or Path(path).expanduser().exists():
        return False
    return bool(_REPO_ID.match(path)) and not path.startswith((".", "~"))


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def check_model(model: ModelSection) -> None:
    """A hub model can be fetched (or is cached, offline), and its weights fit on the cache's disk."""
    if not is_hub_id(model.path):
        return
    check_config(model)
    if offline():
        return
    repo, revision = model.path, model.revision
    missing = weights_to_download(repo, revision)
    if missing is None:
        return
    free = free_bytes(cache_dir())
    if missing > free:
        raise RecipeError(
            f"model.path: {repo} downloads {missing / GB:.1f} GB of weights into {cache_dir()}, but that disk "
            f"has {free / GB:.1f} GB free; free {(missing - free) / GB:.1f} GB or set HF_HOME to a larger disk"
        )
    if missing:
        log.info(
            "model.path: %s downloads %.1f GB of weights into %s (HF_HOME moves it; `hf download %s` "
            "fetches it ahead of a run)",
            repo,
            missing / GB,
            cache_dir(),
            repo,
        )


def check_config(model: ModelSection) -> None:
    """The hub model's config.json can be fetched: it exists, this login may read it, the revision is
    real, the hub answers (or, offline, the config is cached)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache

    repo, revision = model.path, model.revision
    if offline():
        if not isinstance(try_to_load_from_cache(repo, "config.json", revision=revision), str):
            raise RecipeError(
                f"model.path: {repo} is not in the hub cache ({cache_dir()}) and HF_HUB_OFFLINE=1 forbids "
                f"downloading it; fetch it on a machine with network with `hf download {repo}`"
            )
        return
    try:
        with hub_errors("model.path", repo, revision):
            # metadata only, without the hub's retries: a machine without network hears so in seconds
            get_hf_file_metadata(hf_hub_url(repo, "config.json", revision=revision), timeout=10)
    except RecipeError as error:
        cached = isinstance(try_to_load_from_cache(repo, "config.json", revision=revision), str)
        if cached and ("cannot reach the hub" in str(error) or "the hub answered HTTP" in str(error)):
            raise RecipeError(
                f"{str(error).split(';')[0]}; {repo} is in the hub cache: run with HF_HUB_OFFLINE=1 to train from it"
            ) from error
        raise


def check_dataset(data: DataSection) -> None:
    """Hub datasets named by ``data.path`` (or each of ``data.sources``) and ``data.val_path`` exist and
    can be read with this login.
    Offline (HF_HUB_OFFLINE or datasets' own HF_DATASETS_OFFLINE), datasets reads its cache; a miss is
    reported when the data is loaded."""
    from datasets import config as datasets_config

    if offline() or datasets_config.HF_HUB_OFFLINE:
        return
    from huggingface_hub import HfApi

    for field, repo in data_paths(data):
        if not is_hub_id(repo):
            continue
        with hub_errors(field, repo, None, kind="dataset"):
            HfApi().dataset_info(repo, timeout=10)


def weights_to_download(repo: str, revision: str | None) -> int | None:
    """Bytes of the weight files transformers will fetch that are not cached yet; None when the hub's
    API does not say (a mirror that serves files only)."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True, timeout=10)
    except Exception as exc:  # the size is a courtesy: the download itself reports real failures
        log.debug("no file sizes for %s: %s", repo, exc)
        return None
    files = {s.rfilename: s.size or 0 for s in info.siblings or []}
    weights = weight_files(list(files))
    return sum(
        files[f] for f in weights if not isinstance(try_to_load_from_cache(repo, f, revision=revision), str)
    )


def weight_files(names: list[str]) -> list[str]:
    """What transformers loads from a repository: model.safetensors or its shards, else
    pytorch_model.bin or its shards; not other copies a repository may ship (Mistral's
    consolidated.safetensors, Llama-3's original/ folder)."""
    return [f for f in names if _TRANSFORMERS_SAFETENSORS.match(f)] or [
        f for f in names if _TRANSFORMERS_BIN.match(f)
    ]


def free_bytes(folder: Path) -> int:
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    return shutil.disk_usage(existing).free


@contextlib.contextmanager
def hub_errors(field: str, repo: str, revision: str | None, kind: str = "model"):
    """Failures of fetching ``repo`` become one ``RecipeError`` line; anything else passes unchanged."""
    try:
        yield
    except RecipeError:
        raise
    except Exception as exc:  # the hub's errors, httpx's, and the OSError/ValueError wrappers over them
        line = explain(exc, field, repo, revision, kind)
        if line is None:
            raise
        raise RecipeError(line) from exc


def explain(exc: BaseException, field: str, repo: str, revision: str | None, kind: str) -> str | None:
    """The one line for a failed fetch of ``repo``, from the most specific cause in the chain."""
    from huggingface_hub import constants, errors, get_token

    chain = _chain(exc)
    names = {type(e).__name__ for e in chain}
    page = f"{constants.ENDPOINT}/{'datasets/' if kind == 'dataset' else ''}{repo}"
    if _find(chain, errors.GatedRepoError) or any("is a gated dataset" in str(e) for e in chain):
        login = (
            "with the account of your token" if get_token() else "then set HF_TOKEN or run `hf auth login`"
        )
        return f"{field}: {repo} is a gated {kind}: accept its terms at {page} ({login}) and run again"
    if _find(chain, errors.RevisionNotFoundError):
        where = "model.revision" if kind == "model" else field
        return f"{where}: {revision!r} is not a branch, tag or commit of {repo}; see {page}/tree/main"
    if _find(chain, errors.RepositoryNotFoundError) or "DatasetNotFoundError" in names:
        token = "" if get_token() else "; a private one needs HF_TOKEN or `hf auth login`"
        return (
            f"{field}: {repo} is neither a local folder nor a {kind} on the hub ({constants.ENDPOINT}); "
            f"check the path or id{token}"
        )
    # (LocalEntryNotFoundError, a cache miss without network, is an EntryNotFoundError too: not this case)
    if entry := _find(chain, errors.RemoteEntryNotFoundError):
        return f"{field}: {repo} has no file the loader needs ({first_line(entry)[:120]}); check the id"
    if config_line := _config_name_problem(chain, repo):
        return config_line
    if disk := _find(chain, OSError, lambda e: e.errno == errno.ENOSPC):
        return (
            f"{field}: the disk ran full while downloading {repo} ({disk.strerror}, {free_bytes(cache_dir()) / GB:.1f} "
            f"GB free at {cache_dir()}); free space there or set HF_HOME to a larger disk, then run again"
        )
    if names & _CUT_OFF or any("Consistency check failed" in str(e) for e in chain):
        cause = next(e for e in chain if type(e).__name__ in _CUT_OFF or "Consistency" in str(e))
        return (
            f"{field}: the download of {repo} was cut off ({first_line(cause)[:100]}); run the same command "
            f"again to resume it (what arrived is kept in {cache_dir()})"
        )
    offline_mode = offline() or any("OfflineModeIsEnabled" in f"{type(e).__name__} {e}" for e in chain)
    if offline_mode and (names & {"LocalEntryNotFoundError", "ConnectionError", "OfflineModeIsEnabled"}):
        return (
            f"{field}: {repo} is not in the cache ({cache_dir().parent}) and HF_HUB_OFFLINE=1 forbids downloading "
            f"it; fetch it on a machine with network (`hf download {repo}{' --repo-type dataset' if kind == 'dataset' else ''}`)"
        )
    if names & _UNREACHABLE or "LocalEntryNotFoundError" in names:
        cause = next((e for e in chain if type(e).__name__ in _UNREACHABLE), chain[-1])
        return (
            f"{field}: cannot reach the hub at {constants.ENDPOINT} for {repo} ({first_line(cause)[:80]}); "
            f"go online, or download it on a machine with network (`hf download {repo}`), copy its cache here and "
            f"run with HF_HUB_OFFLINE=1"
        )
    if status := next((e.response.status_code for e in chain if isinstance(e, errors.HfHubHTTPError)), None):
        return f"{field}: the hub answered HTTP {status} for {repo}; try again later ({page})"
    return None


def explain_model_failure(exc: BaseException, field: str, path: str, revision: str | None) -> str | None:
    """The one line for a model that failed to load, when ``path`` is a hub id and the cause a fetch."""
    return explain(exc, field, path, revision, "model") if is_hub_id(path) else None


def _config_name_problem(chain: list[BaseException], repo: str) -> str | None:
    """datasets' "Config name is missing" / "BuilderConfig 'x' not found", as the data.config_name line."""
    for error in chain:
        text = str(error)
        configs = re.search(r"\[([^\]]*)\]", text)
        listed = configs.group(1).replace("'", "") if configs else "see the dataset's page"
        if "Config name is missing" in text:
            return (
                f"data.config_name: {repo} has several configurations ({listed}); set data.config_name to one"
            )
        if re.search(r"BuilderConfig .* not found", text):
            return f"data.config_name: {repo} has no such configuration (it has {listed})"
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        chain.append(exc)
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return chain


def _find(chain, kind, test=lambda e: True):
    return next((e for e in chain if isinstance(e, kind) and test(e)), None)
