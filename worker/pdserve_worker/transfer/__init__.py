"""KV transfer: prefill pushes a prompt's KV into a decode slot, one-sided, layer chunk by chunk.

How the pieces fit (every module says more):

- `registry.create_engine(backend)` → `TransferBackend(name, engine, api, blocking, host)`: real
  HIXL (`hixl`, from CANN) when it imports, else `host.engine.Hixl`, which has the same API and
  semantics on host memory (shared memory between processes of a host, TCP between hosts).
  Code above uses only `backend.engine.<hixl method>` (the `TransferEngine` protocol),
  `backend.api.<hixl type or code>`, and the host engine's extras where the backend declares
  them (`blocking`, `host`; None on real HIXL).
- `kv.pool.KVPool(backend, layout)`: the decode pool (or prefill source), allocated once and
  registered before any peer connects; `.tensor` has `layout.shape`.
- `kv.slots.SlotTable`: decode grants slots with leases and generations (`Grant`), quarantines
  abandoned ones.
- `push.KVPusher(backend, PushSource, grants, num_tokens)` (the decode's `kv.slots.Grant`s):
  `push_chunk(layers)` after each chunk's compute, then `finish(extra)` sends `kv_ready`.
  `prefill_and_push(compute, pusher, chunks)` is that loop.
- `readiness.Readiness(backend, mode, accepts=slots.is_reserved, authorize=slots.verify)`:
  decode's `wait(slot, generation, timeout)` → the ready message (only one that carries the
  grant's nonce counts).
- Who may use the KV plane: `link_auth` (the per-service link key and the handshake),
  `leases` (only reserved slots writable), `drops` (counted refusals, summary logs),
  `service_link` (how a worker sets all of this up).
- `peers`: stand-in decode/prefill processes for tests and benchmarks.

Decode side, in order: initialize the engine (listening, with the link key), allocate+register
the pool, then accept links; per request reserve a slot (which leases it), hand the grant to
prefill, `wait`, `commit`, decode, `release`; run `slots.expire()` periodically; at shutdown
deregister, finalize, then free. Prefill side: initialize (client only: no port), register its
source pool, and per request build a KVPusher from the grant(s).
"""
