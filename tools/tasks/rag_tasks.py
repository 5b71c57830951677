#!/usr/bin/env python3
"""Synthetic multi-document (RAG-style) tasks for hypic, in the segment layout hypic serves.

Pure Python 3 standard library. Output is a JSONL stream, one object per prompt:

    {"task", "id", "segments": [system, doc1, ..., docN, question], "answer",
     "answers": [acceptable strings], "metric": "em" | "f1" | "rougeL", "meta": {...}}

("meta" says where the answer lives: document index, entity, attribute, items; harnesses may ignore it.)

The same (task, seed, n, options) always gives bit-identical output: prompt i is drawn from its own
random.Random seeded with the string "hypic-rag/<task>/<seed>/<i>" (string seeds hash with SHA-512,
so PYTHONHASHSEED does not matter).

Prompt text (what a model sees) is every segment followed by "\\n", concatenated; the question
segment ends in "Answer:", so the model's answer starts right after "Answer:\\n". Segments never
start with whitespace, so tokenising each segment (with its "\\n") on its own gives the same ids as
tokenising the concatenation with the Qwen-style pre-tokenizer (see models/hypic-mini/README.md).

Tasks (modelled on the benchmarks the HYPIC paper used):

  lookup     TriviaQA-like. Documents of filler text hold facts "the <attribute> of <entity> is
             <value>" about synthetic entities (1-3 facts a document; every (entity, attribute)
             pair occurs once in the prompt). Distractors are the same attributes of other
             entities and other attributes of the asked entity. Exactly one document holds the
             asked fact. Metric: exact match (em).
  twohop     HotpotQA-like. "The <relation> of <E1> is <E2>" in one document; the asked attribute
             of E2 in a different document. Distractors: other relation chains whose targets carry
             the same attribute, the same attribute of E1 itself, other attributes of E2. Metric: em
             against the value, or "E2: value" (an answer that names the bridge first).
  aggregate  MultiNews/GovReport-like. Every document is a shipment record holding exactly one
             cargo item; the answer lists the cargo of every document in document order,
             ", "-separated. Metric: ROUGE-L F1 over normalised words (order matters).

Facts sit at a random sentence boundary of their document, at the very first tokens with
probability >= 1/4 (where PIC seams act). Filler is generated from about 20 sentence templates over
word lists (several hundred words), so no two documents repeat the same text.

Lengths: document lengths are asked for in tokens but produced in words, with
TOKENS_PER_WORD = 1.3 assumed; the hypic-mini BPE (models/hypic-mini) actually gives about 1.15
tokens a word on this text (measured on the "moderate" evaluation set), so documents come out about
12% shorter in its tokens than asked. Lengths are approximate either way.

Chance levels (python3 rag_tasks.py --chance --n 1000, default options 4-32 documents of 100-1000
tokens; they barely depend on the lengths):
  lookup     em 0.043 guessing a random value of the asked attribute from its whole value list;
             em 0.31 guessing among the values of that attribute present in the prompt (a strong
             "right type, wrong entity" baseline).
  twohop     em 0.027 random value of the asked attribute; 0.30 among that attribute's values in
             the prompt.
  aggregate  rougeL 0.10 for a list of the right length of random cargo items; 0.0 for an empty
             answer.

Usage:
  python3 tools/tasks/rag_tasks.py --task lookup --n 300 --seed 1 \\
      [--min-docs 4 --max-docs 32 --min-doc-tokens 100 --max-doc-tokens 1000] > out.jsonl
  python3 tools/tasks/rag_tasks.py --task twohop --second-hop ...   (each prompt's second hop alone,
      a lookup of the bridge entity: where two-hop answers fail, docs/quality.md)
  python3 tools/tasks/rag_tasks.py --chance [--task lookup] [--n 2000]
  python3 tools/tasks/rag_tasks.py --score preds.jsonl --gold out.jsonl
      (preds.jsonl: one {"id", "prediction"} a line; prints the mean score per task as JSON)
"""

import argparse
import json
import re
import string
import sys
import random

TASKS = ("lookup", "twohop", "aggregate")
METRIC = {"lookup": "em", "twohop": "em", "aggregate": "rougeL"}
TOKENS_PER_WORD = 1.3
SYSTEM = "You are a careful assistant. Read the documents below and answer the question at the end using only facts stated in them."

