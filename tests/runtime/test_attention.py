import pytest
import torch

from rolecall.runtime.attention import keep_mask, passthrough, repeat_kv, use_attention
from tests.tiny import FAMILIES, tiny_model

CASES = [(family, kv) for family in FAMILIES for kv in (1, 4)]


def _batch():
    ids = torch.randint(0, 256, (2, 23))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding on the second row
    return ids, mask


@pytest.mark.parametrize("family, kv_heads", CASES)
def test_passthrough_leaves_logits_identical_and_restores(family, kv_heads):
    model = tiny_model(family, layers=2, heads=4, kv_heads=kv_heads)
    ids, mask = _batch()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        with use_attention(model, passthrough(), name="rolecall-test"):
            assert model.config._attn_implementation == "rolecall-test"
            inside = model(ids, attention_mask=mask).logits
        after = model(ids, attention_mask=mask).logits
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(before, inside)
    assert torch.equal(before, after)


def test_function_is_really_called_and_restored_on_error():
    model = tiny_model("qwen3", layers=3)
    seen = []
    inner = passthrough()

    def spy(module, *args, **kwargs):
        seen.append(module.layer_idx)
        return inner(module, *args, **kwargs)

    ids = torch.randint(0, 256, (1, 9))
    with pytest.raises(RuntimeError, match="boom"), use_attention(model, spy):
        model(ids)
        raise RuntimeError("boom")
    assert seen == [0, 1, 2]
    assert model.config._attn_implementation == "sdpa"
    seen.clear()
    model(ids)
    assert seen == []


def test_a_different_function_changes_the_output():
    """The context really routes attention through our function (a uniform-attention stand-in differs)."""
    model = tiny_model("llama", layers=2)
    ids = torch.randint(0, 256, (1, 12))

    def uniform(module, query, key, value, attention_mask, **kwargs):
        keep = keep_mask(attention_mask, query.shape[2], key.shape[2]).float()
        weights = keep / keep.sum(-1, keepdim=True)
        v = repeat_kv(value, query.shape[1] // value.shape[1])
        return (weights @ v).transpose(1, 2).contiguous(), None

    with torch.no_grad():
        dense = model(ids).logits
        with use_attention(model, uniform):
            flat = model(ids).logits
    assert not torch.allclose(dense, flat, atol=1e-3)


def test_keep_mask_forms_agree():
    causal = keep_mask(None, 3, 5)
    assert causal.shape == (1, 1, 3, 5)
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal[0, 0], expected)
    additive = torch.zeros(1, 1, 3, 5).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert torch.equal(keep_mask(additive, 3, 5), causal)
    assert torch.equal(keep_mask(causal, 3, 5), causal)


def test_repeat_kv_matches_repeat_interleave():
    x = torch.randn(2, 3, 7, 4)
    assert torch.equal(repeat_kv(x, 3), x.repeat_interleave(3, dim=1))
