"""The routing lab (`kvlocal lab`): capture the dense model's real queries and keys once per
haystack, then replay selection rules offline against exact attention.

`capture` reads the queries and keys from llama.cpp's graph and the saved KV state; `rules` holds
the decode selection rules and their replay; `decode` captures and scores answers (`kvlocal lab`);
`prefill` does the same for the document's own ubatches (`kvlocal lab prefill`).
"""