# ------------------------------------------------------------------------------------------------
# word lists
NOUNS = (
    "river bridge tower market garden harbor valley forest village council report season engine "
    "library museum station school factory workshop orchard meadow canal island mountain road "
    "tunnel castle temple square fountain theater stadium hospital airport lighthouse mill barn "
    "cottage palace courtyard archive ledger letter journal diary map chart compass lantern clock "
    "bell drum banner flag statue painting mural carpet basket bottle kettle ladder rope wagon "
    "carriage boat ship raft sail anchor net hammer chisel shovel plow fence gate wall roof window "
    "door staircase corridor cellar attic balcony chimney storm flood drought harvest festival "
    "parade ceremony meeting debate lecture concert exhibition survey census committee guild union "
    "crew team family neighbor visitor traveler merchant farmer sailor soldier teacher student "
    "scholar painter poet singer builder miner hunter fisher weaver baker clerk judge mayor "
    "captain pilot doctor nurse courier guard shepherd"
).split()
ADJECTIVES = (
    "old new quiet busy narrow wide ancient modern small large distant nearby northern southern "
    "eastern western hidden famous forgotten crowded empty bright dark cold warm damp dry steep "
    "gentle rough smooth heavy light careful sudden slow rapid strange ordinary rural urban "
    "wooden stone iron broken repaired painted abandoned restored tall short long brief early "
    "late local foreign public private official informal annual weekly seasonal remote central "
    "coastal inland upper lower outer inner humble grand simple elaborate muddy dusty windy "
    "sunny misty frozen flooded"
).split()
VERBS = (
    "visited repaired crossed described inspected painted measured recorded opened closed built "
    "moved carried followed watched praised criticized ignored discovered explored cleaned "
    "guarded supplied organized delayed announced celebrated questioned approved rejected studied "
    "mapped counted replaced widened restored decorated surveyed reported reached left joined "
    "funded managed planned photographed sketched mentioned remembered admired avoided noticed"
).split()
ADVERBS = (
    "quietly slowly quickly carefully eventually recently suddenly gradually often rarely "
    "usually briefly reluctantly eagerly patiently openly secretly repeatedly finally twice "
    "again early late later soon"
).split()
PLACES = (
    "near the old mill|along the river|behind the market|at the edge of town|in the valley|"
    "beside the harbor|across the bridge|on the northern road|inside the archive|under the "
    "bell tower|at the crossroads|in the upper district|by the canal|outside the gates|"
    "on the island|in the main square|past the orchard|below the cliffs|around the lake|"
    "near the station"
).split("|")
TIMES = (
    "in the spring|during the winter|last autumn|early in the morning|late at night|after the "
    "storm|before the festival|in the following weeks|at the end of the season|during the "
    "long drought|a few years earlier|on a rainy afternoon|before dawn|in the same week|"
    "shortly after noon|over the summer"
).split("|")
GROUPS = (
    "the council|the local guild|a group of students|the harbor crew|several merchants|"
    "the village elders|a traveling committee|the district office|two surveyors|the night "
    "guards|a team of builders|the school board|a family of farmers|the museum staff|"
    "the regional press|a small delegation"
).split("|")
CONNECTORS = (
    "However,|Meanwhile,|Later,|In addition,|As a result,|For this reason,|Even so,|"
    "At first,|In the end,|By then,|Nevertheless,|Afterwards,"
).split("|")
NUMWORDS = "two three four five six seven eight nine ten eleven twelve twenty thirty forty fifty hundred".split()
FILLER_TEMPLATES = (
    "The {adj} {noun} {place} was {verb} by {group} {time}.",
    "{Group} {verb} the {adj} {noun} {time}.",
    "{Conn} the {noun} {place} was {adv} {verb}.",
    "Nobody expected that the {noun} would be {verb} so {adv}.",
    "{Time}, {group} {verb} {num} {noun}s {place}.",
    "According to the {noun}, the {adj} {noun2} had been {verb} {time}.",
    "The {noun} and the {noun2} were {adv} {verb} {place}.",
    "A {adj} {noun} stood {place}, and {group} {adv} {verb} it.",
    "{Conn} {group} {verb} the {noun2} instead of the {noun}.",
    "Many people said the {noun} {place} looked {adj} {time}.",
    "The {adj} {noun} was {verb} {num} times {time}.",
    "{Group} kept a {adj} {noun} {place} for {num} years.",
    "There was a {adj} {noun} {place}, which {group} {adv} {verb}.",
    "The report about the {noun} was {verb} {time}.",
    "{Conn} the {adj} {noun2} near the {noun} was {verb}.",
    "Some {noun}s {place} were {adj}, while others were {adj2}.",
    "{Group} {adv} {verb} the {adj} {noun} and the {adj2} {noun2}.",
    "It took {num} days before the {noun} {place} was {verb}.",
    "The {noun} {place} is {adj}, {adj2} and rarely {verb}.",
    "{Time}, the {adj} {noun} was {verb} again.",
    "Visitors {adv} {verb} the {noun} {place}.",
    "The {noun2} that {group} {verb} {time} was {adj}.",
)

