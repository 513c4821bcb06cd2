"""The help of ServeConfig's own options that the LLMService CRD offers too; the CRD's other options are
EngineConfig's, whose help engine/config.py's option() declares.

Written once here: ServeConfig's fields (serving/config.py) and the CRD's field descriptions (operator/crd.py, row
by row of operator/serve_document.SERVE_FIELDS_FROM_SPEC) both start with it, and each side may add what holds there
only. Standard library only: the operator, installed without the engine, imports it.
"""
from __future__ import annotations

SERVE_OPTION_HELP = {
    "ranks_per_replica": "Tensor-parallel ranks (sockets) of one replica group, at most the model's KV heads; the "
                         "model's weights are sharded across them.",
    "cpus_per_rank": "Cores of each rank; its engine runs this many torch threads.",
    "max_queued_requests": "Requests allowed to wait beyond the running batches (replicas x max_num_seqs); more are "
                           "refused with HTTP 503 and Retry-After (gRPC RESOURCE_EXHAUSTED).",
    "max_queued_tokens": "Prompt tokens one replica group holds admitted but not yet prefilled; a request that would "
                         "pass it is refused with HTTP 503 and Retry-After (gRPC RESOURCE_EXHAUSTED), though an empty "
                         "queue always admits one. It bounds the time to first token. Unset: 10 s of prefill at the "
                         "measured rate (975 tokens/s per core x cores per rank x ranks per replica).",
    "grpc_port": "gRPC endpoint (cpuserve.v1.Inference).",
    "http_port": "OpenAI-compatible HTTP endpoint.",
    "metrics_port": "Prometheus endpoint of the serving metrics, served by the Ingress.",
}


def described(help: str, extra: str = "") -> str:
    """One option's description where it is offered: the shared help, then what holds there only."""
    return f"{help} {extra}" if extra else help
