"""The rollout runner: plays a batch of tool environments with one engine into token-exact trajectories.

The runner speaks tokens to the engine and text to the environments:

1. ``env.reset()``; the prompt is ``info["messages"]`` rendered by the tokenizer's chat template with
   the generation prompt, then tokenized once.
2. Model turns stop on the format's stop strings (or EOS) with ``max_new_tokens`` = the remaining
   response-token budget. With ``continuous=True`` and a :class:`ContinuousEngine` (vLLM) each episode's turn is submitted
   on its own, as soon as the episode is ready for it, and joins the engine's running batch: an
   episode whose tool call returned early does not wait for the slowest episode's turn. With a batch
   :class:`Engine`, ONE ``engine.generate`` call continues every live episode once all of them wait
   for it (lockstep turns). The sampled tokens are appended exactly as returned (mask 1), never
   decoded and re-encoded; they are decoded only to hand the text to ``env.step``, and the env calls
   run in parallel threads, each as soon as its turn is back.
3. The observation is tokenized and appended with mask 0. For formats whose observations stay inside
   the assistant message (``observation_role == "assistant"``, ReTool) that is the observation text
   alone. For ``tool``-role observations (hermes) it is the chat-template glue too: the end of the
   assistant turn, the tool message, and the start of the next assistant turn, computed as a token
   difference of two renderings of a conversation (as verl's tool agent loop does). The observation
   is tokenized as text (:func:`stare_envs.text_tokens.encode_as_text`): a special-token string that the
   model's code printed (``<|im_end|>``, EOS, ``</tool_response>``) never becomes that token's id; only
   the template glue around a tool message has real special tokens. Observations without such strings
   get the ids a plain ``encode`` gives.
4. The episode ends when the env terminates or truncates it, or when the response-token budget is
   spent (``info["finish_reason"] == "budget"``; over-long tool output is cut so the budget holds).
   A budget-cut episode is ended in its env at once (``env.end_episode()``): truncated, scored by the
   env's reward config as giving no answer, its sandbox given back.
5. EOS. For ``tool``-role formats (hermes) EOS ends the assistant message as usual and the tool
   message follows. For formats whose observations stay inside the assistant message (ReTool), a
   turn that ends with EOS ends the episode (``env.end_episode(turn)``: nothing in it runs, it is
   scored on its final answer, if any), as verl does: continuing after it would put EOS in the middle
   of one assistant message and train it as a mid-response token.
6. Infrastructure failures. When an env call of one episode raises
   :class:`~stare_envs.tool_env.EpisodeInfrastructureError` (its container died or was removed, a Docker
   API error, the pool had nothing to lease), that episode alone starts over from ``reset`` on a
   fresh sandbox, with the same sampling stream, up to ``max_episode_retries`` times; after that it
   ends as ``finish_reason == "failed"`` (prompt only, no response tokens, ``info["failed"]`` holds the
   cause), to be excluded by the caller. The other episodes go on either way; ``last_stats`` counts
   ``retried_episodes`` and ``failed_episodes``.

This module needs no torch: engines live in ``stare_agent.engines`` and implement
:class:`stare_envs.engine.Engine`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from stare_envs.engine import (
    ContinuousEngine,
    Engine,
    Generation,
    RolloutError,
    SamplingParams,
    Tokenizer,
    stream_seed,
)
from stare_envs.text_tokens import control_text_pattern, encode_as_text
from stare_envs.tool_env import EpisodeInfrastructureError
from stare_envs.trajectory import Trajectory, TrajectoryBuilder

if TYPE_CHECKING:
    from stare_envs.formats import ToolFormat
    from stare_envs.tool_env import ToolEnv

EpisodeEnd = Literal["terminated", "truncated", "budget", "failed"]

logger = logging.getLogger(__name__)


@dataclass
class RolloutStats:
    """Where the wall time of one :meth:`RolloutRunner.run` went.

    ``engine_s`` is the wall time spent waiting for model turns (generate calls; with a
    :class:`ContinuousEngine`, waits while any turn was in flight), ``env_s`` the wall time spent
    waiting for env calls alone (resets, steps); ``overhead_s`` is everything else the runner did:
    templates, tokenizing observations, decoding turns, bookkeeping. ``engine_calls`` counts
    ``generate`` calls, or ``submit`` calls of a continuous engine.
    """

    episodes: int = 0
    retried_episodes: int = 0
    failed_episodes: int = 0
    turns: int = 0
    engine_calls: int = 0
    sampled_tokens: int = 0
    inserted_tokens: int = 0
    engine_s: float = 0.0
    env_s: float = 0.0
    total_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.total_s - self.engine_s - self.env_s)

    @property
    def overhead_fraction(self) -> float:
        return self.overhead_s / self.total_s if self.total_s > 0 else 0.0


@dataclass(frozen=True)
class RolloutProgress:
    """Where one :meth:`RolloutRunner.run` stands, after each model turn (``on_turn``).

    ``budget_left`` is the response tokens the live episodes may still take: an upper bound on the work
    left, exact for episodes that run to their budget."""

    episodes: int
    ended: int
    turns: int
    response_tokens: int
    budget_left: int


class ToolTurnGlue:
    """Token ids between a model turn and the next one when the observation is ``tool`` messages.

    They are the chat template's text after an assistant message's content when tool messages follow:
    the end of the assistant turn, the rendered tool messages (one, or one per call of a turn for the
    formats with parallel calls), and the generation prompt of the next assistant turn. They are cut
    from one rendering of a reference conversation, ``[system, user, assistant, tool...]`` with the
    generation prompt, at the end of the assistant's (sentinel) content, and tokenized from there: the
    runner never renders the history again (the model's turns stay as sampled), so a template that
    renders an earlier assistant message otherwise than the last one (Qwen3 wraps the last in an empty
    ``<think>`` block) changes nothing here. Cutting there is exact only when the template's text after
    the content starts a new token whatever the content's last token is (it starts with a special token
    in every family of docs/tokens.md); a template where it does not is refused when the glue is made.

    A tool message's content is text: when one holds a special-token string of the tokenizer (tool output
    that prints ``<|im_end|>``), the template's text around the contents is tokenized as usual and each
    content with :func:`~stare_envs.text_tokens.encode_as_text`; otherwise the glue's text is tokenized
    whole.
    """

    _ASSISTANT = "STARE0ASSISTANT0SENTINEL"
    _SENTINEL = "STARE0TOOL0OUTPUT0SENTINEL{}"

    _REFERENCE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]

    def __init__(self, tokenizer: Tokenizer, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self._tokenizer = tokenizer
        self._tools = list(tools) if tools else None
        try:
            marked = self._render([self._SENTINEL.format(0)])
        except Exception as exc:  # the template's own error (jinja's TemplateError): one line, with the fix
            raise RolloutError(
                f"the chat template cannot render a tool message after an assistant message ({exc}): use a "
                "format with observation_role='assistant' (e.g. retool) with this tokenizer"
            ) from exc
        head, found, glue = marked.partition(self._ASSISTANT)
        if not found or self._ASSISTANT in glue or glue.count(self._SENTINEL.format(0)) != 1:
            raise RolloutError(
                "the chat template does not render an assistant message's content, then a tool message's, each "
                "once and in order, so tool-message glue cannot be computed: use a format with "
                "observation_role='assistant' (e.g. retool) with this tokenizer"
            )
        if _encode(tokenizer, marked) != _encode(tokenizer, head + found) + _encode(tokenizer, glue):
            raise RolloutError(
                "the chat template's text after an assistant message does not start a new token, so the "
                "tokens after a model turn depend on how the turn ends: use a format with "
                "observation_role='assistant' (e.g. retool) with this tokenizer"
            )
        self.glue_ids = _encode(tokenizer, glue.replace(self._SENTINEL.format(0), ""))
        """The glue of one empty tool message (its first ids end the assistant turn)."""

    def _render(self, contents: Sequence[str]) -> str:
        """The template's text after the reference assistant message's content, tool messages ``contents``."""
        messages = [
            *self._REFERENCE,
            {"role": "assistant", "content": self._ASSISTANT},
            *({"role": "tool", "content": c} for c in contents),
        ]
        return render_chat(self._tokenizer, messages, tools=self._tools, add_generation_prompt=True)

    def __call__(self, observation: str | Sequence[str], *, turn_ended_with_eos: bool) -> list[int]:
        """Glue ids for the tool messages carrying ``observation`` (one content, or one per message).

        Args:
            observation: The tool message's content, or the contents of a turn's tool messages.
            turn_ended_with_eos: The model's turn already ends with EOS, which is then not repeated when
                the glue starts with it (e.g. ChatML's ``<|im_end|>``).
        """
        contents = [observation] if isinstance(observation, str) else list(observation)
        pattern = control_text_pattern(self._tokenizer)
        if pattern is not None and any(pattern.search(c) for c in contents):
            ids = self._encode_around_contents(contents)
        else:
            ids = _encode(self._tokenizer, self._render(contents).partition(self._ASSISTANT)[2])
        if turn_ended_with_eos and ids[:1] == [self._tokenizer.eos_token_id]:
            ids = ids[1:]
        return ids

    def _encode_around_contents(self, contents: list[str]) -> list[int]:
        """Ids of the glue with each tool message's content encoded as text and the template's text
        around them as usual.

        The template's own text is that of a rendering with sentinel contents; content ``i`` as the
        template writes it (trimmed, say) is what stands in a rendering with only that content real
        where sentinel ``i`` stood.
        """
        sentinels = [self._SENTINEL.format(i) for i in range(len(contents))]
        marked = self._render(sentinels).partition(self._ASSISTANT)[2]
        pieces: list[str] = []
        rest = marked
        for sentinel in sentinels:
            piece, found, rest = rest.partition(sentinel)
            if not found or sentinel in rest:
                raise RolloutError(
                    "the chat template does not write each tool message's content once and in order, so tool "
                    "output cannot be tokenized as text apart from the template's special tokens: use a format "
                    "with observation_role='assistant' (e.g. retool) with this tokenizer"
                )
            pieces.append(piece)
        ids: list[int] = []
        for i, content in enumerate(contents):
            before, _, after = marked.partition(sentinels[i])
            text = self._render([*sentinels[:i], content, *sentinels[i + 1 :]]).partition(self._ASSISTANT)[2]
            if not (
                text.startswith(before) and text.endswith(after) and len(text) >= len(before) + len(after)
            ):
                raise RolloutError(
                    "the chat template does not write a tool message's content as one piece between text of "
                    "its own, so tool output cannot be tokenized as text apart from the template's special "
                    "tokens: use a format with observation_role='assistant' (e.g. retool) with this tokenizer"
                )
            ids += _encode(self._tokenizer, pieces[i]) + encode_as_text(
                self._tokenizer, text[len(before) : len(text) - len(after)]
            )
        return ids + _encode(self._tokenizer, rest)


def render_prompt(
    tokenizer: Tokenizer,
    info: Mapping[str, Any],
    format: ToolFormat,
    *,
    template_tools: bool | None = None,
) -> tuple[str, list[dict[str, Any]] | None]:
    """The prompt of an episode, for RL and SFT alike: the chat template over the ``messages`` of the
    env's reset ``info``, with the generation prompt.

    The env's tool schemas (``info["tools"]``) go to the chat template when ``template_tools`` says
    so, or by default when the format answers in ``tool`` messages and its own system prompt (which
    lists the tools) is not the first message. Returns (prompt text, the schemas given to the
    template or None); the glue of ``tool`` messages must be rendered with the same schemas.
    """
    tools = info.get("tools") or None
    if template_tools is None:
        messages = info["messages"]
        own_prompt = format.system_prompt(tools) if tools else None
        has_own = (
            own_prompt is not None
            and bool(messages)
            and messages[0].get("role") == "system"
            and own_prompt in messages[0]["content"]
        )
        template_tools = format.observation_role == "tool" and bool(tools) and not has_own
    tools = list(tools) if template_tools and tools else None
    return render_chat(tokenizer, info["messages"], tools=tools, add_generation_prompt=True), tools


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The chat template's text for ``messages`` (tool schemas passed only when given).

    Raises:
        RolloutError: the tokenizer has no chat template.
    """
    if hasattr(tokenizer, "chat_template") and not getattr(tokenizer, "chat_template", None):
        raise RolloutError(
            f"the tokenizer ({getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}) has no chat "
            "template: set tokenizer.chat_template to the model's Jinja template, or use a model that ships one"
        )
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools:
        kwargs["tools"] = list(tools)
    return tokenizer.apply_chat_template(list(messages), **kwargs)


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass
class _Episode:
    """One live episode's state inside :meth:`RolloutRunner.run`."""

    env: ToolEnv
    builder: TrajectoryBuilder
    info: dict[str, Any]
    key: str = ""
    reset_kwargs: dict[str, Any] = field(default_factory=dict)
    retries: int = 0
    error: str | None = None
    glue: ToolTurnGlue | None = None
    reward: float = 0.0
    turns: int = 0
    end: EpisodeEnd | None = None
    cut: bool = False  # the budget ran out: the env is asked to end the episode
    turn_ended_with_eos: bool = False
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def finish(self, end: EpisodeEnd) -> None:
        self.end = end


class RolloutRunner:
    """Plays batches of :class:`~stare_envs.tool_env.ToolEnv` episodes with one engine into trajectories.

    Args:
        tokenizer: A Hugging Face tokenizer (chat template, ``encode``, ``decode``, ``eos_token_id``).
        engine: Anything implementing :class:`Engine`.
        max_response_tokens: Budget of response tokens per episode (model turns, tool output and glue).
        sampling: Sampling parameters; ``max_new_tokens`` is replaced each turn by the largest remaining
            budget of the live episodes (each episode's turn is then cut to its own remaining budget,
            which is exactly what a per-episode limit would have produced).
        template_tools: Pass the env's tool schemas (``info["tools"]``) to the chat template, for models
            whose template describes tools itself (Qwen2.5 with hermes). None: only when the format's
            observations are ``tool`` messages and the system prompt is not the format's own (which
            already lists them).
        max_workers: Threads for the parallel ``env.reset``/``env.step`` calls (default: one per env, at most 64).
        max_episode_retries: How often one episode is started over after an infrastructure failure
            before it is given up as ``"failed"`` (see the module docstring, item 6).
        continuous: Submit each episode's turn on its own when the engine is a
            :class:`ContinuousEngine` (item 2); False: lockstep turns with any engine.

    Each trajectory's ``info`` is the env's last step info (without ``messages`` and ``tools``) with
    ``tool_calls`` gathered over all steps, plus ``finish_reason`` (``"terminated"``/``"truncated"``: the
    env ended the episode; ``"budget"``: the token budget did), ``truncated`` (not terminated by the
    env), ``num_turns`` and ``response_tokens``. Its reward is the sum of the env's step rewards; an
    episode cut by the budget is ended in its env at once (``env.end_episode()``), which scores it as
    giving no answer under its reward config and gives its sandbox back. After :meth:`run`,
    ``last_stats`` holds a :class:`RolloutStats`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        engine: Engine,
        *,
        max_response_tokens: int,
        sampling: SamplingParams | None = None,
        template_tools: bool | None = None,
        max_workers: int | None = None,
        max_episode_retries: int = 2,
        continuous: bool = False,
    ) -> None:
        if max_response_tokens < 1:
            raise ValueError(f"max_response_tokens = {max_response_tokens}: use a positive token budget")
        if max_episode_retries < 0:
            raise ValueError(f"max_episode_retries = {max_episode_retries}: use 0 (no retry) or more")
        self.max_episode_retries = max_episode_retries
        self.continuous = continuous
        self.tokenizer = tokenizer
        self.engine = engine
        self.max_response_tokens = max_response_tokens
        self.sampling = sampling or SamplingParams()
        self.template_tools = template_tools
        self.max_workers = max_workers
        self.last_stats = RolloutStats()
        self._glue: dict[tuple[str, ...], ToolTurnGlue] = {}

    # ------------------------------------------------------------------ the loop

    def run(
        self,
        envs: Sequence[ToolEnv],
        *,
        seeds: int | Sequence[int | None] | None = None,
        options: Sequence[dict[str, Any] | None] | None = None,
        episode_keys: Sequence[str] | None = None,
        on_turn: Callable[[RolloutProgress], None] | None = None,
    ) -> list[Trajectory]:
        """Play one episode in each env, all advancing together; return their trajectories in order.

        Args:
            envs: The environments (each is reset here).
            seeds: Per-env reset seeds, or one int giving ``seed + i`` to env ``i`` (Gymnasium's vector
                convention), or None.
            options: Per-env reset options, or None.
            episode_keys: One name per episode for its sampling stream, e.g. ``"<problem id>/<sample
                index>"``: with ``sampling.seed`` set, turn t of an episode is sampled from the stream
                ``stream_seed(sampling.seed, key, t)``, so the same key gives the same episode in any
                batch. Keys should be unique within a run. None: the env's position in this call.
            on_turn: Called (on this thread) after each model turn with a :class:`RolloutProgress`, e.g.
                to show turns and tokens while long episodes run.
        """
        if not envs:
            return []
        seed_list = _per_env(seeds, len(envs), "seeds")
        option_list = list(options) if options is not None else [None] * len(envs)
        if len(option_list) != len(envs):
            raise ValueError(f"got {len(option_list)} options for {len(envs)} envs: pass one per env or None")
        keys = (
            [str(k) for k in episode_keys] if episode_keys is not None else [str(i) for i in range(len(envs))]
        )
        if len(keys) != len(envs):
            raise ValueError(f"got {len(keys)} episode_keys for {len(envs)} envs: pass one per env or None")
        stats = RolloutStats(episodes=len(envs))
        start = time.perf_counter()
        workers = self.max_workers or min(64, len(envs))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env") as pool:
            reset_kwargs = [dict(seed=s, options=o) for s, o in zip(seed_list, option_list, strict=True)]
            resets = self._env_phase(
                stats, pool, [(env.reset, kw) for env, kw in zip(envs, reset_kwargs, strict=True)]
            )
            episodes = [
                self._start(env, info, key, kw)
                for env, (_, info), key, kw in zip(envs, resets, keys, reset_kwargs, strict=True)
            ]
            self._play(episodes, pool, stats, on_turn)
        trajectories = [self._build(ep) for ep in episodes]
        for t in trajectories:
            stats.sampled_tokens += t.num_sampled_tokens
            stats.inserted_tokens += len(t.response_ids) - t.num_sampled_tokens
        stats.total_s = time.perf_counter() - start
        self.last_stats = stats
        return trajectories

    def _play(
        self,
        episodes: list[_Episode],
        pool: ThreadPoolExecutor,
        stats: RolloutStats,
        on_turn: Callable[[RolloutProgress], None] | None = None,
    ) -> None:
        """Take turns and env steps until every episode has ended: each episode asks for its next turn
        as soon as its env step is back; a batch engine is called once every turn in flight waits for it."""
        continuous = self.continuous and isinstance(self.engine, ContinuousEngine)
        order = {id(ep): i for i, ep in enumerate(episodes)}
        in_flight: dict[Future[Any], tuple[_Episode, bool]] = {}  # future -> (episode, is a model turn)
        waiting: list[tuple[_Episode, Future[Generation]]] = []  # turns for the next batch generate call

        def ask(ep: _Episode) -> None:
            if continuous:
                future = self._submit(ep, stats)
            else:
                future = Future()
                waiting.append((ep, future))
            in_flight[future] = (ep, True)

        for ep in episodes:
            ask(ep)
        batches = 0
        while in_flight:
            if waiting and all(is_turn for _, is_turn in in_flight.values()):
                waiting.sort(key=lambda item: order[id(item[0])])
                generations = self._generate([ep for ep, _ in waiting], batches, stats)
                for (_, future), generation in zip(waiting, generations, strict=True):
                    future.set_result(generation)
                waiting.clear()
                batches += 1
            turns_in_flight = continuous and any(is_turn for _, is_turn in in_flight.values())
            t0 = time.perf_counter()
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            if turns_in_flight:
                stats.engine_s += time.perf_counter() - t0
            else:
                stats.env_s += time.perf_counter() - t0
            for future in done:
                ep, is_turn = in_flight.pop(future)
                if is_turn:
                    fn, kwargs = self._take_turn(ep, future.result())
                    in_flight[pool.submit(fn, **kwargs)] = (ep, False)
                    if on_turn is not None:
                        on_turn(self._progress(episodes, stats))
                    continue
                try:
                    result: Any = future.result()
                except EpisodeInfrastructureError as exc:  # it concerns that episode alone
                    self._retry_or_fail(ep, exc, stats)
                else:
                    self._take_step(ep, result)
                if ep.end is None:
                    ask(ep)

    def _progress(self, episodes: list[_Episode], stats: RolloutStats) -> RolloutProgress:
        live = [ep for ep in episodes if ep.end is None]
        return RolloutProgress(
            episodes=len(episodes),
            ended=len(episodes) - len(live),
            turns=stats.turns,
            response_tokens=sum(len(ep.builder) for ep in episodes),
            budget_left=sum(max(self.max_response_tokens - len(ep.builder), 0) for ep in live),
        )

    def _submit(self, ep: _Episode, stats: RolloutStats) -> Future[Generation]:
        """Submit one episode's next turn to a continuous engine, with its own budget and stream."""
        assert isinstance(self.engine, ContinuousEngine)
        base = self.sampling.seed
        params = replace(
            self.sampling,
            max_new_tokens=self.max_response_tokens - len(ep.builder),
            seed=None if base is None else base + ep.turns,
            seeds=None if base is None else (stream_seed(base, ep.key, ep.turns),),
        )
        stats.engine_calls += 1
        stats.turns += 1
        return self.engine.submit(ep.builder.context_ids, params, sorted(ep.env.format.stop_strings))

    def _start(self, env: ToolEnv, info: dict[str, Any], key: str, reset_kwargs: dict[str, Any]) -> _Episode:
        """Render and tokenize the prompt; pick the glue for ``tool``-role formats."""
        prompt, tools = render_prompt(self.tokenizer, info, env.format, template_tools=self.template_tools)
        episode = _Episode(
            env=env,
            builder=TrajectoryBuilder(_encode(self.tokenizer, prompt)),
            info=dict(info),
            key=key,
            reset_kwargs=reset_kwargs,
        )
        if env.format.observation_role == "tool":
            episode.glue = self._glue_for(tools)
        return episode

    def _glue_for(self, tools: Sequence[Mapping[str, Any]] | None) -> ToolTurnGlue:
        key = tuple(sorted(str(t) for t in tools)) if tools else ()
        if key not in self._glue:
            self._glue[key] = ToolTurnGlue(self.tokenizer, tools)
        return self._glue[key]

    def _generate(self, live: list[_Episode], turn: int, stats: RolloutStats) -> list[Generation]:
        """One batch engine call for the episodes ``live``, with the largest remaining budget as the limit."""
        remaining = max(self.max_response_tokens - len(ep.builder) for ep in live)
        base = self.sampling.seed
        if base is None:
            params = replace(self.sampling, max_new_tokens=remaining)
        else:
            seeds = tuple(stream_seed(base, ep.key, ep.turns) for ep in live)
            params = replace(self.sampling, max_new_tokens=remaining, seed=base + turn, seeds=seeds)
        stop = sorted({s for ep in live for s in ep.env.format.stop_strings})
        t0 = time.perf_counter()
        generations = self.engine.generate([ep.builder.context_ids for ep in live], params, stop)
        stats.engine_s += time.perf_counter() - t0
        stats.engine_calls += 1
        stats.turns += len(live)
        if len(generations) != len(live):
            raise RolloutError(
                f"engine returned {len(generations)} generations for {len(live)} prompts: "
                "Engine.generate must return one Generation per prompt, in order"
            )
        return generations

    def _take_turn(self, ep: _Episode, gen: Generation) -> tuple[Callable[..., Any], dict[str, Any]]:
        """Append the model turn (mask 1, as sampled); return the env call it leads to: ``step`` with
        its text, ``end_episode`` with its text (EOS in an assistant-role format), or ``end_episode()``
        when the budget ran out during the turn."""
        remaining = self.max_response_tokens - len(ep.builder)
        ids, logprobs, reason = gen.token_ids, gen.logprobs, gen.finish_reason
        if reason == "abort":
            raise RolloutError(
                "the engine returned an interrupted turn (finish_reason 'abort'): only a wrapper that resumes "
                "it (stare_agent.train.async_rollouts.VersionedEngine) may call the engine's interrupt()"
            )
        switches = gen.version_switches
        if len(ids) > remaining:  # the batch limit was another episode's larger budget
            ids, logprobs, reason = ids[:remaining], logprobs[:remaining], "length"
            switches = tuple((i, v) for i, v in switches if i < remaining)
        ep.builder.append(ids, 1, logprobs, version=gen.weight_version, version_switches=switches)
        ep.turns += 1
        ep.turn_ended_with_eos = reason == "eos"
        if reason == "length" and len(ep.builder) >= self.max_response_tokens:
            ep.cut = True
            return ep.env.end_episode, {}
        text = _decode(self.tokenizer, ids[:-1] if reason == "eos" else ids)
        if reason == "eos" and ep.env.format.observation_role == "assistant":
            return ep.env.end_episode, dict(action=text)
        return ep.env.step, dict(action=text)

    def _take_step(self, ep: _Episode, result: tuple[str, float, bool, bool, dict[str, Any]]) -> None:
        """Record the env's response; append the observation (mask 0) when the episode continues."""
        observation, reward, terminated, truncated, info = result
        messages = info.pop("tool_messages", None) or [observation]  # a tool-role format's messages
        ep.reward += float(reward)
        ep.tool_calls.extend(info.get("tool_calls", ()))
        ep.info.update(info)
        if terminated or truncated:
            ep.finish("budget" if ep.cut else "terminated" if terminated else "truncated")
            return
        if ep.glue is not None:
            ids = ep.glue(messages, turn_ended_with_eos=ep.turn_ended_with_eos)
        else:
            ids = encode_as_text(self.tokenizer, observation)
        remaining = self.max_response_tokens - len(ep.builder)
        ep.builder.append(ids[:remaining], 0)
        if len(ids) >= remaining:
            ep.cut = True
            self._take_step(ep, ep.env.end_episode())

    def _retry_or_fail(self, ep: _Episode, error: EpisodeInfrastructureError, stats: RolloutStats) -> None:
        """Start the episode over (same reset, same sampling stream; the env already gave its broken
        sandbox back), or give it up as ``"failed"`` once its retries are spent."""
        cause = f"{error} [{type(error.__cause__).__name__}]" if error.__cause__ else str(error)
        if ep.retries >= self.max_episode_retries:
            logger.warning("episode %s failed after %d retries, excluded: %s", ep.key, ep.retries, cause)
            stats.failed_episodes += 1
            ep.error = cause
            ep.builder, ep.reward = TrajectoryBuilder(ep.builder.prompt_ids), 0.0  # nothing of it is trained
            ep.finish("failed")
            return
        logger.warning("episode %s hit an infrastructure failure, starting it over: %s", ep.key, cause)
        stats.retried_episodes += 1
        _, info = ep.env.reset(**ep.reset_kwargs)
        fresh = self._start(ep.env, info, ep.key, ep.reset_kwargs)
        fresh.retries = ep.retries + 1
        ep.__dict__.update(fresh.__dict__)

    def _env_phase(
        self,
        stats: RolloutStats,
        pool: ThreadPoolExecutor,
        calls: list[tuple[Callable[..., Any], dict[str, Any]]],
    ) -> list[Any]:
        """Run env calls in parallel; results in order. An :class:`EpisodeInfrastructureError` is
        returned in its call's place (it concerns that episode alone); any other exception propagates."""
        t0 = time.perf_counter()
        futures = [pool.submit(fn, **kwargs) for fn, kwargs in calls]
        results: list[Any] = []
        try:
            for future in futures:
                try:
                    results.append(future.result())
                except EpisodeInfrastructureError as exc:
                    results.append(exc)
            return results
        finally:
            stats.env_s += time.perf_counter() - t0

    def _build(self, ep: _Episode) -> Trajectory:
        info = {k: v for k, v in ep.info.items() if k not in ("messages", "tools")}
        info.update(
            tool_calls=ep.tool_calls,
            finish_reason=ep.end,
            truncated=ep.end != "terminated",
            num_turns=ep.turns,
            response_tokens=len(ep.builder),
        )
        if ep.error is not None:
            info.update(failed=ep.error, retries=ep.retries)
        elif ep.retries:  # played again after an infrastructure failure: counted in the tool health
            info.update(retries=ep.retries)
        return ep.builder.build(reward=ep.reward, info=info)


def _per_env(seeds: int | Sequence[int | None] | None, n: int, name: str) -> list[int | None]:
    if seeds is None:
        return [None] * n
    if isinstance(seeds, int):
        return [seeds + i for i in range(n)]
    seeds = list(seeds)
    if len(seeds) != n:
        raise ValueError(f"got {len(seeds)} {name} for {n} envs: pass one per env, one int, or None")
    return seeds
