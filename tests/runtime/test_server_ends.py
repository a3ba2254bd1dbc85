"""The server's request sizes at their ends, worked by hand: a chat without a limit fills the context exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rolecall.runtime.server.app import Serving
from rolecall.runtime.server.protocol import parse_chat, parse_completion


@pytest.mark.parametrize("context, prompt, limit, want", [
    (100, 10, None, 90),  # prompt + answer = the context, to the token
    (100, 98, None, 2),
    (100, 99, None, 1),
    (100, 100, None, 1),  # a full prompt still gets its one token (the prefill's)
    (2, 1, None, 1),
    (100, 10, 5, 5),  # a limit given is kept as it is
    (100, 10, 200, 200),
])
def test_a_chat_without_a_limit_may_fill_the_context_exactly(context, prompt, limit, want):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    if limit is not None:
        body["max_tokens"] = limit
    serving = Serving(SimpleNamespace(max_context=context), "m")
    request = serving.engine_request(parse_chat(body), list(range(prompt)))
    assert request.max_new_tokens == want and request.prompt == tuple(range(prompt))


def test_a_completion_without_a_limit_takes_openais_sixteen():
    serving = Serving(SimpleNamespace(max_context=1000), "m")
    assert serving.engine_request(parse_completion({"prompt": [1, 2, 3]}), [1, 2, 3]).max_new_tokens == 16
