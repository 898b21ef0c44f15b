"""Chat templates known by name, for `--chat-template NAME` as SGLang takes it.

SGLang keeps its own registry of conversation formats; the ones a text-only server commonly names are written here
as Jinja templates, so they render through Hugging Face's `apply_chat_template` like any template file.
"""

from __future__ import annotations

# ChatML (SGLang's "chatml"): every turn `<|im_start|>{role}\n{content}<|im_end|>\n`, no default system prompt.
CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {"chatml": CHATML}
