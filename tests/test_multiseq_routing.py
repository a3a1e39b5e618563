"""Several sequences decoded in one ubatch, each routed over its own cells (patch 0017), on the tiny
synthetic model: three documents of different lengths in three sequences of one unified cache, one
answer step of each decoded together.

Each sequence's plan is the one it would have decoded alone: its sink, its window and top-k of its own
document's regions, per layer and KV head, counted exactly per sequence. With every region selected
each sequence's logits are its dense logits (the every-region oracle, per sequence); decoded together
or alone, a sequence reads the same regions and gets the same logits, with its own selection memory,
the pins of its own question and its own hints (patch 0018); no sequence gathers a region of another's
document."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.engine

from kvlocal.engine import EngineContext, SequenceStep, decode_batch, llama_cpp  # noqa: E402
from kvlocal.errors import EngineError, UsageError  # noqa: E402
from kvlocal.routing import Fallback, Route  # noqa: E402

R = 64  # cells per region
N_LAYER, N_HEAD_KV, HEAD_DIM = 2, 2, 16  # the tiny qwen2
ROW_BYTES = 2 * HEAD_DIM * 2  # a K and a V row of one KV head, f16
# three documents of whole regions, one per sequence, laid out in this order from cell 0
DOC_REGIONS = {0: 24, 1: 18, 2: 12}
STEP_REGION = sum(DOC_REGIONS.values())  # the region the answer steps' cells land in (region 54)
FIXED = 3  # each sequence's first region (its sink) and the last two it sees (its window)
GEOMETRIC = Route(mode="geometric", top_k=2, region=R, shortlist=0, keep=0.0, pin=0)
# with a selection memory and pins, as kvlocal ask routes (each sequence has its own)
REMEMBERING = Route(mode="geometric", top_k=3, region=R, shortlist=0, keep=0.9, pin=2)


def doc_regions(seq: int) -> list[int]:
    first = sum(n for s, n in DOC_REGIONS.items() if s < seq)
    return list(range(first, first + DOC_REGIONS[seq]))


def doc_length(seq: int) -> int:
    return DOC_REGIONS[seq] * R


@pytest.fixture(scope="module")
def ctx(tiny_model):
    """The three documents prefilled densely, each into its own sequence."""
    ctx = EngineContext.open(tiny_model, n_batch=512, threads=2, kv_type="f16", centroid_block=16,
                             centroid_type="f16", n_ctx=4096, n_seq_max=len(DOC_REGIONS))
    rng = np.random.default_rng(7)
    for seq in DOC_REGIONS:
        ctx.decode_sequence(seq, [int(t) for t in rng.integers(0, 250, size=doc_length(seq))], 0)
    return ctx


def steps_of(tokens: dict[int, int]) -> list[SequenceStep]:
    return [SequenceStep(seq, token, doc_length(seq)) for seq, token in tokens.items()]


STEPS = steps_of({0: 5, 1: 17, 2: 42})


def decode(ctx: EngineContext, route: Route, steps: list[SequenceStep]):
    """Decode `steps` together under `route`: (logits, read stats); the steps' cells removed after."""
    ctx.apply_route(route)
    try:
        logits = ctx.decode_steps(steps)
        return logits, ctx.read_stats()
    finally:
        for step in steps:
            ctx.remove_positions(step.seq, step.pos, -1)


def alone(ctx: EngineContext, route: Route, steps: list[SequenceStep]):
    """Each step decoded by itself: (logits, read stats) per step."""
    return [decode(ctx, route, [step]) for step in steps]


def regions_read(st) -> list[list[set[int]]]:
    """The regions each layer and head gathered, the padding left out."""
    return [[{int(r) for r in head if r >= 0} for head in layer] for layer in st.regions]


