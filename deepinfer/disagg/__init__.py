"""Prefill/decode disaggregation: a prefill engine computes a prompt's KV and its first token and hands the KV over; a
decode engine admits the request with that token, waits for the KV in the background and streams the rest.

params.py: the kv_transfer_params that travel with a request (plain, no torch) · stats.py: hand-off counters ·
transfer.py: the direct path, blocks between two processes over zmq (the worker half) · metrics.py: Prometheus
families. The scheduler half is core/scheduler.py (Request.hold_kv, Request.remote_kv, StepPlan.kv_pulls), the engine
half engine/handoff.py, the proxy router/handoff.py.
"""
