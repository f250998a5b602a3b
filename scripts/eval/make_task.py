"""Writes a small multiple-choice task for lm-evaluation-harness from the corpus attnres ships
(data/shakespeare.txt.gz), so that evaluation needs no data from the Hugging Face hub.

    python scripts/eval/make_task.py --out DIR [--items 200] [--seed 0]
    lm_eval --include_path DIR --tasks attnres_next_line ...

The task, `attnres_next_line`: given three consecutive lines of a play, which of four lines
comes next? One is the line that follows; three are lines drawn from elsewhere in the held-out
text with a length close to it. Items come only from the documents training holds out for
validation (every 10th document, indices 9, 19, ..., split as attnres splits the corpus:
documents end at two blank lines), so a model trained here has not seen them. Scored by
log-likelihood of each choice after the context (`acc`, and `acc_norm`, per byte); chance is
25%. DIR gets `next_line.jsonl` (context, choices, label) and `attnres_next_line.yaml`.
"""
import argparse
import gzip
import json
import os
import random

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASK = "attnres_next_line"


def held_out_documents(text):
    docs = [d.strip("\n") for d in text.replace("\r\n", "\n").split("\n\n\n")]
    docs = [d for d in docs if d.strip()]
    return [d for i, d in enumerate(docs) if i % 10 == 9]


def items(text, count, seed):
    rng = random.Random(seed)
    lines = [line for doc in held_out_documents(text) for line in doc.split("\n")]
    # Verse and prose lines only: not speaker names ("ROMEO:"), stage directions or blanks.
    spoken = [i for i, s in enumerate(lines) if len(s) >= 20 and not s.endswith(":") and not s.startswith("[")]
    spoken_set = set(spoken)
    starts = [i for i in spoken if all(j in spoken_set for j in range(i, i + 4))]
    out = []
    for i in rng.sample(starts, count):
        context, answer = lines[i : i + 3], lines[i + 3]
        pool = sorted(spoken, key=lambda j: abs(len(lines[j]) - len(answer)))
        near = [lines[j] for j in pool[:200] if lines[j] != answer and j not in range(i, i + 4)]
        choices = rng.sample(near, 3) + [answer]
        rng.shuffle(choices)
        out.append({"context": "\n".join(context) + "\n", "choices": choices, "label": choices.index(answer)})
    return out


YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with gzip.open(os.path.join(ROOT, "data", "shakespeare.txt.gz"), "rt", encoding="utf-8") as f:
        text = f.read()
    os.makedirs(args.out, exist_ok=True)
    data = os.path.abspath(os.path.join(args.out, "next_line.jsonl"))
    with open(data, "w", encoding="utf-8") as f:
        for item in items(text, args.items, args.seed):
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    with open(os.path.join(args.out, f"{TASK}.yaml"), "w") as f:
        f.write(YAML.format(task=TASK, data=json.dumps(data)))
    print(f"wrote {args.items} items to {data} and the task {TASK} to {args.out}")


if __name__ == "__main__":
    main()
