"""The FastAPI application: routes, API-key check, and OpenAI-style error handling."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeserve import __version__
from pipeserve.server.chat import create_chat_completion
from pipeserve.server.completions import create_completion
from pipeserve.server.errors import APIError, error_response
from pipeserve.server.metrics import CONTENT_TYPE
from pipeserve.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from pipeserve.server.serving import ClientDisconnected, ServerState, read_json
from pipeserve.server.tokenize import detokenize, tokenize

logger = logging.getLogger(__name__)

# A scrape must not hang behind a stuck engine: past this, /metrics shows the last snapshot.
_STATS_TIMEOUT_S = 5.0


def build_app(state: ServerState, api_key: str | None = None, allowed_origins: list[str] | None = None) -> FastAPI:
    """The app for one engine. Shutting the app down (lifespan end) shuts the engine down.
    ``allowed_origins``: web pages' origins that browsers may let call the API (CORS; ``*``: any);
    none by default, so a page on another origin cannot use a server on the user's machine."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="pipeserve", version=__version__, lifespan=lifespan)
    app.state.server = state
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_credentials=False,
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
    _add_error_handlers(app, state)
    app.include_router(_open_routes(state))
    app.include_router(_v1_routes(state), prefix="/v1", dependencies=[Depends(_key_check(api_key))])
    app.include_router(_tokenizer_routes(state), dependencies=[Depends(_key_check(api_key))])
    return app


def _key_check(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
    return check


def _open_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        state.check_healthy(admitting=False)
        return JSONResponse({"status": "ok"})

    @router.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @router.get("/metrics")
    async def metrics() -> Response:
        await _refresh_metrics(state)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return router


async def _refresh_metrics(state: ServerState) -> None:
    stats = state.metrics.engine.snapshot
    if state.engine.healthy:
        try:
            stats = await asyncio.wait_for(state.engine.stats(), _STATS_TIMEOUT_S)
        except Exception as exc:  # stale figures beat a failed scrape
            logger.warning("engine stats unavailable: %s", exc)
    state.metrics.update(stats, num_server_requests=state.engine.num_requests, healthy=state.engine.healthy)


def _v1_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": state.created, "owned_by": "pipeserve",
            "root": state.model_path, "parent": None, "max_model_len": state.max_model_len}
            for name in state.model_names]}

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        body = parse_request(CompletionRequest, await read_json(request, state.max_body_bytes))
        return await create_completion(state, body, request)

    @router.post("/chat/completions")
    async def chat(request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await read_json(request, state.max_body_bytes))
        return await create_chat_completion(state, body, request)

    return router


def _tokenizer_routes(state: ServerState) -> APIRouter:
    """vLLM's ``/tokenize`` and ``/detokenize`` (at the root, as there; behind the API key here)."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        return tokenize(state, await read_json(request, state.max_body_bytes))

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        return detokenize(state, await read_json(request, state.max_body_bytes))

    return router


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    def respond(status: int, message: str, **kw) -> JSONResponse:
        state.metrics.count_error(status)
        return error_response(status, message, **kw)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(exc.status, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) \
            else str(exc.detail)
        return respond(exc.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(400, str(exc))

    @app.exception_handler(ClientDisconnected)
    async def disconnected(request: Request, exc: ClientDisconnected) -> Response:
        # Nobody reads this: the client is gone, and its requests were aborted.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return respond(500, f"internal error: {type(exc).__name__}: {exc}")