# entity names: synthetic, from syllables
ONSETS = "b br c d dr f g gr h j k kr l m n p pr r s st t tr v z th sh w".split()
VOWELS = "a e i o u ai ea ou ie".split()
CODAS = ["", "", "n", "r", "l", "s", "th", "k", "m", "x"]

ATTRIBUTES = {
    "favorite color": (
        "red blue green yellow purple orange white black gray brown pink teal crimson scarlet "
        "violet indigo amber ivory olive maroon navy turquoise silver golden beige lavender "
        "magenta cyan emerald cobalt"
    ).split(),
    "home city": (
        "Lisbon Oslo Vienna Prague Dublin Madrid Berlin Warsaw Athens Cairo Lima Quito Bogota "
        "Santiago Havana Nairobi Dakar Tunis Rabat Sofia Riga Tallinn Vilnius Helsinki Zagreb "
        "Belgrade Bucharest Budapest Kyiv Tbilisi Baku Tehran Kabul Delhi Dhaka Hanoi Manila "
        "Jakarta Seoul Osaka"
    ).split(),
    "lucky number": None,  # numbers 2..999
    "pet": (
        "cat dog parrot rabbit hamster turtle goldfish ferret lizard snake horse goat pony "
        "canary pigeon owl hedgehog tortoise frog duck goose donkey llama pig sheep mouse rat "
        "crow hawk spider"
    ).split(),
    "favorite fruit": (
        "apple pear plum peach cherry apricot banana mango papaya guava lemon lime orange "
        "grapefruit melon watermelon kiwi fig date grape raspberry strawberry blueberry "
        "blackberry pineapple coconut lychee pomegranate quince persimmon"
    ).split(),
    "profession": (
        "carpenter plumber architect lawyer chemist geologist dentist surgeon pharmacist "
        "librarian journalist photographer electrician mechanic engineer accountant translator "
        "astronomer botanist zoologist historian economist sculptor potter tailor jeweler "
        "florist butcher locksmith firefighter"
    ).split(),
    "birth month": "January February March April May June July August September October November December".split(),
    "favorite sport": (
        "tennis chess rowing fencing archery cycling swimming hockey cricket rugby football "
        "baseball handball volleyball badminton golf sailing skiing skating boxing wrestling "
        "climbing judo karate polo"
    ).split(),
    "instrument": (
        "violin cello piano flute oboe clarinet trumpet trombone harp guitar banjo mandolin "
        "accordion harmonica saxophone tuba bassoon drums xylophone ukulele organ lute sitar "
        "zither bagpipes"
    ).split(),
}
ATTR_NAMES = list(ATTRIBUTES)
NUMBER_VALUES = [str(n) for n in range(2, 1000)]

FACT_TEMPLATES = (
    "The {attr} of {e} is {v}.",
    "{e}'s {attr} is {v}.",
    "Records show that the {attr} of {e} is {v}.",
    "It is well known that {e}'s {attr} is {v}.",
    "As for {e}, the {attr} is {v}.",
)
LOOKUP_QUESTIONS = ("What is the {attr} of {e}?", "What is {e}'s {attr}?")

RELATIONS = ("mentor", "manager", "neighbor", "business partner", "cousin", "landlord", "tutor", "doctor")
LINK_TEMPLATES = (
    "The {rel} of {e1} is {e2}.",
    "{e2} is the {rel} of {e1}.",
    "{e1}'s {rel} is {e2}.",
    "Everyone knows that the {rel} of {e1} is {e2}.",
)
TWOHOP_QUESTION = "What is the {attr} of the {rel} of {e1}?"
FIRST_HOP_QUESTION = "Who is the {rel} of {e1}?"  # a two-hop question's first hop: the bridge's name
# A two-hop answer that names the bridge entity first ("Beamak: Kabul"): a one-line scratchpad, so
# that the second hop is a lookup of an entity just written (train.py --twohop-bridge). Gold
# answers accept it beside the bare value; a wrong bridge scores 0.
TWOHOP_BRIDGE_ANSWER = "{bridge}: {value}"

