"""Prefect flows and deployments: thin wrappers that wire `prism_core` stage functions together.

Nothing here computes; each task calls one plain function of `prism_core`. The pipeline flow
(collect -> timing -> calibrate -> emulate -> report) arrives with the stages it wires.
"""
