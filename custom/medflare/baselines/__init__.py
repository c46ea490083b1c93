"""Baselines on the same data as the published algorithms: FedAvg, FedProx, SCAFFOLD (FLARE jobs) and
local-only / centralised training (the ``medflare baseline`` command)."""
