"""Haystacks for long-context evals: seeded generated prose (or a user's document), sized with the
model's tokenizer, with needle sentences planted at relative depths at sentence boundaries."""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Callable, Iterator, Sequence

# -- generated prose: five topic families of slot templates ---------------------------------------
# Numbers in the prose stay below 2000 (counts, years 1620-1890), so needle values never collide.

_VOCAB = {k: v.split("|") for k, v in {
    "name": "Aldous|Brenna|Corwin|Delphine|Edric|Fenna|Godfrey|Hester|Ivo|Juniper|Kestrel|Lorcan|Mirela"
            "|Nyssa|Osric|Perpetua|Rosamund|Silas|Tamsin|Ulric|Verity|Wendel|Yselda|Bartholomew",
    "town": "Marrowby|Quillhaven|Fenwick|Ashcombe|Dunmere|Larkspur|Holloway|Brackenridge|Saltmarsh|Thornbury",
    "month": "January|February|March|April|May|June|July|August|September|October|November|December",
    "weekday": "Monday|Tuesday|Wednesday|Thursday|Friday|Saturday",
    "ord": "first|second|third|fourth|fifth|ninth|eleventh|fourteenth|twentieth|twenty-third",
    "hour": "six|seven|eight|nine|ten|eleven",
    "weather": "a steady drizzle|clear skies|a cold north wind|thick fog|light snow|a warm southerly breeze"
               "|heavy squalls|a low grey overcast",
    "ship": "Merry Tern|Constance|Grey Heron|Lady Anselm|Providence|Wandering Star",
    "dir": "north by east|due west|south-southwest|east by north|northwest",
    "seabird": "a pair of gannets|a lone albatross|a flock of terns|several petrels|a skua",
    "side": "port|starboard",
    "watch": "morning|forenoon|afternoon|first dog|middle",
    "sail": "topsails|mainsail|jib|mizzen",
    "food": "ship's biscuit|salt beef|dried peas|cheese|oatmeal",
    "vessel": "brig|schooner|fishing smack|whaler|packet boat",
    "part": "larboard rail|forehatch|longboat|capstan bar|galley door",
    "time": "morning|afternoon|whole of the dog watch|last hours of daylight",
    "building": "old grain hall|chapel|market house|schoolroom|customs house|mill",
    "thing": "footbridge|town clock|well pump|cemetery wall|harbour steps|drainage ditch",
    "street": "Tanner Lane|Bell Street|the Cornmarket|Weir Road|Orchard Row|Gallows Hill",
    "fund": "roads|poor relief|lamp|harbour|school",
    "nuisance": "stray goats|the tannery smell|night carts|boys on the roofs|the broken gutter",
    "body": "county surveyor|bishop|river board|turnpike trust|magistrates",
    "terrain": "chalk downs|river meadows|beech hanger|salt flats|limestone scree|heath",
    "plant": "yellow rattle|marsh marigold|wild thyme|sea campion|bog asphodel|lady's bedstraw"
             "|field scabious|greater knapweed|sweet cicely|common sorrel",
    "soil": "thin chalky|peaty|sandy|heavy clay|stony",
    "leaf": "narrow and hairy|broad and glossy|deeply lobed|pale beneath|finely toothed",
    "scent": "honey|aniseed|cut grass|lemon|damp earth",
    "tree": "old yew|crack willow|field maple|hawthorn hedge|alder carr",
    "insect": "bumblebees|hoverflies|small copper butterflies|burnet moths|solitary bees",
    "trade": "weaver|tanner|boatwright|cooper|salt boiler|stonemason",
    "river": "river Wend|Millstream|river Orle|Cold Brook",
    "material": "timber and thatch|rough flint|red brick|dressed limestone",
    "office": "reeve|harbourmaster|schoolmaster|coroner|bailiff",
    "good": "wool|salted herring|slate|barley|tallow candles",
    "dish": "barley broth|mutton stew|leek pie|apple pudding|fish pie|pease pottage",
    "ingredient": "onions|carrots|mutton|butter|leeks|barley|smoked haddock|apples",
    "spice": "mace|nutmeg|black pepper|thyme|salt",
    "garnish": "brown bread|boiled potatoes|pickled cabbage|fresh parsley",
    "condiment": "mustard|horseradish|redcurrant jelly|soured cream",
}.items()}