CARGO = (
    "copper|wool|salt|timber|coffee|tea|sugar|cotton|silk|tobacco|rice|wheat|barley|oats|"
    "corn|olive oil|wine|cheese|butter|leather|marble|granite|coal|iron ore|tin|zinc|nickel|"
    "lead|glass|porcelain|pepper|cinnamon|cloves|saffron|vanilla|cocoa|honey|vinegar|soap|"
    "candles|paper|ink|rope|canvas|linen|hemp|jute|rubber|cement|bricks|tiles|lumber|cork|"
    "amber|pearls|ivory|feathers|furs|dried fish|smoked ham|potatoes|onions|garlic|beans|"
    "lentils|peanuts|almonds|walnuts|raisins|apples|oranges|lemons|bananas|pineapples|"
    "tomatoes|cabbages|carrots|turnips|melons|medicine|fertilizer|nails|tools|clocks|"
    "bicycles|radios|typewriters|sewing machines|lamps|blankets|carpets|hats|boots|umbrellas|"
    "mirrors|violins|books|maps|stamps|toys|perfume|dyes|sulfur|chalk|clay"
).split("|")
CARGO_TEMPLATES = (
    "The cargo of this shipment was {x}.",
    "This shipment carried {x}.",
    "Cargo: {x}.",
    "The ship in this record was loaded with {x}.",
    "According to the manifest, the cargo was {x}.",
)
AGG_QUESTION = "List the cargo of every shipment, in the order the documents appear."

# filler must not mention cargo words, so that every cargo mention is an answer
_cargo_words = {w for c in CARGO for w in c.split()}
NOUNS = [n for n in NOUNS if n not in _cargo_words]


# ------------------------------------------------------------------------------------------------
# generation helpers
def make_name(rng):
    n = 2 if rng.random() < 0.7 else 3
    s = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(n)) + rng.choice(CODAS)
    return s.capitalize()


def unique_names(rng, k):
    out, seen = [], set()
    while len(out) < k:
        s = make_name(rng)
        if s not in seen and len(s) >= 4:
            seen.add(s)
            out.append(s)
    return out


_A_AN = re.compile(r"\b([Aa]) ([aeiou])")


def filler_sentence(rng):
    t = rng.choice(FILLER_TEMPLATES)
    group = rng.choice(GROUPS)
    time = rng.choice(TIMES)
    conn = rng.choice(CONNECTORS)
    noun, noun2 = rng.sample(NOUNS, 2)
    adj, adj2 = rng.sample(ADJECTIVES, 2)
    s = t.format(
        adj=adj, adj2=adj2, noun=noun, noun2=noun2, verb=rng.choice(VERBS), adv=rng.choice(ADVERBS),
        place=rng.choice(PLACES), time=time, Time=time[0].upper() + time[1:], group=group,
        Group=group[0].upper() + group[1:], Conn=conn, num=rng.choice(NUMWORDS),
    )
    s = _A_AN.sub(lambda m: m.group(1) + "n " + m.group(2), s)
    return s[0].upper() + s[1:]


def value_of(rng, attr):
    vals = ATTRIBUTES[attr]
    return rng.choice(NUMBER_VALUES) if vals is None else rng.choice(vals)


def values_of(attr):
    vals = ATTRIBUTES[attr]
    return NUMBER_VALUES if vals is None else vals


def build_doc(rng, target_words, facts):
    """A document of about target_words words with the fact sentences at random sentence
    boundaries (the first position with probability >= 1/4 for the first fact)."""
    sents, words = [], 0
    while words < target_words:
        s = filler_sentence(rng)
        sents.append(s)
        words += len(s.split())
    for i, f in enumerate(facts):
        if i == 0 and rng.random() < 0.25:
            pos = 0
        else:
            pos = rng.randint(0, len(sents))
        sents.insert(pos, f)
    # paragraphs: a newline between sentences now and then (never at the start or the end)
    out = sents[0]
    for s in sents[1:]:
        out += ("\n" if rng.random() < 0.08 else " ") + s
    return out


def doc_word_targets(rng, n_docs, min_tok, max_tok):
    return [max(8, int(round(rng.randint(min_tok, max_tok) / TOKENS_PER_WORD))) for _ in range(n_docs)]


