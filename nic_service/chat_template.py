"""Hugging Face chat templates: load one from a model folder and render a conversation with it.

Templates from the Hub are untrusted code, so they run in Jinja's immutable sandbox, set up as
transformers' apply_chat_template does (same options, filters and globals), so the same template renders
the same prompt here as there. The sandbox keeps a template from reaching anything but its
inputs, not from running without end: a render also has a budget (RENDER_CPU_SECONDS,
MAX_PROMPT_CHARS), and no operator (`*`, `**`, `+`, `~`, `%`), width or count argument
(`center`, `indent`, `wordwrap`, `batch`, `lipsum`, `to_bytes`, ...), str.format, replace,
join, translate or printed value may build a string or list longer than the prompt may be, or
an integer past MAX_INT_BITS (one such operation runs, and allocates, before any check between
operations could stop it). What else builds in one step builds from what the template already
holds, at most a few times its size.
"""

import json
import math
import os
import re
import string
import time
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Older Jinja releases have known sandbox escapes (transformers refuses them too).
_MIN_JINJA = (3, 1, 6)

# One render's budget. A template that loops without end on some conversation (or writes without
# end) would otherwise hold the front-end thread rendering it for good, and with a few such
# requests every thread the front end encodes prompts on. Real templates render a 4 MiB
# conversation of 400,000 messages in under a second and write a few times its size.
RENDER_CPU_SECONDS = 5.0
MAX_PROMPT_CHARS = 64 << 20  # 16 times the default request limit; ~16M tokens of English
# The largest integer a template may compute: a prompt prints none longer than a few digits, and
# `2 ** (10 ** 9)` alone ran for minutes (Python prints no int past 4,300 digits, 14,000 bits).
MAX_INT_BITS = 1 << 16


def render_chat(
    template: str,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    cpu_seconds: float = RENDER_CPU_SECONDS,
    max_chars: int = MAX_PROMPT_CHARS,
    **special_tokens,
) -> str:
    """Renders `messages` ({"role": ..., "content": ...} dicts) into the model's prompt text;
    special_tokens: bos_token, eos_token, pad_token, ... as the template may use them
    (load_special_tokens).

    Raises ValueError when the template is broken, refuses the conversation (raise_exception),
    tries something the sandbox forbids, or overruns its budget: `cpu_seconds` of this thread's
    CPU, `max_chars` characters of prompt.
    """
    compiled = _compile(template)
    budget = _Budget(cpu_seconds, max_chars)
    pieces = []
    try:
        for piece in compiled.generate(
            # Copies: nothing a template does can reach the caller's messages.
            messages=[dict(message) for message in messages],
            # transformers passes these as None when unset; templates test `tools is not none`.
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
            **{_BUDGET: budget},
        ):
            budget.wrote(piece)
            pieces.append(piece)
    except _OverBudget as e:
        raise ValueError(f"the chat template {e}") from e
    except _TemplateRaised as e:
        raise ValueError(f"the chat template rejected the conversation: {e.message}") from e
    except jinja2.exceptions.SecurityError as e:
        raise ValueError(f"the chat template did something its sandbox forbids: {e}") from e
    except Exception as e:  # a template is code: any failure of it is a bad template or conversation
        raise ValueError(f"the chat template failed to render: {type(e).__name__}: {e}") from e
    return "".join(pieces)


def load_chat_template(model_dir: str | os.PathLike) -> str | None:
    """The model's chat template, or None if it has none.

    As in transformers, a `chat_template.jinja` file wins over the `chat_template` entry of
    tokenizer_config.json, which is either the template itself or a list of {"name", "template"}
    entries of which "default" is the one used for chat.

    Raises ValueError when the template cannot be read or does not compile: a syntax error is
    the model folder's, found once when the folder is loaded, not in every chat request.
    """
    template = _read_chat_template(model_dir)
    if template is not None:
        _compile(template)
    return template


