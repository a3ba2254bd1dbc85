"""benchmarks/serve.py and its client (benchmarks/load.py): bad flags refused in one line before any work, the
request distributions, Poisson arrivals, the stream and metrics parsing, the summary and byte-bound arithmetic
against numbers worked out by hand, a server that dies or never gets ready named in one line, and one run end to
end against the real ``rolecall serve`` on a tiny random-weights model on the CPU."""

import json
import math
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest

from tests.benchmarks import SCRIPTS, load_benchmark, refusal
from tests.tiny import tiny_config

BASE = ["--concurrency", "2", "--requests", "4"]


@pytest.fixture(scope="module")
def serve():
    return load_benchmark("serve")


@pytest.fixture(scope="module")
def load():
    return load_benchmark("load")


@pytest.fixture
def tiny(tmp_path):
    """A 4-layer Qwen2 config (2 KV heads; DELTA's roles full, full, Δ, sparse) as a bare config.json."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    tiny_config("qwen2", layers=4, heads=4, kv_heads=2, head_dim=16).to_json_file(folder / "config.json")
    return folder / "config.json"


# -- flags ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, says", [
    (["--concurrency", "4"], "give one of --duration S or --requests N"),
    (["--concurrency", "4", "--duration", "60", "--requests", "8"], "give one of --duration S or --requests N, not both"),
    (["--requests", "8"], "give one of --concurrency N (clients) or --rate R (Poisson arrivals per second)"),
    (["--concurrency", "4", "--rate", "2", "--requests", "8"], "or --rate R (Poisson arrivals per second), not both"),
    (["--rate", "2", "--requests", "8", "--staggered-start"],
     "--staggered-start staggers the first --concurrency requests; it needs --concurrency N, not --rate"),
    (["--rate", "-1", "--requests", "8"], "--rate must be a positive number, got -1.0"),
    (["--rate", "0", "--duration", "10"], "--rate must be a positive number, got 0.0"),
    (["--concurrency", "0", "--requests", "8"], "--concurrency must be at least 1, got 0"),
    (["--concurrency", "2", "--requests", "0"], "--requests must be at least 1, got 0"),
    (["--concurrency", "2", "--duration", "-5"], "--duration must be a positive number, got -5.0"),
    ([*BASE, "--prompt-tokens", "10:5"], "--prompt-tokens 10:5: a range LOW:HIGH needs HIGH at least LOW"),
    ([*BASE, "--prompt-tokens", "1:2:3"], "--prompt-tokens takes a token count N or a range LOW:HIGH of whole "
                                          "numbers, got '1:2:3'"),
    ([*BASE, "--output-tokens", "1k"], "--output-tokens takes a token count N or a range LOW:HIGH of whole "
                                       "numbers, got '1k'"),
    ([*BASE, "--output-tokens", "0:8"], "--output-tokens takes token counts of at least 1, got '0:8'"),
    ([*BASE, "--policies", "full,quest"], "--policies: unknown quest; known: full, delta, lychee"),
    ([*BASE, "--policies", ","], "--policies: none given; known: full, delta, lychee"),
    ([*BASE, "--prompt-tokens", "64", "--output-tokens", "8:64", "--max-context", "100"],
     "--max-context must hold the longest prompt and output (128 tokens), got 100"),
    ([*BASE, "--slots", "0"], "--slots must be at least 1, got 0"),
    ([*BASE, "--budget", "0"], "--budget must be at least 1, got 0"),
    ([*BASE, "--retrieval-heads", "-1"], "--retrieval-heads must be at least 0, got -1"),
    ([*BASE, "--warmup", "-2"], "--warmup must be at least 0, got -2"),
    ([*BASE, "--bandwidth-tbs", "0"], "--bandwidth-tbs must be a positive number, got 0.0"),
    ([*BASE, "--request-timeout", "-1"], "--request-timeout must be a positive number, got -1.0"),
    ([*BASE, "--device", "tpu"], "--device 'tpu': use cpu, cuda or cuda:N"),
    ([*BASE, "--shape", "9b"], "argument --shape: invalid choice: '9b'"),
    ([*BASE, "--shape", "7b", "--model", "smollm2-135m"], "--shape 7b and --model smollm2-135m: give one"),
    ([*BASE, "--manifest-delta", "d.safetensors"], "--manifest-delta goes with --model NAME; with random weights the "
                                                   "manifests are made for the shape"),
    ([*BASE, "--model", "nowhere/config.json"], "--model nowhere/config.json: no such file"),
    ([*BASE, "--random-weights"], "--random-weights goes with --model NAME"),
    ([*BASE, "--model", "someone/model", "--policies", "full,delta"],
     "--policies delta with --model someone/model needs --manifest-delta FILE (this checkout ships no "
     "artifacts/model/model.delta.safetensors)"),
    ([*BASE, "--model", "smollm2-135m", "--manifest-lychee", "missing.safetensors"],
     "--manifest-lychee missing.safetensors: no such file"),
])
def test_bad_flags_are_refused_in_one_line_before_any_work(tmp_path, monkeypatch, capsys, serve, flags, says):
    for name in ("prepare", "serve_and_load", "Server"):
        monkeypatch.setattr(serve, name, lambda *a, **k: pytest.fail("work started on flags that should be refused"))
    monkeypatch.chdir(tmp_path)
    err = refusal(capsys, serve, [*flags, "--out", "o.json"])
    assert says in err and err.endswith("(`serve.py --help` lists the options)")
    assert not list(tmp_path.iterdir())


def test_an_output_under_a_file_is_refused_in_one_line_when_run_as_a_script(tmp_path):
    (tmp_path / "afile").write_text("")
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS.parent)}  # the scripts run as python -m benchmarks.<name>
    done = subprocess.run([sys.executable, "-m", "benchmarks.serve", *BASE, "--out", "afile/sub.json"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("serve.py: error: --out afile/sub.json: ") and "afile is a file, not a folder" in err


def test_the_shipped_manifests_are_the_defaults_of_the_embedded_model(serve):
    args = serve.parse_args(["--model", "smollm2-135m", *BASE, "--device", "cpu"])
    assert args.manifest_delta.endswith("artifacts/smollm2-135m/smollm2-135m.delta.safetensors")
    assert args.manifest_lychee.endswith("artifacts/smollm2-135m/heads-hardkuma.safetensors")
    assert args.policies == ["full", "delta", "lychee"] and args.slots == 2 and args.dtype == "float32"
    args = serve.parse_args(["--rate", "3", "--duration", "5", "--policies", "lychee,full", "--device", "cpu",
                             "--prompt-tokens", "100:200", "--output-tokens", "16"])
    assert args.policies == ["full", "lychee"] and args.shape == "7b" and args.slots == 64 and args.max_context == 216


# -- what is sent --------------------------------------------------------------------------------------------------
def test_lengths_parse_fixed_and_uniform_counts_and_draw_every_count_of_the_range_evenly(load):
    assert load.Lengths.parse("32768", "--x") == load.Lengths(32768, 32768)
    assert load.Lengths.parse("1024:4096", "--x") == load.Lengths(1024, 4096)
    assert str(load.Lengths(5, 5)) == "5" and str(load.Lengths(1, 6)) == "1:6" and load.Lengths(1, 6).mean == 3.5
    rng = np.random.default_rng(0)
    draws = [load.Lengths(1, 6).draw(rng) for _ in range(30000)]
    assert set(draws) == {1, 2, 3, 4, 5, 6}
    # a fair die: mean 3.5, standard deviation sqrt(35/12) = 1.708, so the mean of 30000 is within 4 SE = 0.039
    assert abs(statistics.fmean(draws) - 3.5) < 4 * math.sqrt(35 / 12) / math.sqrt(30000)
    assert {load.Lengths(7, 7).draw(rng) for _ in range(10)} == {7}


def test_request_i_is_the_same_in_every_run_and_avoids_the_ends_of_the_vocabulary(load):
    w = load.Workload(load.Lengths(16, 48), load.Lengths(4, 12), vocab=260, seed=3)
    again = load.Workload(load.Lengths(16, 48), load.Lengths(4, 12), vocab=260, seed=3)
    assert w.token_range() == (65, 195)  # a quarter of a small vocabulary on each side
    assert load.Workload(w.prompt, w.output, vocab=152064).token_range() == (1000, 151064)
    for i in range(50):
        prompt, out = w.request(i)
        assert (prompt, out) == again.request(i)
        assert 16 <= len(prompt) <= 48 and 4 <= out <= 12 and 65 <= min(prompt) <= max(prompt) < 195
    assert w.request(0) != w.request(1) and w.request(0) != w.request(0, warm_up=True)
    assert w.request(0) != load.Workload(w.prompt, w.output, vocab=260, seed=4).request(0)


def test_a_staggered_start_moves_a_uniform_share_of_each_first_output_into_its_prompt(load):
    """The first ``staggered`` requests keep their context at the end (n + out) and decode at least one token; their
    moved share ``a`` is uniform on 0..out − 1 (out fixed at 10: every value shows, mean 4.5); the later requests and
    the warm-up are the unstaggered ones, id for id."""
    plain = load.Workload(load.Lengths(16, 48), load.Lengths(10, 10), vocab=260, seed=3)
    staggered = load.Workload(plain.prompt, plain.output, vocab=260, seed=3, staggered=4000)
    ages = []
    for i in range(4000):
        (p0, o0), (p1, o1) = plain.request(i), staggered.request(i)
        assert len(p1) + o1 == len(p0) + o0 and 1 <= o1 <= o0 == 10 and p1[:len(p0)] == p0
        ages.append(o0 - o1)
    assert set(ages) == set(range(10))
    # a uniform draw on 0..9: standard deviation sqrt(99/12) = 2.87, so the mean of 4000 is within 4 SE = 0.18
    assert abs(statistics.fmean(ages) - 4.5) < 4 * math.sqrt(99 / 12) / math.sqrt(4000)
    assert staggered.request(4000) == plain.request(4000) and staggered.request(0, warm_up=True) == \
        plain.request(0, warm_up=True)


def test_poisson_gaps_have_the_mean_of_the_rate_and_an_exponential_tail(load):
    rate, n = 4.0, 40000
    gaps = [g for g, _ in zip(load.poisson_gaps(rate, seed=1), range(n))]
    assert gaps[:5] == [g for g, _ in zip(load.poisson_gaps(rate, seed=1), range(5))]
    assert gaps[:5] != [g for g, _ in zip(load.poisson_gaps(rate, seed=2), range(5))]
    # exponential: the standard deviation is the mean (1/4), so the sample mean is within 4 SE = 0.005
    assert abs(statistics.fmean(gaps) - 1 / rate) < 4 * (1 / rate) / math.sqrt(n)
    # P(gap > mean) = 1/e; its estimate has SE sqrt(p(1-p)/n) = 0.0024
    above = sum(g > 1 / rate for g in gaps) / n
    assert abs(above - math.exp(-1)) < 4 * math.sqrt(math.exp(-1) * (1 - math.exp(-1)) / n)


# -- what comes back -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("payload, expected", [
    ('{"choices":[{"text":"ab","token_ids":[5,6],"finish_reason":null}]}', (2, None, None, False)),
    ('{"choices":[{"text":"a","finish_reason":null}]}', (1, None, None, False)),
    ('{"choices":[{"text":"","finish_reason":null}]}', (1, None, None, False)),  # a token whose text is not out yet
    ('{"choices":[{"text":"","finish_reason":"length"}]}', (0, None, None, False)),  # only closes the answer
    ('{"choices":[{"text":"","token_ids":[9],"finish_reason":"length"}]}', (1, None, None, False)),
    ('{"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":7}}', (0, 7, None, False)),
    ("[DONE]", (0, None, None, True)),
    ('{"error":{"message":"the engine failed","type":"server_error"}}', (0, None, "the engine failed", False)),
])
def test_stream_events_count_their_tokens(load, payload, expected):
    assert load.read_event(payload) == expected


def test_a_stream_event_that_is_not_json_is_an_error(load):
    tokens, _, error, end = load.read_event("<html>")
    assert tokens == 0 and not end and error == "a stream event that is not JSON: '<html>'"


def test_metrics_are_read_by_the_end_of_their_names(load):
    text = "\n".join([
        "# HELP rolecall_requests_running Requests in a slot.", "# TYPE rolecall_requests_running gauge",
        "rolecall_requests_running 3", "rolecall_requests_waiting 5", "rolecall_slots 8", "rolecall_slots_in_use 3",
        "rolecall_kv_cache_bytes 1.5e9", "rolecall_generated_tokens_total 1234",
        'rolecall_requests_total{finish_reason="length"} 7', "other_thing 9", "garbage line", ""])
    assert load.parse_metrics(text) == {"running": 3.0, "waiting": 5.0, "slots_in_use": 3.0,
                                        "kv_cache_bytes": 1.5e9, "generated_tokens": 1234.0}
    assert load.parse_metrics("my_server_slots_in_use{gpu=\"0\"} 2\nmy_server_slots_in_use{gpu=\"1\"} 4\n") == \
        {"slots_in_use": 6.0}


# -- the summary ---------------------------------------------------------------------------------------------------
def test_percentiles_interpolate_between_the_sorted_values(load):
    assert load.percentile([4, 1, 3, 2], 50) == 2.5
    assert load.percentile([4, 1, 3, 2], 99) == pytest.approx(3.97)  # position 3 × 0.99 = 2.97: 3 + 0.97 × (4 − 3)
    assert load.percentile([4, 1, 3, 2], 0) == 1 and load.percentile([4, 1, 3, 2], 100) == 4
    assert load.percentile([10, 20, 30, 40, 50], 90) == 46  # position 3.6: 40 + 0.6 × 10
    assert load.percentile([7.0], 99) == 7.0 and load.percentile([], 50) is None


def three_requests(load):
    """Two done (one told its count by a usage chunk), one short of its tokens; the phase ends at 4 s."""
    a = load.Record(0, 10, 3, sent=0.0, times=[1.0, 2.0, 3.0], counts=[1, 1, 1], ended=3.0)
    b = load.Record(1, 20, 3, sent=0.5, times=[2.0, 2.5, 4.0], counts=[1, 1, 1], reported=3, ended=4.0)
    c = load.Record(2, 30, 4, sent=1.0, times=[3.0], counts=[1], ended=3.5, error="1 tokens of the 4 asked for")
    return [a, b, c]


def test_a_request_gives_its_first_token_time_its_time_per_token_and_its_tokens_by_a_time(load):
    a, b, c = three_requests(load)
    assert (a.ttft, a.tpot, b.ttft, b.tpot, c.ttft, c.tpot) == (1.0, 1.0, 1.5, 1.0, 2.0, None)
    assert [a.tokens_by(t) for t in (0.5, 1.0, 2.9, 3.0, 9.0)] == [0, 1, 2, 3, 3]
    assert a.tpot_within(1.5, 3.0) == 1.0 and b.tpot_within(0.0, 3.9) == 0.5 and a.tpot_within(1.5, 2.5) is None
    two = load.Record(3, 5, 4, sent=0.0, times=[0.5, 0.6, 0.8], counts=[2, 1, 1], ended=0.8)
    assert two.tokens == 4 and two.tpot == pytest.approx(0.15)  # 0.3 s over the two tokens after the first chunk
    assert a.done and b.done and not c.done


def test_the_summary_of_a_run_matches_hand_worked_numbers(load):
    run = load.Run(three_requests(load), samples=[], lags=[0.001, 0.003], wall=4.0)
    s = load.summarise(run)
    assert s["requests"] == {"sent": 3, "done": 2, "failed": 1, "cut": 0}
    assert s["errors"] == {"1 tokens of the 4 asked for": 1}
    assert (s["tokens_asked_done"], s["tokens_got_done"], s["output_tokens"], s["prompt_tokens"]) == (6, 6, 7, 60)
    assert s["output_tokens_per_s"] == 7 / 4 and s["prompt_tokens_per_s"] == 60 / 4
    assert s["ttft_ms"]["p50"] == pytest.approx(1500) and s["ttft_ms"]["p99"] == pytest.approx(1990)
    assert s["ttft_ms"]["mean"] == pytest.approx(1500) and s["ttft_ms"]["count"] == 3
    assert s["tpot_ms"]["p50"] == pytest.approx(1000) and s["tpot_ms"]["count"] == 2
    # the steady window is [0.4, 3.6]: a's tokens at 1, 2, 3 (1 s each), b's at 2 and 2.5 (0.5 s): median 0.75 s
    assert s["steady_window_s"] == pytest.approx([0.4, 3.6]) and s["steady_tpot_ms"] == pytest.approx(750)
    assert s["latency_s"]["p50"] == pytest.approx(3.25) and s["client_lag_ms"]["max"] == pytest.approx(3)


def test_a_request_cut_at_the_end_of_the_phase_counts_the_tokens_it_got_by_then(load):
    cut = load.Record(0, 10, 8, sent=0.0, times=[1.0, 2.0, 3.0, 4.5], counts=[1, 1, 1, 1], ended=4.0, cut=True)
    s = load.summarise(load.Run([cut], [], [], wall=4.0))
    assert s["requests"] == {"sent": 1, "done": 0, "failed": 0, "cut": 1} and s["output_tokens"] == 3
    assert s["tpot_ms"]["count"] == 0 and s["ttft_ms"]["p50"] == pytest.approx(1000)
    assert cut.decoding_at(3.9, 4.0) and not cut.decoding_at(0.9, 4.0)


def test_server_samples_give_means_in_and_out_of_the_steady_window_and_the_counters_rate(load):
    samples = [(0.0, {"slots_in_use": 1, "generated_tokens": 100}), (1.0, {"slots_in_use": 4, "generated_tokens": 150}),
               (2.0, {"slots_in_use": 4, "generated_tokens": 250}), (3.0, {"slots_in_use": 2, "generated_tokens": 300})]
    out = load.server_load(samples, (0.5, 2.5))
    assert out["samples"] == 4 and out["slots_in_use"] == {"mean": 2.75, "max": 4, "steady_mean": 4}
    assert out["generated_tokens"] == {"increase": 200, "per_s": pytest.approx(200 / 3), "steady_increase": 100,
                                       "steady_s": 1.0}
    assert out["kv_cache_bytes"] is None and out["waiting"] is None
    assert out["step_ms"] is None and out["prefill_share"] is None


def test_the_engine_step_and_prefill_share_come_from_the_counters_inside_the_window(load):
    """Samples at 0..4 s; the window [1, 3] sees 0.5 s of decode over 40 steps (12.5 ms a step) and 0.6 s of
    prefill in its 2 s (30 %); what the counters did outside it does not count."""
    counters = [(0.0, 0.0, 0), (0.2, 1.0, 20), (0.5, 1.1, 28), (0.8, 1.5, 60), (5.0, 9.0, 500)]
    samples = [(float(t), {"prefill_seconds": p, "decode_seconds": d, "decode_steps": n})
               for t, (p, d, n) in enumerate(counters)]
    out = load.server_load(samples, (1.0, 3.0))
    assert out["step_ms"] == pytest.approx(12.5) and out["prefill_share"] == pytest.approx(0.3)
    assert out["decode_steps"]["steady_increase"] == 40 and out["decode_steps"]["increase"] == 500
    quiet = [(t, {**v, "prefill_seconds": 0.0}) for t, v in samples]  # no prefill at all: a share of 0, not unknown
    assert load.server_load(quiet, (1.0, 3.0))["prefill_share"] == 0.0


def test_the_steady_window_starts_when_every_slot_first_decodes_and_runs_to_a_cut_end(load):
    """Three requests whose first tokens come at 1, 2 and 3 s: two slots are first full at 2 s. A phase cut at its
    duration ends the window at the end; one that drains trims the last tenth; a ramp past the end falls back."""
    records = [load.Record(i, 10, 4, sent=0.0, times=[float(i + 1)], counts=[1]) for i in range(3)]
    assert load.ramp_end(records, 2) == 2.0 and load.ramp_end(records, 4) is None
    assert load.steady_window(10.0, ramp=2.0, cut=True) == (2.0, 10.0)
    assert load.steady_window(10.0, ramp=2.0) == (2.0, 9.0)
    assert load.steady_window(10.0, ramp=0.5) == (1.0, 9.0)  # the ramp ended inside the first tenth
    assert load.steady_window(10.0, ramp=9.5) == (1.0, 9.0)
    # tokens read inside the window over its length: a at 1, 2, 3 s and b at 2, 2.5 s, window [2, 4] (cut at 4)
    a = load.Record(0, 10, 3, sent=0.0, times=[1.0, 2.0, 3.0], counts=[1, 1, 1], ended=3.0)
    b = load.Record(1, 20, 3, sent=0.5, times=[2.0, 2.5, 4.0], counts=[1, 1, 1], ended=4.0, cut=True)
    s = load.summarise(load.Run([a, b], [], [], wall=4.0), rows=2, cut=True)
    assert s["steady_window_s"] == [2.0, 4.0]
    assert s["steady_output_tokens_per_s"] == pytest.approx((1 + 2) / 2.0)  # a's 3rd; b's 2nd and 3rd by 4 s


def test_the_live_batch_is_the_requests_decoding_at_each_tick_with_their_contexts(load):
    assert load.live_batches(three_requests(load), 4.0, (0.0, 4.0), ticks=4) == [[], [11], [12, 22], [22]]


def test_the_byte_bound_is_the_weights_and_what_each_policy_reads_at_7b(serve, tmp_path):
    """At 32K: full reads every token; delta 5 full layers of 28 (0, 1 and the Δ-layers 2, 14, 22) and 2,048
    tokens in the others; lychee 32 retrieval heads of 112 and 2,048 tokens in the others."""
    args = serve.parse_args(["--concurrency", "64", "--duration", "300", "--device", "cpu"])
    target = serve.prepare(args, tmp_path)
    from rolecall.core.manifest import RoleManifest
    from rolecall.core.models import load_config
    from rolecall.runtime.engine import SHAPES

    config = load_config(target.model)
    shape = SHAPES["7b"]
    assert target.shape == shape and target.random and target.name == "7b"
    assert serve.ModelShape.from_config(config) == shape and config.max_position_embeddings >= 32768
    assert RoleManifest.load(target.manifests["delta"]).delta_layers == [2, 14, 22]
    heads = RoleManifest.load(target.manifests["lychee"]).head_role
    assert int(heads.sum()) == 32 and heads[0].all()
    per_token = 2 * 2 * 28 * 4 * 128  # K and V, bf16, every layer's 4 KV heads of 128
    reads = {"full": 32768, "delta": (5 * 32768 + 23 * 2048) / 28, "lychee": (32 * 32768 + 80 * 2048) / 112}
    for policy, tokens in reads.items():
        expected = (shape.weight_bytes(2) + 2 * per_token * tokens) / 4.2e12 * 1e3
        assert serve.bound_ms(shape, target.steps[policy], [32768, 32768], 2, 4.2e12) == pytest.approx(expected)
    cmd = serve.server_command(args, target, "delta", 1234)
    assert cmd[cmd.index("serve"):] == [
        "serve", "--model", target.model, "--policy", "delta", "--host", "127.0.0.1", "--port", "1234", "--slots",
        "64", "--max-context", "32768", "--device", "cpu", "--dtype", "float32", "--random-weights", "--manifest",
        target.manifests["delta"], "-p", "budget=2048", "-p", "page_size=16", "-p", "recent_pages=8"]


def test_an_alias_with_random_weights_is_served_from_its_bundled_config(serve, tmp_path):
    args = serve.parse_args(["--model", "qwen-14b", "--random-weights", "--concurrency", "32", "--duration", "300",
                             "--device", "cpu", "--policies", "full,delta"])
    target = serve.prepare(args, tmp_path)
    assert target.random and target.name == "qwen-14b" and target.model == "qwen-14b"
    assert (target.shape.layers, target.shape.kv_heads, target.shape.hidden) == (48, 8, 5120)
    from rolecall.core.manifest import RoleManifest

    delta = RoleManifest.load(target.manifests["delta"])  # made for the shape, as benchmarks/decode.py makes it
    assert delta.model.num_layers == 48 and len(delta.layer_role) == 48 and delta.delta_layers == [2, 14, 22]
    cmd = serve.server_command(args, target, "full", 1234)
    assert cmd[cmd.index("--model"):cmd.index("--model") + 2] == ["--model", "qwen-14b"] and "--random-weights" in cmd


# -- a server that does not come up --------------------------------------------------------------------------------
@pytest.mark.parametrize("script, flags, says", [
    ("print('loading the model'); print('ValueError: --max-context 70000 is past the model'); sys.exit(3)", [],
     "serve.py: error: rolecall serve (--policy full) exited with status 3 before it was ready: loading the model | "
     "ValueError: --max-context 70000 is past the model"),
    ("print('still loading', flush=True); time.sleep(60)", ["--startup-timeout", "2"],
     "serve.py: error: rolecall serve (--policy full) did not answer /health within 2 s (--startup-timeout): "
     "still loading"),
])
def test_a_server_that_dies_or_never_answers_is_named_in_one_line_with_its_last_output(
        serve, tiny, tmp_path, monkeypatch, capsys, script, flags, says):
    started = []

    def command(*_):
        started.append(1)
        return [sys.executable, "-c", f"import sys, time; {script}"]

    monkeypatch.setattr(serve, "server_command", command)
    out = tmp_path / "r.json"
    err = refusal(capsys, serve, ["--model", str(tiny), "--policies", "full", *BASE, "--device", "cpu",
                                  "--out", str(out), *flags])
    assert err == says and started == [1] and not out.exists()


# -- end to end ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_benchmark_runs_the_real_server_end_to_end_on_the_cpu(serve, load, tiny, tmp_path, capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    out = tmp_path / "serve.json"
    code = serve.main(["--model", str(tiny), "--policies", "full,delta", "--concurrency", "4", "--requests", "8",
                       "--prompt-tokens", "16:48", "--output-tokens", "4:12", "--warmup", "1", "--device", "cpu",
                       "--seed", "5", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    asked = sum(load.Workload(load.Lengths(16, 48), load.Lengths(4, 12), vocab=260, seed=5).request(i)[1]
                for i in range(8))
    assert report["gpu"] == "cpu" and report["random_weights"] and report["shape"]["layers"] == 4
    assert report["settings"]["model"] == "config.json" and report["settings"]["slots"] == 4
    assert [r["policy"] for r in report["policies"]] == ["full", "delta"]
    for r in report["policies"]:
        assert r["requests"] == {"sent": 8, "done": 8, "failed": 0, "cut": 0}, r["errors"]
        assert r["tokens_asked_done"] == r["tokens_got_done"] == r["output_tokens"] == asked
        assert r["output_tokens_per_s"] == pytest.approx(asked / r["wall_s"])
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] < 1e3 * r["wall_s"]
        assert 0 < r["tpot_ms"]["p50"] <= r["tpot_ms"]["p99"] and r["ttft_ms"]["count"] == 8
        assert 0 < r["latency_s"]["max"] <= r["wall_s"]
        assert r["server"]["samples"] >= 1 and 0 <= r["server"]["slots_in_use"]["max"] <= 4
        assert r["bound"]["tpot_ms"] is None or 0 < r["bound"]["tpot_ms"] < r["tpot_ms"]["p99"]
    assert report["policies"][1]["manifest"] == "delta.safetensors"
    assert report["policies"][1]["speedup_vs_full"] == pytest.approx(
        report["policies"][1]["output_tokens_per_s"] / report["policies"][0]["output_tokens_per_s"])
    assert "wrote" in printed and out.stat().st_size < 20000
