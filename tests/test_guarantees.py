"""The promises checked against closed forms and brute force, not against the code's own output: vAttention's
sample size (the CLT bound of its paper's Algorithm 2, written out here in plain floats), the recall selector's
greedy choice (every candidate scored by hand), Hoyer sparsity's documented edge cases."""

from __future__ import annotations

import itertools
import math
from statistics import NormalDist

import pytest
import torch

from rolecall.calibrate.select_recall import RecallSelector
from rolecall.calibrate.stats import hoyer_sparsity
from rolecall.runtime.policies.vattention import VAttention


# -- vAttention: the sample size -------------------------------------------------------------------------------------
def clt_sample_size(logits: list[float], values: list[list[float]], fixed_out: list[float], n_r: int,
                    epsilon: float, delta: float) -> int:
    """b = max(b_N, b_D) for one query head, from the pilot's logits (less the fixed set's log-sum-exp) and
    values: b_D = (z n_r σ_D / (η D̂))², b_N = (z n_r √tr Σ_N / (η ‖N̂‖))², z = Φ⁻¹(1 − δ/4), η = ε / (2 + ε),
    D̂ = 1 + n_r mean(e), N̂ = fixed_out + n_r mean(e v); sample variances over the pilot (c − 1)."""
    c = len(logits)
    e = [math.exp(s) for s in logits]
    mean_e = sum(e) / c
    var_e = sum((x - mean_e) ** 2 for x in e) / (c - 1)
    d = len(values[0])
    x = [[e[i] * values[i][j] for j in range(d)] for i in range(c)]
    mean_x = [sum(x[i][j] for i in range(c)) / c for j in range(d)]
    trace = sum((x[i][j] - mean_x[j]) ** 2 for i in range(c) for j in range(d)) / (c - 1)
    z = NormalDist().inv_cdf(1 - delta / 4)
    eta = epsilon / (2 + epsilon)
    d_hat = 1 + n_r * mean_e
    n_hat = math.sqrt(sum((fixed_out[j] + n_r * mean_x[j]) ** 2 for j in range(d)))
    b_d = (z * n_r * math.sqrt(var_e) / (eta * d_hat)) ** 2
    b_n = (z * n_r * math.sqrt(trace) / (eta * n_hat)) ** 2
    return min(n_r, math.ceil(max(b_d, b_n))), b_d, b_n


def sample_size(policy: VAttention, logits, values, fixed_out, n_r: int) -> int:
    t = torch.tensor
    got = policy._sample_size(t(logits, dtype=torch.float64)[None, None, None], t(values, dtype=torch.float64)[None, None],
                              t(fixed_out, dtype=torch.float64)[None, None, None], torch.tensor([[n_r]]))
    return int(got.item())


PILOT_LOGITS = [-3.1, -2.4, -4.0, -2.9, -3.6, -2.2, -3.3, -2.7]


@pytest.mark.parametrize("epsilon, delta", [(0.1, 0.05), (0.05, 0.01), (0.3, 0.2)])
def test_the_sample_size_is_the_clt_bound_when_the_denominator_decides(epsilon, delta):
    """One value for every token and a fixed set's output three times it: ‖N̂‖ grows faster than D̂, so b_D
    decides (with the fixed output equal to the value the two bounds would tie)."""
    values = [[1.0, 0.5]] * len(PILOT_LOGITS)
    fixed_out = [3.0, 1.5]
    want, b_d, b_n = clt_sample_size(PILOT_LOGITS, values, fixed_out, 20000, epsilon, delta)
    assert b_d > b_n and 8 < want < 20000  # the case is the one named, and the bound binds
    policy = VAttention(epsilon=epsilon, delta=delta, pilot=len(PILOT_LOGITS))
    assert sample_size(policy, PILOT_LOGITS, values, fixed_out, 20000) == want


