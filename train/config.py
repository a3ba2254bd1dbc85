"""Training configuration in layers: dataclass defaults, then a YAML file (``configs/train/*.yaml`` by name,
or any path), then explicit overrides (CLI flags). The resolved config is written next to the outputs and
into the manifest's ``config`` metadata."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rolecall.core.configfile import layered, read_config, shipped

MIXED_PRECISION = ("no", "bf16")  # fp16 would need loss scaling, whose skipped steps the NaN check stops on

# The rates a run accepts, (low, high] with low excluded. Both are finite, so inf and nan never reach a step.
# lr: Adam moves each gate parameter by about lr per step, and the parameters live in log space clamped to
# [-ln 1e3, ln 1e3] (rolecall.train.gates.GateParameters.clamp_), about 13.8 wide: above 10 one step crosses most of the
# range, so every gate flips between its ends instead of learning (the recipes use 0.01-0.02).
LR_RANGE = (0.0, 10.0)
# lambda_lr: λ grows by lambda_lr · (E[L0] − goal) a step, the gap being at most the number of gates (below 1e4
# for any model in reach), and λ · E[L0] is weighed against a distillation loss of 1e4-1e5 (SmolLM2). At 1e6 one
# step already puts λ orders of magnitude past any such loss; beyond it only float32 overflow changes
# (`--lambda-lr 1e38` makes the gradients inf in the first steps), not the run (the recipes use 3-8).
LAMBDA_LR_RANGE = (0.0, 1e6)
RATE_FLAGS = {"lr": ("--lr", LR_RANGE, "0.01"), "lambda_lr": ("--lambda-lr", LAMBDA_LR_RANGE, "3.0")}


def rate_problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` as the rate ``name`` (a key of :data:`RATE_FLAGS`), or None."""
    _, (low, high), _ = RATE_FLAGS[name]
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "is not a number"
    if isinstance(value, bool) or not math.isfinite(number):
        return "is not a finite number"
    if not low < number <= high:
        return "is out of range"
    return None


def rate_fix(name: str) -> str:
    """What to pass instead, for a message about the rate ``name``: its range and an example."""
    _, (low, high), example = RATE_FLAGS[name]
    return f"a finite rate in ({_short(low)}, {_short(high)}], e.g. {example}"


def _short(x: float) -> str:
    return f"{x:g}".replace("e+0", "e").replace("e+", "e")  # 1e6, not 1e+06