_FAMILIES = [t.strip().splitlines() for t in (
    """On the {ord} day out of {town}, the {ship} held a course {dir} under {weather}.
    The bosun, {name}, reported {n} inches of water in the hold by the evening watch.
    We sighted {seabird} off the {side} bow shortly after the {watch} watch began.
    Captain {name} ordered the {sail} reefed as the swell grew heavier.
    Provisions were counted again: {n} casks of water and {n2} barrels of {food} remained.
    The cook, {name}, complained that the {food} had begun to spoil in the damp.
    By noon we had {weather}, and the glass was falling slowly.
    {name} was put on the pumps for a double watch after quarrelling with the mate.
    A passing {vessel} flew the colours of {town} but did not answer our signal.
    The carpenter spent the {time} mending the {part} that had split in the storm.""",
    """The council of {town} met in the {building} on the {ord} of {month}, with {name} in the chair.
    Councillor {name} moved that the {thing} on {street} be repaired before the winter.
    The motion was carried by {n} votes to {n2}, with one abstention.
    A petition from the residents of {street} asked for better lighting near the {building}.
    The treasurer reported that the {fund} fund stood lower than in the previous year.
    Discussion of the {thing} was deferred to the next meeting at the request of {name}.
    {name} noted that complaints about {nuisance} had doubled since the spring.
    It was agreed that the clerk would write to the {body} about the state of the {thing}.
    The meeting closed at a quarter past {hour} with thanks to the caretaker of the {building}.""",
    """Along the {terrain} east of {town} we recorded {n} specimens of {plant}.
    The {plant} here grows in {soil} soil and flowers from {month} to {month2}.
    {name} collected seed heads of {plant} for the herbarium at {town}.
    Leaves of the {plant} were {leaf}, with a faint scent of {scent} when crushed.
    In the shade of the {tree} we found a small colony of {plant} not noted before.
    The survey plot near the {terrain} was overrun with {plant}, which crowds out the grasses.
    Pollinators seen on the {plant} included {insect} and a few {insect2}.
    The {terrain} was waterlogged after the rains, so the transect was shortened by {n} paces.""",
    """{town} was founded in {year} by a {trade} who settled along the {river}.
    The first {building} in {town} was built of {material} and stood until the great fire of {year}.
    In {year} the townspeople quarrelled with {town2} over grazing rights on the {terrain}.
    {name}, a {trade} by training, served as the town's first {office}.
    The {building} on {street} still bears the mark of the flood that struck in {year}.
    Trade in {good} made {town} prosperous for a generation, until the {river} silted up.
    Local legend holds that {name} hid the town charter beneath the {building} during the siege.
    By the end of that century the population had grown to some {n} hundred souls.""",
    """For the {dish}, brown the {ingredient} slowly before adding the {ingredient2}.
    {name} insists the {dish} needs a pinch more {spice} than the old recipe calls for.
    Let the dough rest for {n} minutes under a damp cloth before shaping it.
    The {ingredient} from the market on {weekday} was poor, so use the dried kind instead.
    Simmer the {dish} on a low flame until the {ingredient} is tender.
    Keep back a cup of the stock; the {dish} thickens as it cools.
    Serve the {dish} with {garnish} and a spoonful of {condiment}.
    We ran out of {ingredient} again, so add it to the list for {weekday}.""",
)]
_SLOT = re.compile(r"\{([a-z]+?)(2?)\}")


def _sentence(rng: random.Random, template: str) -> str:
    drawn: dict[str, str] = {}

    def fill(m: re.Match) -> str:
        slot, second = m.group(1), m.group(2)
        if slot == "n":
            value = str(rng.randint(2, 60))
        elif slot == "year":
            value = str(rng.randint(1620, 1890))
        else:
            options = [w for w in _VOCAB[slot] if not second or w != drawn.get(slot)]
            value = rng.choice(options)
        drawn.setdefault(slot, value)
        return value

    text = _SLOT.sub(fill, template.strip())
    return text[0].upper() + text[1:]


def generated_paragraphs(seed: int) -> Iterator[list[str]]:
    """Endless seeded prose: paragraphs of 3-7 sentences, runs of paragraphs on one topic."""
    rng = random.Random(f"kvlocal-haystack-{seed}")
    family = rng.randrange(len(_FAMILIES))
    while True:
        if rng.random() < 0.4:
            family = rng.randrange(len(_FAMILIES))
        templates = rng.sample(_FAMILIES[family], rng.randint(3, 7))
        yield [_sentence(rng, t) for t in templates]


