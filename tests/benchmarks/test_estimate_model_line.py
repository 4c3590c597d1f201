"""estimate.py's "Model:" line (the fit tables' heading, and what a later sweep matches its old
points by) names the block options a model sets away from Llama's and its layer types' pattern;
a Llama's line is what it was. No compile: one child imports the script (its import sets up the
CPU devices and flags, as a run does) and prints the line of each config."""

import json
import subprocess
import sys

from tests import ROOT
from tests.child_env import script_env

GEMMA_BLOCK = {"qk_norm": "per_head", "norm_position": "sandwich", "norm_plus_one": True,
               "mlp_activation": "gelu_tanh", "scale_embeddings": True, "query_pre_attn_scalar": 256.0,
               "final_logits_soft_cap": 30.0}

_CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("estimate_script", "scripts/estimate.py")
estimate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(estimate)
from configs import base
lines = {}
for name, preset, model in json.loads(sys.argv[1]):
    config = base.get_config(preset)
    config.model.update(model)
    lines[name] = estimate._model_line(config)
print(json.dumps(lines))
"""


def model_lines(cases) -> dict[str, str]:
    p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cases)], cwd=ROOT, env=script_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def test_model_line_names_the_block_options_and_the_pattern():
    lines = model_lines([("llama", "tiny", {}), ("gemma", "tiny_hybrid", GEMMA_BLOCK),
                         ("qwen2", "tiny", {"qkv_bias": True}), ("olmo3", "olmo3_7b_64k", {})])
    assert "vocab 512, float32 compute, " in lines["llama"], lines["llama"]  # (Llama's line unchanged)
    assert "pattern" not in lines["llama"]
    assert ("vocab 512, qk_norm per_head, sandwich norms, (1 + w) norms, GeGLU, embeddings x sqrt(d_model), "
            "query_pre_attn_scalar 256, final logit soft cap 30, float32 compute, ") in lines["gemma"], lines["gemma"]
    assert ", pattern local x5 (" in lines["gemma"] and "sliding_window 128" in lines["gemma"], lines["gemma"]
    assert "vocab 512, qkv_bias, float32 compute, " in lines["qwen2"], lines["qwen2"]
    assert "vocab 100278, qk_norm whole, post-norms, bfloat16 compute, " in lines["olmo3"], lines["olmo3"]
    assert ", pattern sliding x3 (" in lines["olmo3"] and "sliding_window 4095" in lines["olmo3"], lines["olmo3"]
