"""A long, deterministic sample document with one planted fact to ask about."""

from __future__ import annotations

import os
import random
from pathlib import Path

SAMPLE_QUESTION = "What is the new access code for the seed vault at Halvard Ridge Station?"
SAMPLE_ANSWER = "KESTREL-7419"

_SEED = 7419
_DAYS = 20
_KEY_DEPTH = 0.33

_TITLE = "Field Report: Halvard Ridge Research Station, Spring Season"
_INTRO = (
    "This report summarises the spring season at Halvard Ridge Research Station, a small outpost on "
    "the eastern shoulder of the Greyfell range. The station is led by Dr. Ines Varga and housed a "
    "crew of fourteen this year. Its work covers glacier monitoring, alpine botany, bird surveys and "
    "the upkeep of the regional seed vault dug into the ridge below the main hut. Entries follow the "
    "daily log kept in the mess room, lightly edited for length."
)
_KEY_FACT = (
    "A note on the seed vault. After the keypad fault earlier in the season, chief engineer Tomas "
    "Okafor replaced the lock on the seed vault door. The new access code for the seed vault is "
    f"{SAMPLE_ANSWER}. Dr. Varga asked that the code be recorded once, in this report, and nowhere else."
)
_CLOSING = (
    "The season closed with all instruments recovered or winterised and the hut shuttered against the "
    "autumn storms. Data sets, photographs and the full daily log have been archived with the institute, "
    "and a summary of the botanical findings will follow in a separate note."
)

_VOCAB = {
    "person": [
        "Tomas Okafor", "Mei Lindqvist", "Rafael Osei", "Hanna Petrov", "Jonah Whitcombe",
        "Sunniva Dahl", "Kofi Mensah", "Elif Arslan", "Pavel Novak", "Aino Virtanen", "Lucas Ferreira",
    ],
    "place": [
        "the north moraine", "Corrie Lake", "the upper snowfield", "the boulder meadow", "Raven Col",
        "the old weather mast", "the scree gully", "the lower birch wood", "the meltwater delta",
        "the east ridge saddle",
    ],
    "instrument": [
        "the anemometer", "the snow-depth sensor", "the trail camera", "the radiometer",
        "the rain gauge", "the seismograph", "the drone", "the water sampler", "the GPS base station",
        "the thermistor string",
    ],
    "animal": [
        "a pair of ptarmigan", "a mountain hare", "three ravens", "a lone wolverine", "a herd of reindeer",
        "a golden eagle", "a family of stoats", "a snow bunting", "two red foxes", "a dotterel",
    ],
    "weather": [
        "low cloud and drizzle", "bright sun and a hard frost", "gusting westerly winds", "wet snow",
        "thick fog until noon", "a clear, still sky", "sleet showers", "a warm southerly breeze",
    ],
    "task": [
        "re-staking the ablation poles", "counting saxifrage rosettes", "clearing ice from the solar panels",
        "logging lichen growth", "surveying the meltwater channel", "repairing the boardwalk",
        "sorting seed packets", "calibrating the weather mast", "mapping the snow line",
    ],
    "supply": [
        "diesel", "fresh bread", "spare batteries", "sample bottles", "rope", "coffee", "tarpaulin",
        "dried fruit", "hand warmers",
    ],
    "time": ["at dawn", "before breakfast", "mid-morning", "just after lunch", "late in the afternoon", "at dusk"],
    "number": [str(n) for n in range(3, 48)],
}

_TEMPLATES = [
    "The day began with {weather}, so outdoor work only started {time}.",
    "{person} spent most of the day {task} near {place}.",
    "{person} reported {animal} close to {place} {time}.",
    "{instrument} at {place} stopped logging overnight and had to be restarted by {person}.",
    "We recorded {number} centimetres of fresh snow at the hut and {weather} over the ridge.",
    "{person} and {person} hiked to {place} to check {instrument}, returning tired but pleased.",
    "Stocks of {supply} are running low; {person} added them to the order for the next supply flight.",
    "After dinner {person} gave a short talk on {task}, which started a long argument about methods.",
    "The radio link to the valley dropped for {number} minutes {time} but recovered without help.",
    "{animal} crossed the path in front of {person}, who managed a blurry photograph.",
    "A rockfall was heard from {place} {time}; nobody was working there, and no damage was found.",
    "{person} found that {instrument} had drifted badly since the last check and recalibrated it.",
    "Work on {task} was abandoned {time} because of {weather}.",
    "{person} baked bread with the last of the flour, which lifted everyone's mood considerably.",
    "The water sample from {place} was unusually cloudy, and {person} bottled {number} extra vials.",
    "Meltwater rose quickly {time}, flooding part of the track to {place}.",
    "{person} took the drone over {place} and mapped about {number} hectares before the battery ran out.",
    "{person} twisted an ankle near {place}; the injury is minor, but they will stay indoors for a while.",
    "A late supply flight brought {supply}, letters from home, and a replacement part for {instrument}.",
    "Evening readings showed the air at {place} was about {number} tenths of a degree warmer than at the hut.",
    "{animal} appeared near {place} again, {time} as on earlier days.",
    "{person} spent a quiet evening writing up notes on {task}.",
    "We lost most of the afternoon to {weather} and used it to clean and label equipment.",
    "The generator coughed {time} and {person} traced the fault to a blocked fuel filter.",
    "{person} suggested moving {instrument} to {place}, where the readings should be less noisy.",
    "Tracks in the snow near {place} suggest {animal} passed through during the night.",
    "The ice on Corrie Lake has turned grey and soft, and {person} has forbidden anyone to cross it.",
    "Dr. Varga reviewed the week's data with {person} and asked for more care in labelling samples.",
    "{person} and {person} played chess until midnight while {weather} rattled the windows.",
    "By evening {person} had finished {task}, a job that had been postponed for {number} days.",
]


class _Picker(dict):
    """Format mapping that draws a fresh word for each placeholder, never the same twice running."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self._rng = rng
        self._last: dict[str, str] = {}

    def __missing__(self, key: str) -> str:
        word = self._rng.choice([w for w in _VOCAB[key] if w != self._last.get(key)])
        self._last[key] = word
        return word


def sample_document() -> str:
    """The sample report: about 2,300 words, identical on every call."""
    rng = random.Random(_SEED)
    paragraphs = [_INTRO] + [_day_entry(rng, day) for day in range(1, _DAYS + 1)]
    paragraphs.insert(_key_position(paragraphs), _KEY_FACT)
    return "\n\n".join([_TITLE, *paragraphs, _CLOSING]) + "\n"


def write_sample(path: str | os.PathLike[str]) -> Path:
    """Write the sample document to `path` (UTF-8) and return the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(sample_document(), encoding="utf-8")
    return target


def _day_entry(rng: random.Random, day: int) -> str:
    picker = _Picker(rng)
    sentences = [template.format_map(picker) for template in rng.sample(_TEMPLATES, rng.randint(5, 7))]
    return f"Day {day}. " + " ".join(_capitalize(sentence) for sentence in sentences)


def _capitalize(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def _key_position(paragraphs: list[str]) -> int:
    """Index at which the key fact sits about `_KEY_DEPTH` of the way through."""
    total = sum(len(p.split()) for p in paragraphs)
    seen = 0
    for index, paragraph in enumerate(paragraphs):
        seen += len(paragraph.split())
        if seen >= total * _KEY_DEPTH:
            return index + 1
    return len(paragraphs)