def _read_chat_template(model_dir: str | os.PathLike) -> str | None:
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
    SPECIAL_TOKEN_KEYS (and the model's own: _named_tokens; not additional_special_tokens, which
    transformers 4 handed a template and 5, the oracle, does not) from tokenizer_config.json,
    then from special_tokens_map.json over them in a folder saved without `added_tokens_decoder`
    (older ones, Blink's demo model), as transformers reads such a folder."""
    config, legacy = (_read_json(os.path.join(model_dir, name))
                      for name in ("tokenizer_config.json", "special_tokens_map.json"))
    out: dict = {}
    for source in (config, legacy if "added_tokens_decoder" not in config else {}):
        for key in SPECIAL_TOKEN_KEYS:
            # "" too: transformers hands a template bos_token="" (Llama 3's `bos_token + ...`
            # was an undefined name here)
            if isinstance(source.get(key), (str, dict)):
                out[key] = _token_text(source[key])
        out.update(_named_tokens(source))
    return out


def _named_tokens(config: dict) -> dict:
    """The model's own special tokens transformers hands a template too (a multimodal model's
    image_token, ...): every other `*_token` entry that is a token (a string or an AddedToken
    object: "" too, as transformers hands it; not a flag such as add_bos_token), then the names
    of an `extra_special_tokens` object over them."""
    named = {key: value for key, value in config.items()
             if key.endswith("_token") and key not in SPECIAL_TOKEN_KEYS}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        named.update(extra)
    return {key: _token_text(value) for key, value in named.items()
            if isinstance(value, (str, dict))}


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


class _OverBudget(Exception):
    """A render ran past its budget; the message completes "the chat template ..."."""


# The render variable that holds its _Budget: not a name a template can write, so only the
# loops and calls below reach it.
_BUDGET = "blink render budget"
_CLOCK_EVERY = 16  # budget ticks per look at the clock (a system call, 0.2 us)


class _Budget:
    """One render's allowance. Its thread's CPU time, not wall time: renders and the event loop
    share the GIL, and a render waiting for it spends nothing. A template can run long only by
    looping or calling (Jinja has no other iteration), so every loop iteration and every call
    ticks; every piece of output is counted as it is written."""

    def __init__(self, cpu_seconds: float, max_chars: int):
        self._cpu_seconds, self._max_chars = cpu_seconds, max_chars
        self._deadline = time.thread_time() + cpu_seconds
        self._ticks = 0
        self._chars = 0

    def tick(self) -> None:
        self._ticks += 1
        if self._ticks % _CLOCK_EVERY == 0 and time.thread_time() > self._deadline:
            raise _OverBudget(f"did not finish within {self._cpu_seconds:g} s of CPU")

    def building(self, size: int) -> None:
        """A string or list of `size` items is about to be built: within the output cap, as
        anything longer could only be written past it."""
        if size > self._max_chars:
            raise _OverBudget(f"built a value of {size:,} items, more than {self._max_chars:,}")

    def wrote(self, piece: str) -> None:
        self._chars += len(piece)
        if self._chars > self._max_chars:
            raise _OverBudget(f"wrote more than {self._max_chars:,} characters")


@jinja2.pass_context
def _budgeted_iter(context, iterable):
    """Every template loop iterates through this (_compile puts it there): a loop whose body
    makes no call would otherwise run unseen."""
    budget = context.get(_BUDGET)
    for item in iterable:
        budget.tick()
        yield item


def _text_size(value, limit: int = MAX_PROMPT_CHARS, depth: int = 0) -> int:
    """A bound on len(str(value)), found without building it, and given up once past limit
    (the caller refuses anything past it): strings by their length, numbers by their digits,
    containers by their items' (a list of 60 references to one 50 MB string prints 3 GB)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() * 31 // 100 + 2  # (log10(2) < 0.31)
    if isinstance(value, float):
        return 32
    if isinstance(value, (bytes, bytearray)):
        return 4 * len(value) + 3
    items = ([*value.keys(), *value.values()] if isinstance(value, dict)
             else value if isinstance(value, (list, tuple, set, frozenset)) else None)
    if items is None or depth > 32:
        return 64  # (an object of the sandbox's: an undefined, a namespace, a macro)
    size = 2
    for item in items:
        size += _text_size(item, limit - size, depth + 1) + 2
        if size > limit:
            break
    return size


@jinja2.pass_context
def _budgeted_concat(context, *pieces) -> str:
    """Every `a ~ b ~ ...` joins through this (_compile puts it there): strings that double
    in a loop outgrew memory within a few iterations, before the clock was looked at."""
    context.get(_BUDGET).building(sum(_text_size(piece) for piece in pieces))
    return "".join(str(piece) for piece in pieces)


@jinja2.pass_context
def _budgeted_finalize(context, value):
    """Every `{{ value }}` before it is written: sized before str() builds it."""
    if not isinstance(value, str):
        context.get(_BUDGET).building(_text_size(value))
    return value


_SEQUENCES = (str, list, tuple)

# One %-conversion: its mapping key, width and precision (digits, or * for one taken from the
# arguments) and conversion character
_PERCENT_SPEC = re.compile(
    r"%(?:\((?P<key>[^)]*)\))?[-#0 +]*(?P<width>\*|\d*)(?:\.(?P<precision>\*|\d*))?[hlL]?"
    r"(?P<conversion>.?)", re.DOTALL)


def _number(value) -> int:
    """A width or precision as given (an int, or a string of digits in a format spec)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value)
    return sum(int(n) for n in re.findall(r"\d+", value)) if isinstance(value, str) else 0


