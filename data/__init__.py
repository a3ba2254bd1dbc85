"""Datasets for rolecall, offline by default.

* ``rolecall.data.passkey``: passkey-in-haystack training prompts (DuoAttention / LycheeDecode) and a single-passkey
  needle-in-a-haystack evaluation grid.
* ``rolecall.data.ruler``: a RULER-style synthetic suite (needles, variable tracking, common and frequent words) for
  any tokenizer and length, with RULER's string-match scorer.
* ``rolecall.data.hotpotqa``: HotpotQA distractor-setting prompts with answer targets.
* ``rolecall.data.reasoning``: calibration prompts (CHAMP by default, a user JSONL, or generated arithmetic).
* ``rolecall.data.corpora``: haystack text sources (``pg-essays``, ``booksum[:WHERE]``, ``text:PATH``).

Every builder returns a ``rolecall.data.tokens.TokenDataset`` (a ``torch.utils.data.Dataset`` of dicts with 1-D
``input_ids`` and ``labels``), cached under ``rolecall.core.models.cache_dir() / "data"``. ``build_dataset(name,
tokenizer, **options)`` selects a builder by name, for configs.
"""

from rolecall.data.builders import BUILDERS, build_dataset, builder, check_names

__all__ = ["BUILDERS", "build_dataset", "builder", "check_names"]
