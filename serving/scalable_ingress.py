"""The Ingress deployment as build_app deploys it: its admission limit follows the LLMServer replica count that
a Serve config applied in place gives it as user_config (serving/inplace.py), without restarting it."""
from __future__ import annotations

from typing import Any

from cpuserve.serving.ingress import Ingress


class ScalableIngress(Ingress):
    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Ray Serve calls this at start and whenever the deployment's user_config changes (a lightweight update)."""
        replicas = int(user_config.get("replicas", self.config.replicas))
        if replicas < 0:
            raise ValueError(f"user_config.replicas={replicas}: must be at least 0")
        c = self.config
        self.max_in_flight = max(replicas, 1) * c.max_num_seqs + c.max_queued_requests
