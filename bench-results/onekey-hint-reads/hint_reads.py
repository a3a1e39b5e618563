"""Where the hinted regions lie for each single-document onekey fact at 8k (seeds as given): the regions a
hinted top-1 step reads, the regions of the code and of its sentence's first token. Run from the repository
root on cached haystacks: .venv/bin/python bench-results/onekey-hint-reads/hint_reads.py gen|FILLER 0,1,2"""
import sys
from kvlocal.session import Session
from kvlocal.evals.runner import depth_grid, make_case
from kvlocal.ingest import load_document
from kvlocal.evals.tasks import ONEKEY_SHAPES
from kvlocal.hints import TextIndex, hint_cells, cell_text
filler = sys.argv[1] if sys.argv[1] != "gen" else None
seeds = [int(s) for s in sys.argv[2].split(",")]
s = Session(None, threads=1)
depths = depth_grid(10)
for seed in seeds:
    case = make_case(s, "onekey", 8192, depths, seed, load_document(filler).text if filler else None)
    s.load_document(case.text, label="x")
    pieces = s.token_pieces(s.prefix_cell_tokens())
    index = TextIndex.of(pieces)
    text, char_cells = cell_text(pieces)
    lead = ONEKEY_SHAPES[seed % 4][0].split("{key}")[0][:12]
    for i, p in enumerate(case.probes):
        cells = hint_cells(index, p.question, 1, 64, skip_regions=1)
        read = sorted({c // 64 for c in cells})
        at = text.find(p.answers[0])
        st = text.rfind(lead, 0, at)
        code = (char_cells[at] // 64, char_cells[at + len(p.answers[0]) - 1] // 64)
        start = char_cells[st] // 64
        print(seed, i, p.depth, p.answers[0], "read", read, "code", code, "start", start,
              "START-MISSED" if start not in read else "", flush=True)
