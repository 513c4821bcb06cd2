"""The Ingress deployment as build_app deploys it: its admission limit and the replica count it reports follow
the LLMServer replica count and batching limits that a Serve config applied in place gives it as user_config
(operator/serve_document.py), without restarting it."""
from __future__ import annotations

from typing import Any

import msgspec

from cpuserve.serving.ingress import Ingress, IngressCore
from cpuserve.serving.protocol import ModelInfo


class ScalableIngress(Ingress):
    _replicas: int | None = None  # set by reconfigure; None: the config's (a local `cpuserve serve`)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Ray Serve calls this at start and whenever the deployment's user_config changes (a lightweight update):
        {"replicas", "max_num_seqs", "max_queued_requests"}, each optional (else the config's)."""
        c = self.config
        limits = {"replicas": c.replicas, "max_num_seqs": c.max_num_seqs, "max_queued_requests": c.max_queued_requests}
        for name, value in user_config.items():
            if name not in limits:
                raise ValueError(f"user_config.{name}: not one of {sorted(limits)}")
            if int(value) < (1 if name == "max_num_seqs" else 0):
                raise ValueError(f"user_config.{name}={value}: must be at least {1 if name == 'max_num_seqs' else 0}")
            limits[name] = int(value)
        self._replicas = limits["replicas"]
        self.max_in_flight = max(limits["replicas"], 1) * limits["max_num_seqs"] + limits["max_queued_requests"]

    async def _model_info(self, name: str | None = None) -> ModelInfo:
        info = await IngressCore._model_info(self, name)  # the LLMServer's: its config says 1 when scaled in place
        return info if self._replicas is None else msgspec.structs.replace(info, replicas=self._replicas)
