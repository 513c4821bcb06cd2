"""The Ingress deployment as build_app deploys it: its admission limit and the replica count it reports follow
the LLMServer replica count that a Serve config applied in place gives it as user_config
(operator/serve_document.py), without restarting it."""
from __future__ import annotations

from typing import Any

from cpuserve.serving.ingress import Ingress, IngressCore


class ScalableIngress(Ingress):
    _replicas: int | None = None  # set by reconfigure; None: the config's (a local `cpuserve serve`)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Ray Serve calls this at start and whenever the deployment's user_config changes (a lightweight update)."""
        replicas = int(user_config.get("replicas", self.config.replicas))
        if replicas < 0:
            raise ValueError(f"user_config.replicas={replicas}: must be at least 0")
        c = self.config
        self._replicas = replicas
        self.max_in_flight = max(replicas, 1) * c.max_num_seqs + c.max_queued_requests

    async def _model_info(self) -> dict[str, Any]:
        info = await IngressCore._model_info(self)  # the LLMServer's: its own config says 1 when scaled in place
        return info if self._replicas is None else {**info, "replicas": self._replicas}
