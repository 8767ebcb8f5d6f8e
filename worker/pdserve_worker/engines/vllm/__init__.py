"""pdserve's KV connector for vLLM (connector.py, the class vLLM loads by module path): a
prefill vLLM pushes each layer's KV one-sided into the blocks a decode vLLM reserved, through
pdserve's transfer registry. Sides: scheduler.py (both roles), prefill_worker.py,
decode_worker.py; their vocabulary: grant.py; the transfer engine: plane.py. docs/engines.md."""
