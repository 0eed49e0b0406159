"""Offline distillation: teacher labels, fast-tier training, threshold calibration."""