def test_each_sequence_routes_its_own_regions_with_exact_counts(ctx):
    logits, st = decode(ctx, GEOMETRIC, STEPS)
    assert st.fallback == Fallback.OK and st.n_layer_routed == N_LAYER and len(logits) == 3
    assert sorted(st.sequences) == [0, 1, 2]
    for seq, own in st.sequences.items():
        regions = doc_regions(seq)
        fixed = {regions[0], regions[-1], STEP_REGION}  # the sink, and the window: the document's last region and the step's
        assert own.n_sel == FIXED + 2
        assert own.rows_read == N_LAYER * N_HEAD_KV * (FIXED + 2) * R
        assert own.bytes_kv == own.rows_read * ROW_BYTES
        assert own.rows_dense == N_LAYER * N_HEAD_KV * st.n_kv
        for layer in regions_read(own):
            for head in layer:
                assert len(head) == FIXED + 2 and fixed <= head
                assert head - fixed <= set(regions[1:-1])  # top-k among its own document's candidates
    # the ubatch's totals are its sequences' sums
    for name in ("rows_read", "bytes_kv", "bytes_meta"):
        assert getattr(st, name) == sum(getattr(own, name) for own in st.sequences.values()), name


def test_no_sequence_gathers_a_region_of_another_sequences_document(ctx):
    for route in (GEOMETRIC, Route(mode="geometric", top_k=64, region=R, shortlist=0, keep=0.0, pin=0),
                  Route(mode="random", top_k=3, region=R, seed=5, keep=0.0, pin=0)):
        _, st = decode(ctx, route, STEPS)
        for seq, own in st.sequences.items():
            gathered = {r for layer in regions_read(own) for head in layer for r in head}
            # its document's regions, and the region its own step's cell sits in (shared with the
            # other steps' cells, which its mask row keeps out of its attention)
            assert gathered <= set(doc_regions(seq)) | {STEP_REGION}, (route.mode, seq)
            if route.top_k == 64:
                assert gathered == set(doc_regions(seq)) | {STEP_REGION}


def test_every_region_selected_is_each_sequences_dense_attention(ctx):
    """The every-region oracle, per sequence: top-k covering every candidate reproduces dense."""
    dense, st_dense = decode(ctx, Route(mode="full"), STEPS)
    every, st_every = decode(ctx, Route(mode="geometric", top_k=64, region=R, shortlist=0, keep=0.0, pin=0),
                             STEPS)
    small, _ = decode(ctx, Route(mode="geometric", top_k=1, region=R, shortlist=0, keep=0.0, pin=0), STEPS)
    assert st_dense.sequences == {} and st_every.fallback == Fallback.OK
    for seq, (d, e, s) in enumerate(zip(dense, every, small)):
        diff = float(np.max(np.abs(d - e)))
        assert diff <= 5e-3, (seq, diff)  # the flash-attention summation order, as in test_routing's oracle
        assert float(np.max(np.abs(d - s))) > 10 * diff, seq  # reading fewer regions is not dense
        own = st_every.sequences[seq]
        assert own.rows_read == N_LAYER * N_HEAD_KV * (DOC_REGIONS[seq] + 1) * R


@pytest.mark.parametrize("route", [
    GEOMETRIC,
    Route(mode="geometric", top_k=2, region=R, shortlist=6, keep=0.0, pin=0, layer_top_k="1=4"),
    Route(mode="window", top_k=3, region=R, keep=0.0, pin=0),
    Route(mode="random", top_k=3, region=R, seed=11, keep=0.0, pin=0),
], ids=["geometric", "shortlist-budgets", "window", "random"])
def test_together_is_each_sequence_alone(ctx, route):
    together, st = decode(ctx, route, STEPS)
    for step, logits, ([alone_logits], alone_st) in zip(STEPS, together, alone(ctx, route, STEPS)):
        own = st.sequences[step.seq]
        assert alone_st.sequences == {} and alone_st.fallback == Fallback.OK
        assert np.array_equal(own.regions, alone_st.regions), step.seq
        assert np.array_equal(own.layers, alone_st.layers)
        assert (own.rows_read, own.bytes_kv, own.bytes_meta) == (alone_st.rows_read, alone_st.bytes_kv,
                                                                 alone_st.bytes_meta)
        np.testing.assert_allclose(logits, alone_logits, rtol=0, atol=1e-4)


def test_budgets_per_layer_count_per_sequence(ctx):
    _, st = decode(ctx, Route(mode="geometric", top_k=2, region=R, shortlist=0, keep=0.0, pin=0,
                                    layer_top_k="1=4"), STEPS)
    for own in st.sequences.values():
        assert own.n_sel == FIXED + 4
        assert [[len(head) for head in layer] for layer in regions_read(own)] == [[FIXED + 2] * 2, [FIXED + 4] * 2]
        assert own.rows_read == N_HEAD_KV * R * ((FIXED + 2) + (FIXED + 4))