def fact_sentence(rng, e, attr, v):
    return rng.choice(FACT_TEMPLATES).format(e=e, attr=attr, v=v)


# ------------------------------------------------------------------------------------------------
# tasks. Each returns (docs, qa) where qa is a list of (question, answer, answers); the first entry
# is the prompt's question, the others (all distinct facts of the same prompt) serve training.
def gen_lookup(rng, doc_words, attrs=None):
    """attrs: the attribute pool (default: all). Training passes one or two attributes so that
    every fact has same-attribute distractors and only the entity tells them apart."""
    n = len(doc_words)
    attrs = attrs or ATTR_NAMES
    ents = unique_names(rng, max(4, n + 2))
    used = set()
    doc_facts = [[] for _ in range(n)]
    facts = []
    for d in range(n):
        for _ in range(rng.randint(1, 3)):
            for _try in range(20):
                e = rng.choice(ents)
                a = rng.choice(attrs)
                if (e, a) not in used:
                    break
            else:
                continue
            used.add((e, a))
            v = value_of(rng, a)
            doc_facts[d].append(fact_sentence(rng, e, a, v))
            facts.append((d, e, a, v))
    docs = [build_doc(rng, w, f) for w, f in zip(doc_words, doc_facts)]
    rng.shuffle(facts)
    qa = []
    for d, e, a, v in facts:
        q = rng.choice(LOOKUP_QUESTIONS).format(attr=a, e=e)
        qa.append((q, v, [v], {"doc": d, "entity": e, "attribute": a}))
    return docs, qa


