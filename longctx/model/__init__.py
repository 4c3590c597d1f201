"""The decoder: embedding, blocks of attention and gated MLP, the loss (decoder.py); the attention
layer that runs longctx.ops' ring over the mesh (attention.py); the remat policies (remat.py);
rotary embeddings and their long-context scalings (rope.py); FLOPs per step, for MFU (flops.py).

Imports: longctx.ops, longctx.parallel, longctx.errors. Nothing here knows about training, data
files or checkpoints.
"""

from longctx.model.decoder import (REMAT_POLICIES, Decoder, DecoderBlock, model_nll, token_nll,
                                   weight_decay_mask)

__all__ = ["REMAT_POLICIES", "Decoder", "DecoderBlock", "model_nll", "token_nll", "weight_decay_mask"]
