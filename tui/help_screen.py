"""The help screen (? or F1)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# kvlocal

Ask questions about a long document. Each decode step reads only a **routed subset** of the KV cache:
regions of R tokens are scored by their centroids and the top-k regions, the sink regions at the start
and a window of recent tokens are read.

## The heatmap

Columns are regions of the context from the start of the document (left) to its end (right), bucketed
to the width of the terminal; rows are layers (first layer on top, two layers per row when space is short).

- **amber**: read by the latest decode step
- **blue**: read by earlier steps of this answer (brighter = more steps)
- **brown**: the question and answer after the document

Select a region with the arrow keys (focus the heatmap with tab) or a click to read its text.
After an answer, *sources* lists the regions it read most, with a snippet.
Click an earlier answer to see what it read again.

## Keys

| key | action |
|---|---|
| enter | ask the question in the input |
| ctrl+o | open a document |
| f2 · m | cycle the route mode: geometric, full, window, random |
| f3 · - | fewer routed regions (top-k) |
| f4 · + | more routed regions (top-k) |
| f5 · r | ask the last question again with the current route |
| esc | cancel loading or the answer; leave the input |
| tab | move between the input, heatmap, log and sources |
| ← → / home end | select a region (heatmap) |
| f1 · ? | this help |
| ctrl+q | quit |

Single-letter keys work when the input is not focused (press esc first).
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,q,question_mark,f1", "dismiss", "Close"),
    ]

    DEFAULT_CSS = """
    HelpScreen {
        align: center middle;
    }
    HelpScreen > VerticalScroll {
        width: 90;
        max-width: 100%;
        height: 90%;
        border: round $primary;
        background: $surface;
        padding: 0 1;
    }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll() as scroll:
            scroll.border_title = "help"
            scroll.border_subtitle = "esc closes"
            yield Markdown(HELP)

    def action_dismiss(self, result=None) -> None:
        self.dismiss(None)
