"""The documents a request is answered from, and what each API key may name.

The server's catalog holds the documents and folders it was started with, read once at start
through kvlocal.docset (ingest's formats and bounds); a request names them in its `documents` field,
by the path as given or by its last component. Uploads and message text are read through
kvlocal.ingest.read_bytes (by content; a declared type where the bytes agree).
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from kvlocal.docset import expand_documents, text_digest
from kvlocal.errors import KvlocalError, UsageError
from kvlocal.ingest import Document, read_bytes
from kvlocal.serve.schemas import ApiError, ChatRequest, Limits, api_error


class Catalog:
    """Named documents: each name (a start argument as given, and its last path component where no
    other argument has it) stands for its documents (a folder's, in kvlocal's folder order)."""

    def __init__(self, sources: list[str]) -> None:
        self.names: dict[str, tuple[Document, ...]] = {}
        self.skipped: list[str] = []
        short: dict[str, list[str]] = {}
        for source in sources:
            found = expand_documents([source])  # UsageError / DocumentError: the server does not start
            self.skipped += [s.message for s in found.skipped]
            self.names[source] = tuple(found.documents)
            base = os.path.basename(os.path.normpath(source))
            short.setdefault(base, []).append(source)
        for base, full in short.items():
            if len(full) == 1 and base not in self.names:
                self.names[base] = self.names[full[0]]

    def visible(self, allowed: frozenset[str] | None) -> list[str]:
        """The names a key bound to `allowed` (None: any) may use, sorted."""
        return sorted(n for n in self.names if allowed is None or self._allowed(n, allowed))

    def resolve(self, names: list[str], allowed: frozenset[str] | None) -> list[Document]:
        """The documents of `names`, in order; ApiError 404 for a name unknown or not the key's."""
        documents: list[Document] = []
        for i, name in enumerate(names):
            if name not in self.names or not (allowed is None or self._allowed(name, allowed)):
                raise ApiError(404, f"no document or folder named {name!r} (GET /v1/documents lists them)",
                               code="document_not_found", param=f"documents[{i}]")
            documents += self.names[name]
        return documents

    def _allowed(self, name: str, allowed: frozenset[str]) -> bool:
        """A key bound to names may use those and any other name for the same documents."""
        return any(self.names.get(a) == self.names[name] or a == name for a in allowed)


@dataclass(frozen=True)
class KeyRing:
    """API keys (`--api-key KEY` or `KEY=doc1,folder2`): a key with names sees only those documents."""

    keys: tuple[tuple[str, frozenset[str] | None], ...] = ()

    @classmethod
    def parse(cls, specs: list[str], catalog: Catalog) -> KeyRing:
        keys = []
        for spec in specs:
            key, bound, names = spec.partition("=")
            if not key.strip() or key != key.strip():
                raise UsageError("an --api-key must be a non-empty key without surrounding spaces "
                                 "(KEY, or KEY=doc1,folder2)", setting="api_key")
            allowed = None
            if bound:
                allowed = frozenset(n for n in names.split(",") if n)
                unknown = sorted(n for n in allowed if n not in catalog.names)
                if not allowed or unknown:
                    raise UsageError(f"--api-key binds names the server was not started with: "
                                     f"{', '.join(unknown) or '(none given)'}", setting="api_key")
            keys.append((key, allowed))
        return cls(tuple(keys))

    def grant(self, authorization: str | None) -> frozenset[str] | None:
        """The names the request's key may use (None: all); ApiError 401 without a valid key."""
        if not self.keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "an API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
        for key, allowed in self.keys:
            if hmac.compare_digest(key.encode(), token.strip().encode()):
                return allowed
        raise ApiError(401, "the API key is not valid", code="invalid_api_key")


def request_documents(req: ChatRequest, catalog: Catalog, allowed: frozenset[str] | None,
                      limits: Limits) -> list[Document]:
    """The request's documents (named first, then uploads), checked: at most `limits.max_documents`,
    each read whole, no two with the same text. ApiError for each fault."""
    documents = catalog.resolve(req.named, allowed)
    n = len(documents) + len(req.uploads)
    if n > limits.max_documents:
        raise ApiError(400, f"the request has {n} documents; at most {limits.max_documents} are answered at once",
                       code="too_many_documents", param="documents" if req.named else "messages")
    for upload in req.uploads:
        try:
            documents.append(read_bytes(upload.data, upload.name, upload.declared))
        except KvlocalError as err:
            error = api_error(err)
            error.param = upload.param
            raise error from None
    seen: dict[str, str] = {}
    for doc in documents:
        digest = text_digest(doc.text)
        if digest in seen:
            raise ApiError(400, f"{doc.source} has the same text as {seen[digest]}; give each document once",
                           code="duplicate_document")
        seen[digest] = doc.source
    return documents
