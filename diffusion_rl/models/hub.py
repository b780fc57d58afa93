"""model.path → the local directory a model loads from: a folder, or a Hugging Face Hub repository (`owner/name`)
through huggingface_hub's cache, resolved as diffusers' `from_pretrained` resolves one.

- A local folder of that name wins, as in diffusers.
- A Hub id is fetched by diffusers' own `DiffusionPipeline.download` — the files `from_pretrained` would fetch (the
  pipeline's components, safetensors weights; no single-file checkpoint beside them) — into huggingface_hub's cache
  (HF_HUB_CACHE, else HF_HOME/hub), at `model.revision` (a commit, branch or tag; null = main), and the snapshot
  folder is what every reader of the model (loader, embedding cache, estimate) sees.
- The token is huggingface_hub's own (HF_TOKEN, or the one `hf auth login` stored): this code never reads, passes,
  logs or writes it. HF_HUB_OFFLINE=1: the cache only, no request.
- Nothing cached and nothing downloadable (offline, or no network): one line naming the id and how to download it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from diffusion_rl.errors import UserError
from diffusion_rl.utils.hub_ids import names_hub_repo

logger = logging.getLogger(__name__)


def model_dir(path: str | os.PathLike, revision: str | None = None, *, download: bool = True) -> Path:
    """The local directory of model `path`: the folder when one is there (or `path` cannot name a Hub repository),
    else the Hub repository's snapshot in huggingface_hub's cache at `revision`, downloaded when absent unless
    `download` is False or HF_HUB_OFFLINE is set (then the cache only). A UserError in one line when it cannot."""
    local = Path(path).expanduser()
    if local.exists() or not names_hub_repo(path):
        if revision is not None:
            logger.warning(
                "model.revision=%s does not apply: '%s' is a local folder (it wins over the Hub)", revision, path
            )
        return local
    from diffusers import DiffusionPipeline
    from huggingface_hub import constants

    from diffusion_rl.models.quiet import quiet_loading

    cache_only = constants.is_offline_mode() or not download
    try:
        with quiet_loading():
            folder = DiffusionPipeline.download(str(path), revision=revision, local_files_only=cache_only)
    except OSError as e:  # huggingface_hub's errors are OSErrors: not found in the cache, HTTP errors
        raise UserError(_why_not(str(path), revision, e, download)) from None
    logger.info("model %s%s: %s", path, f" at revision {revision}" if revision else "", folder)
    return Path(folder)


def _why_not(repo: str, revision: str | None, error: BaseException, download: bool) -> str:
    """One line: why Hub repository `repo` is not here, and what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError

    chain = [error]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    answered = next((e for e in chain if isinstance(e, HfHubHTTPError)), None)
    at = f" at revision {revision}" if revision else ""
    if answered is not None:  # the Hub said no: not found, gated, private without a token, no such revision
        reason = str(answered).strip().splitlines()[0]
        return (f"model '{repo}'{at}: no local folder of that name, and the Hub answered: {reason} (a private or "
                "gated repository needs a token: HF_TOKEN or `hf auth login`)")  # fmt: skip
    if constants.is_offline_mode():
        cause = "HF_HUB_OFFLINE is set"
    elif not download:
        cause = "this command reads the cache only"
    else:
        cause = "the Hub cannot be reached"
    revision_flag = f" --revision {revision}" if revision else ""
    return (f"model '{repo}'{at}: no local folder of that name, and the Hub repository is not in huggingface_hub's "
            f"cache ({constants.HF_HUB_CACHE}) while {cause}: download it where the Hub can be reached with "
            f"`hf download {repo}{revision_flag}` (into that cache; HF_HUB_CACHE or HF_HOME move it), or point "
            "model.path at a local diffusers directory")  # fmt: skip
