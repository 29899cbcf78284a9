"""Hugging Face chat templates: load one from a model folder and render a conversation with it.

Templates from the Hub are untrusted code, so they run in Jinja's immutable sandbox, set up as
transformers' apply_chat_template does (same options, filters and globals), so the same template renders
the same prompt here as there.
"""

import json
import os
import re
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Older Jinja releases have known sandbox escapes (transformers refuses them too).
_MIN_JINJA = (3, 1, 6)


def render_chat(
    template: str,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    **special_tokens,
) -> str:
    """Renders `messages` ({"role": ..., "content": ...} dicts) into the model's prompt text;
    special_tokens: bos_token, eos_token, pad_token, ... as the template may use them
    (load_special_tokens).

    Raises ValueError when the template is broken, refuses the conversation (raise_exception), or
    tries something the sandbox forbids.
    """
    compiled = _compile(template)
    try:
        return compiled.render(
            # Copies: nothing a template does can reach the caller's messages.
            messages=[dict(message) for message in messages],
            # transformers passes these as None when unset; templates test `tools is not none`.
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except _TemplateRaised as e:
        raise ValueError(f"the chat template rejected the conversation: {e.message}") from e
    except jinja2.exceptions.SecurityError as e:
        raise ValueError(f"the chat template did something its sandbox forbids: {e}") from e
    except Exception as e:  # a template is code: any failure of it is a bad template or conversation
        raise ValueError(f"the chat template failed to render: {type(e).__name__}: {e}") from e


def load_chat_template(model_dir: str | os.PathLike) -> str | None:
    """The model's chat template, or None if it has none.

    As in transformers, a `chat_template.jinja` file wins over the `chat_template` entry of
    tokenizer_config.json, which is either the template itself or a list of {"name", "template"}
    entries of which "default" is the one used for chat.
    """
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    template = _read_json(config_path).get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(
            f"{config_path} has chat templates named {sorted(map(str, named))} but none named 'default'"
        )
    raise ValueError(f"{config_path}: chat_template must be a string or a list of named templates")


# The special tokens transformers hands a chat template (its special_tokens_map).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")


def load_special_tokens(model_dir: str | os.PathLike) -> dict:
    """The special tokens a chat template sees, as transformers passes them: each of
    SPECIAL_TOKEN_KEYS (and additional_special_tokens, a list) from tokenizer_config.json, then
    from special_tokens_map.json over them in a folder saved without `added_tokens_decoder`
    (older ones, Blink's demo model), as transformers reads such a folder."""
    config, legacy = (_read_json(os.path.join(model_dir, name))
                      for name in ("tokenizer_config.json", "special_tokens_map.json"))
    out: dict = {}
    for source in (config, legacy if "added_tokens_decoder" not in config else {}):
        for key in SPECIAL_TOKEN_KEYS:
            if _token_text(source.get(key)):
                out[key] = _token_text(source[key])
        extra = source.get("additional_special_tokens")
        if isinstance(extra, list) and extra:
            out["additional_special_tokens"] = [_token_text(t) for t in extra]
    return out


def _read_json(path: str) -> dict:
    """A JSON file's object; {} when the file is missing or holds something else."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return value if isinstance(value, dict) else {}


def _token_text(token) -> str:
    """A special token as written in the configs: its text, or {"content": text, ...}."""
    if isinstance(token, dict):
        return token.get("content") or ""
    return token if isinstance(token, str) else ""


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """A template called raise_exception(message): it refuses this conversation."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' version: Jinja's own tojson escapes HTML characters (<, >, &, '), which would change
    # the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    # Llama 3.1-style templates print today's date with it.
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}`, which transformers uses to find the assistant's
    tokens for training masks; rendering just keeps the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


# Memoizes the compile: a server renders every request with the same few templates.
@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    if tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3]) < _MIN_JINJA:
        raise RuntimeError(f"chat templates need jinja2 >= 3.1.6 (sandbox fixes); found {jinja2.__version__}")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template has a syntax error on line {e.lineno}: {e.message}") from e
