"""RULER-style long-context eval cases: seeded, offline, scored by string match.

A case is one haystack (prefilled once) with several needles planted at the requested depths and
one or more probes (questions) about them. `build_case` makes one, `score` grades an answer.
"""

from __future__ import annotations

import math
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from kvlocal.evals.haystack import build_haystack

TASKS = ("passkey", "multikey", "lookalike", "onekey", "multivalue", "multiquery", "vartrack", "cwe", "manifest", "tray")


@dataclass(frozen=True)
class Probe:
    task: str
    question: str  # asked of the model, with "Answer with ..." guidance
    answers: tuple[str, ...]  # all must appear in the answer
    depth: float  # requested depth (0..1) of the (first) needle asked about; -1 when not applicable


@dataclass(frozen=True)
class Case:
    task: str
    text: str  # the whole document
    probes: tuple[Probe, ...]
    seed: int
    n_tokens: int  # tokens of text as counted by count_tokens


_KEYS = (
    "Lisbon|Nairobi|Oslo|Lima|Hanoi|Quito|Dakar|Tbilisi|Montevideo|Reykjavik|Santiago|Marrakesh|Bergen|Zanzibar"
    "|Tallinn|Cusco|Mandalay|Antwerp|Ljubljana|Halifax|Adelaide|Seville|Porto|Bruges|Kyoto|Cairo|Helsinki"
    "|Vilnius|Timbuktu|Havana|Belfast|Granada|Manila|Sapporo|Winnipeg|Tangier|Bologna|Odessa|Kathmandu|Dublin"
    "|the copper kettle|the glass harmonica|the wooden rocking horse|the silver thimble|the leather satchel"
    "|the porcelain teapot|the iron lantern|the wicker basket|the ivory chess set|the pewter tankard"
).split("|")
_CITIES = [k for k in _KEYS if not k.startswith("the ")]
_FIRST_NAMES = ("Marta|Tomas|Ingrid|Kwame|Lucia|Dmitri|Amara|Pavel|Sofia|Rahul|Elena|Jonas|Nadia|Omar|Greta"
                "|Mateo|Leila|Viktor|Hana|Felix").split("|")
_LAST_NAMES = ("Okafor|Lindqvist|Moreau|Petrov|Castillo|Nakamura|Brennan|Haddad|Kowalski|Mensah|Varga|Eriksen"
               "|Duarte|Sato|Novak|Quinn|Adeyemi|Falk|Romano|Iversen").split("|")
_CODE_WORDS = ("amber", "cobalt", "jade", "crimson")  # few on purpose: codes share their word
_COLORS = "blue|red|green|yellow|white|black|orange|purple|grey|brown".split("|")
_BOXES = "locker|crate|cabinet|drawer|trunk|safe|mailbox|chest|cupboard|suitcase".split("|")
_WORDS = """
apple anchor arrow badge bakery balloon bamboo banjo barrel basket beacon bicycle blanket bottle bracelet
bridge bucket buffalo butter button cabbage cactus camera candle canoe canyon carpet carrot castle cattle
cellar chimney circus cloud clover cobweb coffee comet compass copper cotton cradle crayon cricket crystal
cupboard curtain cushion daisy desert diamond dolphin donkey dragon drum eagle earring easel elbow engine
falcon feather fence ferry fiddle finger flag flute forest fossil fountain fox galaxy garden garlic giraffe
glacier glove goblet goose granite grape guitar hammer harbor harp hazel helmet hermit hippo honey horizon
hornet igloo island ivory jacket jaguar jelly jewel jungle kangaroo kettle kitten ladder lagoon lantern lemon
leopard lettuce library lighthouse lily lobster locket magnet mango maple marble meadow melon mermaid meteor
mirror mitten monkey mosaic mountain muffin mushroom napkin necklace needle nest nutmeg oasis octopus olive
onion orchard orchid ostrich otter oven owl paddle palace panda parade parrot peach peanut pebble pelican
pencil pepper piano pickle pigeon pillow pilot pine pirate plum pocket pony poppy potato pretzel puddle
pumpkin puppet quartz quill rabbit raccoon radish rainbow raisin raven ribbon river robot rocket saddle
salmon sandal satellite scarf scooter seashell shadow sheriff shovel sled snail spider sponge squirrel
stable statue stove sugar sunflower swan sweater tablet teapot telescope temple thimble thunder tiger
toaster tomato tortoise towel tractor trumpet tulip tunnel turnip umbrella unicorn valley vase velvet
village violin volcano waffle wagon walnut walrus wardrobe whale whistle willow window wizard wolf yacht
zebra acorn almond antler apron attic avocado bagel ballet banner beetle biscuit blossom bonnet boulder
broom bubble cabin canal cashew cedar cherry chess cinnamon clam coconut coral cork cottage crane crater
cucumber dune ember fern fig firefly flamingo fjord gazelle gecko ginger gondola gravel hedgehog iceberg
jasmine kayak kiwi koala lemur lime llama lotus lynx mast mint moose moth nectar noodle oak oyster pagoda
papaya pearl penguin quiche reef rhubarb saffron sapphire sardine sequoia sherbet spinach sprocket
""".split()


