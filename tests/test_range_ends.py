"""Every documented range of the input checks at its inclusive end (taken, with its documented effect where that
is cheap to see) and just past it (refused in one line naming the field). The ends come from the docstrings and
messages: a policy's parameters, sampling, the server's request fields, prompts and token ids, the manifest's
fields, and the calibration, training, evaluation and tuning settings. One table per module."""

from __future__ import annotations

from statistics import NormalDist

import pytest
import torch

UP = 1 + 1e-9  # just past 1
TINY = 1e-9  # just past 0


# -- the policies' parameters ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, params, past, says", [
    ("delta", {"page_size": 1}, {"page_size": 0}, "page_size must be a number > 0"),
    ("delta", {"num_pages": 1}, {"num_pages": 0}, "num_pages must be a number > 0"),
    ("delta", {"budget": 1}, {"budget": 0}, "budget must be a number > 0"),
    ("delta", {"num_pages": 4, "recent_pages": 4}, {"num_pages": 4, "recent_pages": 5}, "recent_pages=5 is more than"),
    ("delta", {"recent_pages": 0}, {"recent_pages": -1}, "recent_pages must be a whole number ≥ 0"),
    ("delta", {"refine": 1}, {"refine": 0}, "refine must be an integer ≥ 1"),
    ("lethe", {"sparse_ratio": 1.0}, {"sparse_ratio": UP}, r"sparse_ratio is a fraction in \(0, 1\]"),
    ("lethe", {"sparse_ratio": TINY}, {"sparse_ratio": 0.0}, r"sparse_ratio is a fraction in \(0, 1\]"),
    ("lethe", {"budget": 1}, {"budget": 0}, "budget must be a number > 0"),
    ("lethe", {"recent_ratio": 1.0}, {"recent_ratio": UP}, r"recent_ratio must be in \[0, 1\]"),
    ("lethe", {"recent_ratio": 0.0}, {"recent_ratio": -TINY}, r"recent_ratio must be in \[0, 1\]"),
    ("lethe", {"gamma": 1.0}, {"gamma": UP}, r"gamma must be in \[0, 1\]"),
    ("lethe", {"gamma": 0.0}, {"gamma": -TINY}, r"gamma must be in \[0, 1\]"),
    ("lethe", {"tau": 1.0}, {"tau": UP}, r"tau must be in \[0, 1\]"),
    ("lethe", {"tau": 0.0}, {"tau": -TINY}, r"tau must be in \[0, 1\]"),
    ("lethe", {"segments": 1}, {"segments": 0}, "segments must be a number > 0"),
    ("lethe", {"sinks": 0}, {"sinks": -1}, "sinks must be a number ≥ 0"),
    ("lychee", {"budget": 1}, {"budget": 0}, "budget must be a number > 0"),
    ("lychee", {"ratio": 1.0}, {"ratio": UP}, r"ratio is a fraction in \(0, 1\]"),
    ("lychee", {"ratio": TINY}, {"ratio": 0.0}, "ratio must be a number > 0"),
    ("lychee", {"top_p": 1.0}, {"top_p": UP}, r"top_p is a fraction in \(0, 1\]"),
    ("lychee", {"threshold": 1.0}, {"threshold": UP}, r"threshold is a fraction in \(0, 1\]"),
    ("lychee", {"block_size": 1}, {"block_size": 0}, "block_size must be a number > 0"),
    ("lychee", {"recent": 0}, {"recent": -1}, "recent must be a number ≥ 0"),
    ("quest", {"budget": 1}, {"budget": 0}, "budget must be a positive integer"),
    ("quest", {"page_size": 1}, {"page_size": 0}, "page_size must be a positive integer"),
    ("quest", {"dense_layers": 0}, {"dense_layers": -1}, "dense_layers must be a number ≥ 0"),
    ("vattention", {"epsilon": 1 - 1e-9}, {"epsilon": 1.0}, r"epsilon must be in \(0, 1\)"),
    ("vattention", {"epsilon": TINY}, {"epsilon": 0.0}, r"epsilon must be in \(0, 1\)"),
    ("vattention", {"delta": 1 - 1e-9}, {"delta": 1.0}, r"delta must be in \(0, 1\)"),
    ("vattention", {"delta": TINY}, {"delta": 0.0}, r"delta must be in \(0, 1\)"),
    ("vattention", {"sinks": 0}, {"sinks": -1}, "sinks must be a number ≥ 0"),
    ("vattention", {"heavy": 0}, {"heavy": -1}, "heavy must be a number ≥ 0"),
    ("vattention", {"window": 1}, {"window": 0}, "window must be an integer ≥ 1"),
    ("vattention", {"pilot": 2}, {"pilot": 1}, "pilot must be an integer ≥ 2"),
    ("vattention", {"max_sample": 1}, {"max_sample": 0}, "max_sample must be a positive integer"),
])
def test_policy_parameters_at_their_range_ends(policy, params, past, says):
    from rolecall.runtime.policies import PolicyError, get_policy

    taken = get_policy(policy, **params)
    assert all(getattr(taken, k) == v for k, v in params.items())
    with pytest.raises(PolicyError, match=rf"^policy '{policy}': .*{says}") as info:
        get_policy(policy, **past)
    assert "\n" not in str(info.value)


