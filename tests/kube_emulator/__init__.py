"""A Kubernetes API emulator for tests: kmock plus the API server semantics kopf and kubectl need."""

from .runner import EmulatorThread
from .server import ApiError, AuditEntry, KubeEmulator
from .structural import structural_errors

__all__ = ["ApiError", "AuditEntry", "EmulatorThread", "KubeEmulator", "structural_errors"]