def _draw(rng: random.Random, used: set, make: Callable[[], str]) -> str:
    while (value := make()) in used:
        pass
    used.add(value)
    return value


def _magic(rng: random.Random, used: set) -> str:
    return _draw(rng, used, lambda: str(rng.randint(1_000_000, 9_999_999)))


def _keys(rng: random.Random, n: int) -> list[str]:
    if n > len(_KEYS):
        raise ValueError(f"at most {len(_KEYS)} depths per case for this task (got {n})")
    return rng.sample(_KEYS, n)


def _groups(depths: Sequence[float], size: int) -> list[list[float]]:
    """Depths sorted and dealt into ceil(n/size) interleaved groups, so each group spans the text."""
    ordered = sorted(depths)
    n = math.ceil(len(ordered) / size)
    return [ordered[g::n] for g in range(n)]


def _plain(rng, depths):
    """One "special magic number" needle per depth, with distinct keys and values."""
    used: set = set()
    keys = _keys(rng, len(depths))
    values = [_magic(rng, used) for _ in depths]
    needles = [(d, f"The special magic number for {k} is {v}.") for d, k, v in zip(depths, keys, values)]
    return needles, keys, values


# passkey needles: one fact per depth, each in its own words, so that several needles can share a
# haystack without looking alike (multikey and lookalike are the look-alike tasks)
_FACTS = (
    ("The combination of the harbour master's safe is {v}.", "What is the combination of the harbour master's safe?"),
    ("Professor Aldana's library card number is {v}.", "What is Professor Aldana's library card number?"),
    ("The night ferry to Moor Island is registered as vessel {v}.", "Under which vessel number is the night ferry to Moor Island registered?"),
    ("Grandmother Ines kept her savings in co-operative bank account {v}.", "Which co-operative bank account did Grandmother Ines keep her savings in?"),
    ("The lighthouse on Gull Point was rebuilt under building permit {v}.", "Under which building permit was the lighthouse on Gull Point rebuilt?"),
    ("The winning raffle ticket at the spring fair was number {v}.", "What number was the winning raffle ticket at the spring fair?"),
    ("The telescope in the old observatory carries serial number {v}.", "What serial number does the telescope in the old observatory carry?"),
    ("The password of the town archive's computer is {v}.", "What is the password of the town archive's computer?"),
    ("Captain Oduya reported cargo crate {v} missing from the manifest.", "Which cargo crate did Captain Oduya report missing?"),
    ("The bakery's secret rye recipe is locked in strongbox {v}.", "In which strongbox is the bakery's secret rye recipe locked?"),
    ("The stolen tapestry was catalogued as museum item {v}.", "As which museum item was the stolen tapestry catalogued?"),
    ("The mayor's emergency telephone extension is {v}.", "What is the mayor's emergency telephone extension?"),
    ("The seed vault at the botanical garden opens with access code {v}.", "Which access code opens the seed vault at the botanical garden?"),
)


