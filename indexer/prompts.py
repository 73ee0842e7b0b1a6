"""Prompts and chat messages to token ids, per model, exactly as its engine's server makes them.

Each configured model names a tokenizer (a local directory or a hub id,
which Hugging Face's libraries resolve with their own cache, offline mode and
token), optionally a chat template overriding the tokenizer's, and the engine
adapter whose server's rendering rules apply (vLLM's by default). A model is
loaded once, on its first request, and shared by every request after.

Tokenizing a long prompt costs tens of milliseconds of Rust, so it runs in a
thread pool (``tokenizers`` releases the GIL in ``encode_batch``), never on
the event loop. It is also cached, where that is exact: the tokenizer cuts
the text at every added token (``<|eot_id|>`` ...) before normalising,
splitting and merging the pieces in between one by one, so a piece's ids do
not depend on its neighbours, and a chat's pieces (message contents and role
names) are cached individually. A conversation that grows by one turn then
tokenizes only the new turn. That holds when no added token strips
whitespace or matches after normalisation and no pre-tokenizer looks at a
piece's position; a model where it does not hold (checked on a probe when it
loads) is tokenized whole, uncached.

Requires the optional extra ``tokenize`` (``pip install 'kvindex[tokenize]'``);
without it kvindex runs, and a prompt is refused naming the extra.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import logging
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from indexer.engines import catalog
from indexer.engines.rendering import (
    ChatCall,
    ChatMessage,
    ChatOptions,
    PromptRefused,
    Renderer,
    ResponsesRequest,
    ToolServing,
)

EXTRA = "tokenize"
INSTALL = f"pip install 'kvindex[{EXTRA}]'"
_EXTRA_MODULES = ("tokenizers", "transformers", "jinja2", "cachetools")
_DEFAULTS = ChatOptions()

log = logging.getLogger("kvindex.prompts")


class ModelTokenizer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One entry of ``models``: how the engine server serving the model turns a request
    into tokens, so ``prompt``, ``messages`` and ``input`` queries get the same."""

    #: A tokenizer directory or a Hugging Face hub id.
    tokenizer: str
    #: A template file or the template itself; null: the tokenizer's.
    chat_template: str | None = None
    #: The engine adapter whose server's rendering applies (SGLang renders chats
    #: otherwise than vLLM).
    adapter: str = catalog.DEFAULT
    #: The server's ``--enable-auto-tool-choice``: whether ``tool_choice: "auto"`` is served.
    enable_auto_tool_choice: bool = False
    #: The server's ``--tool-call-parser``: needed for ``"auto"``, ``"required"`` and
    #: named tool choices.
    tool_call_parser: str | None = None
    #: The server's ``--exclude-tools-when-tool-choice-none``: ``tool_choice: "none"``
    #: hides the tools from the template.
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        try:
            catalog.renderer(self.adapter)
        except ValueError as e:  # no such adapter, or one that renders nothing
            raise ValueError(f"adapter: {e}") from None

    @property
    def renderer(self) -> Renderer:
        return catalog.renderer(self.adapter)

    @property
    def serving(self) -> ToolServing:
        return ToolServing(
            self.enable_auto_tool_choice,
            self.tool_call_parser,
            self.exclude_tools_when_tool_choice_none,
        )


