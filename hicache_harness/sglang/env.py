"""SGLang 0.5.23 imported and configured in a CPU-only process, without its GPU model runner.

Two things stand between SGLang's scheduler-side modules and a CPU machine:

- `sglang.srt.configs` (imported by its memory pools) imports the configs of
  every multimodal model, and some of them import `torchvision.transforms`
  at module level for image preprocessing. Where torchvision is installed
  (the GPU image has 0.26) it is imported as it is. Where it is not (a CPU
  torch: PyPI's torchvision is a CUDA build whose operators do not load
  beside it, and installing it breaks `transformers` for the whole
  environment), and only there, `torchvision` is a stand-in module for the
  duration of that one import, whose every attribute raises when used; it is
  removed from `sys.modules` afterwards. It never executes: nothing that runs
  here preprocesses an image, and transformers' own probe (is the package
  findable?) reports torchvision absent, so transformers imports nothing
  from it. A stand-in beside an installed torchvision would be found by that
  probe, and transformers would import `torchvision.transforms.v2` from it
  and fail; an installed torchvision that does not import fails
  transformers the same way, so that is an error naming it.
- Its process-wide runtime context (`sglang.srt.runtime_context.publish`)
  must hold a `ServerArgs` before pools are built. `publish_server_args`
  publishes a real `ServerArgs` for a tiny model directory (a DeepSeek-V3
  `config.json` for MLA/DSA pools, a Llama one for MHA/GQA pools: SGLang
  resolves DSA models' server arguments through
  `torch.cuda.get_device_capability`, which a CPU torch cannot answer; the
  pools themselves are built directly and are SGLang's own classes).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

_STAND_INS = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.io")

TINY_MODEL = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_nextn_predict_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 4, "kv_lora_rank": 512, "q_lora_rank": 64,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64, "vocab_size": 1000,
    "max_position_embeddings": 65536, "torch_dtype": "bfloat16", "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
}  # fmt: skip

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000,
    "max_position_embeddings": 65536, "torch_dtype": "bfloat16", "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
}  # fmt: skip


class _Unavailable:
    """An attribute of the torchvision stand-in: usable as a name, raises when called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{self._name}: torchvision is not installed (CPU-only SGLang harness)")


def _stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []

    def getattr_(attr: str) -> _Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{name}.{attr}")

    module.__getattr__ = getattr_  # type: ignore[method-assign]
    return module


def import_sglang() -> None:
    """Import SGLang's configs package once, with the torchvision stand-in only where
    torchvision is not installed (see the module docstring); idempotent."""
    if "sglang.srt.configs" in sys.modules:
        return
    if torchvision_loads():
        import sglang.srt.configs  # noqa: F401
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached before the stand-in exists: absent
    added = [n for n in _STAND_INS if n not in sys.modules]
    for name in added:
        sys.modules[name] = _stand_in(name)
    try:
        import sglang.srt.configs  # noqa: F401
    finally:
        for name in added:
            sys.modules.pop(name, None)


def torchvision_loads() -> bool:
    """True where torchvision is installed and imports; False where it is not installed
    (the stand-in's case). An installed torchvision that does not import raises
    ImportError naming it: transformers, which finds it installed, would import it too."""
    if "torchvision" in sys.modules:
        return True
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - e.g. a CUDA build's operators beside a CPU torch
        raise ImportError(
            f"torchvision is installed but does not import ({type(exc).__name__}: {exc}); transformers finds it "
            "installed and would import it for SGLang's configs: install the build matching torch, or uninstall it"
        ) from exc
    return True


def publish_server_args(workdir: Path, model: dict[str, Any] | None = None, **server_args: Any) -> Any:
    """Publish SGLang's runtime context for a tiny model (`model`: its config.json, the
    DeepSeek-V3 one by default) under `workdir`; returns the ServerArgs. The server
    arguments name the CPU device whatever device the harness's pools use: nothing here
    runs SGLang's model runner, and a CUDA device would have SGLang resolve GPU-only
    arguments (attention backends by compute capability) for a model it never builds."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import_sglang()
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    path = workdir / "tiny-model"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model or TINY_MODEL))
    args = ServerArgs(model_path=str(path), device="cpu", skip_server_warmup=True, **server_args)
    publish(args, role="scheduler")
    return args
