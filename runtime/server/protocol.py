"""The OpenAI wire format, as pure functions: request bodies checked into :class:`Params`, response and chunk
bodies built, errors shaped as OpenAI's. Nothing here knows HTTP or the scheduler.

A body that is wrong raises :class:`ProtocolError` naming the offending field (``param``), the value and what the
field takes, in one line. Fields this server does not implement are refused where they would change the answer
(``echo``, ``logprobs``, penalties, ``n`` > 1, ...) and ignored where they would not (``user``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rolecall.runtime.engine.sampling import M32, Sampling

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat fills what is left of the context

# Fields that would change the answer and are not implemented: refused unless they hold their default.
UNSUPPORTED = ("echo", "logprobs", "top_logprobs", "best_of", "suffix", "frequency_penalty", "presence_penalty",
               "logit_bias", "tools", "tool_choice", "functions", "function_call", "response_format")
DEFAULTS: tuple[Any, ...] = (None, False, 0, 0.0, "", [], {}, "none", "auto")


class ProtocolError(Exception):
    """A request refused with HTTP ``status``: the OpenAI error ``type``, the request field ``param`` (or None),
    ``code`` (or None) and a one-line message."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.type, self.code = param, status, type, code

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.param, self.type, self.code)


def error_body(message: str, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class Params:
    """A checked completion or chat request. ``prompt``: text or token ids (completions), ``messages``: the chat
    turns, each ``{"role", "content"}`` with text content (chat); ``max_tokens`` None means "what fits the context"
    (chat's default). ``temperature`` 0 is greedy; ``seed`` None lets the server draw one for each sampled request."""

    model: str | None
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int | None = COMPLETION_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    return_token_ids: bool = False

    def sampling(self, seed: int) -> Sampling:
        """The engine's sampling for this request; ``seed`` is used where the request gave none."""
        if self.temperature == 0:
            return Sampling()
        return Sampling(True, float(self.temperature), self.top_k, float(self.top_p),
                        self.seed if self.seed is not None else seed)


def parse_completion(body: Any) -> Params:
    """A ``/v1/completions`` body checked (:class:`ProtocolError` naming the field)."""
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ProtocolError(f"prompt holds {len(prompt)} prompts; this server takes one prompt per request (a "
                            "string or a list of token ids): send them as separate requests", "prompt")
    elif not isinstance(prompt, str):
        raise ProtocolError(f"prompt must be a string or a non-empty list of token ids, got {_shown(prompt)}",
                            "prompt")
    return _params(body, prompt=prompt, max_tokens=_count(body, "max_tokens", COMPLETION_MAX_TOKENS))


def parse_chat(body: Any) -> Params:
    """A ``/v1/chat/completions`` body checked (:class:`ProtocolError` naming the field). ``max_completion_tokens``
    (the newer name) wins over ``max_tokens``; without either, the answer may fill the context."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError(f"messages must be a non-empty list of {{\"role\", \"content\"}} objects, got "
                            f"{_shown(messages)}", "messages")
    turns = [_message(m, i) for i, m in enumerate(messages)]
    limit = _count(body, "max_completion_tokens", None)
    return _params(body, messages=turns, max_tokens=limit if limit is not None else _count(body, "max_tokens", None))


def _params(body: dict[str, Any], **fields: Any) -> Params:
    """The fields completions and chat share."""
    for name in UNSUPPORTED:
        value = body.get(name)
        if value not in DEFAULTS and not (name == "best_of" and value == 1):
            raise ProtocolError(f"{name} is not supported by this server; leave it out", name)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise ProtocolError(f"n must be 1 (one choice per request), got {_shown(n)}", "n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError(f"model must be a string, got {_shown(model)}", "model")
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise ProtocolError(f"temperature must be in [0, 2] (0 is greedy), got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ProtocolError(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise ProtocolError(f"top_k must be an integer ≥ 0 (0 or -1: off), got {_shown(top_k)}", "top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= M32):
        raise ProtocolError(f"seed must be an integer in [0, 2**32), got {_shown(seed)}", "seed")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise ProtocolError("stream_options is only allowed with stream: true", "stream_options")
    if options is not None and not isinstance(options, dict):
        raise ProtocolError(f"stream_options must be an object, got {_shown(options)}", "stream_options")
    include_usage = _flag(options or {}, "include_usage", "stream_options.include_usage")
    return Params(model=model, temperature=float(temperature), top_p=float(top_p), top_k=max(top_k or 0, 0),
                  seed=seed, stop=_stop(body.get("stop")), stream=stream, include_usage=include_usage,
                  ignore_eos=_flag(body, "ignore_eos"), return_token_ids=_flag(body, "return_token_ids"), **fields)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {_shown(body)}")
    return body


def _message(message: Any, i: int) -> dict[str, str]:
    """A chat turn as ``{"role", "content"}`` with text content (a list of text parts is joined)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ProtocolError(f"{where} must be an object with a string role, got {_shown(message)}", "messages")
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ProtocolError(f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                "supported", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ProtocolError(f"{where}.content must be a string or a list of text parts, got {_shown(content)}",
                            "messages")
    return {"role": message["role"], "content": content}


def _stop(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ProtocolError(f"stop must be a non-empty string or a list of them, got {_shown(stop)}", "stop")
    return tuple(stops)


def _count(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or value < 1:
        raise ProtocolError(f"{name} must be an integer ≥ 1, got {_shown(value)}", name)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{name} must be a number, got {_shown(value)}", name)
    return value


def _flag(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ProtocolError(f"{param or name} must be true or false, got {_shown(value)}", param or name)
    return bool(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any, most: int = 60) -> str:
    """A value as the client sent it (JSON), cut to ``most`` characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= most else text[:most - 1] + "…"


# -- responses -----------------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(chat: bool, id: str, created: int, model: str, text: str, finish_reason: str,
             usage: dict[str, int], token_ids: list[int] | None = None) -> dict[str, Any]:
    """A whole answer: ``text_completion`` or ``chat.completion`` with one choice and its ``usage``;
    ``token_ids`` (the ``return_token_ids`` extension) goes into the choice when given."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage}


def chunk(chat: bool, id: str, created: int, model: str, text: str | None, finish_reason: str | None = None,
          *, role: bool = False, token_ids: list[int] | None = None, include_usage: bool = False) -> dict[str, Any]:
    """One streamed piece: new ``text`` (None: no text field, for chat's closing ``delta: {}``), ``finish_reason``
    on the last; chat's first chunk carries the ``role``. With ``include_usage`` the chunk says ``usage: null``
    (the usage comes in :func:`usage_chunk`)."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk(chat: bool, id: str, created: int, model: str, usage: dict[str, int]) -> dict[str, Any]:
    """The closing chunk of a stream with ``stream_options.include_usage``: no choices, the request's usage."""
    return {"id": id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage}


def sse(body: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` (or the literal ``[DONE]``) and a blank line."""
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


class StopText:
    """The answer's text as it streams, ending before its first stop string (OpenAI leaves the stop string out;
    the scheduler keeps it, and may end a little after it, at a token boundary). :meth:`feed` returns the text
    that can be sent now: the tail that might still begin a stop string is held back until more text shows
    whether it does, or the answer ends."""

    def __init__(self, stops: tuple[str, ...] | list[str] = ()) -> None:
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.held = ""
        self.stopped = False

    def feed(self, text: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        self.held += text
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.held = self.held[:min(hits)], ""
            return out
        keep = 0 if final else min(self.hold, len(self.held))
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out


FINISH_REASONS = {"stop": "stop", "eos": "stop", "length": "length"}  # the scheduler's, as OpenAI names them


__all__ = ["COMPLETION_MAX_TOKENS", "FINISH_REASONS", "Params", "ProtocolError", "StopText", "chunk", "error_body",
           "parse_chat", "parse_completion", "response", "sse", "usage", "usage_chunk"]