def test_two_of_three_sequences_and_a_sequence_of_few_regions(ctx):
    """Any subset of the sequences decodes together; a short sequence routes the candidates it has."""
    steps = steps_of({2: 9, 0: 3})
    _, st = decode(ctx, Route(mode="geometric", top_k=16, region=R, shortlist=0, keep=0.0, pin=0), steps)
    assert sorted(st.sequences) == [0, 2]
    # sequence 2 has 10 candidates, sequence 0 has 22: each reads min(top_k, its candidates)
    assert st.sequences[2].n_sel == FIXED + 10 and st.sequences[0].n_sel == FIXED + 16
    assert st.n_sel == FIXED + 16


def test_several_tokens_of_one_sequence_beside_another_still_fall_back(ctx):
    ctx.apply_route(GEOMETRIC, batch_top_k=2)
    steps = [SequenceStep(0, 5, doc_length(0)), SequenceStep(0, 6, doc_length(0) + 1), SequenceStep(1, 7, doc_length(1))]
    try:
        decode_batch(ctx.raw_context, steps, logits=[True] * 3)
        st = ctx.read_stats()
    finally:
        for step in steps:
            ctx.remove_positions(step.seq, step.pos, -1)
    assert st.fallback == Fallback.MULTI_SEQ and st.sequences == {} and st.n_layer_routed == 0


def test_a_batch_takes_one_step_per_sequence(ctx):
    with pytest.raises(UsageError, match="one token of each sequence"):
        ctx.decode_steps([SequenceStep(0, 5, doc_length(0)), SequenceStep(0, 6, doc_length(0) + 1)])
    assert llama_cpp().llama_memory_seq_pos_max(llama_cpp().llama_get_memory(ctx.raw_context), 0) == doc_length(0) - 1


# a question of each sequence, read at once (a dense pass, which writes its sequence's pins), and the
# tokens of its answer's steps
QUESTION = {0: [31, 32, 33, 34, 35, 36], 1: [61, 62, 63, 64, 65], 2: [91, 92, 93, 94, 95, 96, 97]}
ANSWER = {0: [5, 6, 7, 8, 9], 1: [17, 18, 19, 20, 21], 2: [42, 43, 44, 45, 46]}


def answer_steps(seq: int, t: int) -> SequenceStep:
    return SequenceStep(seq, ANSWER[seq][t], doc_length(seq) + len(QUESTION[seq]) + t)


def answered(ctx: EngineContext, route: Route, seqs: list[int], together: bool) -> dict[int, list]:
    """Each sequence's question read, then its answer's steps decoded, all sequences' together (one
    ubatch a step) or one sequence after another: per sequence, (logits, its read stats) per step; the
    questions' and answers' cells removed after."""
    ctx.apply_route(route)
    per_seq: dict[int, list] = {seq: [] for seq in seqs}
    try:
        groups = [seqs] if together else [[seq] for seq in seqs]
        for group in groups:
            for seq in group:
                ctx.decode_sequence(seq, QUESTION[seq], doc_length(seq))
            for t in range(len(ANSWER[group[0]])):
                steps = [answer_steps(seq, t) for seq in group]
                logits = ctx.decode_steps(steps)
                st = ctx.read_stats()
                for step, step_logits in zip(steps, logits):
                    per_seq[step.seq].append((step_logits, st.sequences[step.seq] if together else st))
            if not together:
                ctx.remove_positions(group[0], doc_length(group[0]), -1)
    finally:
        for seq in seqs:
            ctx.remove_positions(seq, doc_length(seq), -1)
    return per_seq


def test_memory_and_pins_route_each_sequence_together_as_alone(ctx):
    """Every step of every answer reads the regions it reads decoded alone, with the selection memory of
    its own steps and the pins of its own question (their bytes counted as alone)."""
    seqs = list(DOC_REGIONS)
    together = answered(ctx, REMEMBERING, seqs, together=True)
    alone = answered(ctx, REMEMBERING, seqs, together=False)
    for seq in seqs:
        for t, ((logits, own), (alone_logits, alone_st)) in enumerate(zip(together[seq], alone[seq])):
            assert alone_st.sequences == {} and alone_st.fallback == Fallback.OK
            assert np.array_equal(own.regions, alone_st.regions), (seq, t)
            assert (own.rows_read, own.bytes_kv, own.bytes_meta) == (alone_st.rows_read, alone_st.bytes_kv,
                                                                     alone_st.bytes_meta), (seq, t)
            np.testing.assert_allclose(logits, alone_logits, rtol=0, atol=1e-4)


