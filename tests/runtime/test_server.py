"""``rolecall serve``: the OpenAI wire format as pure functions, the app on a scripted scheduler (errors, streams,
disconnects, draining), and the real command on a tiny model, talked to with the official ``openai`` client and
held token for token against :func:`rolecall.runtime.engine.generate`."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rolecall.runtime.engine.sampling import Sampling
from rolecall.runtime.server.metrics import exposition
from rolecall.runtime.server.protocol import (
    Params,
    ProtocolError,
    StopText,
    chunk,
    parse_chat,
    parse_completion,
    response,
    sse,
    usage,
)

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

CONTEXT = 512  # the cache a CPU decodes quickly
SLOTS = 4


# -- the wire format -------------------------------------------------------------------------------------------
def test_a_completion_body_with_defaults():
    assert parse_completion({"model": "m", "prompt": "hi"}) == Params(model="m", prompt="hi", max_tokens=16)
    p = parse_completion({"prompt": [3, 1, 2], "max_tokens": 5, "temperature": 0, "stop": "\n", "stream": True,
                          "stream_options": {"include_usage": True}, "ignore_eos": True, "n": 1, "user": "u"})
    assert p == Params(model=None, prompt=[3, 1, 2], max_tokens=5, temperature=0.0, stop=("\n",), stream=True,
                       include_usage=True, ignore_eos=True)
    assert p.sampling(seed=9) == Sampling()  # temperature 0: greedy, the seed unused


def test_sampling_takes_the_requests_seed_or_the_servers():
    p = parse_completion({"prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 40})
    assert p.sampling(seed=7) == Sampling(True, 0.5, 40, 0.9, 7)
    assert parse_completion({"prompt": "x", "seed": 3, "top_k": -1}).sampling(seed=7) == Sampling(True, 1.0, 0, 1.0, 3)


def test_a_chat_body():
    p = parse_chat({"messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
                    "max_tokens": 4, "max_completion_tokens": 9})
    assert p.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert p.max_tokens == 9  # the newer name wins
    assert parse_chat({"messages": [{"role": "user", "content": "a"}]}).max_tokens is None  # what fits the context


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be an integer ≥ 1, got 0"),
    ({"prompt": "x", "max_tokens": "abc"}, "max_tokens", 'got "abc"'),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "got true"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", 'temperature must be a number, got "hot"'),
    ({"prompt": "x", "temperature": 2.5}, "temperature", "in [0, 2]"),
    ({"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "x", "seed": -1}, "seed", "[0, 2**32)"),
    ({"prompt": "x", "n": 2}, "n", "n must be 1"),
    ({"prompt": ["a", "b"]}, "prompt", "holds 2 prompts"),
    ({"prompt": []}, "prompt", "non-empty list of token ids"),
    ({"prompt": None}, "prompt", "got null"),
    ({"prompt": "x", "stop": [""]}, "stop", "non-empty string"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ({"prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ({"prompt": "x", "echo": True}, "echo", "not supported"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": "x", "model": 3}, "model", "must be a string"),
])
def test_a_bad_completion_body_names_the_field(body, param, says):
    with pytest.raises(ProtocolError) as e:
        parse_completion(body)
    assert e.value.param == param and e.value.status == 400 and says in str(e.value)
    assert e.value.body() == {"error": {"message": str(e.value), "type": "invalid_request_error", "param": param,
                                        "code": None}}


@pytest.mark.parametrize("body, says", [
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"content": "x"}]}, "messages[0] must be an object with a string role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
])
def test_a_bad_chat_body_names_messages(body, says):
    with pytest.raises(ProtocolError) as e:
        parse_chat(body)
    assert e.value.param == "messages" and says in str(e.value)


def test_response_and_chunk_shapes():
    assert response(False, "cmpl-1", 5, "m", "hi", "stop", usage(3, 2)) == {
        "id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "stop", "text": "hi"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    assert response(True, "c", 5, "m", "hi", "length", usage(1, 1), [4, 2])["choices"] == [
        {"index": 0, "logprobs": None, "finish_reason": "length", "message": {"role": "assistant", "content": "hi"},
         "token_ids": [4, 2]}]
    assert chunk(True, "c", 5, "m", "", role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunk(True, "c", 5, "m", None, "stop")["choices"][0] == {"index": 0, "logprobs": None,
                                                                    "finish_reason": "stop", "delta": {}}
    assert chunk(False, "c", 5, "m", "x", include_usage=True)["usage"] is None
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n' and sse("[DONE]") == "data: [DONE]\n\n"


def _fed(stops, pieces):
    text = StopText(stops)
    return [text.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]


def test_stop_text_leaves_the_stop_string_out_and_holds_back_only_what_could_begin_one():
    assert _fed((), ["ab", "cd", ""]) == ["ab", "cd", ""]
    assert _fed(("\n\n",), ["ab\n", "\ncd", ""]) == ["ab", "", ""]  # the stop spans two pieces
    assert _fed(("\n\n",), ["ab\n", "c", "d"]) == ["ab", "\n", "cd"]  # a held newline that began no stop
    assert _fed(("END", "x"), ["aEN", "Dxb", ""]) == ["a", "", ""]  # the earliest of two stops wins
    assert _fed(("END", "x"), ["axEND"]) == ["a"]


def test_stop_text_over_every_split():
    """Fed in any pieces, the text sent is the text up to its first stop string (all of it without one)."""
    for text in ("one two\n\nthree", "no stop here", "END at once", "xx\n\n"):
        want = text[:min([i for i in (text.find(s) for s in ("\n\n", "END")) if i >= 0], default=len(text))]
        for a in range(len(text) + 1):
            for b in range(a, len(text) + 1):
                assert "".join(_fed(("\n\n", "END"), [text[:a], text[a:b], text[b:]])) == want, (text, a, b)


def test_metrics_exposition():
    stats = {"running": 2, "waiting": 1, "slots": 4, "slots_in_use": 2, "kv_bytes": 1024, "kv_pages_total": 64,
             "kv_pages_used": 5, "preemptions": 3, "generated_tokens": 17,
             "tokens_per_s": 12.5, "prefill_seconds": 0.25, "prefill_tokens": 30, "decode_seconds": 1.5,
             "decode_steps": 16}
    text = exposition(stats, 30, {"stop": 2, "length": 1}, draining=False)
    assert "# HELP rolecall_requests_running Requests in a slot, generating.\n# TYPE rolecall_requests_running gauge\n" \
           "rolecall_requests_running 2\n" in text
    assert parse_metrics(text) == {"rolecall_requests_running": 2, "rolecall_requests_waiting": 1, "rolecall_slots": 4,
                                   "rolecall_slots_in_use": 2, "rolecall_kv_cache_bytes": 1024,
                                   "rolecall_kv_pages_total": 64, "rolecall_kv_pages_used": 5,
                                   "rolecall_preemptions_total": 3,
                                   "rolecall_generated_tokens_total": 17, "rolecall_tokens_per_second": 12.5,
                                   "rolecall_prefill_seconds_total": 0.25, "rolecall_prefill_tokens_total": 30,
                                   "rolecall_decode_seconds_total": 1.5, "rolecall_decode_steps_total": 16,
                                   "rolecall_prompt_tokens_total": 30, 'rolecall_requests_total{finish_reason="length"}': 1,
                                   'rolecall_requests_total{finish_reason="stop"}': 2, "rolecall_draining": 0}
    assert "# TYPE rolecall_generated_tokens_total counter" in text and text.endswith("rolecall_draining 0\n")


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus' text format, strictly: every sample named by a HELP and a TYPE line before it."""
    samples, described = {}, set()
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            described.add(line.split()[2])
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        assert match[1].split("{")[0] in described, line
        value = float(match[2])
        samples[match[1]] = int(value) if value.is_integer() else value
    return samples


