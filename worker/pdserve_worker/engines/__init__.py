"""Model engines behind the prefill and decode roles: the `Engine` contract (base.py), the
engines by name (registry.py) and pdserve's own torch engine (native.py)."""