@dataclass
class TrainConfig:
    """Everything that decides a training run. Defaults follow LycheeDecode (3000 steps, batch 1, lr 0.01,
    stretch (−0.1, 1.1), 30 % token budget, 32 retrieval heads)."""

    model: str = "smollm2-135m"
    model_name: str | None = None  # the name recorded in the manifest (default: the model's alias or id)
    gate: str = "hardkuma"  # a name in rolecall.train.gates.GATES
    target: int = 32  # retrieval heads wanted among the gated (layer >= 1, KV head) pairs
    steps: int = 3000
    batch_size: int = 1  # samples per step (the global batch: split over the processes of a multi-GPU run)
    lr: float = 0.01  # Adam, gate parameters
    # gradient ascent on the Lagrange multiplier. Its right size follows the distillation loss (a sum over the
    # vocabulary, 1e4-1e5 for SmolLM2); with 3.0 and lr 0.02 SmolLM2 ends on 8 heads for a target of 8 with 84 of
    # 87 gates decided (artifacts/smollm2-135m/), 10 and 30 overshot the target; the paper does not give a value
    lambda_lr: float = 3.0
    # every gate keeps P(z = 0) in [min_gate_prob, 1 − min_gate_prob] (rolecall.train.gates.GateParameters.constrain_), so
    # neither the distillation loss nor λ loses its grip on a gate that has made up its mind; E[L0] is then driven
    # to target (1 − 2p) + n p, what `target` decided gates count (GateParameters.l0_goal)
    min_gate_prob: float = 0.01
    token_budget: float | int = 0.3  # fraction of the keys (<= 1.0) or a fixed count of tokens (int)
    prefill_chunk: int = 1000
    low: float = -0.1
    high: float = 1.1
    exact_target: bool = False  # roles: top-`target` gates by E[z] instead of E[z] > 0.5
    # hybrid models: gates of sliding-window layers are held open (z = 1) and left out of E[L0] and the target;
    # True gates them like any other layer
    include_sliding: bool = False
    seed: int = 0
    # recompute attention scores in backward instead of keeping them (the reference layer, rolecall.train.hybrid;
    # on a GPU the fused kernels of rolecall.train.hybrid_kernel keep none either way)
    gradient_checkpointing: bool = True
    mixed_precision: str = "no"  # accelerate autocast: no | bf16
    tf32: bool = True  # TF32 tensor cores for the reference layer's float32 attention scores on GPUs
    dtype: str | None = None  # model weights when the CLI loads it (None: the alias's default)
    device_map: str | None = None  # "auto" spreads a model over the visible GPUs
    deepspeed: str | None = None  # a DeepSpeed JSON (path or configs/deepspeed/ name) whose ZeRO-3 shards the model
    random_weights: bool = False  # the model's architecture with random weights: speed and memory only
    checkpoint_every: int = 100
    # data: "passkey" builds rolecall.data.passkey.build_passkey_dataset; otherwise a .jsonl file of
    # {"input_ids": [...], "labels": [...]} records
    dataset: str = "passkey"
    data_source: str = "pg-essays"
    lengths: tuple[int, int] = (1000, 10000)
    num_samples: int = 64
    num_passkeys: int = 10
    passkey_words: int = 32
    output: str | None = None  # default artifacts/<model>.heads.safetensors
    plots: bool = True

    def __post_init__(self):
        from rolecall.train.gates import GATES  # torch: imported when a config is made, not for --help

        if self.gate not in GATES:
            raise ValueError(f"gate {self.gate!r} is unknown; choose one of {', '.join(sorted(GATES))}")
        t = self.target
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"target {t!r} asks for no retrieval heads, and at least 1 is needed; pass --target N "
                             "with N >= 1 (and at most the model's gated heads)")
        for name in ("steps", "batch_size", "prefill_chunk", "checkpoint_every", "num_samples", "num_passkeys",
                     "passkey_words"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in RATE_FLAGS:
            problem = rate_problem(name, getattr(self, name))
            if problem:
                raise ValueError(f"{name} {getattr(self, name)!r} {problem}; give {rate_fix(name)}")
            setattr(self, name, float(getattr(self, name)))
        if not 0.0 <= float(self.min_gate_prob) < 0.5:
            raise ValueError(f"min_gate_prob must be in [0, 0.5) (0 turns the bound off), got {self.min_gate_prob!r}")
        self.min_gate_prob = float(self.min_gate_prob)
        b = self.token_budget
        if isinstance(b, bool) or not ((isinstance(b, int) and b >= 1) or (isinstance(b, float) and 0 < b <= 1)):
            raise ValueError(f"token_budget must be a fraction in (0, 1] (e.g. 0.3) or a token count >= 1, got {b!r}")
        if not (self.low < 0 < 1 < self.high):
            raise ValueError(f"low/high must satisfy low < 0 < 1 < high, got ({self.low}, {self.high})")
        from rolecall.core.models import DTYPES

        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}, got {self.mixed_precision!r}")
        lengths = tuple(int(x) for x in self.lengths)
        if len(lengths) != 2 or not 1 <= lengths[0] <= lengths[1]:
            raise ValueError(f"lengths must be two token counts low <= high, got {self.lengths!r}")
        self.lengths = lengths

    def resolved_output(self) -> Path:
        if self.output:
            return Path(self.output)
        return Path("artifacts") / f"{model_slug(self.model)}.heads.safetensors"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["lengths"] = list(self.lengths)
        return d


def model_slug(name: str) -> str:
    """A file-name-safe short name: an alias as is, the last part of an id or path, without .gguf."""
    last = Path(name.rstrip("/")).name or name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", re.sub(r"\.gguf$", "", last))


def shipped_configs() -> dict[str, Path]:
    return shipped("train")


def read_yaml(name_or_path: str) -> dict[str, Any]:
    """The mapping in a training config: a path, or the name of one in configs/train/."""
    return read_config(name_or_path, "training config", "train")


def build_config(yaml_config: str | None = None, **overrides: Any) -> TrainConfig:
    """Defaults, then the YAML, then ``overrides`` whose value is not None.

    Without ``yaml_config``, a shipped ``configs/train/<model>.yaml`` named after the model alias is the YAML
    layer, so every model can carry settings that suit it (context length, step cost); its variants,
    ``configs/train/<model>.<variant>.yaml``, are read only when named.
    """
    if yaml_config is None:
        model = overrides.get("model") or TrainConfig.model
        if model in shipped_configs():
            yaml_config = model
    values: dict[str, Any] = read_yaml(yaml_config) if yaml_config else {}
    return layered(TrainConfig, values, overrides, what=f"training config {yaml_config}" if yaml_config
                   else "training config")


