#!/usr/bin/env python3
"""Checks train.py's packed rows against the text they were made from: every two-hop question's
--bridge-aux target sits on the question's last token (the one that predicts the answer's first
token) and spells the bridge entity as the documents do, and that bridge is the one the documents
link to the question's first entity ("The <rel> of <E1> is <E2>." in one of four templates); rows of
other tasks carry no target. The answers' positions and kinds are checked on the way. Exits 1 with
the first mismatch. CPU, a few seconds (ctest TrainRecipe.RowsMatchText).

Usage: python3 tools/train/check_rows.py [--rows 40]
"""
import argparse
import os
import random
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tasks"))
import rag_tasks as R  # noqa: E402
import train as T  # noqa: E402

QUESTION = re.compile(re.escape(R.TWOHOP_QUESTION).replace(r"\{attr\}", "(.+)").replace(r"\{rel\}", "(.+)")
                      .replace(r"\{e1\}", "(.+)"))


def linked(docs, rel, e1, e2):
    return any(t.format(rel=rel, e1=e1, e2=e2) in docs for t in R.LINK_TEMPLATES)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=40, help="rows per task")
    a = ap.parse_args()
    enc, dec, tid = T.load_tokenizer(os.path.join(T.TOKENIZER_DIR, "tokenizer.json"))
    eos = tid("<|im_end|>")
    rng = random.Random(16)
    n_targets = 0
    for task in ("twohop", "twohop_drill", "lookup", "first_hop", "aggregate"):
        rows = []
        for _ in range(a.rows):
            doc_tok = [rng.randint(20, 120) for _ in range(rng.randint(2, 8))]
            ids, kind, block, bridge = T.build_row(rng, enc, task, doc_tok, eos)
            if not len(ids) == len(kind) == len(block) == len(bridge):
                raise SystemExit(f"{task}: ids {len(ids)}, kind {len(kind)}, block {len(block)}, bridge {len(bridge)}")
            rows.append((ids, kind, block, task, bridge))
        for i, (x, y, kd, blk, bt, br) in enumerate([T.pack([r], eos) for r in rows]):
            ids, kind, _, _, bridge = rows[i]
            docs = dec([t for t, k in zip(ids, kind) if k == 0])
            starts = [p for p in range(1, len(ids)) if kind[p] == 2 and kind[p - 1] == 1]  # answers' first tokens
            targets = [p for p, b in enumerate(bridge) if b]
            if task not in ("twohop", "twohop_drill"):
                if targets:
                    raise SystemExit(f"{task} row {i}: bridge targets at {targets} in a task without bridges")
                continue
            if targets != [p - 1 for p in starts]:
                raise SystemExit(f"{task} row {i}: targets at {targets}, answers start at {starts}")
            for p in targets:
                q_start = max(q for q in range(p + 1) if kind[q] == 1 and (q == 0 or kind[q - 1] != 1))
                m = QUESTION.search(dec(ids[q_start: p + 1]))
                name = dec(bridge[p])
                if not m:
                    raise SystemExit(f"{task} row {i}: no two-hop question before position {p}")
                if not name.startswith(T.NAME_LEAD) or not linked(docs, m.group(2), m.group(3), name.strip()):
                    raise SystemExit(f"{task} row {i}: bridge {name!r} is not the {m.group(2)} of {m.group(3)} "
                                     "in the documents")
                if name not in docs:
                    raise SystemExit(f"{task} row {i}: {name!r} is not spelled as in the documents")
                packed = [int(t) for t in br[0, p] if t >= 0]
                if packed != bridge[p][: T.BRIDGE_TOKENS] or int(y[0, p]) != ids[p + 1]:
                    raise SystemExit(f"{task} row {i}: packed target {packed} / next token {int(y[0, p])} at {p}")
                n_targets += 1
    if n_targets < a.rows:
        raise SystemExit(f"only {n_targets} bridge targets in {2 * a.rows} two-hop rows")
    print(f"ok: {n_targets} bridge targets in {2 * a.rows} two-hop rows, none in other tasks' rows")


if __name__ == "__main__":
    main()
