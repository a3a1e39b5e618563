"""The chat prompt: the document goes first (a reusable prefix), the question after it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from jinja2.sandbox import ImmutableSandboxedEnvironment

SYSTEM_PROMPT = (
    "You are kvlocal, a careful assistant. Answer questions about the document the user gives you, "
    "using only what the document says. Be brief and quote exact names, numbers and codes."
)

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_QUESTION_MARK = "\u2063KVLOCAL-QUESTION\u2063"


@dataclass(frozen=True)
class PromptParts:
    """prefix + question + suffix is the rendered chat; the prefix depends on the document only."""

    prefix: str
    suffix: str
    template_hash: str

    def question_text(self, question: str) -> str:
        return question.strip() + self.suffix


def build_prompt(document: str, chat_template: str | None) -> PromptParts:
    """Render the model's chat template with the document first and split it where the question goes."""
    template = chat_template or CHATML_TEMPLATE
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    rendered = env.from_string(template).render(
        messages=[
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Document:\n\n{document.strip()}\n\nQuestion:\n{_QUESTION_MARK}"},
        ],
        add_generation_prompt=True,
        bos_token="",
        eos_token="",
    )
    prefix, found, suffix = rendered.partition(_QUESTION_MARK)
    if not found:
        raise ValueError("the chat template dropped the user message")
    template_hash = hashlib.sha256((template + SYSTEM_PROMPT).encode()).hexdigest()[:16]
    return PromptParts(prefix=prefix, suffix=suffix, template_hash=template_hash)
