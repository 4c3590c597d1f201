"""Does transformers load what `scripts/convert_hf.py to-hf` writes, and compute the same logits?

Run in the fixture venv (make_fixtures.py's docstring), on directories exported from the fixtures:

  for m in llama_untied llama_tied llama3_scaling mistral_window qwen3 qwen2_window gemma3 olmo3; do
    python scripts/convert_hf.py to-longctx --hf=tests/assets/hf/$m --out=/tmp/export/lc_$m
    python scripts/convert_hf.py to-hf --checkpoint=/tmp/export/lc_$m --out=/tmp/export/hf_$m [--dtype=...]
  done
  /tmp/hfvenv/bin/python tests/assets/hf/check_export.py /tmp/export [MODEL ...]

For each model it loads hf_<model> with `from_pretrained` (no warnings about unexpected or missing
weights allowed), runs the fixture's inputs in float32 and prints the max |logit difference|
against golden_logits.npz (0 for a float32 export; the bfloat16 rounding of the weights for a
bfloat16 one). The pytest suite cannot run this (it has no torch); the result is quoted in
versions.json ("export_check").
"""

import os
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main(root: str, names: list[str]) -> None:
    inputs = dict(np.load(os.path.join(HERE, "inputs.npz")))
    golden = np.load(os.path.join(HERE, "golden_logits.npz"))
    for name in names or make_fixtures.MODELS:
        model, info = AutoModelForCausalLM.from_pretrained(
            os.path.join(root, f"hf_{name}"), attn_implementation="eager", output_loading_info=True)
        problems = {k: v for k, v in info.items() if v}
        assert not problems, f"{name}: {problems}"
        model = model.float().eval()
        logits = make_fixtures.logits_of(model, inputs)[:, ::make_fixtures.LOGIT_STRIDE]
        diff = float(np.abs(logits - golden[name]).max())
        layer_types = getattr(model.config, "layer_types", None)
        print(f"{name}: {type(model).__name__}, dtype in config {model.config.dtype}, "
              f"max |logit difference| vs the original = {diff:.3g}"
              + (f", layer_types {layer_types}" if layer_types else ""))


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1], sys.argv[2:])