def test_the_policies_derived_sizes_at_their_range_ends():
    """K = ceil(budget / P) for delta and quest: a budget of 1 token is one page, P + 1 tokens two; delta's L is
    min(8, K) when not given. vAttention's z = Φ⁻¹(1 − δ/4) and η = ε / (2 + ε) at the ends of (0, 1)."""
    from rolecall.runtime.policies import get_policy

    assert (get_policy("delta", budget=1).num_pages, get_policy("delta", budget=1).recent_pages) == (1, 1)
    assert get_policy("delta", budget=17, page_size=16).num_pages == 2
    assert get_policy("delta", num_pages=8).recent_pages == 8 and get_policy("delta", num_pages=9).recent_pages == 8
    assert get_policy("quest", budget=1).num_pages == 1 and get_policy("quest", budget=17, page_size=16).num_pages == 2
    for eps, delta in ((1e-6, 1e-6), (1 - 1e-6, 1 - 1e-6)):
        v = get_policy("vattention", epsilon=eps, delta=delta)
        assert v.z == pytest.approx(NormalDist().inv_cdf(1 - delta / 4), rel=1e-9)
        assert v.eta == pytest.approx(eps / (2 + eps), rel=1e-12)


def test_a_budget_past_the_context_reads_the_context():
    """mean_tokens_read: a layer reads all ``context`` tokens where its full share is 1, min(context, budget) where
    it is 0, its window where it has one. Three layers (full, sparse, window 4) at a context of 10: a budget of 16
    reads (10 + 10 + 4) / 3 = 8, a budget of 6 (10 + 6 + 4) / 3, a budget of exactly 10 the same as 16."""
    from types import SimpleNamespace

    from rolecall.runtime.policies import mean_tokens_read

    shape = SimpleNamespace(windows=[None, None, 4])
    assert mean_tokens_read(shape, 10, 16, [1.0, 0.0, 0.0]) == pytest.approx(8.0)
    assert mean_tokens_read(shape, 10, 10, [1.0, 0.0, 0.0]) == pytest.approx(8.0)
    assert mean_tokens_read(shape, 10, 6, [1.0, 0.0, 0.0]) == pytest.approx(20 / 3)
    assert mean_tokens_read(shape, 10, 6, [0.5, 0.5, 0.0]) == pytest.approx((8.0 + 8.0 + 4) / 3)