def gen_twohop(rng, doc_words, attrs=None, e1_distractor=0.5):
    """attrs: the attribute pool of the chains and the background facts (default: all). Training's
    two-hop drill passes one or two attributes and e1_distractor 1.0, so that every candidate value
    carries the asked attribute and only the bridge entity tells them apart (as gen_lookup's attrs
    does for one hop). The defaults draw exactly what the held-out sets always drew."""
    pool = attrs or ATTR_NAMES
    n = len(doc_words)
    m = max(1, min(8, n // 2))  # relation chains
    ents = unique_names(rng, 2 * m + n + 2)
    e1s, e2s, others = ents[:m], ents[m:2 * m], ents[2 * m:]
    used = set()
    doc_facts = [[] for _ in range(n)]
    chains = []
    for i in range(m):
        d_link = rng.randrange(n)
        rel = rng.choice(RELATIONS)
        doc_facts[d_link].append(rng.choice(LINK_TEMPLATES).format(rel=rel, e1=e1s[i], e2=e2s[i]))
        chain_attrs = rng.sample(pool, rng.randint(1, min(2, len(pool))))
        asked = []
        for a in chain_attrs:
            v = value_of(rng, a)
            d = rng.choice([x for x in range(n) if x != d_link])
            doc_facts[d].append(fact_sentence(rng, e2s[i], a, v))
            used.add((e2s[i], a))
            asked.append((a, v, d))
            # distractor: the same attribute of E1 itself, half of the time
            if rng.random() < e1_distractor and (e1s[i], a) not in used:
                used.add((e1s[i], a))
                doc_facts[rng.randrange(n)].append(fact_sentence(rng, e1s[i], a, value_of(rng, a)))
        chains.append((e1s[i], rel, e2s[i], d_link, asked))
    # background facts about other entities (the same attributes: distractors)
    for d in range(n):
        for _ in range(rng.randint(0, 2)):
            e, a = rng.choice(others), rng.choice(pool)
            if (e, a) in used:
                continue
            used.add((e, a))
            doc_facts[d].append(fact_sentence(rng, e, a, value_of(rng, a)))
    for f in doc_facts:
        rng.shuffle(f)
    docs = [build_doc(rng, w, f) for w, f in zip(doc_words, doc_facts)]
    qa = []
    for e1, rel, e2, d_link, asked in chains:
        for a, v, d in asked:
            q = TWOHOP_QUESTION.format(attr=a, rel=rel, e1=e1)
            qa.append((q, v, [v, TWOHOP_BRIDGE_ANSWER.format(bridge=e2, value=v)],
                       {"link_doc": d_link, "fact_doc": d, "bridge": e2, "attribute": a,
                        "relation": rel, "first": e1}))
    rng.shuffle(qa)
    return docs, qa


def gen_aggregate(rng, doc_words):
    n = len(doc_words)
    items = rng.sample(CARGO, n) if n <= len(CARGO) else [rng.choice(CARGO) for _ in range(n)]
    docs = [build_doc(rng, w, [rng.choice(CARGO_TEMPLATES).format(x=x)]) for w, x in zip(doc_words, items)]
    ans = ", ".join(items)
    return docs, [(AGG_QUESTION, ans, [ans], {"items": items})]


GENERATORS = {"lookup": gen_lookup, "twohop": gen_twohop, "aggregate": gen_aggregate}


def question_segment(q):
    return "Question: " + q + "\nAnswer:"


def make_prompt(rng, task, doc_words, **gen_kw):
    """(segments, qa) for one prompt with len(doc_words) documents of about doc_words[i] words.
    segments = [system, doc1..docN, question of qa[0]]; qa = [(question_text, answer, answers, meta)]."""
    docs, qa = GENERATORS[task](rng, doc_words, **gen_kw)
    return [SYSTEM] + docs + [question_segment(qa[0][0])], qa


def example(task, seed, i, min_docs, max_docs, min_tok, max_tok):
    rng = random.Random(f"hypic-rag/{task}/{seed}/{i}")
    n = rng.randint(min_docs, max_docs)
    segs, qa = make_prompt(rng, task, doc_word_targets(rng, n, min_tok, max_tok))
    q, ans, answers, meta = qa[0]
    return {
        "task": task,
        "id": f"{task}-s{seed}-{i:06d}",
        "segments": segs,
        "answer": ans,
        "answers": answers,
        "metric": METRIC[task],
        "meta": meta,
    }


def second_hop_question(meta, form=LOOKUP_QUESTIONS[0]):
    """The lookup question of a two-hop question's second hop (meta: gen_twohop's)."""
    return form.format(attr=meta["attribute"], e=meta["bridge"])


def _hop_alone(ex, tag, question, answer):
    """A two-hop example with its question replaced by one of its hops, scored as a lookup."""
    assert ex["segments"][-1].startswith("Question: What is the " + ex["meta"]["attribute"] + " of the "), \
        "not a two-hop example"
    return dict(ex, task="lookup", id=ex["id"] + tag, answer=answer, answers=[answer], metric=METRIC["lookup"],
                segments=ex["segments"][:-1] + [question_segment(question)])


def second_hop(ex):
    """A two-hop example asked its second hop alone: the asked attribute of the bridge entity, by
    name. A plain lookup, but in a prompt with link sentences ("The mentor of X is Y."), which is
    where the default model's two-hop answers fail (docs/quality.md)."""
    return _hop_alone(ex, "-hop2", second_hop_question(ex["meta"]), ex["answer"])


def first_hop_question(meta):
    """The question of a two-hop question's first hop: the bridge entity's name (meta: gen_twohop's)."""
    return FIRST_HOP_QUESTION.format(rel=meta["relation"], e1=meta["first"])


def first_hop(ex):
    """A two-hop example asked its first hop alone: who the relation of the first entity is. The
    answer is an invented name of ~3 tokens, which no other task asks the model to write; answers
    that name the bridge first ("<bridge>: <value>") need it (tools/train/README.md, attempt 16)."""
    return _hop_alone(ex, "-hop1", first_hop_question(ex["meta"]), ex["meta"]["bridge"])


def prompt_text(segments):
    """The exact prompt string: every segment followed by a newline, concatenated."""
    return "".join(s + "\n" for s in segments)


# ------------------------------------------------------------------------------------------------
# scoring (SQuAD-style normalisation: lower case, drop punctuation and articles, split on spaces)
_PUNCT = set(string.punctuation)


def normalize(s):
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return s.split()


def em(pred, answers):
    p = normalize(pred)
    return float(any(p == normalize(a) for a in answers))


def f1(pred, answers):
    p = normalize(pred)
    best = 0.0
    for a in answers:
        g = normalize(a)
        cg = {}
        for w in g:
            cg[w] = cg.get(w, 0) + 1
        cp = {}
        for w in p:
            cp[w] = cp.get(w, 0) + 1
        same = sum(min(c, cg.get(w, 0)) for w, c in cp.items())
        if not p or not g:
            best = max(best, float(p == g))
            continue
        if same == 0:
            continue
        pr, rc = same / len(p), same / len(g)
        best = max(best, 2 * pr * rc / (pr + rc))
    return best


def _lcs(a, b):
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(pred, answers):
    p = normalize(pred)
    best = 0.0
    for a in answers:
        g = normalize(a)
        if not p or not g:
            best = max(best, float(p == g))
            continue
        l = _lcs(p, g)
        if l == 0:
            continue
        pr, rc = l / len(p), l / len(g)
        best = max(best, 2 * pr * rc / (pr + rc))
    return best


SCORERS = {"em": em, "f1": f1, "rougeL": rouge_l}


def score(pred, ex):
    return SCORERS[ex["metric"]](pred, ex["answers"])


# ------------------------------------------------------------------------------------------------
def chance(task, n, args):
    """Monte-Carlo chance levels: (random value from the whole list, random value among the
    prompt's candidates of the asked type)."""
    tot_a = tot_b = 0.0
    for i in range(n):
        ex = example(task, 999999, i, args.min_docs, args.max_docs, args.min_doc_tokens, args.max_doc_tokens)
        rng = random.Random(i)
        if task == "aggregate":
            k = len(ex["meta"]["items"])
            guess = ", ".join(rng.sample(CARGO, k))
            tot_a += score(guess, ex)
            tot_b += score("", ex)
            continue
        a = ex["meta"]["attribute"]
        tot_a += score(rng.choice(values_of(a)), ex)
        text = "\n".join(ex["segments"][1:-1])
        cands = [v for v in values_of(a) if re.search(r"\b" + re.escape(v) + r"\b", text)]
        if a == "lucky number":
            cands = re.findall(r"lucky number (?:of \w+ )?is (\d+)", text)
        tot_b += score(rng.choice(cands), ex) if cands else 0.0
    return tot_a / n, tot_b / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=TASKS)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min-docs", type=int, default=4)
    ap.add_argument("--max-docs", type=int, default=32)
    ap.add_argument("--min-doc-tokens", type=int, default=100)
    ap.add_argument("--max-doc-tokens", type=int, default=1000)
    ap.add_argument("--second-hop", action="store_true",
                    help="with --task twohop: ask each prompt's second hop alone (a lookup of the bridge entity)")
    ap.add_argument("--first-hop", action="store_true",
                    help="with --task twohop: ask each prompt's first hop alone (the bridge entity's name)")
    ap.add_argument("--chance", action="store_true", help="print Monte-Carlo chance levels and exit")
    ap.add_argument("--score", metavar="PREDS", help="score a predictions JSONL against --gold")
    ap.add_argument("--gold", metavar="GOLD")
    args = ap.parse_args()
    if not (1 <= args.min_docs <= args.max_docs) or not (1 <= args.min_doc_tokens <= args.max_doc_tokens):
        ap.error("need 1 <= min <= max for documents and document tokens")

    if args.score:
        gold = {}
        with open(args.gold) as f:
            for line in f:
                ex = json.loads(line)
                gold[ex["id"]] = ex
        sums, counts = {}, {}
        with open(args.score) as f:
            for line in f:
                p = json.loads(line)
                ex = gold[p["id"]]
                sums[ex["task"]] = sums.get(ex["task"], 0.0) + score(p["prediction"], ex)
                counts[ex["task"]] = counts.get(ex["task"], 0) + 1
        print(json.dumps({t: {"score": sums[t] / counts[t], "n": counts[t], "metric": METRIC[t]} for t in sums}))
        return
    if args.chance:
        for t in [args.task] if args.task else TASKS:
            a, b = chance(t, args.n, args)
            print(json.dumps({"task": t, "metric": METRIC[t], "random_value": round(a, 4),
                              "informed" if t != "aggregate" else "empty_answer": round(b, 4)}))
        return
    if not args.task:
        ap.error("--task is required")
    if args.second_hop and args.task != "twohop":
        ap.error("--second-hop asks two-hop prompts' second hop: it needs --task twohop")
    if args.first_hop and (args.task != "twohop" or args.second_hop):
        ap.error("--first-hop asks two-hop prompts' first hop: it needs --task twohop and no --second-hop")
    out = sys.stdout
    for i in range(args.n):
        ex = example(args.task, args.seed, i, args.min_docs, args.max_docs, args.min_doc_tokens, args.max_doc_tokens)
        if args.second_hop:
            ex = second_hop(ex)
        elif args.first_hop:
            ex = first_hop(ex)
        out.write(json.dumps(ex, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
