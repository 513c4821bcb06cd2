"""OpenVINO GenAI's ContinuousBatchingPipeline behind a small OpenAI-compatible streaming /v1/completions.

GenAI has no HTTP server of its own, and OpenVINO Model Server is not a PyPI package, so bench/serving.py serves
the pipeline with this file, run by the openvino peer's venv python (standard library only besides OpenVINO):

    python bench/peer_openvino_server.py --model model.gguf --port 8010 --threads 2 --max-seqs 32

One thread owns the pipeline: it adds the requests the HTTP threads queue, runs pipeline.step() while any is
unfinished and hands each request its new tokens. The HTTP threads only parse, queue and write SSE. It serves
what the benchmark sends and refuses the rest with a 400 naming the field: `prompt` as token ids, `max_tokens`,
`temperature` 0 (greedy), `ignore_eos`, `stream`, `stream_options.include_usage`, `model`.
"""
from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from peer_openvino import build_properties, build_scheduler_config

KNOWN = {"prompt", "max_tokens", "temperature", "ignore_eos", "stream", "stream_options", "model"}


class Engine(threading.Thread):
    """The pipeline's only user: requests come in through `pending`, tokens go out through each one's queue."""

    def __init__(self, args):
        import openvino_genai as g

        super().__init__(daemon=True)
        cfg = {"batches": [args.max_seqs], "prompt_len": args.max_len // 2, "gen_tokens": args.max_len // 2}
        self.g, self.pending, self.next_id = g, queue.Queue(), 0
        self.pipe = g.ContinuousBatchingPipeline(args.model, build_scheduler_config(cfg), "CPU",
                                                 build_properties(args.threads))
        self.tokenizer = self.pipe.get_tokenizer()

    def submit(self, prompt: list[int], max_tokens: int, ignore_eos: bool) -> queue.Queue:
        out = queue.Queue()
        self.pending.put((prompt, max_tokens, ignore_eos, out))
        return out

    def _add(self, prompt, max_tokens, ignore_eos, out, active):
        import numpy as np
        import openvino as ov

        gc = self.g.GenerationConfig()
        gc.max_new_tokens, gc.do_sample, gc.ignore_eos = max_tokens, False, ignore_eos
        if ignore_eos:
            gc.min_new_tokens = max_tokens
        ids = ov.Tensor(np.asarray([prompt], dtype=np.int64))  # input_ids: [1, L]
        active.append((self.pipe.add_request(self.next_id, ids, gc), out))
        self.next_id += 1

    def run(self):
        active = []
        while True:
            try:  # block while idle; never while requests run
                item = self.pending.get_nowait() if active else self.pending.get()
                self._add(*item, active)
                continue  # drain the queue before the next step
            except queue.Empty:
                pass
            if self.pipe.has_non_finished_requests():
                self.pipe.step()
            for handle, out in list(active):
                if handle.can_read():
                    out.put([t for o in handle.read().values() for t in o.generated_ids])
                if handle.get_status() != self.g.GenerationStatus.RUNNING and not handle.can_read():
                    out.put(None)
                    active.remove((handle, out))


class Handler(BaseHTTPRequestHandler):
    engine: Engine

    def log_message(self, *args):  # no access log on stderr
        pass

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _bad(self, param: str, message: str) -> None:
        self._json(400, {"error": {"message": message, "type": "invalid_request_error", "param": param}})

    def do_GET(self):
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "openvino", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

    def do_POST(self):
        if self.path != "/v1/completions":
            return self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except ValueError as e:
            return self._bad("body", f"the body is not JSON: {e}")
        prompt, max_tokens = body.get("prompt"), body.get("max_tokens", 16)
        if set(body) - KNOWN:
            return self._bad(sorted(set(body) - KNOWN)[0], f"not supported here; known: {sorted(KNOWN)}")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return self._bad("prompt", "prompt must be a non-empty list of token ids")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return self._bad("max_tokens", "max_tokens must be a positive integer")
        if body.get("temperature", 1) != 0:
            return self._bad("temperature", "only temperature=0 (greedy) is served")
        if body.get("stream") is not True:
            return self._bad("stream", "only stream=true is served")
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        out = self.engine.submit(prompt, max_tokens, bool(body.get("ignore_eos")))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        rid, made, produced = f"cmpl-{id(out):x}", int(time.time()), 0
        while (ids := out.get()) is not None:
            produced += len(ids)
            text = self.engine.tokenizer.decode(ids)
            self._event({"id": rid, "object": "text_completion", "created": made, "model": "openvino",
                         "choices": [{"index": 0, "text": text, "finish_reason": None}]})
        finish = "length" if produced >= max_tokens else "stop"
        self._event({"id": rid, "object": "text_completion", "created": made, "model": "openvino",
                     "choices": [{"index": 0, "text": "", "finish_reason": finish}]})
        if usage:
            self._event({"id": rid, "object": "text_completion", "created": made, "model": "openvino",
                         "choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": produced,
                                                  "total_tokens": len(prompt) + produced}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, body: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        self.wfile.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512, help="prompt + output tokens of one request")
    args = p.parse_args()
    Handler.engine = Engine(args)
    Handler.engine.start()
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
