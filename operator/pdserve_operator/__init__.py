"""pdserve operator: reconciles PDInferenceService resources and hosts the broker."""
