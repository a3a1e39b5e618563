"""No region straddles two documents of a set (README, "Several documents"), for every region size a
route may take: a set of documents whose bodies are no whole number of regions is loaded on the tiny
model through the library, and each region's cells are checked to hold one document's text (or only
the template around them): by the loaded layout for every allowed size, and by the regions the engine
itself reports reading at the largest a set allows; a larger region is refused."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

from kvlocal.ingest import Document  # noqa: E402
from kvlocal.library import load_set  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.route_settings import MAX_REGION, SET_LAYOUT_UNIT  # noqa: E402
from kvlocal.routing import RouteConfig  # noqa: E402
from kvlocal.session import Session  # noqa: E402

DOCS = [Document(" ".join(f"entry {i}: value {i * 7 % 101}." for i in range(41)), "a.txt", "txt"),
        Document(" ".join(f"line {i} says {i * 13 % 97} apples." for i in range(23)), "b.txt", "txt"),
        Document(" ".join(f"row {i} holds {i * 5 % 89} coins." for i in range(67)), "c.txt", "txt")]
REGION_SIZES = [1 << i for i in range(SET_LAYOUT_UNIT.bit_length()) if SET_LAYOUT_UNIT % (1 << i) == 0]


@pytest.fixture
def loaded(cache_dir, tiny_model):
    session = Session(str(tiny_model), threads=2)
    load_set(session, DOCS)
    yield session
    session.close()


def owner(session: Session, cell: int) -> str:
    """Whose cell it is: a document's (its label), the template head before them or what follows them."""
    spans = session.layout.spans
    span = next((s for s in spans if s.start <= cell < s.end), None)
    if span is not None:
        return span.label
    return "head" if cell < spans[0].start else "after"


def straddling(session: Session, region: int, regions) -> list[tuple[int, set[str]]]:
    return [(r, owners) for r in regions
            if len(owners := {owner(session, c) for c in range(r * region, (r + 1) * region)}) > 1]


def test_the_set_has_bodies_that_are_no_whole_number_of_regions(loaded):
    spans = loaded.layout.spans
    assert loaded.layout.kind == "consecutive" and [s.label for s in spans] == ["a.txt", "b.txt", "c.txt"]
    assert all(s.n_tokens % SET_LAYOUT_UNIT for s in spans)
    assert REGION_SIZES[0] == 1 and REGION_SIZES[-1] == SET_LAYOUT_UNIT and len(REGION_SIZES) == 7


@pytest.mark.parametrize("region", REGION_SIZES)
def test_no_region_of_any_allowed_size_straddles_two_documents(loaded, region):
    RouteConfig(mode="geometric", region=region)  # a size the route accepts
    n_regions = -(-loaded.n_prefix // region)
    assert straddling(loaded, region, range(n_regions)) == []


def test_the_regions_the_engine_reads_at_the_largest_size_hold_one_document_each(loaded):
    """Every region selected: the engine reports each region it read, by id, at its region size."""
    answer = loaded.ask("Which value does entry 3 hold?", route=RouteConfig(mode="geometric", region=SET_LAYOUT_UNIT,
                                                                             top_k=10_000, focus="set"), max_tokens=3,
                        want_regions=True)
    steps = [piece.stats for piece in answer if piece.stats is not None]
    assert steps and all(st.region_size == SET_LAYOUT_UNIT for st in steps)
    read = {int(r) for st in steps for r in st.regions.ravel() if r >= 0}
    first_documents = {s.start // SET_LAYOUT_UNIT for s in loaded.layout.spans}
    assert first_documents <= read  # every document's regions were read
    assert straddling(loaded, SET_LAYOUT_UNIT, sorted(read)) == []


@pytest.mark.parametrize("region", [r for r in (128, MAX_REGION) if r > SET_LAYOUT_UNIT])
def test_a_set_refuses_regions_longer_than_its_layout_unit(loaded, region):
    with pytest.raises(UsageError, match="at most 64"):
        list(loaded.ask("Which value does entry 3 hold?", route=RouteConfig(mode="geometric", region=region),
                        max_tokens=2))
    with pytest.raises(UsageError, match="at most 64"):  # a focused answer too: the set's regions are its
        list(loaded.ask("Which value does entry 3 hold?", route=RouteConfig(mode="geometric", region=region,
                                                                            focus="hinted"), max_tokens=2))