def test_an_answer_ending_keeps_the_memory_of_the_others(ctx):
    """Sequence 1's cells removed between two steps of the others: their next steps still route as alone."""
    ctx.apply_route(REMEMBERING)
    try:
        for seq in DOC_REGIONS:
            ctx.decode_sequence(seq, QUESTION[seq], doc_length(seq))
        ctx.decode_steps([answer_steps(seq, 0) for seq in DOC_REGIONS])
        ctx.remove_positions(1, doc_length(1), -1)
        steps = [answer_steps(0, 1), answer_steps(2, 1)]
        ctx.decode_steps(steps)
        together = ctx.read_stats().sequences
    finally:
        for seq in DOC_REGIONS:
            ctx.remove_positions(seq, doc_length(seq), -1)
    alone = answered(ctx, REMEMBERING, [0, 2], together=False)
    for seq in (0, 2):
        assert np.array_equal(together[seq].regions, alone[seq][1][1].regions), seq


def test_a_sequences_own_hints_route_it_as_the_same_hints_alone(ctx):
    """Sequence 0 given its own hint, sequence 2 the hint of every sequence: decoded together, each reads
    what the same hint reads it alone; a sequence given none of its own but hints of another's cells
    reads as with no hints."""
    hinted = {0: doc_regions(0)[10] * R + 3, 2: doc_regions(2)[5] * R + 1}
    try:
        ctx.set_hints([hinted[2]])
        ctx.set_hints([hinted[0]], seq=0)
        together, st = decode(ctx, GEOMETRIC, STEPS)
        ctx.set_hints([hinted[0]])
        alone_0 = decode(ctx, GEOMETRIC, [STEPS[0]])[1]
        ctx.set_hints([hinted[2]])
        alone_2 = decode(ctx, GEOMETRIC, [STEPS[2]])[1]
        ctx.set_hints([])
        alone_1 = decode(ctx, GEOMETRIC, [STEPS[1]])[1]
    finally:
        ctx.set_hints([])
    for seq, alone_st in ((0, alone_0), (1, alone_1), (2, alone_2)):
        assert np.array_equal(st.sequences[seq].regions, alone_st.regions), seq
    for seq in (0, 2):
        for layer in regions_read(st.sequences[seq]):
            assert all(hinted[seq] // R in head for head in layer), seq


def test_hints_of_every_sequence_drop_a_sequences_own(ctx):
    try:
        ctx.set_hints([doc_regions(0)[10] * R], seq=0)
        ctx.set_hints([])
        _, st = decode(ctx, GEOMETRIC, STEPS)
    finally:
        ctx.set_hints([])
    _, plain = decode(ctx, GEOMETRIC, STEPS)
    assert np.array_equal(st.sequences[0].regions, plain.sequences[0].regions)
    with pytest.raises(EngineError):
        ctx.set_hints([1], seq=len(DOC_REGIONS))


def test_each_sequence_kept_to_its_cells_reads_its_own_region(ctx):
    """Each sequence given a region of its own: its step lands there (its window reads that region),
    another sequence's range is refused, and a sequence without one keeps out of the others'."""
    own = {0: STEP_REGION + 1, 2: STEP_REGION + 3}  # sequence 1 keeps no cells
    try:
        for seq, region in own.items():
            ctx.keep_cells(seq, region * R, (region + 1) * R)
        with pytest.raises(EngineError):
            ctx.keep_cells(1, own[0] * R + 8, own[0] * R + 72)
        _, st = decode(ctx, GEOMETRIC, STEPS)
    finally:
        for seq in own:
            ctx.keep_cells(seq)
    for seq, region in own.items():
        assert all(region in head for layer in regions_read(st.sequences[seq]) for head in layer), seq
    # sequence 1's step took the first empty cell outside them: the region after the documents'
    assert all(STEP_REGION in head for layer in regions_read(st.sequences[1]) for head in layer)
    assert not any(r in head for r in own.values() for layer in regions_read(st.sequences[1]) for head in layer)
