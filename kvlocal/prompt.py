"""The prompt: the document goes first (a reusable prefix), the question after it.

The model's chat template is rendered with placeholders in place of the document and the
question, so untrusted text never passes through the template; the prompt is then kept as
segments, and only the template's own segments are tokenized with special tokens. A document
or question that spells `<|im_end|>` gets the characters, never the control token.

A model without a chat template (a base model) gets a plain completion prompt: document,
question, "Answer:" — never another family's markers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from kvlocal.errors import ModelError

SYSTEM_PROMPT = (
    "You are kvlocal, a careful assistant. Answer questions about the document the user gives you, "
    "using only what the document says. Be brief and quote exact names, numbers and codes."
)

# placeholders the template renders in place of the user's text (never part of the user's text:
# the document and question are spliced into the rendered template, not rendered by it)
_DOCUMENT_MARK = "\u2063KVLOCAL-DOCUMENT\u2063"
_QUESTION_MARK = "\u2063KVLOCAL-QUESTION\u2063"
_USER_CONTENT = f"Document:\n\n{_DOCUMENT_MARK}\n\nQuestion:\n{_QUESTION_MARK}"

# part of the template hash (and so of a saved state's key): the document and question are
# tokenized as segments of their own, which shifts a token at their edges
_LAYOUT = "segments-1\0"

# the completion prompt of a model without a chat template
_COMPLETION_HEAD = "Document:\n\n"
_COMPLETION_MIDDLE = "\n\nQuestion: "
_COMPLETION_SUFFIX = "\nAnswer:"
_COMPLETION_STOPS = ("\n\n", "\nQuestion:")


@dataclass(frozen=True)
class Segment:
    """A piece of the prompt; only `template` pieces may hold control tokens."""

    text: str
    template: bool


@dataclass(frozen=True)
class PromptParts:
    """head + document + middle + question + suffix is the prompt; the prefix depends on the document only."""

    head: str
    document: str
    middle: str
    suffix: str
    template_hash: str
    stops: tuple[str, ...] = ()  # answer text that ends the answer (a completion prompt has no end-of-turn token)
    answer_prefix: str = ""  # plain text that opens the model's turn (a benchmark's answer prefix), answered on from there

    @property
    def prefix(self) -> str:
        return self.head + self.document + self.middle

    def prefix_segments(self) -> list[Segment]:
        return [Segment(self.head, True), Segment(self.document, False), Segment(self.middle, True)]

    def question_segments(self, question: str) -> list[Segment]:
        segments = [Segment(question.strip(), False), Segment(self.suffix, True)]
        return segments + [Segment(self.answer_prefix, False)] if self.answer_prefix else segments


class _TemplateRefused(Exception):
    """The template called raise_exception (e.g. a template without a system role)."""


def _raise_exception(message: str = "") -> None:
    raise _TemplateRefused(message)


def build_prompt(document: str, chat_template: str | None, *, model_name: str = "the model") -> PromptParts:
    """Split the rendered prompt around the document and the question; ModelError if the template is unusable."""
    document = document.strip()
    if not chat_template:
        digest = hashlib.sha256((_LAYOUT + "completion" + _COMPLETION_HEAD + _COMPLETION_MIDDLE + _COMPLETION_SUFFIX).encode())
        return PromptParts(_COMPLETION_HEAD, document, _COMPLETION_MIDDLE, _COMPLETION_SUFFIX,
                           digest.hexdigest()[:16], _COMPLETION_STOPS)
    rendered, folded = _render(chat_template, model_name)
    head, found_doc, rest = rendered.partition(_DOCUMENT_MARK)
    middle, found_q, suffix = rest.partition(_QUESTION_MARK)
    if not (found_doc and found_q) or _DOCUMENT_MARK in suffix or _QUESTION_MARK in suffix:
        raise ModelError(f"the chat template of {model_name} does not render the user's message as given; "
                         "it cannot be used for questions about a document")
    digest = hashlib.sha256((_LAYOUT + chat_template + SYSTEM_PROMPT + ("\0folded" if folded else "")).encode())
    return PromptParts(head, document, middle, suffix, digest.hexdigest()[:16])


def _render(chat_template: str, model_name: str) -> tuple[str, bool]:
    """The template rendered around the placeholders, and whether the instructions went into the user turn."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    try:
        template = env.from_string(chat_template)
    except jinja2.TemplateSyntaxError as err:
        raise ModelError(f"the chat template of {model_name} has a syntax error (line {err.lineno}: {err.message})") from None
    with_system = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": _USER_CONTENT}]
    # templates without a system role (Mistral, Llama 2, Gemma) refuse one: fold the instructions
    # into the user turn, as those models expect
    folded = [{"role": "user", "content": f"{SYSTEM_PROMPT}\n\n{_USER_CONTENT}"}]
    for messages in (with_system, folded):
        try:
            text = template.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        except _TemplateRefused as err:
            refusal = str(err)
            continue
        except SecurityError:
            raise ModelError(f"the chat template of {model_name} tried something the template sandbox forbids") from None
        except Exception as err:  # noqa: BLE001 - any error inside a third-party template is the template's
            raise ModelError(f"the chat template of {model_name} failed: {type(err).__name__}: {err}") from None
        return text, messages is folded
    raise ModelError(f"the chat template of {model_name} refuses a single user message: {refusal}")