def test_lychees_recent_tokens_keep_every_block_they_touch():
    """Eight tokens in blocks of 2 (blocks 0..3): the last 3 tokens, 5, 6 and 7, lie in blocks 2 and 3, so both are
    kept beside block 0, the only one the threshold keeps (the highest share); 2 recent tokens keep block 3 alone."""
    from rolecall.runtime.policies.lychee import Lychee

    scores, valid = torch.tensor([[[0.7, 0.1, 0.1, 0.1]]]), torch.ones(1, 1, 4, dtype=torch.bool)
    for recent, blocks in ((3, [0, 2, 3]), (2, [0, 3]), (0, [0])):
        chosen = Lychee(threshold=1.0, block_size=2, recent=recent)._choose(scores, valid)
        assert sorted(int(i) for i in chosen.flatten() if i >= 0) == blocks

def test_select_pages_keeps_recent_pages_from_zero_to_all_of_them():
    """Eight tokens in pages of 2 (pages 0..3, page 0 scoring highest, then 1): two pages with L = 2 are the last
    two whatever the scores; with L = 0 the two best; L = 3 > K is refused, as are P = 0 and K = 0."""
    from rolecall.runtime.policies import PolicyError
    from rolecall.runtime.policies.delta import select_pages

    scores = torch.tensor([[9.0, 9.0, 5.0, 5.0, 1.0, 1.0, 0.0, 0.0]])
    assert select_pages(scores, 2, 2, 2).tolist() == [[2, 3]]
    assert select_pages(scores, 2, 2, 0).tolist() == [[0, 1]]
    assert select_pages(scores, 1, 1, 1).tolist() == [[7]]
    for args, says in (((2, 2, 3), "recent_pages must be an integer in"), ((2, 2, -1), "recent_pages must be"),
                       ((0, 2, 0), "page_size must be a positive"), ((2, 0, 0), "num_pages must be a positive")):
        with pytest.raises(PolicyError, match=f"^select_pages: {says}"):
            select_pages(scores, *args)


# -- sampling and the server's request fields --------------------------------------------------------------------------
@pytest.mark.parametrize("field, edge, past, says", [
    ("temperature", TINY, 0.0, "temperature must be > 0 when sampling"),
    ("top_k", 0, -1, r"top_k must be an integer ≥ 0 \(0 = off\)"),
    ("top_p", 1.0, UP, r"top_p must be in \(0, 1\]"),
    ("seed", 2**32 - 1, 2**32, r"seed must be in \[0, 2\*\*32\)"),
    ("seed", 0, -1, r"seed must be in \[0, 2\*\*32\)"),
])
def test_sampling_at_its_range_ends(field, edge, past, says):
    from rolecall.runtime.engine.sampling import Sampling

    assert getattr(Sampling(do_sample=True, **{field: edge}), field) == edge
    with pytest.raises(ValueError, match=f"^{says}"):
        Sampling(do_sample=True, **{field: past})


def test_greedy_decoding_takes_a_temperature_of_zero():
    from rolecall.runtime.engine.sampling import Sampling

    assert Sampling(do_sample=False, temperature=0.0).temperature == 0.0


@pytest.mark.parametrize("field, edge, past, says", [
    ("max_tokens", 1, 0, "max_tokens must be an integer ≥ 1"),
    ("top_p", TINY, 0.0, "top_p must be in (0, 1]"),
    ("n", 1, 2, "n must be 1"),
    ("best_of", 1, 2, "best_of is not supported"),
    ("seed", 0, -1, "seed must be an integer in [0, 2**32)"),
])
def test_the_servers_completion_fields_at_their_range_ends(field, edge, past, says):
    from rolecall.runtime.server.protocol import ProtocolError, parse_completion

    parsed = parse_completion({"prompt": "x", field: edge})
    if field in ("max_tokens", "top_p", "seed"):
        assert getattr(parsed, field) == edge
    with pytest.raises(ProtocolError) as info:
        parse_completion({"prompt": "x", field: past})
    assert info.value.param == field and info.value.status == 400 and str(info.value).startswith(says)


def test_the_servers_chat_token_limit_takes_one_and_refuses_zero():
    from rolecall.runtime.server.protocol import ProtocolError, parse_chat

    turns = [{"role": "user", "content": "x"}]
    assert parse_chat({"messages": turns, "max_completion_tokens": 1}).max_tokens == 1
    with pytest.raises(ProtocolError) as info:
        parse_chat({"messages": turns, "max_completion_tokens": 0})
    assert info.value.param == "max_completion_tokens"


