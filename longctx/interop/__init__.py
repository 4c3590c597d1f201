"""Models in and out: Hugging Face Llama checkpoints converted to longctx parameters and back
(hf.py), longctx's own exported parameters (params_io.py), and export directories that appear
whole or not at all (staging.py).

Imports: longctx.train (the checkpoint reader), longctx.model, longctx.config, longctx.errors;
torch and transformers never (safetensors and tokenizers only, loaded where used).
"""
