"""The scheduler's engine side (interim): one request at a time through :func:`runtime.engine.generate`."""

from __future__ import annotations

from typing import Any

import torch

from runtime.engine.generate import Decoders, generate


class _Stream:
    def __init__(self, sched: Any, live: Any) -> None:
        self.sched, self.live, self.prompt_seen = sched, live, False

    def put(self, ids: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.sched._deliver(self.live, [int(t) for t in ids.flatten()], None)

    def end(self) -> None:
        pass


class Batcher:
    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.decoders = Decoders()

    def advance(self) -> None:
        s = self.sched
        with s._lock:
            live = s._waiting.popleft() if s._waiting else None
            if live is not None:
                s._running[live.id] = live
        if live is None:
            return
        r = live.request
        stream = _Stream(s, live)
        out = generate(s.weights, s.policy, [list(r.prompt)], max_new_tokens=r.max_new_tokens, sampling=r.sampling,
                       eos_token_id=None if r.ignore_eos else s.eos, pad_token_id=s.pad_token_id,
                       stop_strings=list(r.stop), tokenizer=s.tokenizer, streamer=stream, kernels=s.kernels,
                       decoders=self.decoders)
        s.kv_bytes = out.info["cache_bytes"]
        s.generated += len(out.tokens[0])
        s._deliver(live, [], out.finish[0])
        with s._lock:
            s._running.pop(live.id, None)