# -- prompts and token ids ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("least", [1, 2, 5])
def test_a_token_limit_at_its_least_is_taken_and_one_less_refused(least):
    from rolecall.runtime.prompts import PromptError, check_max_new_tokens

    assert check_max_new_tokens(least, least=least) == least
    with pytest.raises(PromptError, match=rf"^max_new_tokens must be a whole number of tokens ≥ {least}, got "
                                          rf"{least - 1}; generate at least {least} token"):
        check_max_new_tokens(least - 1, least=least)


def test_a_prompt_and_its_new_tokens_may_fill_the_context_exactly():
    """Three tokens and five new ones fit a context of 8 and not one of 7."""
    from rolecall.core.models import ContextLengthError
    from rolecall.runtime.prompts import check_prompts

    assert check_prompts([[1, 2, 3]], vocab_size=10, max_new_tokens=5, context=8) == [[1, 2, 3]]
    with pytest.raises(ContextLengthError, match=r"\(3 tokens\) plus max_new_tokens 5 is 8 tokens, more than"):
        check_prompts([[1, 2, 3]], vocab_size=10, max_new_tokens=5, context=7)


def test_token_ids_run_from_zero_to_one_below_the_vocabulary():
    from rolecall.core.tokens import TokenIdError, check_token_ids

    check_token_ids([[0, 9], torch.tensor([9, 0])], 10, "seq {n}")
    with pytest.raises(TokenIdError, match=r"^seq 2 has token id 10, the model's vocabulary has 10 ids \(0-9\)"):
        check_token_ids([[9], torch.tensor([10])], 10, "seq {n}")
    with pytest.raises(TokenIdError, match=r"^seq 1 has token id -1"):
        check_token_ids([[-1]], None, "seq {n}")


# -- the manifest --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, edge, past, says", [
    ("layers.role", 2, 3, r"layers\.role\[1\] is 3, outside \{0 full, 1 selection, 2 sparse\}"),
    ("layers.role", 0, -1, r"layers\.role\[1\] is -1, outside"),
    ("heads.role", 1, 2, r"heads\.role\[0, 1\] is 2, outside \{0 sparse, 1 retrieval\}"),
    ("heads.role", 0, -1, r"heads\.role\[0, 1\] is -1, outside"),
])
def test_manifest_roles_at_the_ends_of_their_sets(name, edge, past, says):
    from rolecall.core.manifest import ManifestError, RoleManifest
    from tests.test_bad_input_api import manifest, rewritten, set_value

    raw = manifest().to_bytes()
    loaded = RoleManifest.from_bytes(rewritten(raw, set_value(name, 1, edge)))
    field = loaded.layer_role if name == "layers.role" else loaded.head_role.flatten()
    assert int(field[1]) == edge
    with pytest.raises(ManifestError, match=says):
        RoleManifest.from_bytes(rewritten(raw, set_value(name, 1, past)))


def test_manifest_counts_and_sliding_layers_at_their_range_ends():
    """num_kv_heads is a positive integer like the other counts; sliding layers lie in [0, num_layers)."""
    from rolecall.core.manifest import ManifestError, ModelIdentity, RoleManifest

    RoleManifest(ModelIdentity(2, 1, 1, 1, sliding_layers=[0, 1]))
    with pytest.raises(ManifestError, match=r"^model\.num_kv_heads must be a positive integer, got 0"):
        RoleManifest(ModelIdentity(2, 1, 0, 1))
    with pytest.raises(ManifestError, match=r"^model\.sliding_layers holds layer -1, but the model has 2 layers \(0-1\)"):
        RoleManifest(ModelIdentity(2, 1, 1, 1, sliding_layers=[-1]))


