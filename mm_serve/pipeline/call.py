"""One OpenAI call, read once from its body: its tier, its prompts, its ``max_tokens``, its
sampling parameters.

``max_tokens`` is read from the body once (``max_completion_tokens``, else ``max_tokens``) and
resolved once against the prompt (:meth:`Call.sampling_params`: absent, it is the rest of the
context, as vLLM does; the context is checked there and nowhere else on this path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mm_serve.config import APIConfig
from mm_serve.ground.tiers import Tier
from mm_serve.pipeline.chat_prompt import ChatPrompt
from mm_serve.protocol.errors import APIError, bad_request
from mm_serve.protocol.schemas import ChatCompletionRequest, CompletionRequest
from mm_serve.protocol.service_tier import tier_of
from mm_serve.protocol.structured_outputs import StructuredOutputError, grammar_of
from mm_serve.protocol.tools import ToolError, tool_grammar, tool_mode
from mm_serve.runtime.sampling_params import MAX_SEED, SamplingParams

DEFAULT_PRECHECK_TOKENS = 16  # max_tokens the early admission check assumes when the call sets none
MAX_PROMPTS = 64  # prompts in one completions call
MAX_MODEL_CHARS = 4096  # the longest model name (a path) a call may name
MAX_CHARS_PER_TOKEN = 32  # a cheap bound checked before tokenizing (no tokenizer yields fewer tokens)

Body = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True)
class Call:
    """A chat or completions call.

    Attributes:
        body: the validated request body.
        tier: the SLO tier it is served in.
        arrival: when it arrived, ``time.monotonic()`` seconds (its TTFT counts from here).
        max_tokens: what it asks for (None: the rest of the context).
        chat: a chat call's messages (None for completions).
        prompts: a completions call's engine requests (``{"prompt": text}`` or
            ``{"prompt_token_ids": ids}``), one per prompt; empty for chat.
        logprobs: the log-probabilities to return per token (chat: ``top_logprobs`` when
            ``logprobs`` is set; completions: ``logprobs``); None for none.
        grammar: the structured output it asks for, ``((kind, text), field)`` (None: free text); a named
            or required ``tool_choice`` asks for one too (:mod:`mm_serve.protocol.tools`).
        tool_mode: how a chat call's tool calls are made: ``named``, ``required``, ``auto`` or None.
        grammar_compile_s: seconds the front end took to compile :attr:`grammar` (0: none, or cached);
            admission adds it to the TTFT prediction for the prefill worker's own compile.
    """

    body: Body
    tier: Tier
    arrival: float
    max_tokens: int | None
    chat: ChatPrompt | None
    prompts: list[dict[str, Any]]
    logprobs: int | None
    grammar: tuple[tuple[str, str], str] | None = None
    tool_mode: str | None = None
    grammar_compile_s: float = 0.0

    @classmethod
    def parse(cls, body: Body, default_tier: Tier, arrival: float, api: APIConfig | None = None) -> Call:
        """Read ``body`` once (within ``api``'s request limits, when given).

        Raises:
            APIError: 400 for an unknown ``service_tier``, an image outside a user message, an empty
                prompt, more than :data:`MAX_PROMPTS` prompts, a stream of several prompts, or more stop
                strings, stop characters, messages or content parts than ``api`` allows.
        """
        if api is not None:
            check_limits(body, api)
        try:
            tier = tier_of(body.service_tier, default_tier)
        except ValueError as exc:
            raise bad_request(str(exc), "service_tier", "invalid_service_tier") from None
        try:
            grammar = grammar_of(body)
        except StructuredOutputError as exc:
            raise bad_request(str(exc), exc.param) from None
        if grammar is not None:
            _check_grammar_size(grammar[0][1], grammar[1], api)
        if isinstance(body, ChatCompletionRequest):
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            mode, grammar = _tools(body, grammar, api)
            return cls(body, tier, arrival, body.max_completion_tokens or body.max_tokens,
                       ChatPrompt.parse(body.messages), [], logprobs, grammar, mode)
        prompts = _prompts(body.prompt)
        _check_prompt_count(len(prompts))  # also in check_limits, which a call without ``api`` skips
        if body.stream and len(prompts) > 1:
            raise bad_request("streaming supports one prompt per request", "prompt")
        return cls(body, tier, arrival, body.max_tokens, None, prompts, body.logprobs, grammar)

    @property
    def num_prompts(self) -> int:
        """Prompts of the call (each run ``n`` times)."""
        return 1 if self.chat is not None else len(self.prompts)

    @property
    def max_tokens_field(self) -> str:
        """The body field the output limit came from: ``max_completion_tokens`` where a chat call set it,
        else ``max_tokens`` (what a 400 about the limit names)."""
        return "max_completion_tokens" if getattr(self.body, "max_completion_tokens", None) else "max_tokens"

    @property
    def precheck_max_tokens(self) -> int:
        """``max_tokens`` for the early admission check, before the prompt is tokenized: what the call
        asks, else :data:`DEFAULT_PRECHECK_TOKENS` (the rest of the context is not known yet; a
        lower bound is what an early refusal may rest on)."""
        return self.max_tokens or DEFAULT_PRECHECK_TOKENS

    def check_values(self, vocab_size: int) -> None:
        """What can be checked before the prompt is processed: token ids in ``stop_token_ids`` and
        ``logit_bias`` within the vocabulary, ``min_tokens`` at most a ``max_tokens`` given (a bad value is
        a 400 before any admission work, never a 429 for a call that could not run).

        Raises:
            APIError: 400 naming the field.
        """
        body = self.body
        for name, ids in (("stop_token_ids", body.stop_token_ids or []),
                          ("logit_bias", [int(k) for k in body.logit_bias or {}])):  # keys are decimal strings
            bad_ids = [t for t in ids if not 0 <= t < vocab_size]
            if bad_ids:
                raise bad_request(f"{name} must hold token ids in [0, {vocab_size}) (the vocabulary), "
                                  f"got {bad_ids[:5]}", name)
        if body.min_tokens and self.max_tokens is not None and body.min_tokens > self.max_tokens:
            raise bad_request(f"min_tokens ({body.min_tokens}) must be at most {self.max_tokens_field} "
                              f"({self.max_tokens})", "min_tokens")

    def sampling_params(self, prompt_len: int, context_len: int) -> SamplingParams:
        """The sampling parameters of one prompt of ``prompt_len`` tokens; ``max_tokens`` defaults to
        the rest of the context (as vLLM). Token ids are not checked here: :meth:`check_values` does, once
        for the call, before its prompts are processed.

        Raises:
            APIError: 400 when prompt plus ``max_tokens`` exceeds the context, a stop string is empty, or a
                parameter is out of range.
        """
        body = self.body
        max_tokens = self.max_tokens or max(1, context_len - prompt_len)  # a full context: refused below
        if self.max_tokens is None and prompt_len >= context_len:  # no room for the one token generated
            raise bad_request(
                f"this model's context length is {context_len} tokens; the prompt alone has {prompt_len} tokens "
                "(image tokens included), which leaves no room for output: shorten it",
                "messages" if self.chat is not None else "prompt", "context_length_exceeded",
            )
        if prompt_len + max_tokens > context_len:
            raise bad_request(
                f"this model's context length is {context_len} tokens; the prompt has {prompt_len} tokens "
                f"(image tokens included) and {self.max_tokens_field} is {max_tokens}, {prompt_len + max_tokens} in all",
                self.max_tokens_field, "context_length_exceeded",
            )
        stop = body.stop if isinstance(body.stop, list) else ([] if body.stop is None else [body.stop])
        if any(not s for s in stop):
            raise bad_request("stop strings must be non-empty", "stop")
        if self.grammar is not None and self.grammar[0][0] == "json_object" and max_tokens < 2:
            raise bad_request(f"a JSON object needs {self.max_tokens_field} of at least 2 ({{}} is the shortest)",
                              self.max_tokens_field)
        stop_ids = body.stop_token_ids or []
        bias = {int(key): value for key, value in (body.logit_bias or {}).items()}  # keys checked: decimal strings
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
                seed=engine_seed(body.seed), stop=tuple(stop), stop_token_ids=tuple(stop_ids),
                ignore_eos=body.ignore_eos, logprobs=self.logprobs, n=body.n, min_tokens=body.min_tokens or 0,
                logit_bias=tuple(sorted(bias.items())), presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                structured=None if self.grammar is None else self.grammar[0],
                prompt_logprobs=self.logprobs if getattr(body, "echo", None) else None,
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from None


def _check_grammar_size(text: str, param: str, api: APIConfig | None) -> None:
    """Raises:
        APIError: 400 ``grammar_limit`` when the grammar ``text`` that ``param`` asks for is over
            ``api.max_grammar_chars`` (for a forced tool choice, ``tools``: their parameter schemas)."""
    if api is not None and len(text) > api.max_grammar_chars:
        raise bad_request(f"the {param} grammar has {len(text)} characters; the limit is {api.max_grammar_chars} "
                          "(api.max_grammar_chars)", param, "grammar_limit")


def _tools(body: ChatCompletionRequest, grammar: tuple[tuple[str, str], str] | None, api: APIConfig | None,
           ) -> tuple[str | None, tuple[tuple[str, str], str] | None]:
    """A chat call's tool mode, and its grammar with a named or required ``tool_choice``'s.

    Raises:
        APIError: 400 for more tools than ``api.max_tools`` (``tools_limit``), a ``tool_choice`` without tools
            or naming an undeclared function, or a forced tool choice beside another structured output.
    """
    if body.tools and api is not None and len(body.tools) > api.max_tools:
        raise bad_request(f"{len(body.tools)} tools in one request; the limit is {api.max_tools} (api.max_tools)",
                          "tools", "tools_limit")
    try:
        mode = tool_mode(body.tools, body.tool_choice)
        forced = tool_grammar(body.tools or [], body.tool_choice, body.parallel_tool_calls) if mode else None
    except ToolError as exc:
        raise bad_request(str(exc), exc.param) from None
    if forced is None:
        return mode, grammar
    _check_grammar_size(forced[1], "tools", api)
    if grammar is not None:
        raise bad_request(f"a {mode} tool_choice makes the output a tool call; it cannot also follow {grammar[1]}",
                          "tool_choice")
    return mode, (forced, "tool_choice")


def engine_seed(seed: int | None) -> int | None:
    """The engine seed of an API ``seed`` (any signed 64-bit integer).

    Choice ``i`` of ``n`` (at most 16) draws with seed + ``i``, which must stay within
    ``MAX_SEED``: seeds in ``[0, MAX_SEED - 15]`` are used as they are, others wrap modulo
    ``MAX_SEED - 14`` (so ``-1`` and ``MAX_SEED - 15`` draw alike).
    """
    return None if seed is None else seed % (MAX_SEED - 14)


def _prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A completions ``prompt`` as its prompts: one text, one list of token ids, or several of either (an
    empty list: none)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def _check_prompt_count(count: int) -> None:
    """Raises:
        APIError: 400 ``prompts_limit`` past :data:`MAX_PROMPTS`."""
    if count > MAX_PROMPTS:
        raise bad_request(f"{count} prompts in one request; the limit is {MAX_PROMPTS} (fixed)", "prompt",
                          "prompts_limit")


def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[dict[str, Any]]:
    """A completions ``prompt`` as engine requests, one per prompt.

    Raises:
        APIError: 400 for an empty list.
    """
    prompts = _prompt_list(prompt)
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt")
    return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]


def check_model(requested: str, served: str, model_dir: str) -> None:
    """Raises:
        APIError: 404 unless ``requested`` names the served model (its name or its folder)."""
    if requested not in (served, model_dir):
        shown = requested if len(requested) <= 200 else f"{requested[:200]}... ({len(requested)} characters)"
        raise APIError(404, f"the model '{shown}' does not exist; this server serves '{served}'",
                       "not_found_error", "model", "model_not_found")


def check_limits(body: Body, api: APIConfig) -> None:
    """The per-request limits on what costs work for every token, part or character: ``n``
    (``api.max_n``), the alternatives per token (``api.max_logprobs``), the count and total length of
    ``stop`` (``api.max_stop_strings``, ``api.max_stop_chars``) and of ``stop_token_ids``
    (``api.max_stop_token_ids``), ``logit_bias`` (``api.max_logit_bias``), a chat call's messages and content parts
    (``api.max_messages``, ``api.max_content_parts``), a completions call's prompts (:data:`MAX_PROMPTS`),
    and the text no prompt within ``api.max_request_length`` tokens can hold (:func:`check_text_chars`;
    a prompt of token ids longer than it). Checked where the body is parsed, so that what passes is
    bounded before it reaches the event loop (:mod:`mm_serve.api.body_parser`).

    Raises:
        APIError: 400 naming the limit (codes ``n_limit``, ``logprobs_limit``, ``stop_limit``,
            ``logit_bias_limit``, ``messages_limit``, ``content_parts_limit``, ``context_length_exceeded``).
    """
    if len(body.model) > MAX_MODEL_CHARS:
        raise bad_request(f"the model name has {len(body.model)} characters; no name or path served is longer than "
                          f"{MAX_MODEL_CHARS}", "model", "model_not_found")
    if body.n > api.max_n:
        raise bad_request(f"n is {body.n}; the limit is {api.max_n} (api.max_n)", "n", "n_limit")
    top = body.top_logprobs if isinstance(body, ChatCompletionRequest) else body.logprobs
    if top is not None and top > api.max_logprobs:
        name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        raise bad_request(f"{name} is {top}; the limit is {api.max_logprobs} (api.max_logprobs)", name,
                          "logprobs_limit")
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stops) > api.max_stop_strings:
        raise bad_request(f"{len(stops)} stop strings in one request; the limit is {api.max_stop_strings} "
                          "(api.max_stop_strings)", "stop", "stop_limit")
    chars = sum(len(stop) for stop in stops)
    if chars > api.max_stop_chars:
        raise bad_request(f"the stop strings hold {chars} characters together; the limit is {api.max_stop_chars} "
                          "(api.max_stop_chars)", "stop", "stop_limit")
    stop_ids = len(body.stop_token_ids or [])
    if stop_ids > api.max_stop_token_ids:
        raise bad_request(f"{stop_ids} stop_token_ids in one request; the limit is {api.max_stop_token_ids} "
                          "(api.max_stop_token_ids)", "stop_token_ids", "stop_limit")
    biased = len(body.logit_bias or {})
    if biased > api.max_logit_bias:
        raise bad_request(f"logit_bias has {biased} entries; the limit is {api.max_logit_bias} (api.max_logit_bias)",
                          "logit_bias", "logit_bias_limit")
    if isinstance(body, ChatCompletionRequest):
        if len(body.messages) > api.max_messages:
            raise bad_request(f"{len(body.messages)} messages in one request; the limit is {api.max_messages} "
                              "(api.max_messages)", "messages", "messages_limit")
        parts = sum(len(m.content) for m in body.messages if isinstance(m.content, list))
        if parts > api.max_content_parts:
            raise bad_request(f"{parts} content parts in one request; the limit is {api.max_content_parts} "
                              "(api.max_content_parts)", "messages", "content_parts_limit")
        text = sum(len(m.content) if isinstance(m.content, str) else
                   sum(len(p.text) for p in m.content if p.type == "text") for m in body.messages if m.content)
        check_text_chars(text, api.max_request_length, "messages")
        return
    prompts = _prompt_list(body.prompt)
    _check_prompt_count(len(prompts))
    for prompt in prompts:
        if isinstance(prompt, str):
            check_text_chars(len(prompt), api.max_request_length, "prompt")
        elif len(prompt) > api.max_request_length:
            raise bad_request(f"the prompt has {len(prompt)} tokens, more than api.max_request_length "
                              f"({api.max_request_length})", "prompt", "context_length_exceeded")


def check_text_chars(chars: int, max_request_length: int, param: str) -> None:
    """A cheap bound before tokenizing: no tokenizer makes fewer than one token per
    :data:`MAX_CHARS_PER_TOKEN` characters, so more text than that many per token of
    ``api.max_request_length`` cannot fit.

    Raises:
        APIError: 400 ``context_length_exceeded`` naming ``param``.
    """
    if chars > max_request_length * MAX_CHARS_PER_TOKEN:
        raise bad_request(
            f"the prompt has {chars} characters, more than api.max_request_length ({max_request_length} "
            f"tokens) can hold at {MAX_CHARS_PER_TOKEN} characters per token", param, "context_length_exceeded",
        )
