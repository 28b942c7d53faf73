"""The experiment trackers a run logs to (``--logger``): W&B (offline without credentials, never
a login prompt), CSV, or none. Light on purpose (Lightning's loggers are imported when one is
made), so that the benchmark and the sweeps can log without importing the runner.

``--logger wandb`` uses Lightning's `WandbLogger`. Without an API key (``WANDB_API_KEY``, or a
``api.wandb.ai`` entry in ``~/.netrc`` as ``wandb login`` writes it) the run is offline: it is
written under ``<run dir>/wandb/offline-run-*`` and uploaded later with ``wandb sync DIR``.
``WANDB_MODE`` (``online``, ``offline``, ``disabled``) overrides the choice. When a W&B run is
already active (a sweep agent calling the training function), the logger attaches to it instead of
starting another.
"""

from __future__ import annotations

import configparser
import csv
import io
import json
import netrc
import os
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from framework.config_fields import ConfigError


def _wandb_host() -> str:
    """The W&B server's host: ``WANDB_BASE_URL``, the ``base_url`` of W&B's settings, or wandb.ai."""
    url = os.environ.get("WANDB_BASE_URL", "")
    if not url:
        cfg_dir = Path(os.environ.get("WANDB_CONFIG_DIR", "~/.config/wandb")).expanduser()
        for settings in (cfg_dir / "settings", Path("wandb") / "settings"):
            parser = configparser.ConfigParser()
            try:
                parser.read(settings)
            except configparser.Error:
                continue
            url = parser.get("default", "base_url", fallback=url)
    return urlsplit(url or "https://api.wandb.ai").netloc or "api.wandb.ai"


def has_wandb_credentials() -> bool:
    """Whether W&B would find an API key without prompting: ``WANDB_API_KEY``,
    ``WANDB_IDENTITY_TOKEN_FILE``, or a ``.netrc`` entry for the server (``wandb login`` writes one)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    candidates = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for path in candidates:
        p = Path(path).expanduser()
        if not p.is_file():
            continue
        try:
            entry = netrc.netrc(str(p)).authenticators(_wandb_host())
        except (netrc.NetrcParseError, OSError):
            continue
        if entry and entry[2]:
            return True
    return False


def wandb_mode() -> str:
    """``online`` when W&B credentials are present, ``offline`` otherwise (``WANDB_MODE`` wins)."""
    env = os.environ.get("WANDB_MODE")
    if env:
        return env
    return "online" if has_wandb_credentials() else "offline"


def make_logger(kind: str, run_dir: Path, name: str, project: str, config: dict[str, Any]) -> Any:
    """The Lightning logger for ``--logger kind`` writing under ``run_dir`` (``None`` for ``none``)."""
    if kind == "none":
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    if kind == "csv":
        from pytorch_lightning.loggers import CSVLogger

        logger = CSVLogger(save_dir=str(run_dir), name="csv", version="")
        _keep_earlier_rows(logger, run_dir / "csv" / "metrics.csv")
    elif kind == "wandb":
        import wandb
        from pytorch_lightning.loggers import WandbLogger

        if wandb.run is not None:  # inside a sweep agent / the user's own wandb.init: theirs to finish
            logger = WandbLogger(experiment=wandb.run)
            logger.selfspec_owned = False
        else:
            mode = wandb_mode()
            logger = WandbLogger(
                project=project,
                name=name,
                save_dir=str(run_dir),
                offline=mode == "offline",
                mode=mode,
                settings=wandb.Settings(silent=True, init_timeout=60),
            )
            # Lightning always hands wandb.init ``anonymous=None``, which wandb >= 0.19 answers with
            # "WARNING The anonymous setting has no effect..." on the user's terminal; an unset
            # value is what Lightning means.
            init_args = getattr(logger, "_wandb_init", None)
            if isinstance(init_args, dict) and init_args.get("anonymous", False) is None:
                del init_args["anonymous"]
            logger.selfspec_owned = True
    else:
        raise ConfigError("--logger", kind, "one of wandb, csv, none")
    # plain JSON types: Lightning writes them to hparams.yaml, which yaml.safe_load must read back
    logger.log_hyperparams(json.loads(json.dumps(config, default=str)))
    return logger


def _keep_earlier_rows(logger: Any, metrics: Path) -> None:
    """A resumed run's CSV logger keeps the rows the earlier run wrote: Lightning deletes an
    existing ``metrics.csv`` when its writer starts; it is written back, and the writer continues
    its header (new columns rewrite the file with the rows kept)."""
    if not metrics.is_file():
        return
    kept = metrics.read_text(encoding="utf-8")
    with warnings.catch_warnings():  # "Previous log files ... will be deleted": not these
        warnings.filterwarnings("ignore", message=".*Previous log files in this directory will be deleted")
        writer = logger.experiment  # starting the writer deletes the file
    metrics.write_text(kept, encoding="utf-8")
    header = next(csv.reader(io.StringIO(kept)), [])
    if hasattr(writer, "metrics_keys"):
        writer.metrics_keys = list(header)


def close_logger(logger: Any, log: Any, tag: str = "[selfspec]", failed: bool = False) -> None:
    """Finish a W&B run this tool started (not one a sweep agent owns; ``failed``: with exit code 1,
    so that no later run attaches to it) and say where it is; a CSV logger is saved and its
    directory named."""
    from pytorch_lightning.loggers import WandbLogger

    if not isinstance(logger, WandbLogger):
        logger.save()
        log(f"{tag} metrics: {logger.log_dir}")
        return
    import wandb

    run = logger.experiment
    offline = run.settings.mode in ("offline", "dryrun")
    run_dir = Path(run.dir).parent
    if getattr(logger, "selfspec_owned", False) and wandb.run is run:
        run.finish(exit_code=1 if failed else None)
    if offline:
        log(f"{tag} W&B offline run: {run_dir} (upload with `wandb sync {run_dir}`)")


__all__ = ["close_logger", "has_wandb_credentials", "make_logger", "wandb_mode"]