def test_the_sample_size_is_the_clt_bound_when_the_numerator_decides():
    """Zero-mean values (signs alternate): N̂ is small, so b_N decides and asks for far more draws than b_D."""
    values = [[(-1.0) ** i * (1 + 0.2 * i), (-1.0) ** (i // 2)] for i in range(len(PILOT_LOGITS))]
    fixed_out = [0.05, -0.02]
    want, b_d, b_n = clt_sample_size(PILOT_LOGITS, values, fixed_out, 10 ** 7, 0.1, 0.05)
    assert b_n > 4 * b_d and want < 10 ** 7
    policy = VAttention(epsilon=0.1, delta=0.05, pilot=len(PILOT_LOGITS))
    assert sample_size(policy, PILOT_LOGITS, values, fixed_out, 10 ** 7) == want


def test_a_residual_the_pilot_covers_is_read_whole_and_the_cap_binds():
    policy = VAttention(epsilon=0.1, delta=0.05, pilot=len(PILOT_LOGITS))
    values = [[1.0, 0.0]] * len(PILOT_LOGITS)
    assert sample_size(policy, PILOT_LOGITS, values, [1.0, 0.0], len(PILOT_LOGITS)) == len(PILOT_LOGITS)
    capped = VAttention(epsilon=0.01, delta=0.05, pilot=len(PILOT_LOGITS), max_sample=16)
    spread = [[1.0 + i, 0.0] for i in range(len(PILOT_LOGITS))]
    assert clt_sample_size(PILOT_LOGITS, spread, [1.0, 0.0], 5000, 0.01, 0.05)[0] > 16
    assert sample_size(capped, PILOT_LOGITS, spread, [1.0, 0.0], 5000) == 16


# -- the recall selector: greedy, each step the best addition ---------------------------------------------------------
def mean_recall_by_hand(recall: list[list[float]], chosen: set[int], warmup: int) -> float:
    """Mean over sparse layers l (past the warm-up, not chosen) of recall[s][l], s the nearest chosen layer below."""
    sparse = [layer for layer in range(warmup, len(recall)) if layer not in chosen]
    if not sparse:
        return 1.0
    return sum(recall[max(s for s in chosen if s < layer)][layer] for layer in sparse) / len(sparse)


def greedy_by_hand(recall: list[list[float]], warmup: int, count: int) -> list[int]:
    chosen = {warmup}
    while len(chosen) < count:
        candidates = [c for c in range(warmup + 1, len(recall)) if c not in chosen]
        best = max(candidates, key=lambda c: (mean_recall_by_hand(recall, chosen | {c}, warmup), -c))
        chosen.add(best)
    return sorted(chosen)


def test_the_last_layer_is_chosen_when_it_is_the_best_addition():
    """Layers 3 and 4 follow layer 2 well and layer 5 does not: the best second Δ-layer is the last one."""
    r = [[0.0] * 6 for _ in range(6)]
    r[2][3], r[2][4], r[2][5] = 0.9, 0.9, 0.1
    r[3][4], r[3][5], r[4][5] = 0.5, 0.2, 0.2
    recall = torch.tensor(r)
    assert RecallSelector(warmup=2)(recall, recall, 2) == [2, 5] == greedy_by_hand(r, 2, 2)
    # auto with a target no set below all layers reaches: every layer past the warm-up, no empty max()
    assert RecallSelector(warmup=2, target_recall=1.0)(recall, recall, "auto") == [2, 3, 4, 5]


def test_the_greedy_choice_matches_brute_force_scoring_on_random_matrices():
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        layers, warmup = 9, 1 + trial % 2
        r = torch.rand(layers, layers, generator=g, dtype=torch.float64).tolist()
        for count in range(1, layers - warmup + 1):
            got = RecallSelector(warmup=warmup)(torch.tensor(r), torch.tensor(r), count)
            assert got == greedy_by_hand(r, warmup, count), (trial, count)
    # and on a small model the greedy pick at two layers is the exhaustive optimum here (checked by enumeration)
    r = [[0.0] * 6 for _ in range(6)]
    r[2][3], r[2][4], r[2][5], r[3][4], r[3][5], r[4][5] = 0.9, 0.9, 0.1, 0.5, 0.2, 0.2
    best = max(({2, c} for c in range(3, 6)), key=lambda s: mean_recall_by_hand(r, s, 2))
    assert sorted(best) == RecallSelector(warmup=2)(torch.tensor(r), torch.tensor(r), 2)


# -- Hoyer sparsity: the documented edge cases -------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 7, 64])
def test_hoyer_sparsity_of_an_all_zero_row_is_zero_as_documented(n):
    assert hoyer_sparsity(torch.zeros(n)).item() == 0.0
    assert hoyer_sparsity(torch.zeros(3, n)).tolist() == [0.0, 0.0, 0.0]
    assert hoyer_sparsity(torch.zeros(n, dtype=torch.float64), torch.tensor(n)).item() == 0.0


def test_hoyer_sparsity_matches_its_formula_on_every_two_level_row():
    """Rows of k equal entries and n − k zeros: ‖p‖₁/‖p‖₂ = √k, so the sparsity is (√n − √k)/(√n − 1)."""
    n = 10
    for k, scale in itertools.product(range(1, n + 1), (0.01, 3.0)):
        row = torch.zeros(n, dtype=torch.float64)
        row[:k] = scale
        want = (math.sqrt(n) - math.sqrt(k)) / (math.sqrt(n) - 1)
        assert hoyer_sparsity(row).item() == pytest.approx(want, rel=1e-12, abs=1e-12), k


# -- the manifest: its canonical header and role sets ----------------------------------------------------------------
def test_a_manifest_whose_header_was_reformatted_is_refused():
    """The same content with its JSON header re-serialised (indented): the content hash still matches the parsed
    header, so only the canonical-bytes check stands between it and a load."""
    import json
    import struct

    from rolecall.core.manifest import ManifestError, RoleManifest
    from tests.test_bad_input_api import manifest

    raw = manifest().to_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    assert RoleManifest.from_bytes(raw).layer_role.tolist() == [0, 1, 2, 2]
    text = json.dumps(header, sort_keys=True, indent=1).encode()
    text += b" " * (-len(text) % 8)
    with pytest.raises(ManifestError, match="content hash is not-canonica"):
        RoleManifest.from_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


@pytest.mark.parametrize("value", [2, -1])
def test_head_roles_outside_zero_and_one_are_refused(value):
    from rolecall.core.manifest import ManifestError, RoleManifest
    from tests.test_bad_input_api import manifest, rewritten, set_value

    bad = rewritten(manifest().to_bytes(), set_value("heads.role", 3, value))
    with pytest.raises(ManifestError, match=rf"heads.role\[1, 1\] is {value}, outside {{0 sparse, 1 retrieval}}"):
        RoleManifest.from_bytes(bad)


def test_delta_keeps_no_more_recent_pages_than_pages():
    """``budget=100`` of 16-token pages is 7 pages: the default of 8 recent pages becomes 7; 8 asked for
    explicitly is refused."""
    from rolecall.runtime.policies import PolicyError, get_policy

    policy = get_policy("delta", budget=100, page_size=16)
    assert policy.num_pages == 7 and policy.recent_pages == 7
    with pytest.raises(PolicyError, match="recent_pages"):
        get_policy("delta", budget=100, page_size=16, recent_pages=8)


# -- boundaries: the inclusive end of every documented range ---------------------------------------------------------
def test_lychee_top_p_takes_the_fewest_blocks_whose_mass_reaches_p_exactly():
    """LycheeDecode's top-p mode keeps the smallest set of blocks holding at least ``top_p`` of the mass: with four
    equal blocks and p = 0.5 two reach it exactly (a third is one too many); with two halves one does."""
    from rolecall.runtime.policies.lychee import Lychee

    policy = Lychee(top_p=0.5, recent=0)
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    chosen = policy._choose(torch.tensor([[[0.25, 0.25, 0.25, 0.25]]]), valid)
    assert sorted(int(i) for i in chosen.flatten() if i >= 0) == [0, 1]
    chosen = policy._choose(torch.tensor([[[0.5, 0.5, 0.0, 0.0]]]), valid)
    assert sorted(int(i) for i in chosen.flatten() if i >= 0) == [0]
    chosen = policy._choose(torch.tensor([[[0.1, 0.6, 0.2, 0.1]]]), valid)  # 0.6 alone passes 0.5
    assert sorted(int(i) for i in chosen.flatten() if i >= 0) == [1]


def test_vattention_heavy_hitters_reach_the_slot_just_before_the_window():
    """Slots 0..7, one sink, a window of 4 (slots 4..7): the candidates are slots 1..3, and slot 3, the highest,
    is the newest slot outside the window. With exactly as many candidates as heavy hitters, all come back."""
    from rolecall.runtime.policies.vattention import heavy_hitters

    scores = torch.tensor([[[0.0, 0.0, 0.0, 9.0, 1.0, 1.0, 1.0, 1.0]]])
    first = torch.tensor([0])
    assert heavy_hitters(scores, first, 7, sinks=1, window=4, heavy=2).tolist() == [[[3, 1]]]
    got = heavy_hitters(torch.tensor([[[5.0, 1.0, 2.0, 3.0, 9.0, 9.0, 9.0, 9.0]]]), first, 7, sinks=1, window=4, heavy=3)
    assert sorted(got.flatten().tolist()) == [1, 2, 3]


@pytest.mark.parametrize("pieces, stop, cut", [
    ([b"xEN", b"D"], "END", 4),  # all but its last character given out before
    ([b"ab\n", b"\n", b"zz"], "\n\n", 4),  # a two-character stop one character at a time
    ([b"a", b"E", b"N", b"D", b"more"], "END", 4),
])
def test_a_stop_string_split_across_deliveries_is_found_when_it_is_the_last_one(pieces, stop, cut):
    """The stop string's first characters went out in earlier pieces and its last comes now: found at once, at the
    fewest ids that hold it (each id a byte)."""
    from rolecall.runtime.engine.text import TokenText, cut_at_stop
    from tests.runtime.test_token_text import Bytes

    text = TokenText(Bytes(), [stop])
    for piece in pieces:
        text.add(list(piece))
        if text.stop_cut() is not None:
            break
    ids = list(b"".join(pieces))
    assert text.stop_cut() == cut == cut_at_stop(Bytes(), ids, [stop])


def test_the_stopper_finishes_a_row_at_its_limit_and_pads_it_after():
    """Rows with limits 2 and 5: after two tokens row 0 is finished and later steps write padding (0) for it; row
    1 runs on. An EOS ends a row on the step that emits it."""
    from rolecall.runtime.engine.generate import Stopper

    s = Stopper(2, [2, 5], [], 0, "cpu")
    s(torch.tensor([7, 8]))
    assert s.finished.tolist() == [False, False]
    s(torch.tensor([7, 8]))
    assert s.finished.tolist() == [True, False]
    s(torch.tensor([9, 9]))
    assert s.out.tolist() == [[7, 7, 0, 0, 0], [8, 8, 9, 0, 0]]
    e = Stopper(1, [5], [4], 0, "cpu")
    e(torch.tensor([3]))
    e(torch.tensor([4]))
    assert e.finished.tolist() == [True] and e.out.tolist() == [[3, 4, 0, 0, 0]]


def test_a_row_of_the_scheduler_with_one_token_to_make_makes_one():
    """max_new_tokens = 1: the prefill's token is the whole answer (RowStopper.set_row finishes the row there)."""
    from rolecall.runtime.engine.batcher import RowStopper

    stopper = RowStopper(2, 1, 0, "cpu")
    assert stopper.set_row(0, 1, [], 5) is True
    assert stopper.set_row(1, 2, [], 5) is False
    assert stopper.set_row(1, 3, [9], 9) is True  # its first token is its EOS


@pytest.mark.parametrize("field, edge, past", [("temperature", 2, 2.0000001), ("temperature", 0, -1e-9),
                                               ("top_p", 1, 1.0000001)])
def test_the_servers_sampling_ranges_include_their_ends(field, edge, past):
    """OpenAI's documented ranges: temperature in [0, 2], top_p in (0, 1]; the ends are accepted, just past them
    refused naming the field."""
    from rolecall.runtime.server.protocol import ProtocolError, parse_completion

    assert getattr(parse_completion({"prompt": "hi", field: edge}), field) == edge
    with pytest.raises(ProtocolError) as info:
        parse_completion({"prompt": "hi", field: past})
    assert info.value.param == field and info.value.status == 400


def test_a_lethe_budget_of_exactly_one_loads():
    """A layer that keeps its whole context has budget 1.0, the closed end of (0, 1]: it round-trips through a
    file; the next float32 above 1 is refused."""
    import struct

    from rolecall.core.manifest import ManifestError, RoleManifest
    from tests.test_bad_input_api import manifest, rewritten, set_value

    m = manifest(layer_budget=[1.0, 1.0, 0.5, 1.0])
    assert RoleManifest.from_bytes(m.to_bytes()).layer_budget.tolist() == [1.0, 1.0, 0.5, 1.0]
    above = struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", 1.0))[0] + 1))[0]
    with pytest.raises(ManifestError, match=r"layers\.budget\[2\] is 1\.0000001"):
        RoleManifest.from_bytes(rewritten(m.to_bytes(), set_value("layers.budget", 2, above)))


# -- a second planted set: worked by hand -------------------------------------------------------------------------------
def test_head_sparsity_is_each_heads_hoyer_sum_over_its_layers_count():
    """Two heads of one layer with Hoyer sums 0.4 and 0.8 over 2 recorded rows: 0.2 and 0.4, whose mean is the
    layer's 0.3."""
    from rolecall.calibrate.totals import CalibrationTotals

    t = CalibrationTotals.zeros(1, 2, 1)
    t.hoyer_sum[0, :, 0] = torch.tensor([0.4, 0.8], dtype=t.hoyer_sum.dtype)
    t.hoyer_count[0, 0] = 2
    means = t.means()
    assert means["head_sparsity"][0].tolist() == pytest.approx([0.2, 0.4])
    assert float(means["head_sparsity"].mean()) == pytest.approx(float(means["layer_sparsity"].mean()))


def test_auto_peaks_stop_at_a_recall_that_meets_the_target_exactly():
    from rolecall.calibrate.select_peaks import PeaksSelector

    chosen = PeaksSelector(warmup=0, min_gap=1, target_recall=0.5)(torch.tensor([0.0, 0.3, 0.1]),
                                                                  torch.full((3, 3), 0.5), "auto")
    assert chosen == [0]  # layer `warmup` is always the first Δ-layer, and it alone already reaches 0.5


def test_resume_takes_the_latest_of_several_checkpoints(tmp_path):
    from rolecall.train.checkpoint import checkpoint_path, latest_checkpoint

    out = tmp_path / "h.safetensors"
    for step in (2, 4, 10):
        path = checkpoint_path(out, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    assert latest_checkpoint(out) == checkpoint_path(out, 10)


def test_lethes_breakpoint_keeps_the_candidates_whose_mass_reaches_tau_exactly():
    """Scores 2, 1, 1 (total 4), tau 0.5: the first candidate alone holds 2 = tau × total, so one is kept."""
    from rolecall.runtime.policies.lethe import Lethe

    kept = Lethe(budget=16, tau=0.5, segments=1)._segmented(torch.tensor([2.0, 1.0, 1.0]), torch.ones(3, dtype=torch.bool), 3)
    assert kept.tolist() == [True, False, False]


def test_vattention_sample_size_uses_the_unbiased_variance_of_the_pilot():
    """Pilot weights e = 1 and 3 (unbiased variance 2), values 0 (so b_N = 0), fixed output 1, n_r = 100,000:
    b = ⌈(z n_r √2 / (η (1 + 2 n_r)))²⌉ = 4223 at ε = δ = 0.05."""
    from rolecall.runtime.policies.vattention import VAttention

    v = VAttention()
    logits = torch.tensor([0.0, math.log(3.0)], dtype=torch.float32).view(1, 1, 1, 2)
    got = v._sample_size(logits, torch.zeros(1, 1, 2, 4), torch.ones(1, 1, 1, 4), torch.tensor([[100000]]))
    z, eta, n_r = NormalDist().inv_cdf(1 - v.delta / 4), v.epsilon / (2 + v.epsilon), 100000
    want = math.ceil((z * n_r * math.sqrt(2.0) / (eta * (1 + 2 * n_r))) ** 2)
    assert want == 4223 and int(got.flatten()[0]) == pytest.approx(want, abs=1)


def test_a_sliding_layer_past_the_last_layer_is_refused():
    """Layers 0..L-1 of a 3-layer model; L and -1 are refused, naming the first one outside."""
    from rolecall.core.manifest import ManifestError, ModelIdentity, RoleManifest

    roles = torch.tensor([0, 1, 2], dtype=torch.int8)
    for sliding, bad in (([3], 3), ([-1], -1), ([0, 4], 4)):
        with pytest.raises(ManifestError, match=f"model.sliding_layers holds layer {bad}, but the model has 3 layers"):
            RoleManifest(ModelIdentity(3, 2, 1, 4, sliding_layers=sliding), layer_role=roles)
    for sliding in ([2], [0], [0, 1, 2]):
        assert RoleManifest(ModelIdentity(3, 2, 1, 4, sliding_layers=sliding), layer_role=roles).model.sliding_layers \
            == sliding


def test_the_servers_seed_range_is_every_32_bit_value():
    from rolecall.runtime.server.protocol import ProtocolError, parse_completion

    assert parse_completion({"prompt": "x", "seed": 2**32 - 1}).seed == 2**32 - 1
    for bad in (2**32, -1):
        with pytest.raises(ProtocolError) as info:
            parse_completion({"prompt": "x", "seed": bad})
        assert info.value.param == "seed"


def test_passkey_lengths_take_one_from_each_stratum_up_to_the_top():
    import numpy as np

    from rolecall.data.passkey import spread_lengths

    for seed in range(5):
        assert sorted(spread_lengths(0, 1, 2, np.random.default_rng(seed))) == [0, 1]
        assert sorted(spread_lengths(5, 9, 5, np.random.default_rng(seed))) == [5, 6, 7, 8, 9]


# -- more range ends, worked by hand ----------------------------------------------------------------------------------
def test_lychee_threshold_keeps_a_block_whose_share_equals_it():
    """Threshold mode keeps every block whose share of the mass is at least the threshold: shares 0.25, 0.25,
    0.4, 0.1 at a threshold of 0.25 keep blocks 0, 1 and 2 (the two at exactly 0.25 included)."""
    from rolecall.runtime.policies.lychee import Lychee

    policy = Lychee(threshold=0.25, recent=0)
    chosen = policy._choose(torch.tensor([[[0.25, 0.25, 0.4, 0.1]]]), torch.ones(1, 1, 4, dtype=torch.bool))
    assert sorted(int(i) for i in chosen.flatten() if i >= 0) == [0, 1, 2]


def test_vattention_reads_a_residual_as_large_as_the_pilot_whole():
    """Equal pilot logits and values: both variances are 0, so the CLT bound asks for no draw (one, the least
    sample). A residual of exactly ``pilot`` slots is still read whole (the pilot already cost that much); one slot
    more takes the bound's single draw."""
    policy = VAttention(pilot=8)
    logits, values, fixed_out = [-2.0] * 8, [[1.0, 0.5]] * 8, [1.0, 0.5]
    _, b_d, b_n = clt_sample_size(logits, values, fixed_out, 9, policy.epsilon, policy.delta)
    assert b_d < 1e-20 and b_n < 1e-20
    assert sample_size(policy, logits, values, fixed_out, 8) == 8
    assert sample_size(policy, logits, values, fixed_out, 9) == 1


def test_the_row_samplers_top_p_drops_a_token_once_the_mass_before_it_reaches_p():
    """Four equal logits (probability 1/4 each, exact in binary): the mass before the k-th token is (k − 1)/4. At
    top_p = 0.5 the third token's prior mass 0.5 already reaches p, so two tokens can be drawn; at 0.75, three.
    Over 400 steps every allowed token comes up and no other."""
    from rolecall.runtime.engine.sampling import RowSampler, Sampling

    rows = RowSampler(2, "cpu")
    rows.set_row(0, Sampling(do_sample=True, top_p=0.5, seed=1), 0)
    rows.set_row(1, Sampling(do_sample=True, top_p=0.75, seed=2), 0)
    logits = torch.zeros(2, 4)
    drawn = torch.stack([rows(logits) for _ in range(400)])  # [steps, rows]
    assert [len(set(drawn[:, r].tolist())) for r in (0, 1)] == [2, 3]


def test_a_long_stop_string_split_across_deliveries_is_found_beside_a_short_one():
    """Stops "!" and "END": "EN" went out before and "D" comes now, so the look-back must reach back the longest
    stop's length less one (two characters), not the shortest's (none). Found at once, at 4 ids (each id a byte)."""
    from rolecall.runtime.engine.text import TokenText
    from tests.runtime.test_token_text import Bytes

    text = TokenText(Bytes(), ["!", "END"])
    text.add(list(b"xEN"))
    assert text.stop_cut() is None
    text.add(list(b"D"))
    assert text.stop_cut() == 4 and text.stop_text() == "xEND"



# -- a third planted set: range ends and refusals, worked by hand -----------------------------------------------------
def test_a_top_p_of_zero_is_refused_and_the_least_positive_one_taken():
    """top_p lies in (0, 1]: 0 keeps no token and is refused naming the field; any positive value is taken."""
    from rolecall.runtime.engine.sampling import Sampling

    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        Sampling(do_sample=True, top_p=0.0)
    assert Sampling(do_sample=True, top_p=1e-9).top_p == 1e-9


def test_a_lethe_budget_of_zero_is_refused_and_the_least_positive_one_loads():
    """(0, 1] is open at 0: a layer that keeps nothing is refused naming the field and its place; the smallest
    positive float32 loads."""
    from rolecall.core.manifest import ManifestError, RoleManifest
    from tests.test_bad_input_api import manifest, rewritten, set_value

    m = manifest(layer_budget=[1.0, 1.0, 0.5, 1.0])
    with pytest.raises(ManifestError, match=r"layers\.budget\[2\] is 0\.0, not a fraction in \(0, 1\]"):
        RoleManifest.from_bytes(rewritten(m.to_bytes(), set_value("layers.budget", 2, 0.0)))
    tiny = float(torch.finfo(torch.float32).smallest_normal)
    assert RoleManifest.from_bytes(rewritten(m.to_bytes(), set_value("layers.budget", 2, tiny))).layer_budget[2] > 0


@pytest.mark.parametrize("field", ["num_layers", "num_heads", "head_dim"])
def test_a_model_count_of_zero_is_refused_naming_it(field):
    """The identity's counts are positive integers: 0 is refused in one line naming the field; 1 is taken."""
    from rolecall.core.manifest import ManifestError, ModelIdentity, RoleManifest

    counts = {"num_layers": 1, "num_heads": 1, "num_kv_heads": 1, "head_dim": 1}
    RoleManifest(ModelIdentity(**counts))
    with pytest.raises(ManifestError, match=rf"model\.{field} must be a positive integer, got 0"):
        RoleManifest(ModelIdentity(**{**counts, field: 0}))


def test_auto_peaks_make_every_layer_a_delta_layer_when_no_smaller_set_meets_the_target():
    """Sparse layers recall 0.5 of the mass and the target is 1: only a set with no sparse layer (recall 1 by
    definition) reaches it, so all three layers after a warm-up of 0 are Δ-layers."""
    from rolecall.calibrate.select_peaks import PeaksSelector

    chosen = PeaksSelector(warmup=0, min_gap=1, target_recall=1.0)(torch.tensor([0.0, 0.3, 0.1]),
                                                                  torch.full((3, 3), 0.5), "auto")
    assert chosen == [0, 1, 2]


def test_the_servers_top_k_takes_minus_one_as_off_and_refuses_below_it():
    """top_k ≥ 0, with 0 and -1 both meaning off: -1 is taken as 0, -2 refused naming the field."""
    from rolecall.runtime.server.protocol import ProtocolError, parse_completion

    assert parse_completion({"prompt": "x", "top_k": -1}).top_k == 0
    with pytest.raises(ProtocolError) as info:
        parse_completion({"prompt": "x", "top_k": -2})
    assert info.value.param == "top_k" and info.value.status == 400