def _percent_size(text: str, args) -> int:
    """A bound on the length of `text % args`: each conversion's width, precision and value,
    taken from the arguments in order as `%` takes them."""
    mapping = args if isinstance(args, dict) else None
    values = iter(args if isinstance(args, tuple) else () if mapping is not None else (args,))
    size = len(text)
    for m in _PERCENT_SPEC.finditer(text):
        for part in ("width", "precision"):
            given = m.group(part)
            size += _number(next(values, 0) if given == "*" else given or "")
        if m.group("conversion") in ("%", ""):
            continue
        key = m.group("key")
        value = mapping.get(key) if mapping is not None and key is not None else next(values, "")
        size += _text_size(value)
    return size


def _format_size(text: str, args, kwargs) -> int:
    """A bound on the length of text.format(*args, **kwargs): each field's value (the whole
    argument it names) and its spec's widths, nested fields resolved as format resolves them."""
    auto = iter(range(len(args)))

    def argument(name: str):
        name = re.split(r"[.\[]", name, maxsplit=1)[0]
        if name == "":
            name = str(next(auto, -1))
        if name.isdigit():
            return args[int(name)] if int(name) < len(args) else ""
        return kwargs.get(name, "")
    size = len(text)
    for _, name, spec, _ in string.Formatter().parse(text):
        if name is None:
            continue
        value = argument(name)
        spec = spec or ""
        for literal, nested, _, _ in string.Formatter().parse(spec):
            size += _number(literal) + (_number(argument(nested)) if nested is not None else 0)
        size += _text_size(value)
    return size


def _str_call_size(text: str, method: str, args, kwargs) -> int:
    """A bound on the length of the string text.method(*args, **kwargs) builds, for the methods
    whose arguments can make it much longer than the strings they hold (0 for the others:
    at most a few times their inputs, which the budget has seen)."""
    if method in ("center", "ljust", "rjust", "zfill", "expandtabs"):
        width = args[0] if args else kwargs.get("width", kwargs.get("tabsize", 8))
        if not isinstance(width, int):
            return 0  # (the method raises its own TypeError)
        if method == "expandtabs":
            return len(text) + text.count("\t") * max(width, 0)
        return max(len(text), width)
    if method == "replace" and len(args) >= 2:
        return _replace_size(text, *args[:3])
    if method == "join" and args:
        return _join_size(text, args[0])
    if method == "translate" and args and isinstance(args[0], dict):
        longest = max((_text_size(v) for v in args[0].values()), default=1)
        return len(text) * max(longest, 1)
    if method == "format":
        return _format_size(text, args, kwargs)
    if method == "format_map" and args and isinstance(args[0], dict):
        return _format_size(text, (), args[0])
    return 0