def check_settings(config: TrainConfig, model_cfg, allow_long: bool = False) -> int | None:
    """Refuse, in one line and before any data is built or weights load, a ``target`` the model has no room for
    and passkey ``lengths`` beyond its context (a warning with ``allow_long``). Returns the context limit."""
    from rolecall.core.models import check_context, context_limit
    from rolecall.train.hybrid import GateLayout

    text = model_cfg.get_text_config() if hasattr(model_cfg, "get_text_config") else model_cfg
    num_kv = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    layout = GateLayout.of(model_cfg, config.include_sliding)
    gated = layout.gated_heads(num_kv)
    if config.target > gated:
        held = f", less {len(layout.held)} held-open layer(s)" if layout.held else ""
        raise ValueError(f"target {config.target} is more than the {gated} gated heads of {config.model} "
                         f"(layers 1..{layout.num_layers - 1} × {num_kv} KV heads{held}); pass --target N with "
                         f"1 <= N <= {gated}")
    limit = context_limit(model_cfg, config.model)
    if config.dataset == "passkey":
        lo, hi = config.lengths
        check_context(hi, limit, f"the longest haystack of --lengths {lo},{hi}",
                      f"pass --lengths within {limit} (the prompt around the haystack adds a few dozen tokens)",
                      allow_long, "train-heads")
    return limit


def check_dataset(dataset, config: TrainConfig, model_cfg, limit: int | None, allow_long: bool = False) -> None:
    """Refuse, in one line and before the model loads, a sample with a token id outside the model's vocabulary,
    one whose labels mark no target after a prompt, one longer than its context (a warning with ``allow_long``),
    and a ``token_budget`` that covers every key of every sample (nothing would be sparse)."""
    import torch

    from rolecall.core.models import check_context
    from rolecall.core.tokens import check_token_ids, vocab_size

    what = "passkey sample {n}" if config.dataset == "passkey" else f"sample {{n}} of {config.dataset}"
    ids = [torch.as_tensor(dataset[i]["input_ids"]).reshape(-1) for i in range(len(dataset))]
    check_token_ids(ids, vocab_size(model_cfg), what)
    keys = [target_keys(ids[i], dataset[i]["labels"], what.replace("{n}", str(i + 1))) for i in range(len(ids))]
    check_budget(config.token_budget, keys, what)
    if not ids or (config.dataset == "passkey" and limit is not None and config.lengths[1] > limit):
        return  # check_settings has refused or warned already
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    fix = "lower --lengths" if config.dataset == "passkey" else "cut it or pass shorter samples"
    check_context(len(ids[longest]), limit, what.replace("{n}", str(longest + 1)), fix, allow_long, "train-heads")


def config_json(config: TrainConfig) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, indent=2) + "\n"


def target_keys(input_ids, labels, name: str) -> int:
    """The keys the student reads at a sample's last target (its prompt and target span, as
    :func:`rolecall.train.distill.split_sample` cuts them), or a one-line refusal naming the sample (``name``) when its
    labels mark no target, mark the very first token, or differ in length from its input_ids."""
    import torch

    ids, lab = torch.as_tensor(input_ids).reshape(-1), torch.as_tensor(labels).reshape(-1)
    if ids.shape != lab.shape:
        raise ValueError(f"{name} has {ids.numel()} input_ids but {lab.numel()} labels; give both lists the same "
                         "length (labels -100 except on the target tokens)")
    where = torch.nonzero(lab != -100).flatten()
    if where.numel() == 0:
        raise ValueError(f"{name} has no target tokens (all {lab.numel()} labels are -100); label the answer tokens "
                         "with their ids, or leave the sample out")
    if int(where[0]) < 1:
        raise ValueError(f"{name} labels its first token as a target; put a prompt before the first target")
    return int(where[-1])


def check_budget(budget: float | int, keys: list[int], what: str) -> None:
    """Refuse a token budget that keeps every key of every sample (``keys``: per sample, the keys its last target
    reads; ``what``: how to name sample n): the sparse heads would then read what the full ones read, the
    distillation loss would sit at rounding noise and no gate could learn a role."""
    from rolecall.train.hybrid import budget_tokens

    if not keys or any(budget_tokens(budget, k) < k for k in keys):
        return
    longest = max(range(len(keys)), key=keys.__getitem__)
    sample = what.replace("{n}", str(longest + 1))
    raise ValueError(f"--token-budget {budget} keeps every token of every sample (the longest, {sample}, reads "
                     f"{keys[longest]} keys at its last target): sparse heads would read what full ones read and no "
                     f"gate could learn; pass a count below {keys[longest]} or a fraction below 1 such as 0.3")