class _Loaded:
    """One model's tokenizer, template traits and exact piece splitter."""

    def __init__(self, name: str, spec: ModelTokenizer) -> None:
        from transformers import AutoTokenizer

        self.name = name
        self.adapter = spec.adapter
        self.serving = spec.serving
        self.hf = AutoTokenizer.from_pretrained(spec.tokenizer)
        self.backend = self.hf.backend_tokenizer
        configured = _template_text(spec.chat_template)
        self.template = configured or _own_template(self.hf, None)
        #: the template a request with tools renders with: a tokenizer's ``tool_use`` one
        #: where it names templates (Hugging Face's pick, and vLLM's), else the same
        self.tool_template = configured or _own_template(self.hf, [])
        named = inspect.signature(self.hf.apply_chat_template).parameters.values()
        self._params = [p.name for p in named if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        self._traits: dict[tuple[str, str], Any] = {}
        for template in (self.template, self.tool_template):  # a broken one fails the load
            self.traits(self.adapter, template)
        self.added = {t.content: i for i, t in self.backend.get_added_tokens_decoder().items()}
        self.split = _piece_splitter(self.backend, self.added)
        self.specials = _special_tokens_around(self.backend)
        if self.split is not None and not self._pieces_exact():
            self.split = None

    def traits(self, adapter: str, template: str | None) -> Any:
        """``template`` as the server of engine adapter ``adapter`` reads it (None: no
        template); each reading made once."""
        if template is None:
            return None
        traits = self._traits.get((adapter, template))
        if traits is None:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            tree = _compile_jinja_template(template).environment.parse(template)
            traits = catalog.renderer(adapter).template_traits(template, tree, self._params)
            self._traits[adapter, template] = traits
        return traits

    def _pieces_exact(self) -> bool:
        """Whether tokenizing piece by piece equals tokenizing the whole, on a probe."""
        tokens = list(self.added)[:3]
        probe = (
            f"{tokens[0]}user  \u00dcn\u00efcode\n\n e\u0301{tokens[-1]} next{tokens[0]}\t 123 x"
        )
        pieces = self.split(probe)
        known = {p: self.plain(p) for p in pieces[0::2]}
        specials = self.specials is not None
        return self.join(pieces, known, specials) == self.whole(probe, specials)

    def pieces(self, text: str, add_special_tokens: bool) -> list[str] | None:
        """The text cut at added tokens (odd items are the added tokens), or None
        when this model's text must be tokenized whole."""
        if self.split is None or (add_special_tokens and self.specials is None):
            return None
        return self.split(text)

    def plain(self, piece: str) -> tuple[int, ...]:
        return tuple(self.backend.encode(piece, add_special_tokens=False).ids)

    def whole(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def join(
        self, pieces: list[str], known: Mapping[str, tuple[int, ...]], add_special_tokens: bool
    ) -> list[int]:
        """The ids of ``pieces``, the plain ones read from ``known``."""
        ids: list[int] = []
        added = self.added
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(added[piece])
            elif piece:
                ids.extend(known[piece])
        if add_special_tokens:
            before, after = self.specials
            return [*before, *ids, *after]
        return ids


def _template_text(setting: str | None) -> str | None:
    """A configured chat template: a file's text, or the template itself (vLLM's rule:
    a value that names no file and holds any of ``{}\\n`` is a template)."""
    if setting is None:
        return None
    path = Path(setting)
    try:
        is_file = path.is_file()
    except OSError:  # a long template is no file name (ENAMETOOLONG)
        is_file = False
    if is_file:
        return path.read_text()
    if any(c in setting for c in "{}\n"):
        return setting
    raise ValueError(f"chat_template {setting!r} is neither a file nor a template")


def _own_template(hf: Any, tools: list[Any] | None) -> str | None:
    """The tokenizer's template for a request with ``tools`` or without (None)."""
    try:
        return hf.get_chat_template(None, tools=tools)
    except ValueError:  # the tokenizer has no chat template (of that name)
        return None


def _piece_splitter(backend: Any, added: Mapping[str, int]) -> Callable[[str], list[str]] | None:
    """``re.split`` at added tokens, longest first (the tokenizer's leftmost-longest
    match); None when the tokenizer's pieces would not be independent."""
    tokens = backend.get_added_tokens_decoder().values()
    if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in tokens):
        return None
    if '"prepend_scheme":"first"' in backend.to_str().replace(" ", ""):
        return None  # Metaspace marks only the text's first piece
    ordered = sorted(added, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, ordered)) + ")").split


