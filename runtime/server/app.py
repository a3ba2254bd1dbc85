"""The HTTP side: a FastAPI app that turns OpenAI requests into scheduler requests and scheduler events into
OpenAI responses (whole, or streamed as server-sent events).

Every refusal is OpenAI's error object naming the field: 400 for a bad request (FastAPI's own 422 included),
404 for another model's name or an unknown path, 503 while the server drains, 500 for a failure of ours, after
which the server goes on serving. A client that goes away mid-request has its request cancelled.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from rolecall.runtime.engine.scheduler import Event, RequestError, SchedulerClosed
from rolecall.runtime.engine.scheduler import Request as EngineRequest
from rolecall.runtime.server import metrics
from rolecall.runtime.server.protocol import (
    FINISH_REASONS,
    Params,
    ProtocolError,
    StopText,
    chunk,
    error_body,
    parse_chat,
    parse_completion,
    response,
    sse,
    usage,
    usage_chunk,
)

DISCONNECT_POLL_S = 0.5  # how often a waiting whole-answer request looks whether its client is still there
ENDPOINTS = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"


class Serving:
    """What the app serves (``app.state.serving``): the scheduler, the model's name and tokenizer, whether the
    server drains, and the server's own counters (touched on the event loop only)."""

    def __init__(self, scheduler: Any, model_name: str, tokenizer: Any = None) -> None:
        self.scheduler, self.model_name, self.tokenizer = scheduler, model_name, tokenizer
        self.draining = False
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.finished: Counter[str] = Counter()

    def check_open(self) -> None:
        if self.draining:
            raise ProtocolError("the server is shutting down and takes no new requests", status=503,
                                type="server_error")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ProtocolError(f"the model {name!r} does not exist here; this server serves {self.model_name!r}",
                                "model", status=404, code="model_not_found")

    def prompt_ids(self, params: Params) -> list[int]:
        """The request's prompt as token ids: ids as given, text through the tokenizer, chat turns through the
        tokenizer's chat template with the assistant's turn opened."""
        tok = self.tokenizer
        if params.messages is not None:
            if tok is None or tok.chat_template is None:
                what, send = (("no tokenizer", "token ids") if tok is None else
                              ("a tokenizer without a chat template (a base model)", "text or token ids"))
                raise ProtocolError(f"chat needs a chat template and this server has {what}; send {send} to "
                                    "/v1/completions", "messages")
            from jinja2 import TemplateError

            try:
                out = tok.apply_chat_template(params.messages, add_generation_prompt=True, return_dict=True)
            except TemplateError as e:
                raise ProtocolError(f"the chat template refused the messages: {e}", "messages") from None
            return list(out["input_ids"])
        if isinstance(params.prompt, str):
            if tok is None:
                raise ProtocolError("this server has no tokenizer; send the prompt as a list of token ids", "prompt")
            return list(tok(params.prompt)["input_ids"])
        return list(params.prompt)

    def engine_request(self, params: Params, ids: list[int]) -> EngineRequest:
        """The scheduler's request; chat without a limit may fill the context."""
        limit = params.max_tokens
        if limit is None:
            limit = max(1, self.scheduler.max_context - len(ids))
        return EngineRequest(tuple(ids), limit, params.sampling(secrets.randbits(32)), params.stop, params.ignore_eos)

    def submit(self, request: EngineRequest, chat: bool) -> tuple[int, asyncio.Queue[Event]]:
        """Hand ``request`` to the scheduler; its events arrive on the returned queue, on this event loop."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:  # the scheduler's thread: hand over, never block
            loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            rid = self.scheduler.submit(request, emit)
        except RequestError as e:
            field = "messages" if chat and e.field == "prompt" else e.field
            raise ProtocolError(str(e), field) from None
        except SchedulerClosed as e:
            raise ProtocolError(str(e), status=503, type="server_error") from None
        self.prompt_tokens += len(request.prompt)
        return rid, events

    def ended(self, event: Event) -> None:
        """Count a finished request under its OpenAI finish reason (``cancelled`` and ``error`` as they are)."""
        self.finished[FINISH_REASONS.get(event.finish_reason, event.finish_reason)] += 1


def failure(event: Event) -> ProtocolError | None:
    """The error a request that ended without an answer gets: the engine failed (500), the server stopped (503)."""
    if event.finish_reason == "error":
        return ProtocolError(f"the engine failed on this request: {event.error}", status=500, type="server_error")
    if event.finish_reason not in FINISH_REASONS:
        return ProtocolError("the server stopped before this request finished", status=503, type="server_error")
    return None


async def answer(serving: Serving, http: Request, params: Params, chat: bool) -> Response:
    """Run one request: the whole answer as JSON, or its stream."""
    serving.check_model(params.model)
    ids = serving.prompt_ids(params)
    rid, events = serving.submit(serving.engine_request(params, ids), chat)
    head = (f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), serving.model_name)
    if params.stream:
        return StreamingResponse(stream(serving, rid, events, params, chat, head), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text, tokens, last = StopText(params.stop), [], None
    parts: list[str] = []
    try:
        while last is None:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    return Response(status_code=499)  # nobody reads it; the request is cancelled below
                continue
            tokens.extend(event.token_ids)
            parts.append(text.feed(event.text, final=event.finish_reason is not None))
            if event.finish_reason is not None:
                last = event
                serving.ended(event)
    finally:
        if last is None:
            serving.scheduler.cancel(rid)
    error = failure(last)
    if error is not None:
        raise error
    return JSONResponse(response(chat, *head, "".join(parts), FINISH_REASONS[last.finish_reason],
                                 usage(last.prompt_tokens, last.completion_tokens),
                                 tokens if params.return_token_ids else None))


async def stream(serving: Serving, rid: int, events: asyncio.Queue[Event], params: Params, chat: bool,
                 head: tuple[str, int, str]) -> AsyncIterator[str]:
    """The server-sent events of one request: chunks of new text, the closing chunk with ``finish_reason``, the
    usage chunk when asked for, then ``[DONE]``. A failure after the stream began is an error event. When the
    client goes away (the task is cancelled) the request is cancelled."""
    text, ended = StopText(params.stop), False
    extra = {"include_usage": params.include_usage}
    try:
        if chat:
            yield sse(chunk(chat, *head, "", role=True, **extra))
        while not ended:
            event = await events.get()
            ended = event.finish_reason is not None
            if ended:
                serving.ended(event)
                error = failure(event)
                if error is not None:
                    yield sse(error.body())
                    break
            new = text.feed(event.text, final=ended)
            reason = FINISH_REASONS[event.finish_reason] if ended else None
            ids = event.token_ids if params.return_token_ids else None
            if new or reason or ids:
                yield sse(chunk(chat, *head, None if chat and ended and not new else new, reason, token_ids=ids,
                                **extra))
            if ended and params.include_usage:
                yield sse(usage_chunk(chat, *head, usage(event.prompt_tokens, event.completion_tokens)))
        yield sse("[DONE]")
    except Exception as e:  # noqa: BLE001 - the status line is sent: the failure goes to the client as an event
        yield sse(error_body(f"the server failed on this request ({type(e).__name__}: {e})", type="server_error"))
        yield sse("[DONE]")
    finally:
        if not ended:
            serving.scheduler.cancel(rid)


async def body_of(http: Request) -> Any:
    try:
        return json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"the request body is not JSON: {e}") from None


def _answer_errors_as_json(app: FastAPI) -> None:
    """Every refusal and failure as an OpenAI-style JSON error: a request the protocol refuses (400 naming the
    field, or 503 while draining), a body the schema refuses (400 naming the field), an unknown endpoint or method
    (404, 405, naming the endpoints there are), and anything else (500; the server goes on serving)."""

    @app.exception_handler(ProtocolError)
    async def refused(_: Request, e: ProtocolError) -> JSONResponse:
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = (e.errors() or [{}])[0]
        loc = list(first.get("loc", ()))
        where = [str(part) for part in (loc[1:] if loc[:1] in (["body"], ["query"], ["path"], ["header"]) else loc)]
        return JSONResponse(error_body(f"{'.'.join(where) or 'the body'}: {first.get('msg', 'invalid')}",
                                       where[0] if where else None), 400)

    @app.exception_handler(HTTPException)
    async def http_error(http: Request, e: HTTPException) -> JSONResponse:
        message = {404: f"{http.url.path}: no such endpoint; this server has {ENDPOINTS}",
                   405: f"{http.method} {http.url.path}: not allowed; this server has {ENDPOINTS}"}
        return JSONResponse(error_body(message.get(e.status_code, str(e.detail))), e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def crashed(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"the server failed on this request ({type(e).__name__}); it goes on "
                                       "serving", type="server_error"), 500)


def create_app(scheduler: Any, *, model_name: str, tokenizer: Any = None) -> FastAPI:
    """The OpenAI-compatible app on ``scheduler`` (a :class:`rolecall.runtime.engine.scheduler.Scheduler`: ``submit``,
    ``cancel``, ``stats``, ``max_context``), answering to ``model_name``; ``tokenizer`` turns text prompts and chat
    turns into ids (without one, prompts must be token ids and chat is refused). ``app.state.serving`` is the
    :class:`Serving`; set its ``draining`` to answer 503 to new requests and to ``/health``."""
    serving = Serving(scheduler, model_name, tokenizer)
    app = FastAPI(title="rolecall", description="OpenAI-compatible completions on rolecall's engine")
    app.state.serving = serving

    _answer_errors_as_json(app)

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        serving.check_open()
        return await answer(serving, http, parse_completion(await body_of(http)), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        serving.check_open()
        return await answer(serving, http, parse_chat(await body_of(http)), chat=True)

    def card() -> dict[str, Any]:
        return {"id": serving.model_name, "object": "model", "created": serving.created, "owned_by": "rolecall",
                "max_model_len": scheduler.max_context}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        serving.check_model(name)
        return card()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        if serving.draining:
            return PlainTextResponse("draining", 503)
        if scheduler.failure:
            return PlainTextResponse(f"the engine stopped: {scheduler.failure}", 503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        text = metrics.exposition(scheduler.stats(), serving.prompt_tokens, serving.finished, serving.draining)
        return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)

    return app


__all__ = ["Serving", "create_app"]
