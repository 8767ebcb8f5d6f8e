"""A Kubernetes API emulator for tests: kmock plus the API server semantics kopf and kubectl need."""

from .crd_validation import validate_crd
from .runner import EmulatorThread
from .server import ApiError, AuditEntry, KubeEmulator

__all__ = ["ApiError", "AuditEntry", "EmulatorThread", "KubeEmulator", "validate_crd"]