def _passkey(rng, depths):
    if len(depths) > len(_FACTS):
        raise ValueError(f"at most {len(_FACTS)} depths per case for this task (got {len(depths)})")
    used: set = set()
    facts = rng.sample(_FACTS, len(depths))
    values = [_magic(rng, used) for _ in depths]
    needles = [(d, fact.format(v=v)) for d, (fact, _), v in zip(depths, facts, values)]
    probes = [Probe("passkey", f"{question} Answer with the number only.", (v,), d)
              for d, (_, question), v in zip(depths, facts, values)]
    return needles, probes, values


def _multikey(rng, depths):
    used, keys = set(), set()
    digits = lambda: "".join(map(str, [rng.randint(2, 9)] + rng.sample(range(10), 3)))  # noqa: E731
    probe_keys = [_draw(rng, keys, lambda: (rng.choice(_COLORS), rng.choice(_BOXES), digits())) for _ in depths]
    needles, probes, forbid = [], [], set()
    for (color, box, num), depth in zip(probe_keys, depths):
        value = _magic(rng, used)
        key = f"the {color} {box} {num}"
        needles.append((depth, f"The special magic number for {key} is {value}."))
        probes.append(Probe("multikey", f"What is the special magic number for {key} mentioned in the document? "
                                        "Answer with the number only.", (value,), depth))
        j = rng.choice([1, 2])  # swap two of the last three digits (they are distinct)
        swapped = num[:j] + num[j + 1] + num[j] + num[j + 2:]
        looks = [(color, box, swapped),
                 (rng.choice([c for c in _COLORS if c != color]), box, num),
                 (color, rng.choice([b for b in _BOXES if b != box]), num)]
        for look in rng.sample(looks, rng.randint(2, 3)):
            if look in keys:
                continue
            keys.add(look)
            needles.append((rng.random(), f"The special magic number for the {' '.join(look)} is {_magic(rng, used)}."))
        forbid |= {num, swapped}
    return needles, probes, sorted(used | forbid)


