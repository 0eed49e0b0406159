"""The audit of live traffic: the statistics that watch a certificate after calibration."""
