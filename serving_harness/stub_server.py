"""A stand-in OpenAI completions endpoint for measuring the harness itself (not vLLM).

It streams ``max_tokens`` server-sent events per request, ``token_delay_ms`` apart, then a usage
chunk and ``[DONE]``, like vLLM's ``/v1/completions`` with ``stream_options.include_usage``; it
also answers ``/health`` and ``/metrics``. The load-generator overhead benchmark and the load
generator's unit tests use it; nothing here counts as a measurement of vLLM.

    python -m serving_harness.stub_server --port 8100 --token-delay-ms 1
"""

from __future__ import annotations

import argparse
import asyncio
import json

METRICS_TEXT = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="stub"} %d\n'
    'vllm:num_requests_waiting{engine="0",model_name="stub"} 0.0\n'
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n'
)


def make_app(token_delay_ms: float = 0.0):
    from aiohttp import web

    state = {"running": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n_out, n_in = int(body["max_tokens"]), len(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        state["running"] += 1
        try:
            for i in range(n_out):
                if token_delay_ms:
                    await asyncio.sleep(token_delay_ms / 1000.0)
                choice = {"index": 0, "text": f" w{i + 3}", "finish_reason": "length" if i == n_out - 1 else None}
                await resp.write(b"data: " + json.dumps({"model": body["model"], "choices": [choice]}).encode()
                                 + b"\n\n")
            usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        finally:
            state["running"] -= 1
        return resp

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS_TEXT % state["running"])

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/metrics", metrics),
                    web.get("/health", health)])
    return app


def main() -> None:
    from aiohttp import web

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    web.run_app(make_app(args.token_delay_ms), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
