"""Inspection of a step: the single-device equivalence harness, collectives from HLO, the
communication and GPU program reports, profiler traces and FLOPs per token."""
