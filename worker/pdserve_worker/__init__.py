"""pdserve worker: the model engine, the KV transfer and the prefill/decode/router roles."""

__version__ = "0.1.0"
