"""The hardware twin: roofline step times from model x device profiles, ``calibrate`` and ``kv-size``."""
