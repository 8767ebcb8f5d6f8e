"""KV transfer: prefill pushes a prompt's KV into a decode slot, one-sided, layer chunk by chunk.

How the pieces fit (every module says more):

- `engine.create_engine(backend)` → `TransferBackend(name, engine, api)`: real HIXL (`hixl`,
  from CANN) when it imports, else `host_engine.Hixl`, which has the same API and semantics
  on host memory (shared memory between processes of a host, TCP between hosts). Code above
  uses only `backend.engine.<hixl method>` and `backend.api.<hixl type or code>`.
- `kv.pool.KVPool(backend, layout)`: the decode pool (or prefill source), allocated once and
  registered before any peer connects; `.tensor` has `layout.shape`.
- `kv.slots.SlotTable`: decode grants slots with leases and generations (`Grant`), quarantines
  abandoned ones.
- `push.KVPusher(backend, PushSource, [PushTarget.from_grant(g)...], num_tokens)`:
  `push_chunk(layers)` after each chunk's compute, then `finish(extra)` sends `kv_ready`.
  `prefill_and_push(compute, pusher, chunks)` is that loop.
- `readiness.Readiness(backend, mode, accepts=slots.is_reserved)`: decode's
  `wait(slot, generation, timeout)` → the ready message.
- `peers`: stand-in decode/prefill processes for tests and benchmarks.

Decode side, in order: initialize the engine (listening), allocate+register the pool, then
accept links; per request reserve a slot, hand the grant to prefill, `wait`, `commit`, decode,
`release`; run `slots.expire()` periodically. Prefill side: initialize (client), register its
source pool, and per request build a KVPusher from the grant(s).
"""