def _lookalike(rng, depths):
    """One fact per depth, all of one shape (a person from a city was issued a code), with codes that
    share their word and often their first two digits ("amber-3397", "amber-3389")."""
    if len(depths) > len(_CITIES):
        raise ValueError(f"at most {len(_CITIES)} depths per case for this task (got {len(depths)})")
    people: set = set()
    numbers: set = set()
    prefixes = [str(rng.randint(20, 99)) for _ in range(max(1, len(depths) // 3))]
    needles, probes = [], []
    for depth, place in zip(depths, rng.sample(_CITIES, len(depths))):
        person = _draw(rng, people, lambda: f"{rng.choice(_FIRST_NAMES)} {rng.choice(_LAST_NAMES)}")
        digits = _draw(rng, numbers, lambda: f"{rng.choice(prefixes)}{rng.randint(0, 99):02d}")
        code = f"{rng.choice(_CODE_WORDS)}-{digits}"
        needles.append((depth, f"{person} from {place} was issued the access code {code}."))
        probes.append(Probe("lookalike", f"What access code was {person} from {place} issued? "
                                         "Answer with the code only.", (code,), depth))
    return needles, probes, sorted(numbers)


def _codes(rng: random.Random, n: int) -> tuple[list[str], set[str]]:
    """`n` distinct codes like "amber-4452": two words for the case, 4 digits from a few two-digit
    prefixes, and about half of them a sibling of an earlier code that shares its first three digits
    ("amber-4452", "amber-4459"). Returns the codes and their digits."""
    words = rng.sample(_CODE_WORDS, 2)
    prefixes = [str(rng.randint(20, 99)) for _ in range(max(1, n // 4))]
    numbers: set = set()
    codes = []

    def stem(sibling: bool) -> str:  # the first three digits: an earlier code's (mostly) or new ones
        if sibling and rng.random() < 0.9:
            return rng.choice(codes).split("-")[1][:3]
        return f"{rng.choice(prefixes)}{rng.randint(0, 9)}"

    for _ in range(n):
        sibling = bool(codes) and rng.random() < 0.5
        digits = _draw(rng, numbers, lambda: stem(sibling) + str(rng.randint(0, 9)))
        codes.append(f"{rng.choice(words)}-{digits}")
    return codes, numbers


_HOSTS = tuple(("orion|vega|altair|rigel|deneb|sirius|antares|castor|pollux|procyon|capella|arcturus|spica"
                "|regulus|mira|bellatrix|alnitak|mintaka|saiph|electra|maia|merope|alcyone|atlas|hadar|shaula|nunki"
                "|kochab|mizar|alcor|dubhe|merak|phecda|megrez|alioth|thuban|rasalhague|sabik|zosma|denebola").split("|"))
_PARTIES = tuple(_LAST_NAMES) + tuple(("Achterberg|Bjornstad|Ciobanu|Delacroix|Esposito|Fonseca|Grunwald"
                                       "|Halvorsen|Ibarra|Jovanovic|Kaminski|Larsen|Marchetti|Nieminen|Oyelaran"
                                       "|Pereira|Rasmussen|Szabo|Takahashi|Urquhart").split("|"))
_YEARS = tuple(str(y) for y in range(1901, 1999))

# onekey: every fact of a case is one sentence with one key word changed (a place, a person's name, a
# host, a year) and a code; (fact, question, keys). Case seed s uses shape s mod 4.
ONEKEY_SHAPES = (
    ("The night-shift locker at the {key} depot opens with the access code {code}.",
     "Which access code opens the night-shift locker at the {key} depot?", tuple(_CITIES)),
    ("Clause 14 of the maintenance contract signed with Ms {key} sets the penalty reference {code}.",
     "What penalty reference does clause 14 of the maintenance contract signed with Ms {key} set?", _PARTIES),
    ("The nightly backup job on host {key} finished and logged the ticket {code}.",
     "Which ticket did the nightly backup job on host {key} log?", _HOSTS),
    ("In the harbour register, the row for the year {key} lists the mooring permit {code}.",
     "Which mooring permit does the row for the year {key} in the harbour register list?", _YEARS),
)

# the same questions in other words (each shape's in the order of ONEKEY_SHAPES): the key word verbatim,
# the rest reworded, possessives included (`kvlocal eval library --paraphrase`)
ONEKEY_PARAPHRASES = (
    ("I forgot the code of the night locker at our {key} depot. What is it?",
     "At the {key} depot, which code opens the locker used by the night shift?",
     "What is the {key} depot's night-shift locker code?"),
    ("In Ms {key}'s maintenance contract, which penalty reference does clause 14 set?",
     "Clause 14 of the contract with Ms {key}: what is its penalty reference?",
     "What penalty reference applies under clause 14 of Ms {key}'s maintenance agreement?"),
    ("What ticket was logged when the nightly backup on {key} finished?",
     "The nightly backup on host {key}: which ticket did it log?",
     "Which ticket came from {key}'s nightly backup job?"),
    ("In the harbour register, which mooring permit is listed for {key}?",
     "Which mooring permit does the harbour register list in the row for {key}?",
     "For the year {key}, what mooring permit is in the harbour register?"),
)


def _onekey(rng, depths, shape, task="onekey", make_codes=_codes):
    """One fact per depth, all the same sentence with only its key word changed, with codes from
    `make_codes` that share their letters and often their first digits; each fact asked once."""
    fact, question, all_keys = shape
    if len(depths) > len(all_keys):
        raise ValueError(f"at most {len(all_keys)} depths per case for this task (got {len(depths)})")
    keys = rng.sample(all_keys, len(depths))
    codes, numbers = make_codes(rng, len(depths))
    needles = [(d, fact.format(key=k, code=c)) for d, k, c in zip(depths, keys, codes)]
    probes = [Probe(task, question.format(key=k) + " Answer with the code only.", (c,), d)
              for d, k, c in zip(depths, keys, codes)]
    return needles, probes, sorted(numbers) + keys  # the filler neither repeats a code nor names a key


def _tag_codes(rng: random.Random, n: int) -> tuple[list[str], set[str]]:
    """`n` distinct codes like "KT-40917": one of two letter pairs for the case and 5 digits, about
    half of them a sibling of an earlier code that shares its first four digits ("KT-40913")."""
    pairs = ["".join(rng.sample(string.ascii_uppercase, 2)) for _ in range(2)]
    numbers: set = set()
    codes: list[str] = []

    def digits() -> str:
        stem = rng.choice(codes).split("-")[1][:4] if codes and rng.random() < 0.5 else str(rng.randint(1000, 9999))
        return stem + str(rng.randint(0, 9))

    for _ in range(n):
        codes.append(f"{rng.choice(pairs)}-{_draw(rng, numbers, digits)}")
    return codes, numbers


# two more one-word look-alike families, kept apart from the ones routing rules are chosen on (onekey,
# lookalike) to check a rule on facts it was not chosen on: other sentences, keys and code shapes
_SHIPS = tuple(("Albatross|Boreas|Calypso|Dauntless|Endeavour|Fairwind|Galatea|Halcyon|Intrepid|Juniper|Kestrel"
                "|Lodestar|Meridian|Nautilus|Osprey|Peregrine|Quickstep|Resolute|Seaford|Tempest|Undaunted|Valiant"
                "|Wayfarer|Xanthe|Yarrow|Zephyr|Argonaut|Bluebell|Corsair|Dolphin|Egret|Falmouth|Gannet|Heron"
                "|Islander|Jubilee|Kittiwake|Lapwing|Marlin|Northstar").split("|"))
_PLANTS = tuple(("foxglove|yarrow|borage|chicory|lovage|sorrel|tansy|valerian|woad|betony|comfrey|feverfew"
                 "|hyssop|lungwort|mallow|motherwort|mugwort|orache|purslane|rampion|samphire|skirret|soapwort"
                 "|speedwell|stitchwort|teasel|toadflax|vervain|agrimony|bugloss|campion|celandine|clary|dittany"
                 "|elecampane|fumitory|goldenrod|horehound|knapweed|meadowsweet").split("|"))
MANIFEST_SHAPE = ("The supply ship {key} left the harbour carrying cargo manifest {code}.",
                  "Which cargo manifest was the supply ship {key} carrying when it left the harbour?", _SHIPS)
TRAY_SHAPE = ("In the north greenhouse, the seed tray of {key} is labelled with batch {code}.",
              "Which batch is the seed tray of {key} in the north greenhouse labelled with?", _PLANTS)


def _multivalue(rng, depths):
    used: set = set()
    groups = _groups(depths, 4)
    needles, probes = [], []
    for key, group in zip(_keys(rng, len(groups)), groups):
        values = [_magic(rng, used) for _ in group]
        needles += [(d, f"One of the special magic numbers for {key} is {v}.") for d, v in zip(group, values)]
        probes.append(Probe("multivalue", f"What are all the special magic numbers for {key} mentioned in the "
                                          "document? Answer with the numbers only, separated by commas.",
                            tuple(values), group[0]))
    return needles, probes, sorted(used)


def _multiquery(rng, depths):
    depths = list(depths)
    extra = [rng.random()] if len(depths) == 1 else []  # a lone depth still needs a second key
    needles, keys, values = _plain(rng, depths + extra)
    order = sorted(range(len(needles)), key=lambda i: needles[i][0])
    half = len(order) // 2
    partner = {order[r]: order[(r + half) % len(order)] for r in range(len(order))}
    probes = []
    for i, depth in enumerate(depths):
        j = partner[i]
        probes.append(Probe("multiquery", f"What are the special magic numbers for {keys[i]} and {keys[j]} mentioned "
                                          "in the document? Answer with the two numbers only, separated by a comma.",
                            (values[i], values[j]), depth))
    return needles, probes, values


def _vartrack(rng, depths):
    names: set = set()
    values: set = set()
    name = lambda: _draw(rng, names, lambda: "".join(rng.choices(string.ascii_uppercase, k=5)))  # noqa: E731
    value = lambda: _draw(rng, values, lambda: str(rng.randint(10_000, 99_999)))  # noqa: E731

    def chain(hop_depths: list[float]) -> tuple[list, tuple[str, ...], str]:
        v, chain_names = value(), [name() for _ in hop_depths]
        lines = [f"VAR {chain_names[0]} = {v}."]
        lines += [f"VAR {b} = VAR {a}." for a, b in zip(chain_names, chain_names[1:])]
        return list(zip(sorted(hop_depths), lines)), tuple(chain_names), v

    needles, probes = [], []
    for group in _groups(depths, 5):
        hops = group + [rng.uniform(group[0], 1.0) for _ in range(4 - len(group))]
        planted, chain_names, v = chain(hops)
        needles += planted
        probes.append(Probe("vartrack", f"Find all variables that are assigned the value {v} in the document. "
                                        "Answer with the variable names only, separated by commas.",
                            chain_names, group[0]))
    needles += chain([rng.random(), rng.random()])[0]  # a decoy chain with another value
    return needles, probes, sorted(names | values)


_PLANTERS = {"passkey": _passkey, "multikey": _multikey, "lookalike": _lookalike,
             "multivalue": _multivalue, "multiquery": _multiquery, "vartrack": _vartrack,
             "manifest": partial(_onekey, shape=MANIFEST_SHAPE, task="manifest", make_codes=_tag_codes),
             "tray": partial(_onekey, shape=TRAY_SHAPE, task="tray", make_codes=_tag_codes)}


def _cwe(n_tokens: int, seed: int, count_tokens: Callable[[str], int]) -> Case:
    words = random.Random(f"kvlocal-cwe-{seed}").sample(_WORDS, len(_WORDS))
    common, rare = words[:10], words[10:]

    def listing(lines: int) -> str:
        f_common = max(3, round(lines / 30))  # the 10 common words fill about a third of the list
        rest = max(0, lines - 10 * f_common)
        f_rare = max(1, math.ceil(rest / len(rare)))
        if f_rare + 2 > f_common:
            raise ValueError(f"cannot make a common-word list of {lines} lines")
        seq = common * f_common + rare[: round(rest / f_rare)] * f_rare
        random.Random(f"kvlocal-cwe-{seed}-{lines}").shuffle(seq)
        return "\n".join(f"{i}. {w}" for i, w in enumerate(seq, 1))

    lo, hi, goal = 0.95 * n_tokens, 1.03 * n_tokens, 0.99 * n_tokens
    lines = max(30, round(goal * 100 / max(1, count_tokens(listing(100)))))
    tried: set[int] = set()
    for _ in range(8):
        text = listing(lines)
        got = count_tokens(text)
        if lo <= got <= hi:
            question = ("What are the 10 most common words in the numbered list in the document? "
                        "Answer with the 10 words only, separated by commas.")
            return Case("cwe", text, (Probe("cwe", question, tuple(common), -1.0),), seed, got)
        tried.add(lines)
        lines = max(30, round(lines * goal / max(1, got)))
        while lines in tried:
            lines += 1 if got < goal else -1
    raise ValueError(f"cannot size a common-word list to {n_tokens} tokens (got {got}); is n_tokens too small?")


def build_case(
    task: str,
    n_tokens: int,
    depths: Sequence[float],
    *,
    seed: int,
    count_tokens: Callable[[str], int],
    filler: str | None = None,
) -> Case:
    """One haystack of about `n_tokens` tokens (0.95-1.03 x) for `task`, with needles at `depths`
    (0 = first paragraph, 1 = last). `filler` (a document's text) replaces the generated prose;
    cwe ignores it and `depths`. Deterministic in `seed`."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; one of {', '.join(TASKS)}")
    if task == "cwe":
        return _cwe(n_tokens, seed, count_tokens)
    if not depths:
        raise ValueError("at least one depth is needed")
    planter = _PLANTERS.get(task) or partial(_onekey, shape=ONEKEY_SHAPES[seed % len(ONEKEY_SHAPES)])
    needles, probes, forbid = planter(random.Random(seed), list(depths))
    text, _, got = build_haystack(n_tokens, needles, seed=seed, count_tokens=count_tokens, filler=filler,
                                  forbid=forbid)
    return Case(task, text, tuple(probes), seed, got)


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def score(probe: Probe, answer: str) -> float:
    """Fraction of `probe.answers` found in `answer`: case- and whitespace-insensitive, each as a whole
    token (so 1234567 is not found inside 91234567)."""
    if not probe.answers:
        return 0.0
    text = _norm(answer)
    found = sum(
        1 for a in probe.answers if re.search(r"(?<![0-9a-z])" + re.escape(_norm(a)) + r"(?![0-9a-z])", text)
    )
    return found / len(probe.answers)