def test_a_manifest_of_the_current_schema_loads_and_one_newer_is_refused():
    from rolecall.core.manifest import SCHEMA_VERSION, ManifestError, RoleManifest
    from tests.test_bad_input_api import manifest, rewritten

    def version(v):
        def change(header, data):
            header["__metadata__"]["schema_version"] = str(v)
        return change

    raw = manifest().to_bytes()
    assert RoleManifest.from_bytes(rewritten(raw, version(SCHEMA_VERSION))).layer_role.tolist() == [0, 1, 2, 2]
    with pytest.raises(ManifestError, match=f"manifest schema {SCHEMA_VERSION + 1} is newer than this rolecall reads"):
        RoleManifest.from_bytes(rewritten(raw, version(SCHEMA_VERSION + 1)))


# -- calibration, training, evaluation and tuning settings ---------------------------------------------------------------
CALIBRATE_ENDS = [
    *[(name, 1, 0, f"{name} must be an integer ≥ 1") for name in
      ("num_prompts", "max_new_tokens", "stride", "chunk_size", "query_block", "bins", "page_size")],
    ("recent_pages", {"recent_pages": 1, "num_pages": 1}, {"recent_pages": 0, "num_pages": 1},
     "recent_pages must be an integer ≥ 1"),
    *[(name, 0, -1, f"{name} must be an integer ≥ 0") for name in ("min_context", "warmup", "seed")],
    ("num_pages", {"num_pages": 8, "recent_pages": 8}, {"num_pages": 7, "recent_pages": 8}, "must be ≥ recent_pages"),
    ("min_gap", 1, 0, "min_gap must be ≥ 1"),
    ("num_delta", 1, 0, "num_delta must be an integer ≥ 1 or 'auto'"),
    ("target_recall", 1.0, UP, r"target_recall must be in \(0, 1\]"),
    ("target_recall", TINY, 0.0, r"target_recall must be in \(0, 1\]"),
    ("budget", 1.0, UP, r"budget must be a fraction in \(0, 1\]"),
    ("budget", {"budget": TINY, "min_budget": 0.0}, {"budget": 0.0, "min_budget": 0.0}, "budget must be a fraction"),
    ("min_budget", 0.0, -TINY, r"min_budget must be in \[0, budget\]"),
    ("min_budget", {"budget": 0.5, "min_budget": 0.5}, {"budget": 0.5, "min_budget": 0.5 + TINY}, "min_budget must be"),
    ("temperature", TINY, 0.0, "temperature must be a finite number > 0"),
    ("top_p", 1.0, UP, r"top_p in \(0, 1\]"),
    ("top_p", TINY, 0.0, r"top_p in \(0, 1\]"),
    ("max_traces", 1, 0, "max_traces must be ≥ 1"),
]


@pytest.mark.parametrize("field, edge, past, says", CALIBRATE_ENDS)
def test_the_calibration_config_at_its_range_ends(field, edge, past, says):
    from rolecall.calibrate.config import CalibrateConfig
    from rolecall.core.configfile import ConfigError

    edge, past = (v if isinstance(v, dict) else {field: v} for v in (edge, past))
    taken = CalibrateConfig(**edge)
    assert all(getattr(taken, k) == v for k, v in edge.items())
    with pytest.raises(ConfigError, match=f"^calibration config: .*{says}"):
        CalibrateConfig(**past)