# -- the app on a scripted scheduler -----------------------------------------------------------------------------
class ScriptedScheduler:
    """The scheduler's API, answering from a script: a prompt's first id says what happens. 1: each of
    ``max_new_tokens`` tokens is the letter a, b, c, ... at once; 2: nothing until cancelled; 3: the engine fails;
    4: ``submit`` raises a bug of ours. Prompts longer than 8 ids are refused as past the context."""

    max_context = 8
    failure = None

    def __init__(self) -> None:
        self.cancelled: list[int] = []
        self.ids = iter(range(1, 1 << 30))

    def submit(self, request, emit):
        from rolecall.runtime.engine.scheduler import Event, RequestError

        prompt = list(request.prompt)
        if len(prompt) + request.max_new_tokens > self.max_context:
            raise RequestError("prompt", f"{len(prompt)} + {request.max_new_tokens} > {self.max_context}")
        if prompt[0] == 4:
            raise KeyError("a bug")
        rid = next(self.ids)
        if prompt[0] == 1:
            for i in range(request.max_new_tokens):
                emit(Event([i], chr(97 + i), None, len(prompt), i + 1))
            emit(Event([], "", "length", len(prompt), request.max_new_tokens))
        if prompt[0] == 3:
            emit(Event([], "", "error", len(prompt), 0, error="RuntimeError: the GPU fell off"))
        return rid

    def cancel(self, rid):
        self.cancelled.append(rid)

    def stats(self):
        return {"running": 0, "waiting": 0, "slots": 1, "slots_in_use": 0, "kv_bytes": 0, "kv_pages_total": 0,
                "kv_pages_used": 0, "preemptions": 0, "generated_tokens": 0, "tokens_per_s": 0.0}


