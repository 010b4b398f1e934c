"""Models with recurrent state layers (Mamba1, Mamba2, Gated DeltaNet) in P/D: what the scheduler
half does for them, as vLLM's NixlConnector does (docs/vllm.md, "Hybrid models").

* **The prefill backoff.** vLLM recomputes the last loaded prompt token on the decode engine so
  that it has logits to sample from. Attention KV of that token is rewritten with the same values;
  a recurrent state would be advanced past the token twice. So the prefill engine computes the
  prompt without its last ``backoff`` tokens (the request is truncated when it arrives, before any
  prefix-cache lookup), holds the state after ``M = N - backoff`` tokens and says so in
  ``remote_num_tokens``; the decode engine loads exactly ``M`` tokens (attention KV of ``M``
  tokens and the state after ``M``) and computes the rest itself.
* **One block per state group.** vLLM allocates a state group's blocks as placeholders (null
  block 0), the state slot, then ``num_speculative_blocks`` scratch blocks for speculative
  decoding ('none' mode: ``[state, scratch...]``; 'align' mode: one column per block of tokens,
  states already moved forward nulled). Only the state slot, the block-table column
  ``(M - 1) // block_size`` that vLLM's worker resumes from, is held and read.

Pure values and duck-typed vLLM objects: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StateGroups", "truncate_prompt"]


def _is_state_spec(spec: Any) -> bool:
    return "Mamba" in type(spec).__name__


@dataclass(frozen=True, slots=True, kw_only=True)
class StateGroups:
    """The KV-cache groups of an engine as the scheduler half moves them.

    ``scratch``: per KV-cache group, ``None`` for a token-indexed group (attention, MLA, sliding
    window) or, for a state group, the number of speculative scratch blocks vLLM allocates after
    its state slot. ``backoff``: prompt tokens a prefill engine leaves to the decode engine (0
    without state groups and multi-token lookahead)."""

    scratch: tuple[int | None, ...] = ()
    backoff: int = 0

    @classmethod
    def from_config(cls, kv_cache_config: Any, *, lookahead_tokens: int = 0) -> StateGroups:
        """From vLLM's ``KVCacheConfig``. ``lookahead_tokens``: vLLM's
        ``VllmConfig.num_prefill_lookahead_tokens`` (prompt tokens an EAGLE/MTP drafter reads past
        the computed ones): a multi-module MTP drafter's window beyond the first token is held back
        too, as vLLM's ``_prefill_backoff`` does."""
        scratch: list[int | None] = []
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            specs = list((getattr(spec, "kv_cache_specs", None) or {}).values()) or [spec]
            states = [s for s in specs if _is_state_spec(s)]
            scratch.append(
                max(int(getattr(s, "num_speculative_blocks", 0)) for s in states)
                if states
                else None
            )
        has_state = any(n is not None for n in scratch)
        return cls(
            scratch=tuple(scratch),
            backoff=max(1 if has_state else 0, int(lookahead_tokens) - 1),
        )

    @property
    def has_state(self) -> bool:
        return any(n is not None for n in self.scratch)

    def clip(self, block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """Per group, the blocks that hold data. Token-indexed groups: without the null blocks
        (id 0) vLLM pads sliding-window groups with before the in-window tail. State groups: the
        state slot alone, i.e. the last block before the trailing scratch blocks (at least one
        block stays, as vLLM's ``clip_ssm_state_blocks``); nothing if that is the null block."""
        out: list[tuple[int, ...]] = []
        for g, group in enumerate(block_ids):
            ids = list(group)
            scratch = self.scratch[g] if g < len(self.scratch) else None
            if scratch is None:
                start = 0
                while start < len(ids) and ids[start] == 0:
                    start += 1
                out.append(tuple(ids[start:]))
                continue
            if ids:
                ids = ids[: len(ids) - min(scratch, len(ids) - 1)][-1:]
            out.append(tuple(b for b in ids if b != 0))
        return tuple(out)

    def tokens_to_load(self, num_prompt_tokens: int, remote_num_tokens: int) -> int:
        """Prompt tokens whose KV a decode engine reads for a prompt of ``num_prompt_tokens``
        from a producer that computed ``remote_num_tokens`` (0: not said).

        Without state groups, ``N - backoff`` (all of the prompt unless a drafter's lookahead is
        held back; ``N`` when the prompt is not longer than that), whatever the producer said, as
        before. With state groups the producer's state is the one after exactly
        ``remote_num_tokens``, so those are loaded if they leave at least ``backoff`` prompt tokens
        to compute here; otherwise (an unknown count, a producer that did not back off, a
        one-token prompt) nothing can be loaded: 0, and the prompt is computed here."""
        if not self.has_state:
            if num_prompt_tokens > self.backoff:
                return num_prompt_tokens - self.backoff
            return num_prompt_tokens
        if 0 < remote_num_tokens <= num_prompt_tokens - self.backoff:
            return remote_num_tokens
        return 0


def truncate_prompt(request: Any, tokens: int) -> bool:
    """Drop the last ``tokens`` prompt tokens of a prefill request (vLLM ``Request``) and cap it
    at one output token: its KV and state then end ``tokens`` short of the prompt, which the
    decode engine computes. Not done (False) for a prompt not longer than ``tokens`` or one that
    skips reading the prefix cache (prompt logprobs: the decode engine recomputes its whole
    prompt). Call it before the scheduler first looks the request up (``on_new_request``), and
    once."""
    if tokens <= 0 or request.num_prompt_tokens <= tokens:
        return False
    if request.get_skip_reading_prefix_cache():
        return False
    if request.prompt_token_ids is not None:
        del request.prompt_token_ids[-tokens:]
        mask = getattr(request, "prompt_is_token_ids", None)
        if mask is not None:
            request.prompt_is_token_ids = mask[:-tokens]
    if request.prompt_embeds is not None:
        request.prompt_embeds = request.prompt_embeds[:-tokens]
    del request._all_token_ids[-tokens:]
    request.num_prompt_tokens -= tokens
    request.max_tokens = 1
    return True