TRAIN_ENDS = [
    ("target", 1, 0, "target 0 asks for no retrieval heads"),
    *[(name, 1, 0, f"{name} must be a positive integer, got 0") for name in
      ("steps", "batch_size", "prefill_chunk", "checkpoint_every", "num_samples", "num_passkeys", "passkey_words")],
    ("lr", 10.0, 10.0 * UP, r"lr .* is out of range; give a finite rate in \(0, 10\]"),
    ("lr", TINY, 0.0, r"lr 0\.0 is out of range"),
    ("lambda_lr", 1e6, 1e6 * UP, r"lambda_lr .* is out of range; give a finite rate in \(0, 1e6\]"),
    ("lambda_lr", TINY, 0.0, r"lambda_lr 0\.0 is out of range"),
    ("min_gate_prob", 0.0, -TINY, r"min_gate_prob must be in \[0, 0\.5\)"),
    ("min_gate_prob", 0.5 - TINY, 0.5, r"min_gate_prob must be in \[0, 0\.5\)"),
    ("token_budget", 1, 0, r"token_budget must be a fraction in \(0, 1\] \(e\.g\. 0\.3\) or a token count >= 1"),
    ("token_budget", 1.0, UP, r"token_budget must be a fraction in \(0, 1\]"),
    ("token_budget", TINY, 0.0, r"token_budget must be a fraction in \(0, 1\]"),
    ("low", -TINY, 0.0, r"low/high must satisfy low < 0 < 1 < high, got \(0\.0, 1\.1\)"),
    ("high", UP, 1.0, r"low/high must satisfy low < 0 < 1 < high, got \(-0\.1, 1\.0\)"),
    ("lengths", (1, 1), (0, 1), "lengths must be two token counts low <= high"),
    ("lengths", (5, 5), (6, 5), "lengths must be two token counts low <= high"),
]


@pytest.mark.parametrize("field, edge, past, says", TRAIN_ENDS)
def test_the_training_config_at_its_range_ends(field, edge, past, says):
    from rolecall.train.config import TrainConfig

    assert getattr(TrainConfig(**{field: edge}), field) == edge
    with pytest.raises(ValueError, match=f"^{says}"):
        TrainConfig(**{field: past})


def test_a_count_token_budget_below_every_samples_keys_is_taken_and_one_reaching_them_refused():
    """budget_tokens: an int is a count clamped to [1, keys], a fraction ceil(budget · keys) at least 1. A count
    one below the longest sample's 10 keys leaves one key out; a fraction whose ceiling reaches 10 leaves none."""
    from rolecall.train.config import check_budget
    from rolecall.train.hybrid import budget_tokens

    assert [budget_tokens(b, 10) for b in (9, 10, 11, 0.91, 0.9, 0.01)] == [9, 10, 10, 10, 9, 1]
    check_budget(9, [10], "s{n}")
    check_budget(0.9, [10], "s{n}")
    for budget in (10, 0.91):
        with pytest.raises(ValueError, match=f"^--token-budget {budget} keeps every token of every sample"):
            check_budget(budget, [10], "s{n}")


def test_an_evaluation_makes_at_least_two_tokens():
    from rolecall.eval.runner import EvalSettings
    from rolecall.runtime.prompts import PromptError

    assert EvalSettings(max_new_tokens=2).max_new_tokens == 2
    with pytest.raises(PromptError, match=r"^max_new_tokens must be a whole number of tokens ≥ 2 \(the first token "
                                          r"comes from the dense prefill\), got 1"):
        EvalSettings(max_new_tokens=1)


@pytest.mark.parametrize("field, edge, past", [
    ("batch", 1, 0), ("time_tokens", 2, 1), ("context", 1, 0), ("eval_batch", 1, 0), ("max_drop", TINY, 0.0),
])
def test_the_tuning_settings_at_their_range_ends(field, edge, past):
    from rolecall.eval.tune import TuneSettings

    assert getattr(TuneSettings(**{field: edge}), field) == edge
    with pytest.raises(ValueError, match=f"^{field} {past!r}: give"):
        TuneSettings(**{field: past})


def test_tuning_takes_a_budget_and_a_refine_of_one_and_refuses_zero():
    from rolecall.eval.tune import candidates

    got = candidates(["layers"], ("delta",), (1,), (1,))
    assert [(c.policy, c.budget, c.refine) for c in got[1:]] == [("delta", 1, 1)]
    with pytest.raises(ValueError, match=r"^budgets \[1, 0\]: give at least one token budget of at least 1"):
        candidates(["layers"], ("delta",), (1, 0))
    with pytest.raises(ValueError, match=r"^refine \[1, 0\]: give whole numbers of at least 1"):
        candidates(["layers"], ("delta",), (1,), (1, 0))

