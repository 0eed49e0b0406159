"""A bundle on disk: the manifest (tiers, questions, thresholds, teacher) and its typed
calibration and training sections."""
