"""KV transfer: prefill pushes a prompt's KV into a decode's pool, one-sided, layer chunk by chunk.

- `registry.create_engine(name)` -> `base.TransferBackend`: real HIXL, or the host engine
  (`backends/host/engine.Hixl`, same API on host memory); code above uses only
  `backend.engine`, `backend.api` and the extras the backend declares (`blocking`, `host`).
- `pool.KVPool`: the pool, allocated once and registered before any peer connects.
- `push.KVPusher(backend, PushSource, grants, num_tokens)`: `push_chunk(layers)` after each
  chunk's compute, then `finish(extra)` sends `kv_ready`; `prefill_and_push` is that loop.
- `readiness.Readiness`: the decode's `wait(slot, generation, timeout)` for the ready message
  (only one carrying the grant's nonce counts).
- Who may use the KV plane: `leases` (only reserved bytes writable), `service_link`.
Decode: initialize (listening, with the link key), allocate and register the pool, then per
request reserve (kv/slots.py or kv/blocks.py), hand the grant over, `wait`, commit, decode,
release. Prefill: initialize (client only), register its source pool, push per request.
"""