def filler_paragraphs(filler: str) -> Iterator[list[str]]:
    """The user's document as paragraphs of sentences, repeated from the start when exhausted."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", filler):
        sentences = []
        for s in re.split(r"(?<=[.!?])\s+", " ".join(block.split())):
            while len(s) > 600:  # extracted text without sentence punctuation: cut at a space
                cut = s.rfind(" ", 0, 400)
                cut = cut if cut > 0 else 400
                sentences.append(s[:cut])
                s = s[cut:].lstrip()
            if s:
                sentences.append(s)
        if sentences:
            paragraphs.append(sentences)
    if not paragraphs:
        raise ValueError("the filler document has no text")
    while True:
        yield from (list(p) for p in paragraphs)


# -- planting and sizing ----------------------------------------------------------------------------

def _whole(words: Sequence[str]) -> re.Pattern | None:
    words = [w for w in words if w]
    if not words:
        return None
    return re.compile(r"(?<![0-9a-z])(?:" + "|".join(map(re.escape, words)) + r")(?![0-9a-z])", re.I)


def _assemble(body: Sequence[tuple[int, str]], needles: Sequence[tuple[float, str]]) -> tuple[str, list[int]]:
    """Body sentences (paragraph id, text) with needles put at the boundary nearest their depth."""
    offsets = [0]
    for _, s in body:
        offsets.append(offsets[-1] + len(s) + 1)
    total = offsets[-1] + sum(len(s) + 1 for _, s in needles)
    at: dict[int, list[int]] = {}
    shift, prev = 0, 0
    for i in sorted(range(len(needles)), key=lambda j: needles[j][0]):
        target = needles[i][0] * total - shift
        k = min(max(bisect.bisect_left(offsets, target), prev), len(body))
        if k > prev and abs(offsets[k - 1] - target) <= abs(offsets[k] - target):
            k -= 1
        at.setdefault(k, []).append(i)
        shift, prev = shift + len(needles[i][1]) + 1, k
    items: list[tuple[int, str, int]] = []  # (paragraph id, sentence, needle index or -1)
    for k in range(len(body) + 1):
        pid = body[min(k, len(body) - 1)][0] if body else 0
        items += [(pid, needles[i][1], i) for i in at.get(k, [])]
        if k < len(body):
            items.append((body[k][0], body[k][1], -1))
    parts: list[str] = []
    starts = [0] * len(needles)
    pos = 0
    for j, (pid, sentence, needle) in enumerate(items):
        if j:
            sep = " " if items[j - 1][0] == pid else "\n\n"
            parts.append(sep)
            pos += len(sep)
        if needle >= 0:
            starts[needle] = pos
        parts.append(sentence)
        pos += len(sentence)
    return "".join(parts), starts


def build_haystack(
    n_tokens: int,
    needles: Sequence[tuple[float, str]],
    *,
    seed: int,
    count_tokens: Callable[[str], int],
    filler: str | None = None,
    forbid: Sequence[str] = (),
) -> tuple[str, list[int], int]:
    """A text of about `n_tokens` tokens (0.95-1.03 x) with each (depth, sentence) needle planted at
    that relative depth. Filler sentences containing a `forbid` word (needle values) are skipped.
    Returns (text, start offset of each needle, token count of the text)."""
    for depth, _ in needles:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth {depth} is outside 0..1")
    lo, hi, goal = 0.95 * n_tokens, 1.03 * n_tokens, 0.99 * n_tokens
    bad = _whole(forbid)
    source = filler_paragraphs(filler) if filler is not None else generated_paragraphs(seed)
    body: list[tuple[int, str]] = []
    lengths = [0]  # lengths[k]: characters of the first k body sentences

    def grow(chars: float) -> None:
        misses = 0
        while lengths[-1] < chars:
            pid = body[-1][0] + 1 if body else 0
            kept = [s for s in next(source) if not (bad and bad.search(s))]
            misses = 0 if kept else misses + 1
            if misses > 1000:
                raise ValueError("every filler paragraph contains a needle value")
            for s in kept:
                body.append((pid, s))
                lengths.append(lengths[-1] + len(s) + 1)

    grow(min(4000, 6 * n_tokens))
    sample = "\n\n".join(s for _, s in body[: bisect.bisect_left(lengths, 2000)] or body[:1])
    ratio = len(sample) / max(1, count_tokens(sample))
    needle_tokens = count_tokens(" ".join(s for _, s in needles)) if needles else 0
    if needle_tokens > 0.9 * hi:
        raise ValueError(f"{len(needles)} needles take {needle_tokens} tokens, too many for {n_tokens}")
    chars = max(0.0, (goal - needle_tokens) * ratio)
    k_prev, got = -1, -1
    for _ in range(8):
        grow(chars + 1000)
        k = bisect.bisect_left(lengths, chars)
        if k > 0 and chars - lengths[k - 1] < lengths[k] - chars:
            k -= 1
        if k == k_prev:  # stuck between two sentence counts: step one sentence towards the goal
            k = k + 1 if got < goal else max(0, k - 1)
            while len(body) < k:
                grow(lengths[-1] + 1)
        text, starts = _assemble(body[:k], needles)
        got = count_tokens(text)
        if lo <= got <= hi:
            return text, starts, got
        ratio = len(text) / max(1, got)
        chars, k_prev = lengths[k] + (goal - got) * ratio, k
    raise ValueError(f"cannot size a haystack to {n_tokens} tokens (got {got}); is n_tokens too small?")
