"""Continuing a request from its partial output, when an engine fails mid-answer: the output
tokens received become the prompt's tail on another engine at the same weight version, and the
sample's text is stitched across the split (docs/rollout.md).

The pure parts (which sampling parameters can be continued, and how they change) are
functions here; the rest is `Continuation`, the half of RolloutClient that builds the sample
across pieces (a base class: what it reads of the client is declared on it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from vime.supervisor.states import VersionRule, WeightsMode

from .rollout_types import Answer, Engine, Partial, RolloutStats, Split, StartOver, answer_tokens

log = logging.getLogger("vime.rollout")  # the client's logger: one stream for a request's story
STALE_PREFIX = "stale:"  # how a reason for throwing a sample away for staleness begins


# -- continuation: the pure parts ------------------------------------------------------------

# Parameters of a chat request that a completion on token ids does not take: the chat's
# rendering is already in the prompt's token ids.
_CHAT_ONLY = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
              "chat_template_kwargs", "documents", "tools", "tool_choice", "parallel_tool_calls",
              "reasoning_effort", "include_reasoning", "mm_processor_kwargs", "top_logprobs",
              "max_completion_tokens", "response_format")
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def continuation_blocker(sampling: Mapping[str, Any], chat: bool = False) -> str | None:
    """Why a request with these sampling parameters cannot be continued faithfully from a
    partial output (it then starts over), or None when it can."""
    stop = sampling.get("stop")
    if stop:
        # vLLM holds back streamed text that may begin a stop string, so the text received
        # lags the token ids; and a stop string across the split would not be seen.
        return "stop strings cannot be continued (streamed text is held back; one across the split is missed)"
    if sampling.get("presence_penalty") or sampling.get("frequency_penalty"):
        # vLLM counts these over output tokens only: the received tokens would become prompt.
        return "presence/frequency penalties count output tokens only; the received ones would become prompt"
    if sampling.get("bad_words"):
        return "bad_words are matched against output tokens only; the received ones would become prompt"
    fmt = sampling.get("response_format")
    fmt_type = fmt.get("type") if isinstance(fmt, Mapping) else fmt
    if fmt_type not in (None, "text") or any(sampling.get(k) is not None for k in _STRUCTURED) \
            or (chat and sampling.get("tools") and sampling.get("tool_choice") != "none"):
        return "structured output cannot be continued (its grammar would start again at the split)"
    return None


def continuation_seed(seed: int, offset: int) -> int:
    """The seed of a seeded request continued after `offset` output tokens. A seeded sample
    cannot be continued bit-exactly: the engine's generator would start again at the split.
    Reusing `seed` would draw, for the continued tokens, the very noise that drew the first
    ones; a seed derived from (seed, offset) does not, and the same split of the same request
    still gives the same sample. The Split records the seed used."""
    return (int(seed) + int(offset) * 0x9E3779B97F4A7C15) % ((1 << 63) - 1)


def continuation_sampling(sampling: Mapping[str, Any], received: int, chat: bool = False) -> dict[str, Any]:
    """The sampling parameters of the /v1/completions request that continues a request after
    `received` output tokens (its prompt: the prompt's token ids + those tokens). Unchanged:
    temperature, top_p, top_k, min_p, repetition_penalty (vLLM applies it over prompt and
    output tokens, so the received ones count either way), logit_bias, stop_token_ids (checked
    token by token), ignore_eos, skip_special_tokens. n: only 1 is accepted by the client.
    Changed:
    - max_tokens (a chat's max_completion_tokens, which vLLM prefers) less `received`; absent
      stays absent (vLLM then allows the rest of the context: the same total);
    - min_tokens less `received` (not below 0): the bound is on the whole output;
    - seed: continuation_seed(seed, received) (see there);
    - a chat's logprobs=True / top_logprobs=K become the completion's logprobs=max(1, K): the
      sampled token's logprob is what the client keeps, as for the first piece;
    - dropped: a chat's own parameters (_CHAT_ONLY: the rendering is in the token ids),
      truncate_prompt_tokens (the prompt's ids are already the truncated prompt; the received
      tokens must not be cut), prompt_logprobs (it would score the received tokens again),
      add_special_tokens (a token-id prompt is not tokenized), echo."""
    out = {k: v for k, v in sampling.items()
           if k not in ("truncate_prompt_tokens", "prompt_logprobs", "add_special_tokens", "echo")}
    if chat:
        for k in _CHAT_ONLY:
            out.pop(k, None)
        if sampling.get("logprobs"):
            out["logprobs"] = max(1, int(sampling.get("top_logprobs") or 0))
        else:
            out.pop("logprobs", None)
    limit = sampling.get("max_completion_tokens") if chat else None
    if limit is None:
        limit = sampling.get("max_tokens")
    if limit is not None:
        out["max_tokens"] = int(limit) - received
    if sampling.get("min_tokens"):
        out["min_tokens"] = max(0, int(sampling["min_tokens"]) - received)
    if sampling.get("seed") is not None:
        out["seed"] = continuation_seed(sampling["seed"], received)
    return out


class Continuation:
    """The continuation half of RolloutClient: choosing an engine to continue on, keeping a
    failed attempt's output as a piece, starting over, and the sample's text across pieces."""

    # What it reads of the client (set by RolloutClient.__init__ and refresh).
    stats: RolloutStats
    engines: list[Engine]
    weight_version: Any
    rule: VersionRule  # the daemon's routing rule (its mode and max_staleness)
    request_timeout: float
    _held: set[str]  # engines an in-flight update holds (no attempt until it ends)
    continue_partial: bool
    model: str | None
    _session: Any
    _auth: dict[str, str]

    if TYPE_CHECKING:
        async def refresh(self, *, force: bool = False) -> None: ...

        def pick(self, exclude: Any = (), avoid: Any = ()) -> Engine | None: ...

    async def _continuation_engine(self, failed: set[str], aborted: set[str], state: Partial
                                   ) -> tuple[Engine | None, str]:
        """An engine to continue `state` on (listed at the weight version its tokens were made
        on, while the daemon's published version is unchanged), or None and why not. The
        membership was read again after the failure (_attempt refreshes). Async mode: any
        listed engine (the daemon lists those the rule allows) at the last piece's version or
        newer, while the prefix's tokens are within max_staleness of the current version."""
        if self.rule.mode is WeightsMode.ASYNC:
            return await self._async_continuation_engine(failed, aborted, state)
        if self.weight_version != state.published:
            return None, (f"the weight version changed since the tokens were made (published "
                          f"{state.published!r} -> {self.weight_version!r})")
        for read in (False, True):
            if read:
                await self.refresh()  # the daemon may list engines we do not know of yet
            engine = self._continuation_pick(failed, aborted, state)
            if engine is not None:
                return engine, ""
        listed = ", ".join(f"{e.name} {e.weight_version!r}" for e in self.engines) or "none"
        return None, (f"no routable engine left at weight version {state.version!r} that the tokens were made "
                      f"on (listed: {listed}; failed this request: {', '.join(sorted(failed)) or 'none'})")

    async def _async_continuation_engine(self, failed: set[str], aborted: set[str], state: Partial
                                         ) -> tuple[Engine | None, str]:
        if self._stale_pieces(state.splits):  # the caller counts it (RolloutClient._choose): regenerated or dropped
            return None, self._stale_prefix_why(state)
        last = state.splits[-1].newest_version
        for read in (False, True):
            if read:
                await self.refresh()
            engine = self._continuation_pick(failed, aborted, state)
            if engine is not None:
                return engine, ""
        deadline = time.monotonic() + self.request_timeout
        while True:
            if self._stale_pieces(state.splits):  # a publish read meanwhile took the prefix past the bound
                return None, self._stale_prefix_why(state)
            if not (self._held and time.monotonic() < deadline):
                break
            # Those left are being updated (an in-flight update cut this request): the first
            # one back, on its new weights, continues it.
            await asyncio.sleep(0.01)
            engine = self._continuation_pick(failed, aborted, state)
            if engine is not None:
                return engine, ""
        listed = ", ".join(f"{e.name} {e.weight_version!r}" for e in self.engines) or "none"
        return None, (f"no routable engine left at weight version {last!r} or newer to continue on (listed: "
                      f"{listed}; failed this request: {', '.join(sorted(failed)) or 'none'})")

    def _continuation_pick(self, failed: set[str], aborted: set[str], state: Partial) -> Engine | None:
        """An engine listed now that may continue `state` (no read, no wait), or None. Sync mode:
        one at the version the tokens were made on, while the published version is unchanged.
        Async mode: one at the last piece's newest version or newer (never back to older
        weights: the pieces' versions do not decrease), while the prefix is within the bound."""
        if self.rule.mode is not WeightsMode.ASYNC:
            if self.weight_version != state.published:
                return None
            return self.pick(failed | {e.name for e in self.engines if e.weight_version != state.version}, aborted)
        if self._stale_pieces(state.splits):
            return None
        last = state.splits[-1].newest_version

        def behind(version: Any) -> bool:  # older than the last piece's (a label: any other)
            lag = VersionRule.lag(version, last if isinstance(last, int) else None)
            return version != last if lag is None else lag > 0

        return self.pick(failed | {e.name for e in self.engines if behind(e.weight_version)}, aborted)

    def _stale_prefix_why(self, state: Partial) -> str:
        """Why a cut request whose tokens so far are past the bound is not continued."""
        old = self._stale_pieces(state.splits)
        return (f"{STALE_PREFIX} the tokens so far include ones from {old[0].weight_version!r}, more than "
                f"max_staleness ({self.rule.max_staleness}) versions behind the current {self.weight_version!r}")

    def _stale_pieces(self, splits: list[Split]) -> list[Split]:
        """The pieces whose tokens are more than max_staleness behind the current version (async
        mode; a piece's weight_version is the oldest its tokens may come from)."""
        if self.rule.mode is not WeightsMode.ASYNC:
            return []
        return [s for s in splits if self.rule.too_old(s.weight_version, self.weight_version)]

    def _start_over(self, rid: str, state: Partial, why: str, *, engine: str | None = None,
                    version: Any = None, extra: int = 0) -> None:
        """Throw the partial output away: the next attempt starts from the prompt."""
        tokens = len(state) + extra
        if state.splits:
            engine, version = state.splits[-1].engine, state.splits[-1].weight_version
        state.started_over.append(StartOver(engine or "?", version, tokens, why))
        self.stats.tokens_regenerated += tokens
        self.stats.started_over += 1
        log.info("rollout: %s: starting over, %d token(s) thrown away: %s", rid, tokens, why)
        state.prompt_token_ids, state.token_ids, state.logprobs, state.text = None, [], None, []
        state.splits, state.version, state.published = [], None, None
        state.synced, state.head, state.silent, state.piece = 0, "", set(), None

    async def _split_between_characters(self, rid: str, engine: Engine, state: Partial) -> None:
        """Before a continuation: fold the last piece's text in, and if the prefix ends inside
        a character (vLLM holds back the text of a token that ends inside a multi-byte
        character, and its detokenizer, primed with a prompt that ends inside one, streams the
        whole prompt's text again), keep every token anyway: the text across the split is
        built from token ids with the engine's /detokenize (_window_text). Only when no
        listed engine answers /detokenize is the prefix cut back to where its text is whole, and
        the tokens after it thrown away (Split.dropped, counted as regenerated)."""
        if state.piece is not None:
            start, texts, bounds = state.piece
            state.piece = None
            await self._fold(engine, state, start, texts, bounds, final=False)
        keep = state.synced
        dropped = len(state) - keep
        if not dropped:
            return
        # Any listed engine's tokenizer will do (the same model's): the one picked may be the
        # one just killed, still listed until the daemon sees it, and its silence is no reason
        # to throw the tokens away.
        if await self._detokenize_any(engine, self._context(state, keep) + state.token_ids[keep:]) is not None:
            log.info("rollout: %s: the last %d token(s) end inside a character; kept, their text is built "
                     "from token ids", rid, dropped)
            return
        if keep == 0:
            self._start_over(rid, state, "the tokens received end inside a character and /detokenize did not "
                                         "answer: no whole-character split")
            return
        last = state.splits.pop()
        if keep > last.offset:
            state.splits.append(last._replace(tokens=keep - last.offset, dropped=dropped))
        elif state.splits:  # the whole last piece goes: the piece before it keeps the count
            state.splits[-1] = state.splits[-1]._replace(dropped=state.splits[-1].dropped + dropped)
        del state.token_ids[keep:]
        if state.logprobs is not None:
            del state.logprobs[keep:]
        state.silent = {i for i in state.silent if i < keep}
        state.head = ""
        self.stats.tokens_regenerated += dropped
        log.info("rollout: %s: %d token(s) end inside a character and /detokenize did not answer; continuing "
                 "after %d", rid, dropped, keep)

    # -- the sample's text across splits ---------------------------------------------------

    @staticmethod
    def _context(state: Partial, at: int) -> list[int]:
        """The ids just before output token `at` (a point where a whole character ends): decoded
        with a window and subtracted, they give the window's text as it reads in place (a
        SentencePiece tokenizer drops the leading space of a decode's first token)."""
        ids = (state.prompt_token_ids or []) + state.token_ids[:at]
        return ids[max(0, len(ids) - 8):]

    async def _whole(self, engine: Engine, state: Partial, at: int, streamed: str) -> bool:
        """Whether vLLM's text of output tokens [state.synced, at) ends on a whole character:
        their decode does, and unless the last token's own text is part of a character, the
        stream's text (`streamed`) ends with it too (a special token at the end, which the
        stream skips, makes the decode whole but not the stream's)."""
        text = await self._detokenize(engine, state.token_ids[state.synced:at])
        if text is None or text.endswith("\ufffd"):
            return False
        last = await self._detokenize(engine, state.token_ids[at - 1:at])
        return last is not None and ("\ufffd" in last or streamed.endswith(last))

    async def _fold(self, engine: Engine, state: Partial, start: int, texts: list[str],
                    bounds: list[tuple[int, int, bool, bool]], *, final: bool) -> None:
        """Fold one piece's streamed text (`texts`, chunk ends `bounds`, absolute tokens; the
        piece's tokens begin at `start` and are already in state.token_ids) into the sample's.
        A piece whose stream began at state.synced is in step with its text; one that began
        after a gap is not until its first chunk known to end whole (a one-token chunk with
        text, or one /detokenize says ends whole: at most 4 asked), and the gap up to there
        becomes a window of ids, with the text streamed around it (head, tail) to check it
        against. `final`: the answer, taken to its end."""
        end = len(state)
        first = 0
        asked = 0

        async def ends_whole(tok: int, whole: bool, has_text: bool, streamed: Callable[[], str]) -> bool:
            """A chunk end known whole, or (at most 4 asked in all) one /detokenize says is."""
            nonlocal asked
            if not whole and has_text and asked < 4:
                asked += 1
                whole = await self._whole(engine, state, tok, streamed())
            return whole

        if state.synced < start:
            for i, (tok, n_text, whole, has_text) in enumerate(bounds):
                if await ends_whole(tok, whole, has_text, lambda: "".join(texts[:n_text])):
                    state.text.append((state.synced, tok, state.head, "".join(texts[:n_text])))
                    state.synced, state.head, first = tok, "", i + 1
                    break
            else:
                if final:
                    state.text.append((state.synced, end, state.head, "".join(texts)))
                    state.synced, state.head = end, ""
                return
        from_text = bounds[first - 1][1] if first else 0
        if final:
            state.text.append("".join(texts[from_text:]))
            state.synced = end
            return
        for tok, n_text, whole, has_text in reversed(bounds[first:]):
            if await ends_whole(tok, whole, has_text, lambda: state.head + "".join(texts[from_text:n_text])):
                state.text.append("".join(texts[from_text:n_text]))
                state.synced, state.head = tok, "".join(texts[n_text:])
                return
        state.head = "".join(texts[from_text:])

    async def _sample_text(self, engine: Engine, state: Partial, stop_token: bool) -> str | None:
        """The sample's text: its streamed segments, and each window of ids between them
        decoded (_window_text) by `engine`, else by another listed engine; None if none
        answers. `stop_token`: the last token ended the request as a stop token (EOS), which
        vLLM leaves out of the text."""
        out: list[str] = []
        for seg in state.text:
            if isinstance(seg, str):
                out.append(seg)
                continue
            for e in self._engine_first(engine):
                text = await self._window_text(e, state, *seg, stop_token=stop_token and seg[1] == len(state))
                if text is not None:
                    break
            else:
                return None
            out.append(text)
        return "".join(out)

    async def _window_text(self, engine: Engine, state: Partial, lo: int, hi: int, head: str, tail: str,
                           *, stop_token: bool) -> str | None:
        """The text vLLM streams for output tokens [lo, hi) (a whole character ends at lo, and
        at hi unless it is the end), from their ids: the engine's /detokenize of the ids before
        lo and the window, less that of the ids before lo; None if it does not answer.

        /detokenize keeps special tokens, which vLLM's streamed text skips
        (skip_special_tokens), so they are found and left out: a token streamed in a chunk
        without text where the decode is whole was skipped; and the text must agree with what
        was streamed around it: `head` (after lo, before the split) then `tail` (the next
        piece's, up to hi), or begin with head and be how `tail` ends (where vLLM streamed the
        whole text again); else the tokens whose removal makes it agree were special ones. At the
        end, the bytes of an unfinished character and a stop token are not streamed: nor are
        they here."""
        ids = state.token_ids
        ctx = self._context(state, lo)
        end = hi == len(state)
        keep = [i for i in range(lo, hi) if not (stop_token and i == len(state) - 1 and not state.keep_stop)]
        for i in sorted(i for i in state.silent if lo <= i < hi)[:16]:
            text = await self._detokenize(engine, ctx + [ids[j] for j in keep if j <= i])
            if text is None:
                return None
            if not text.endswith("\ufffd") and i in keep:
                keep.remove(i)
        base = await self._detokenize(engine, ctx)
        if base is None:
            return None

        async def build(kept: list[int]) -> str | None:
            full = await self._detokenize(engine, ctx + [ids[j] for j in kept])
            if full is not None and not full.startswith(base):  # the context did not decode the same
                full, prefix = await self._detokenize(engine, [ids[j] for j in kept]), ""
            else:
                prefix = base
            if full is None:
                return None
            return full[len(prefix):].rstrip("\ufffd") if end else full[len(prefix):]

        def fits(text: str) -> bool:
            return text == head + tail or text.startswith(head) and tail.endswith(text)

        text = await build(keep)
        if text is None or fits(text):
            return text
        # Specials in chunks that also streamed text: those whose own text is whole are the
        # candidates (a special's content is); sets of up to 3 of the first 10, 64 tries.
        cands = []
        for i in keep:
            one = await self._detokenize(engine, [ids[i]])
            if one is None:
                return None
            if one and "\ufffd" not in one:
                cands.append(i)
        tries = itertools.islice(itertools.chain.from_iterable(
            itertools.combinations(cands[:10], k) for k in (1, 2, 3)), 64)
        for drop in tries:
            other = await build([j for j in keep if j not in drop])
            if other is None:
                return None
            if fits(other):
                return other
        log.warning("rollout: the text of output tokens [%d, %d) built from ids does not match the text streamed "
                    "around it; kept as /detokenize gives it", lo, hi)
        return text

    def _engine_first(self, engine: Engine) -> list[Engine]:
        """`engine`, then every other listed engine: any of them has the model's tokenizer."""
        return [engine] + [e for e in self.engines if e.name != engine.name]

    async def _detokenize_any(self, engine: Engine, ids: list[int]) -> str | None:
        """`engine`'s /detokenize of `ids`, else the first other listed engine's that answers."""
        for e in self._engine_first(engine):
            text = await self._detokenize(e, ids)
            if text is not None:
                return text
        return None

    async def _detokenize(self, engine: Engine, ids: list[int]) -> str | None:
        """The engine's text of `ids` (vLLM's POST /detokenize), or None if it does not answer."""
        if not ids:
            return ""
        try:
            async with self._session.post(f"{engine.url}/detokenize", json={"model": self.model or engine.model,
                                                                             "tokens": ids},
                                          headers=self._auth) as resp:
                if resp.status != 200:
                    return None
                data = await resp.json()
        except Exception as e:  # noqa: BLE001 - then the split falls at a chunk known to be whole
            log.debug("rollout: /detokenize on %s: %s", engine.name, e)
            return None
        text = data.get("prompt") if isinstance(data, dict) else None
        return text if isinstance(text, str) else None

    def _keep(self, rid: str, state: Partial, engine: Engine, published: Any, answer: Answer,
              outcome: str, seed: Any, made_on: tuple[Any, str, Any]) -> None:
        """After a failed attempt: keep what it streamed as the next piece of the sample, or
        throw the whole partial output away (and say why). `made_on`: the piece's
        (weight_version, span, weight_version_end), piece_version's."""
        n = answer_tokens(answer)
        if n == 0:
            return
        self.stats.tokens_before_fault += n
        total = len(state) + n
        why = None
        if not self.continue_partial:
            why = "continue_partial is off"
        elif state.blocker:
            why = state.blocker
        elif answer.token_ids is None or (state.prompt_token_ids is None and answer.prompt_token_ids is None):
            why = "the engine sent no token ids (return_token_ids) to continue from"
        elif state.want_logprobs and (answer.logprobs is None or len(answer.logprobs) != n):
            why = f"{len(answer.logprobs or ())} logprob(s) for {n} token(s) received"
        elif state.limit is not None and total >= int(state.limit):
            why = f"all {total} token(s) of max_tokens received, but no finish reason"
        if why:
            self._start_over(rid, state, why, engine=engine.name, version=made_on[0], extra=n)
            return
        # Else `why` above: the ids, and the prompt's with the first piece, and the logprobs wanted.
        assert answer.token_ids is not None
        if not state.splits:
            assert answer.prompt_token_ids is not None
            state.prompt_token_ids = list(answer.prompt_token_ids)
            state.version, state.published = engine.weight_version, published
        state.piece = self._piece(state, answer)
        version, span, end = made_on
        state.splits.append(Split(engine.name, version, len(state), n, outcome, seed, span=span,
                                  weight_version_end=end))
        state.token_ids.extend(answer.token_ids)
        if state.want_logprobs:
            assert answer.logprobs is not None
            state.logprobs = (state.logprobs or []) + list(answer.logprobs)

    @staticmethod
    def _piece(state: Partial, answer: Answer) -> tuple[int, list[str], list[tuple[int, int, bool, bool]]]:
        """An answer as a piece of the sample (its tokens not yet added): where it starts, its
        streamed text, its chunk ends in the sample's token count."""
        start = len(state)
        state.silent.update(start + i for i in answer.silent)
        return start, answer.text, [(start + t, p, whole, has_text) for t, p, whole, has_text in answer.bounds]
