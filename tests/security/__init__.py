"""Attack tests (a package, so that its conftest does not shadow the other `conftest` modules)."""
