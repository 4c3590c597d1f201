"""longctx: long-context LLM pretraining in JAX with ring attention around the Pallas splash kernel."""

__version__ = "0.1.0"
