"""kvlocal.tui: the Textual app (`kvlocal tui`)."""
