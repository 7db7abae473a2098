"""The stand-in's routes that report on the server: health, readiness, info, metrics.

``/health`` (and ``/health_generate``) runs a one-token generate and answers 503 while starting,
draining or past SGLang's health-check timeout; ``/ready`` (0.5.23) is the state alone. The info
routes answer as the chosen version does, old names logging their deprecation on 0.5.12+;
``/metrics`` (with ``--enable-metrics``) serves the gauges a supervisor reads.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .durations import DURATIONS
from .logline import log

if TYPE_CHECKING:
    from .server import StandinServer


def info_routes(server: StandinServer) -> list[Route]:
    profile = server.profile

    def deprecated(old: str, new: str) -> None:
        if profile.deprecated_info_routes:
            log(
                f"Endpoint '{old}' is deprecated and will be removed in a future version. "
                f"Please use '{new}' instead."
            )

    async def health(request: Request) -> Response:
        st = server.state
        if st.gracefully_exit or st.status == "Starting":
            return Response(status_code=503)
        if st.status == "UnHealthy" and profile.health_unhealthy_is_sticky:
            return Response(status_code=503)
        assert server.engine is not None
        tic = time.time()
        gen = server.engine.generate(1, 1)
        try:
            await asyncio.wait_for(anext(gen), timeout=server.seconds("health_timeout"))
        except TimeoutError:
            log(
                "Health check failed. Server couldn't get a response from detokenizer for "
                f"last {int(DURATIONS['health_timeout'])} seconds. tic start time: "
                f"{time.strftime('%H:%M:%S', time.localtime(tic))}. last_heartbeat time: "
                f"{time.strftime('%H:%M:%S', time.localtime(st.last_heartbeat))}"
            )
            st.status = "UnHealthy"
            return Response(status_code=503)
        finally:
            await gen.aclose()
        st.status = "Up"
        return Response(status_code=200)

    async def ready(request: Request) -> Response:
        ok = server.state.status == "Up" and not server.state.gracefully_exit
        return Response(status_code=200 if ok else 503)

    def model_info() -> dict[str, Any]:
        return {
            "model_path": server.args.model_path,
            "tokenizer_path": server.args.tokenizer_path or server.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }

    async def get_model_info(request: Request) -> Response:
        deprecated("/get_model_info", "/model_info")
        return JSONResponse(model_info())

    async def model_info_route(request: Request) -> Response:
        info = model_info()
        info.update(served_model_name=server.model_name, architectures=["LlamaForCausalLM"])
        return JSONResponse(info)

    def server_info() -> dict[str, Any]:
        args = {k: v for k, v in vars(server.args).items() if not k.startswith("standin_")}
        first = server.ready_infos[0] if server.ready_infos else {}
        internal: dict[str, Any] = {
            "last_gen_throughput": server.state.stats.get("last_gen_throughput", 0.0),
            "memory_usage": {
                "weight": 42.1,
                "kvcache": 70.3,
                "token_capacity": 1,
                "graph": 1.44,
            },
        }
        accept = server.state.stats.get("avg_spec_accept_length")
        if accept is not None:
            internal["avg_spec_accept_length"] = accept
        info = {
            **args,
            "max_total_num_tokens": first.get("max_total_num_tokens"),
            "max_req_input_len": first.get("max_req_input_len"),
            "internal_states": [internal],
            "version": profile.version,
        }
        if profile.version == "0.5.23":
            info.update(startup_time=server.startup_time, frontend="python")
        return info

    async def get_server_info(request: Request) -> Response:
        deprecated("/get_server_info", "/server_info")
        return JSONResponse(server_info())

    async def server_info_route(request: Request) -> Response:
        return JSONResponse(server_info())

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.model_name,
                        "object": "model",
                        "created": int(server.started_at),
                        "owned_by": "sglang",
                        "root": server.model_name,
                        "parent": None,
                        "max_model_len": server.cfg.context_length,
                    }
                ],
            }
        )

    async def ping(request: Request) -> Response:
        return Response(status_code=200)

    async def flush_cache(request: Request) -> Response:
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )

    async def metrics(request: Request) -> Response:
        stats = server.state.stats
        labels = f'model_name="{server.model_name}",engine_type="unified",tp_rank="0",pp_rank="0"'
        accept = stats.get("avg_spec_accept_length") or 0.0
        running = len(server.engine.streams) if server.engine else 0
        text = (
            "# HELP sglang:gen_throughput The generation throughput (token/s).\n"
            "# TYPE sglang:gen_throughput gauge\n"
            f"sglang:gen_throughput{{{labels}}} {stats.get('last_gen_throughput', 0.0)}\n"
            "# HELP sglang:num_running_reqs The number of running requests.\n"
            "# TYPE sglang:num_running_reqs gauge\n"
            f"sglang:num_running_reqs{{{labels}}} {running}\n"
            "# HELP sglang:spec_accept_length "
            "The average acceptance length of speculative decoding.\n"
            "# TYPE sglang:spec_accept_length gauge\n"
            f"sglang:spec_accept_length{{{labels}}} {accept}\n"
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/ping", ping, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
    ]
    if profile.at_least_0_5_12:
        routes += [
            Route("/model_info", model_info_route, methods=["GET"]),
            Route("/server_info", server_info_route, methods=["GET"]),
        ]
    if profile.version == "0.5.23":
        routes.append(Route("/ready", ready, methods=["GET"]))
    if server.args.enable_metrics:
        routes.append(Route("/metrics", metrics, methods=["GET"]))
    return routes