@pytest.fixture(scope="module")
def scripted():
    """The app on a :class:`ScriptedScheduler` without a tokenizer, served by uvicorn in a thread."""
    import uvicorn

    from rolecall.runtime.server import bind, create_app

    scheduler = ScriptedScheduler()
    app = create_app(scheduler, model_name="scripted")

    @app.get("/typed")
    def typed(n: int) -> int:  # FastAPI checks n: its 422 must come out as OpenAI's 400
        return n + 1

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield app, scheduler, sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def call(port: int, method: str, path: str, body=None, read=True):
    """``(status, text)`` of one request; ``body`` a dict (sent as JSON) or bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    reply = conn.getresponse()
    status, text = reply.status, reply.read().decode()
    conn.close()
    return status, text


def error_of(text: str) -> dict:
    return json.loads(text)["error"]


def test_scripted_answers_whole_and_streamed(scripted):
    _, _, port = scripted
    status, text = call(port, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 3, "return_token_ids": True})
    body = json.loads(text)
    assert status == 200 and body["choices"][0]["text"] == "abc" and body["choices"][0]["token_ids"] == [0, 1, 2]
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
    status, text = call(port, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 3, "stream": True, "stop": "c"})
    events = [line[6:] for line in text.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    pieces = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(p["text"] for p in pieces) == "ab" and pieces[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("method, path, body, status, param, says", [
    ("POST", "/v1/completions", {"prompt": [1], "max_tokens": 9}, 400, "prompt", "1 + 9 > 8"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "messages",
     "this server has no tokenizer"),
    ("POST", "/v1/completions", {"prompt": "text"}, 400, "prompt", "send the prompt as a list of token ids"),
    ("POST", "/v1/completions", {"prompt": [1], "max_tokens": 1, "model": "gpt-4"}, 404, "model", "serves 'scripted'"),
    ("POST", "/v1/completions", b"{not json", 400, None, "not JSON"),
    ("POST", "/v1/completions", {"prompt": [3], "max_tokens": 1}, 500, None, "the GPU fell off"),
    ("POST", "/v1/completions", {"prompt": [4], "max_tokens": 1}, 500, None, "the server failed on this request (KeyError)"),
    ("GET", "/typed?n=abc", None, 400, "n", "n: Input should be a valid integer"),
    ("GET", "/v2/nothing", None, 404, None, "/v2/nothing: no such endpoint"),
    ("GET", "/v1/completions", None, 405, None, "GET /v1/completions: not allowed"),
])
def test_scripted_refusals_are_openai_errors(scripted, method, path, body, status, param, says):
    _, _, port = scripted
    got, text = call(port, method, path, body)
    error = error_of(text)
    assert got == status and error["param"] == param and says in error["message"], text
    assert "Traceback" not in text and call(port, "GET", "/health") == (200, "ok")


def test_scripted_stream_that_fails_ends_with_an_error_event(scripted):
    _, _, port = scripted
    status, text = call(port, "POST", "/v1/completions", {"prompt": [3], "max_tokens": 1, "stream": True})
    events = [line[6:] for line in text.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]" and "the GPU fell off" in error_of(events[-2])["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_cancels_its_request(scripted, stream):
    _, scheduler, port = scripted
    before = list(scheduler.cancelled)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [2], "max_tokens": 1, "stream": stream}), headers={"Content-Type": "application/json"})
    if stream:
        assert conn.getresponse().status == 200  # the stream has begun
    else:
        time.sleep(0.2)
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 10
    while len(scheduler.cancelled) == len(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(scheduler.cancelled) == len(before) + 1


def test_draining_answers_503(scripted):
    app, _, port = scripted
    app.state.serving.draining = True
    try:
        assert call(port, "GET", "/health") == (503, "draining")
        status, text = call(port, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 1})
        assert status == 503 and error_of(text)["type"] == "server_error" and "shutting down" in text
    finally:
        app.state.serving.draining = False
    assert call(port, "GET", "/health") == (200, "ok")


# -- the command on a tiny model ---------------------------------------------------------------------------------
def start(folder, *extra: str, model=None) -> tuple[subprocess.Popen, int, str]:
    """``rolecall serve`` on ``model`` (default ``folder``, where its stderr goes) on a free port; returns the
    process, its port and its ready line."""
    code = "import sys\nfrom rolecall.cli import main\nsys.exit(main())"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a tiny model decodes fastest on one thread
    argv = [sys.executable, "-c", code, "serve", "--model", str(model or folder), "--policy", "full", "--device", "cpu",
            "--port", "0", "--slots", str(SLOTS), "--max-context", str(CONTEXT), "--served-model-name", "tiny", *extra]
    with open(folder / "stderr.txt", "a") as err:  # the process keeps its own copy of the file
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    timer = threading.Timer(180, proc.kill)  # a server that never says it is ready fails the test, not the run
    timer.start()
    line = proc.stdout.readline()
    timer.cancel()
    match = re.search(r"http://127\.0\.0\.1:(\d+) ", line)
    assert match, f"no ready line: {line!r}; stderr: {(folder / 'stderr.txt').read_text()[-2000:]}"
    return proc, int(match[1]), line.strip()


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    """The tiny model's folder, and the engine's own greedy answer for prompt ids."""
    from rolecall.core.models import load_model, load_tokenizer
    from rolecall.runtime.engine import Weights, generate
    from rolecall.runtime.session import bound_policy
    from tests.tiny import tiny_folder

    folder = tiny_folder(tmp_path_factory.mktemp("tiny"))
    model = load_model(str(folder), dtype="float32")
    weights = Weights.from_model(model, positions=CONTEXT)
    policy = bound_policy("full", None, model.config)
    tokenizer = load_tokenizer(str(folder))
    eos = model.generation_config.eos_token_id

    def engine(ids: list[int], n: int, ignore_eos: bool = False) -> tuple[list[int], str]:
        out = generate(weights, policy, [ids], max_new_tokens=n, eos_token_id=None if ignore_eos else eos,
                       pad_token_id=tokenizer.pad_token_id)
        return out.tokens[0], {"eos": "stop"}.get(out.finish[0], out.finish[0])

    return folder, tokenizer, engine


@pytest.fixture(scope="module")
def served(tiny):
    folder, tokenizer, engine = tiny
    proc, port, line = start(folder)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    yield client, port, line
    assert stop(proc) == 0


def test_the_ready_line(served):
    _, port, line = served
    pages = SLOTS * -(-CONTEXT // 16)  # the rows' pages at the full context: the pool's cap
    assert line == (f"rolecall serve: tiny with policy full on http://127.0.0.1:{port} ({SLOTS} slots, context {CONTEXT}"
                    f", KV in {pages:,} pages of 16 tokens)")


def test_health_and_models(served):
    client, port, _ = served
    assert call(port, "GET", "/health") == (200, "ok")
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_greedy_completions_are_the_engines_tokens(served, tiny):
    client, _, _ = served
    _, tokenizer, engine = tiny
    for prompt in ("The passkey is 7", [65, 66, 67, 10, 256, 30]):
        ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
        tokens, finish = engine(ids, 24)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"return_token_ids": True})
        choice = got.choices[0]
        assert choice.token_ids == tokens and choice.finish_reason == finish
        assert choice.text == tokenizer.decode(tokens, skip_special_tokens=True)
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(tokens))
        assert got.id.startswith("cmpl-") and got.model == "tiny" and got.object == "text_completion"


def test_chat_completion_goes_through_the_chat_template(served, tiny):
    client, _, _ = served
    _, tokenizer, engine = tiny
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello there"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    tokens, finish = engine(list(ids), 20)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.role == "assistant" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.content == tokenizer.decode(tokens, skip_special_tokens=True)
    assert got.choices[0].finish_reason == finish and got.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_concatenates_to_the_whole_answer(served, chat):
    client, _, _ = served
    ask = dict(model="tiny", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    if chat:
        create, ask["messages"] = client.chat.completions.create, [{"role": "user", "content": "Count: 1 2 3"}]
        answer = create(**ask).choices[0].message.content
    else:
        create, ask["prompt"] = client.completions.create, "Count: 1 2 3"
        answer = create(**ask).choices[0].text
    pieces = list(create(**ask, stream=True, stream_options={"include_usage": True}))
    text = "".join((p.choices[0].delta.content or "") if chat else p.choices[0].text for p in pieces if p.choices)
    assert len(pieces) > 3 and text == answer
    assert [p.choices[0].finish_reason for p in pieces if p.choices][-1] == "length"
    assert pieces[-1].choices == [] and pieces[-1].usage.completion_tokens == 30


def test_a_stop_string_ends_the_answer_before_it(served):
    client, _, _ = served
    ask = dict(model="tiny", prompt="abc", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=40, **ask).choices[0].text
    stop = next(full[i:i + 2] for i in range(10, len(full) - 1) if full[i:i + 2].isascii() and full[i:i + 2].isprintable())
    want = full[:full.find(stop)]
    assert len(want) >= 10
    got = client.completions.create(max_tokens=40, stop=[stop], **ask).choices[0]
    assert (got.text, got.finish_reason) == (want, "stop")
    streamed = client.completions.create(max_tokens=40, stop=stop, stream=True, **ask)
    assert "".join(p.choices[0].text for p in streamed) == want


def test_twenty_concurrent_requests_each_get_their_own_answer(served, tiny):
    client, _, _ = served
    _, _, engine = tiny
    asks = [([(7 * i + j) % 250 for j in range(1 + (13 * i) % 40)], 1 + (11 * i) % 32) for i in range(20)]

    def ask(one):
        ids, n = one
        got = client.completions.create(model="tiny", prompt=ids, max_tokens=n, temperature=0,
                                        extra_body={"return_token_ids": True})
        return got.choices[0].token_ids, got.usage.prompt_tokens

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, asks))
    for (ids, n), (tokens, prompt_tokens) in zip(asks, answers):
        assert tokens == engine(ids, n)[0] and prompt_tokens == len(ids)


def test_bad_requests_are_400_naming_the_field_and_the_server_lives(served):
    client, _, _ = served
    cases = [(dict(prompt=[65] * (CONTEXT - 4), max_tokens=16), "prompt"),
             (dict(prompt="hi", max_tokens=0), "max_tokens"),
             (dict(prompt="hi", max_tokens="abc"), "max_tokens"),
             (dict(prompt="hi", temperature="hot"), "temperature"),
             (dict(prompt="hi", n=2), "n")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", **kwargs)
        assert e.value.status_code == 400 and e.value.body["param"] == param, kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * CONTEXT}])
    assert e.value.body["param"] == "messages" and f"context of {CONTEXT}" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi")
    assert e.value.body["param"] == "model"
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_metrics_count_what_was_served(served):
    client, port, _ = served
    before = parse_metrics(call(port, "GET", "/metrics")[1])
    got = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = parse_metrics(call(port, "GET", "/metrics")[1])
    assert after["rolecall_generated_tokens_total"] - before["rolecall_generated_tokens_total"] == 5
    # the prompt prefilled once, the 4 tokens after the prefill's in whole runs of check_every steps
    assert after["rolecall_prefill_tokens_total"] - before["rolecall_prefill_tokens_total"] == got.usage.prompt_tokens
    steps = after["rolecall_decode_steps_total"] - before["rolecall_decode_steps_total"]
    assert steps >= 4 and steps % 8 == 0
    assert after["rolecall_decode_seconds_total"] > before["rolecall_decode_seconds_total"]
    assert after["rolecall_prefill_seconds_total"] > before["rolecall_prefill_seconds_total"]
    assert after["rolecall_prompt_tokens_total"] - before["rolecall_prompt_tokens_total"] == got.usage.prompt_tokens
    finished = 'rolecall_requests_total{finish_reason="length"}'
    assert after[finished] - before.get(finished, 0) == 1
    assert after["rolecall_slots"] == SLOTS and after["rolecall_requests_running"] == 0
    assert after["rolecall_kv_cache_bytes"] > 0 and after["rolecall_draining"] == 0
    # a pool of the pages the rows hold at the full context (full reads through block tables), none held now
    assert after["rolecall_kv_pages_total"] == SLOTS * -(-CONTEXT // 16) and after["rolecall_kv_pages_used"] == 0
    assert after["rolecall_preemptions_total"] == 0


@pytest.mark.slow
def test_sigterm_finishes_the_requests_in_flight_refuses_new_ones_and_exits_0(tiny):
    folder, _, _ = tiny
    proc, port, _ = start(folder)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    try:
        began, pieces = threading.Event(), []

        def read():
            for piece in client.completions.create(model="tiny", prompt="Go", max_tokens=250, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True},
                                                   stream_options={"include_usage": True}):
                pieces.append(piece)
                began.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert began.wait(60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            client.completions.create(model="tiny", prompt="late", max_tokens=2)
            raise AssertionError("a request after SIGTERM was served")
        except openai.InternalServerError as e:
            assert e.status_code == 503 and "shutting down" in e.body["message"]
        except openai.APIConnectionError:
            pass  # it had already exited
        reader.join(120)
        assert pieces[-1].usage.completion_tokens == 250
        assert [p.choices[0].finish_reason for p in pieces if p.choices][-1] == "length"
        assert proc.wait(60) == 0
    finally:
        stop(proc)


@pytest.mark.slow
def test_random_weights_from_a_bare_config_serve_token_ids(tiny, tmp_path):
    """--random-weights builds the engine's random weights from config.json alone; without a tokenizer beside it,
    prompts are token ids and text, chat and stop strings are refused naming the field."""
    import shutil

    import torch

    from rolecall.core.models import load_config
    from rolecall.runtime.engine import ModelShape, Weights, generate
    from rolecall.runtime.session import bound_policy

    shutil.copy(tiny[0] / "config.json", tmp_path / "config.json")
    config = load_config(str(tmp_path / "config.json"))
    weights = Weights.random(ModelShape.from_config(config), "cpu", torch.float32, positions=CONTEXT)
    want = generate(weights, bound_policy("full", None, config), [[5, 6, 7]], max_new_tokens=8,
                    eos_token_id=None, pad_token_id=0).tokens[0]
    proc, port, _ = start(tmp_path, "--random-weights", model=tmp_path / "config.json")
    try:
        assert "has no tokenizer: prompts must be token ids" in (tmp_path / "stderr.txt").read_text()
        status, text = call(port, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
                                                              "ignore_eos": True, "return_token_ids": True})
        choice = json.loads(text)["choices"][0]
        assert status == 200 and choice["token_ids"] == want and choice["text"] == ""
        for path, body, param in [("/v1/completions", {"prompt": "hi"}, "prompt"),
                                  ("/v1/completions", {"prompt": [5], "stop": "x"}, "stop"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                   "messages")]:
            status, text = call(port, "POST", path, body)
            assert status == 400 and error_of(text)["param"] == param, text
    finally:
        assert stop(proc) == 0


@pytest.mark.parametrize("flags, says", [
    (["--slots", "0"], "--slots 0: serve at least 1 request at a time"),
    (["--port", "70000"], "--port 70000: give a port in [0, 65535]"),
    (["--max-context", "1"], "--max-context 1: a request needs at least 2 positions"),
    (["--device-map", "auto"], "--device-map auto: the engine serves a model from one device"),
    (["-p", "engine=static"], "-p engine: rolecall serve always decodes on the engine"),
    (["-p", "min_context=-4"], "-p min_context=-4: give a whole number of tokens ≥ 0"),
    (["--policy", "delta"], "policy 'delta' needs a manifest with a layers section"),
    (["--max-context", "9000"], "--max-context is 9000 tokens, more than the model's context of 4096"),
    (["--policy", "lethe", "-p", "sparse_ratio=0.25"], "--policy lethe: policy 'lethe' with a share of the context"),
])
def test_bad_flags_are_one_line_before_any_weight_loads(tiny, flags, says, monkeypatch, capsys):
    from rolecall.cli import main

    def load(*_, **__):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("rolecall.core.models.load_model", load)
    assert main(["serve", "--model", str(tiny[0]), "--device", "cpu", "--policy", "full", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rolecall serve: error: ") and says in err and err.count("\n") == 1, err


@pytest.mark.parametrize("name, params", [
    ("quest", {"budget": 32, "page_size": 16, "dense_layers": 1}),
    ("lethe", {"budget": 24, "sinks": 2, "recent_ratio": 0.25}),
    ("vattention", {"epsilon": 0.3, "delta": 0.3, "sinks": 2, "window": 8, "heavy": 8, "pilot": 8, "max_sample": 24}),
])
def test_a_policy_with_per_row_state_serves_the_tokens_it_decodes_alone(tiny, name, params):
    """Policies whose step keeps state per row (quest's page bounds, lethe's held slots, scores and evictions)
    serve: greedy answers through the server are the engine's own for each prompt alone, several at once (the
    prompts pass lethe's budget, so every row evicts on its own)."""
    from rolecall.core.models import load_model
    from rolecall.runtime.engine import Weights, generate
    from rolecall.runtime.session import bound_policy

    folder, tokenizer, _ = tiny
    model = load_model(str(folder), dtype="float32")
    weights = Weights.from_model(model, positions=CONTEXT)
    policy = bound_policy(name, None, model.config, **params)
    prompts = [[5 + i] * (20 + 13 * i) for i in range(4)]
    want = [generate(weights, policy, [p], max_new_tokens=12, eos_token_id=None, min_context=0).tokens[0]
            for p in prompts]
    flags = [f for key, value in params.items() for f in ("-p", f"{key}={value}")]
    proc, port, line = start(folder, "--policy", name, *flags, *(["-p", "min_context=0"] if name != "lethe" else []))
    try:
        assert f"with policy {name}" in line
        results = [None] * len(prompts)

        def ask(i: int) -> None:
            status, text = call(port, "POST", "/v1/completions", {"prompt": prompts[i], "max_tokens": 12,
                                                                  "temperature": 0, "ignore_eos": True,
                                                                  "return_token_ids": True})
            results[i] = (status, json.loads(text)["choices"][0]["token_ids"])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [(200, w) for w in want]
    finally:
        assert stop(proc) == 0


def test_a_port_in_use_and_a_missing_server_library_are_one_line(tiny, monkeypatch, capsys):
    from rolecall.cli import main
    from rolecall.runtime.server import bind

    taken = bind("127.0.0.1", 0)
    taken.listen()
    port = taken.getsockname()[1]
    try:
        assert main(["serve", "--model", str(tiny[0]), "--device", "cpu", "--policy", "full",
                     "--port", str(port)]) == 2
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert err.startswith(f"rolecall serve: error: --host 127.0.0.1 --port {port}: cannot listen there") and \
        err.count("\n") == 1, err
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if it were not installed
    assert main(["serve", "--model", str(tiny[0]), "--policy", "full"]) == 2
    assert capsys.readouterr().err == ("rolecall serve: error: rolecall serve needs uvicorn, not installed here: "
                                       "pip install 'rolecall[serve]'\n")