def _replace_size(text, old, new, count=-1) -> int:
    """A bound on the length of text.replace(old, new, count)."""
    if not all(isinstance(x, str) for x in (text, old, new)):
        return 0  # (replace raises its own TypeError)
    found = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(text) + found * max(len(new) - len(old), 0)


def _join_size(separator, items, *_) -> int:
    """A bound on the length of separator.join(items) (0 where items is not yet a sequence:
    an iterator's items are built one at a time, each ticked where a loop made them)."""
    if not isinstance(items, (str, list, tuple)):
        return 0
    return _text_size(separator) * max(len(items) - 1, 0) + _text_size(items)


def _sized_filter(filter_function, size):
    """filter_function, sized first: size(value, *args, **kwargs) bounds what it builds. It
    takes the render's context, so Jinja never runs it while compiling (constant folding)."""
    passes = getattr(filter_function, "jinja_pass_arg", None)

    @jinja2.pass_context
    def sized(context, value, *args, **kwargs):
        context.get(_BUDGET).building(size(value, *args, **kwargs))
        first = {None: (), "eval_context": (context.eval_ctx,),
                 "environment": (context.environment,), "context": (context,)}[
            passes and passes.name]
        return filter_function(*first, value, *args, **kwargs)
    return sized


def _indent_size(value, width=4, first=False, blank=False) -> int:
    prefix = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    return _text_size(value) + (str(value).count("\n") + 1) * max(prefix, 0)


def _wordwrap_size(value, width=79, break_long_words=True, wrapstring=None, *_, **__) -> int:
    """Every character can start a line: the text, and a line break for each."""
    return _text_size(value) * (1 + len(wrapstring if isinstance(wrapstring, str) else "\n"))


def _tojson_size(value, ensure_ascii=False, indent=None, *_, **__) -> int:
    """Each item on a line of its own, indented at most a level an item (6 bytes an escaped
    character at most)."""
    size = 6 * _text_size(value)
    return size * (1 + _number(indent)) if indent is not None else size


def _sum_size(value, attribute=None, start=0) -> int:
    """Lists summed onto a list start: their items' total."""
    if not isinstance(start, (list, tuple)) or not isinstance(value, (list, tuple)):
        return 0
    return len(start) + sum(len(x) for x in value if isinstance(x, (list, tuple, str)))


# The filters whose arguments can make their output much longer than their input, and the
# bound of each one's output
_SIZED_FILTERS = {
    "center": lambda value, width=80: max(_text_size(value), width if isinstance(width, int)
                                          else 0),
    "indent": _indent_size,
    "format": lambda value, *args, **kwargs: _percent_size(str(value), kwargs or args),
    "replace": lambda value, old, new, count=None: _replace_size(
        str(value), str(old), str(new), -1 if count is None else count),
    "join": lambda value, d="", attribute=None: _join_size(d, value),
    # the last batch (slice) is filled to linecount items (slices lists) in one step
    "batch": lambda value, linecount, fill_with=None: _number(linecount),
    "slice": lambda value, slices, fill_with=None: _number(slices),
    "wordwrap": _wordwrap_size,
    "tojson": _tojson_size,
    "sum": _sum_size,
}


