"""What a decision costs: the roofline (FLOPs and bytes per prompt against a device's roof) and
how each tier is priced in seconds per state and per token."""
