"""PDInferenceService spec and status (moved to spec/service.py; split per sub-spec next)."""

from pdserve_operator.spec.service import *  # noqa: F403