@jinja2.pass_context
def _sized_lipsum(context, n=5, html=True, min=20, max=100):
    """Jinja's lipsum global, sized first: n paragraphs of up to max words (of up to 12
    characters) took 47 s and 1.7 GB at n = 10 ** 6."""
    context.get(_BUDGET).building(_number(n) * _number(max) * 12)
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def _int_bits(operator: str, left, right) -> int:
    """A bound on the bits of `left operator right` for integers (0 for other operands)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return 0
    if operator == "*":
        return left.bit_length() + right.bit_length()
    if operator == "**" and right > 0:
        magnitude = abs(left)
        if magnitude <= 1:  # 0, 1 and -1 stay small
            return 0
        if right.bit_length() > 64:  # past what a float holds, and far past any limit
            return right
        # the result's bits, floor(right log2 |left|) + 1 (bit_length times right counted
        # 2 ** n as 2n bits: 2 ** 40000, 40,001 bits, was refused)
        return int(right * math.log2(magnitude)) + 1
    return 0


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox whose every call ticks the render's budget (a macro that calls
    itself twice runs in exponential time without any loop), and whose `*`, `**`, `+` and `%`,
    string methods that take a width and str.format are sized before they run: `"x" * 10 ** 10`
    and `'x'.center(10 ** 10)` were one operation of 10 GB each."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(self, context, obj, /, *args, **kwargs):
        budget = context.get(_BUDGET)
        budget.tick()
        text, method = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
        if isinstance(text, int) and method == "to_bytes":  # `(1).to_bytes(10 ** 9)`
            budget.building(_number(args[0] if args else kwargs.get("length", 1)))
        if not isinstance(text, str):  # str.format, as wrap_str_format wrapped it
            text, method = getattr(obj, "blink_text", None), getattr(obj, "blink_method", "")
        if isinstance(text, str):  # `'x'.center(10 ** 10)`: one call of 10 GB
            budget.building(_str_call_size(text, method, args, kwargs))
        return super().call(context, obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """The sandbox's str.format, named for call's sizing (the sandbox wraps the method as
        the template reads it, so call sees a function of its own)."""
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            wrapper.blink_text, wrapper.blink_method = value.__self__, value.__name__
        return wrapper

    def call_binop(self, context, operator: str, left, right):
        if operator == "%" and isinstance(left, str):  # `'%*s' % (10 ** 10, '')`
            context.get(_BUDGET).building(_percent_size(left, right))
        if operator == "+":  # (templates add strings all the time: the short way)
            if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
                context.get(_BUDGET).building(len(left) + len(right))
            return left + right  # (an integer sum grows a bit an operation, loops ticked)
        sequence, times = (right, left) if isinstance(right, _SEQUENCES) else (left, right)
        if operator == "*" and isinstance(sequence, _SEQUENCES) and isinstance(times, int):
            context.get(_BUDGET).building(len(sequence) * times)
        elif _int_bits(operator, left, right) > MAX_INT_BITS:
            raise _OverBudget(f"computed an integer of more than {MAX_INT_BITS:,} bits")
        return super().call_binop(context, operator, left, right)


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


def _call(function, args: list) -> jinja2.nodes.Call:
    """A template node that calls one of this module's functions with args (template nodes)."""
    name = jinja2.nodes.ImportedName(f"{__name__}.{function.__name__}")
    return jinja2.nodes.Call(name, args, [], None, None)


# Memoizes the compile: a server renders every request with the same few templates.
@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    if tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3]) < _MIN_JINJA:
        # (a ValueError: the front end's start names it in one line, as any unusable template)
        raise ValueError(f"chat templates need jinja2 >= 3.1.6 (sandbox fixes); found "
                         f"{jinja2.__version__}")
    env = _BudgetedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    for name, size in _SIZED_FILTERS.items():
        env.filters[name] = _sized_filter(env.filters[name], size)
    env.globals["lipsum"] = _sized_lipsum
    env.finalize = _budgeted_finalize
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        tree = env.parse(template)
        for loop in list(tree.find_all(jinja2.nodes.For)):
            # `for x in items` becomes `for x in _budgeted_iter(items)`: the same items, ticked
            loop.iter = _call(_budgeted_iter, [loop.iter])
        for concat in list(tree.find_all(jinja2.nodes.Concat)):
            # `a ~ b` becomes `_budgeted_concat(a, b)`, the one piece of a join
            concat.nodes = [_call(_budgeted_concat, concat.nodes)]
        return env.from_string(tree)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template has a syntax error on line {e.lineno}: {e.message}") from e
