"""A Hermes / Qwen 2.5 style chat template (tools in the system turn, ``<tool_call>`` JSON
blocks, ``<tool_response>`` for tool results), shortened from Qwen2.5-Instruct's, and a tiny
random-weight model folder that uses it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from models import tiny_model_dir

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    '\n<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def hermes_model_dir(dest: Path) -> Path:
    """The built-in tiny dense model, copied to ``dest`` with ``HERMES_TEMPLATE``."""
    shutil.copytree(tiny_model_dir("dense"), dest)
    path = dest / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = HERMES_TEMPLATE
    path.write_text(json.dumps(config))
    return dest
