"""Data-parallel serving: one router in front of pools of replicas (a `both` pool, or disaggregated `prefill` and
`decode` pools). policy.py picks a replica (pure); router.py keeps the pools' health and state current from the
replicas' reports (server/replica_api.py); proxy.py serves the OpenAI routes and forwards, retries and relays;
handoff.py sends a request to a prefill replica, then to a decode replica with the KV hand-off; launch.py and
ray_launch.py start replicas on one machine or across a Ray cluster with the router in front."""
