"""What every run does once, whichever front end starts it.

``run.py`` (`framework.runner`: one method against vanilla, with ``--resume`` and several
processes) and ``bench.py`` (`framework.benchmark`: several methods interleaved on one model
load) are front ends over these steps:

- `start`: seed every generator, set torch's threads, load the prompts;
- `stamped`: the default output name, ``runs/<label>-<time><suffix>``;
- `metadata` and `write_json`: ``meta.json``, with the configuration, the machine
  (`framework.models.provenance.environment`), what produced the run (model, code, device,
  dtype) and what the method could not do as configured;
- `AnswerFiles`: Spec-Bench's answer files, checked before anything is written and rewritten
  from the records at the end or on Ctrl-C;
- `tracker`: the experiment tracker a run's ``--logger`` names (W&B, CSV or none).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from framework.data.prompts import Prompt, load_prompts
from framework.data.specbench import check_answer_dir, write_answer_files
from framework.models.loading import model_name
from framework.models.provenance import environment
from framework.session.loggers import make_logger
from framework.session.run_config import RunConfig
from framework.session.session import Session, provenance


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device's), as Lightning's
    ``seed_everything`` does, without importing Lightning (a benchmark does not need it)."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every device's generator


def start(run: RunConfig) -> list[Prompt]:
    """Seed (``generation.seed``), set torch's threads (``runner.threads``, when given) and load
    the prompts ``data`` names.

    Raises:
        DataError: the prompts cannot be read, or none is left after the filters.
    """
    seed_everything(run.generation.seed)
    if run.runner.threads:
        torch.set_num_threads(run.runner.threads)
    data = run.data
    return load_prompts(data.path, data.categories or None, data.limit, data.offset)


def stamped(label: str, suffix: str = "") -> Path:
    """``runs/<label>-<YYYYmmdd-HHMMSS><suffix>``, ``label`` made safe for a file name."""
    safe = "".join(ch if ch.isalnum() or ch in "-_+" else "_" for ch in label)
    return Path("runs") / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}{suffix}"


def metadata(config: Mapping[str, Any], session: Session | None = None, **fields: Any) -> dict[str, Any]:
    """A run's ``meta.json``: ``config`` (the resolved configuration), ``environment`` (the
    machine and its libraries), ``started``, the given ``fields``, and with a loaded ``session``
    its ``provenance`` and ``notes``."""
    meta: dict[str, Any] = {
        "config": dict(config),
        "environment": environment(),
        **fields,
        "started": time.time(),
    }
    if session is not None:
        meta["provenance"] = provenance(session.cfg.model.name_or_path, session)
        meta["notes"] = session.notes
        meta["resolved"] = session.resolved()
    return meta


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` as indented JSON (values JSON cannot hold written as strings)."""
    path.write_text(json.dumps(data, indent=2, default=str))


class AnswerFiles:
    """Spec-Bench's answer files of a run (``--specbench-answers``; off when ``directory`` is
    empty), one per method, rewritten whole from the records each time they are written.

    Args:
        directory: where the files go.
        methods: the method labels that will have records.
        protect: files an answer file must not overwrite (the results).
        model: the configured model name (``--model``); the answers' ``model_id`` prefix.
        log: where the line naming the files goes.
        tag: that line's prefix.

    Raises:
        ConfigError: at once, before anything is written (`check_answer_dir`).
    """

    def __init__(
        self,
        directory: str | None,
        methods: Sequence[str],
        protect: Iterable[Path],
        model: str,
        log: Callable[[str], None] = print,
        tag: str = "[selfspec]",
    ) -> None:
        self.protect = list(protect)
        check_answer_dir(directory, methods, self.protect)
        self.directory, self.model, self.log, self.tag = directory, model, log, tag

    def write(
        self, records: Iterable[Mapping[str, Any]], repeats: int | None = None, net: Any = None
    ) -> dict[str, Path]:
        """Write the files of ``records`` (``repeats`` > 1: one folder per repeat); ``net``: the
        loaded model, which names the answers when ``--model`` is a path."""
        if not self.directory:
            return {}
        paths = write_answer_files(
            records,
            self.directory,
            model=model_name(self.model, net),
            repeats=repeats,
            protect=self.protect,
        )
        self.log(f"{self.tag} Spec-Bench answer files: {', '.join(str(p) for p in paths.values())}")
        return paths


def tracker(run: RunConfig, directory: Path, name: str, config: dict[str, Any]) -> Any:
    """The Lightning logger of ``run.runner.logger`` writing under ``directory``, named ``name``,
    with ``config`` as the run's configuration (``None`` for ``--logger none``)."""
    return make_logger(run.runner.logger, directory, name, run.runner.wandb_project, config)


__all__ = [
    "AnswerFiles",
    "metadata",
    "seed_everything",
    "stamped",
    "start",
    "tracker",
    "write_json",
]
