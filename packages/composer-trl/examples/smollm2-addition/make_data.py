"""Write the two-digit addition task as composer-train reads it: train.jsonl (prompt, answer, chosen, rejected) and
test.jsonl (held-out sums: the first --test of the task's fixed held-out set, the same for every --seed),
chat-formatted for an instruct model.

    python make_data.py [--train 512] [--test 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from composer_core.tasks.addition import split_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=512)
    p.add_argument("--test", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    train, test = split_rows(args.seed, args.train, args.test)
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        Path(name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"wrote {name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
