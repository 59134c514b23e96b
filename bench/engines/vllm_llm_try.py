"""Issue 24, item 2: does vLLM 0.33's own GPU model runner run on the device image?

    python3 bench/engines/vllm_llm_try.py --json OUT.json      # on the device, after bench/device/vllm.sh set up vLLM

Builds `vllm.LLM` offline on a tiny random-weight Llama written from a config
(`load_format="dummy"`: nothing downloaded; `skip_tokenizer_init`, token-id
prompts), eager mode, vLLM's native (non-compiled) custom ops, the Triton
attention backend (Triton is on the image), and generates a few tokens for
prompts that share a prefix. Whatever stops it is recorded: the exception,
its type, and the innermost vLLM frame, so the note can name the import, op
or kernel. This is a probe, not a test; it always writes its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


def innermost_vllm_frame(tb) -> str | None:
    frames = [f for f in traceback.extract_tb(tb) if "/vllm/" in f.filename]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename.split('/vllm/', 1)[1]}:{f.lineno} in {f.name}: {f.line}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--backend", default="TRITON_ATTN")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: one traceback
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report: dict = {"backend": args.backend, "stage": "import", "ok": False}
    t0 = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        report["stage"] = "build"
        model = Path(tempfile.mkdtemp()) / "tiny-llama"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY_LLAMA))
        llm = LLM(model=str(model), skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
                  dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.2, enable_prefix_caching=True,
                  attention_config={"backend": args.backend}, compilation_config={"custom_ops": ["none"]},
                  seed=0)
        report["stage"] = "generate"
        shared = list(range(10, 10 + 512))
        prompts = [TokensPrompt(prompt_token_ids=shared + [600 + i] * 16) for i in range(4)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
        report["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
        report["ok"] = True
        report["stage"] = "done"
    except BaseException as exc:  # noqa: BLE001 - a probe: record what stopped it
        report["error_type"] = type(exc).__name__
        report["error"] = str(exc)[:2000]
        report["innermost_vllm_frame"] = innermost_vllm_frame(exc.__traceback__)
        report["traceback_tail"] = traceback.format_exc()[-6000:]
        traceback.print_exc()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "traceback_tail"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