def _special_tokens_around(backend: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids the post-processor puts before and after a single text, or None if
    that is not the same for every text (then such prompts are tokenized whole)."""
    found = set()
    for probe in ("a", "hello world 12"):
        plain, full = backend.encode(probe, add_special_tokens=False).ids, backend.encode(probe).ids
        at = next(
            (k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain),
            None,
        )
        if at is None:
            return None
        found.add((tuple(full[:at]), tuple(full[at + len(plain) :])))
    return found.pop() if len(found) == 1 else None


#: One tokenizer loads at a time in the process: transformers imports its classes
#: lazily, and two threads importing them at once can see a half-made module
#: ("cannot import name 'AutoTokenizer'"), which the preloads at start made likely.
_LOAD_LOCK = threading.Lock()


def missing_extra() -> list[str]:
    """The modules of the ``tokenize`` extra that are not installed."""
    return [m for m in _EXTRA_MODULES if importlib.util.find_spec(m) is None]


class Tokenizers:
    """The configured models' tokenizers, a shared piece cache and the worker threads.

    ``cache_tokens`` bounds the cache by the token ids it holds (LRU; a
    million ids are some tens of MB). ``workers``: threads tokenizing at once.
    """

    def __init__(
        self, models: Mapping[str, ModelTokenizer], workers: int = 2, cache_tokens: int = 1 << 20
    ) -> None:
        self._specs = dict(models)
        self._loaded: dict[str, _Loaded] = {}
        self._failed: dict[str, str] = {}
        self._cache_lock = threading.Lock()
        self._cache: Any = None
        self._cache_tokens = cache_tokens
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvindex-tokenize")

    @property
    def models(self) -> list[str]:
        return sorted(self._specs)

    async def tokens(
        self,
        model: str | None,
        *,
        prompt: str | list[int] | None = None,
        messages: list[ChatMessage] | None = None,
        options: ChatOptions = _DEFAULTS,
        responses: ResponsesRequest | None = None,
        adapter: str | None = None,
    ) -> list[int]:
        """The prompt token ids the model's server hands its engine for this request (a
        completions ``prompt``, a chat's ``messages`` with ``options``, or a Responses
        request), off the event loop; ``adapter``: as the server of that engine adapter
        makes them (None: the model's configured one)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool,
            lambda: self.tokens_now(
                model,
                prompt=prompt,
                messages=messages,
                options=options,
                responses=responses,
                adapter=adapter,
            ),
        )

    def tokens_now(
        self,
        model: str | None,
        *,
        prompt: str | list[int] | None = None,
        messages: list[ChatMessage] | None = None,
        options: ChatOptions = _DEFAULTS,
        responses: ResponsesRequest | None = None,
        adapter: str | None = None,
    ) -> list[int]:
        """:meth:`tokens` in the calling thread."""
        if prompt is not None:
            renderer = catalog.renderer(adapter) if adapter else self._renderer(model)
            given = renderer.completion_input(prompt)
            if not isinstance(given, str):
                return list(given)
            loaded = self._model(model, "prompt")
            return self._encode(
                loaded, given, renderer.completion_special_tokens(options.add_special_tokens)
            )
        field = "messages" if responses is None else "input"
        loaded = self._model(model, field)
        adapter = adapter or loaded.adapter
        renderer, serving = catalog.renderer(adapter), loaded.serving

        def call_with(template: str | None) -> ChatCall:
            traits = loaded.traits(adapter, template)
            if responses is not None:
                return renderer.responses_call(responses, traits, serving)
            assert messages is not None
            return renderer.chat_call(messages, options, traits, serving)

        template = loaded.template
        if template is None:
            raise PromptRefused(
                field, f"model {model!r} has no chat template: set models.{model}.chat_template"
            )
        call = call_with(template)
        if call.tools is not None and loaded.tool_template != template:
            template = loaded.tool_template
            call = call_with(template)
        text = self._rendered(loaded, template, call, field)
        return self._encode(loaded, text, call.add_special_tokens)

    @staticmethod
    def _rendered(loaded: _Loaded, template: str | None, call: ChatCall, field: str) -> str:
        """The chat template's text for ``call``; 400 naming ``field`` where it fails."""
        try:
            text = loaded.hf.apply_chat_template(
                conversation=call.conversation,
                tools=call.tools,
                chat_template=template,
                tokenize=False,
                **call.kwargs,
            )
        except Exception as e:  # a template error, or transformers refusing the flags
            raise PromptRefused(field, f"the chat template failed: {e}") from None
        if not isinstance(text, str):
            raise PromptRefused("chat_template_kwargs", "must leave the template rendering text")
        return text

    def _encode(self, loaded: _Loaded, text: str, add_special_tokens: bool) -> list[int]:
        """Cached pieces are read under the lock; the rest is tokenized outside it, at once."""
        pieces = loaded.pieces(text, add_special_tokens)
        if pieces is None:
            return loaded.whole(text, add_special_tokens)
        name, cache = loaded.name, self._cache
        plain = [p for p in dict.fromkeys(pieces[0::2]) if p]
        with self._cache_lock:
            known = {p: ids for p in plain if (ids := cache.get((name, p))) is not None}
        missing = [p for p in plain if p not in known]
        if missing:
            encoded = loaded.backend.encode_batch(missing, add_special_tokens=False)
            fresh = {p: tuple(e.ids) for p, e in zip(missing, encoded, strict=True)}
            known |= fresh
            with self._cache_lock:
                for piece, ids in fresh.items():
                    if len(ids) <= cache.maxsize:
                        cache[name, piece] = ids
        return loaded.join(pieces, known, add_special_tokens)

    def adapter(self, model: str | None) -> str:
        """The engine adapter whose server renders the model's prompts by default."""
        spec = self._specs.get(model) if model is not None else None
        return spec.adapter if spec is not None else catalog.DEFAULT

    def _renderer(self, model: str | None) -> Renderer:
        """The configured model's renderer; the default adapter's for token ids given
        without a model kvindex knows."""
        spec = self._specs.get(model) if model is not None else None
        return spec.renderer if spec is not None else catalog.renderer(catalog.DEFAULT)

    def _model(self, model: str | None, field: str) -> _Loaded:
        """The model's loaded tokenizer: 4xx naming the field when none can be had."""
        loaded = self._loaded.get(model) if model is not None else None
        if loaded is not None:
            return loaded
        missing = missing_extra()
        if missing:
            raise PromptRefused(
                field, f"needs the optional extra {EXTRA!r} ({INSTALL}); missing: {missing}"
            )
        if model is None:
            raise PromptRefused("model", f"is required with {field}: it picks the tokenizer")
        spec = self._specs.get(model)
        if spec is None:
            known = ", ".join(self.models) or "none is configured"
            raise PromptRefused("model", f"no tokenizer is configured for {model!r} ({known})")
        self._ensure(model, spec)
        if model in self._failed:
            raise PromptRefused("model", self._failed[model], 503)
        return self._loaded[model]

    def _ensure(self, model: str, spec: ModelTokenizer) -> None:
        """The model's tokenizer loaded (or failed), once, whichever thread asks first."""
        with _LOAD_LOCK:
            if model not in self._loaded and model not in self._failed:
                self._load(model, spec)

    def preload(self) -> None:
        """Load every configured model's tokenizer and chat template now, in the worker
        threads: the first prompt query for a model then waits for none of it (on a
        real fleet a tokenizer took about 2 s, the first query's whole latency)."""
        if missing_extra():
            return  # every prompt query is refused naming the extra (and serve refuses)
        for model, spec in self._specs.items():
            self._pool.submit(self._ensure, model, spec)

    def failed(self) -> dict[str, str]:
        """Why each model whose tokenizer failed to load failed."""
        return dict(self._failed)

    def loading(self) -> list[str]:
        """The models whose preload has not finished yet (``/readyz`` waits for them)."""
        return [m for m in self.models if m not in self._loaded and m not in self._failed]

    def _load(self, model: str, spec: ModelTokenizer) -> None:
        if self._cache is None:
            import cachetools

            self._cache = cachetools.LRUCache(self._cache_tokens, getsizeof=len)
        try:
            self._loaded[model] = _Loaded(model, spec)
        except Exception as e:  # a missing directory, a hub error, a broken template
            self._failed[model] = f"the tokenizer of {model!r} failed to load: {e}"
            log.error("tokenizer failed to load", extra={"model": model, "error": str(e)})
        else:
            log.info("tokenizer loaded", extra={"model": model, "tokenizer": spec.tokenizer})

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
