"""The scheduler-side half of the connector: which requests load, hold or heartbeat this step.

It runs in vLLM's scheduler process and decides; a hold or a load leaves the moment it is
decided (``request_finished``, ``update_state_after_alloc``) where its ``sender`` can take it:
to every TP rank's worker when all live in this process (vLLM's single-process executor: the
worker's own stream), else to every rank's sidecar on the scheduler's own channel
(:mod:`.steps.sends`), and the next step's metadata tells the workers what was sent
(:class:`Sent`: their streams carry its events) and what the sidecars refused; a load whose
read every rank's sidecar reported done on the scheduler's step lanes is reported received to vLLM
by the scheduler itself (:meth:`SchedulerSide.received`), a step before the workers could. What neither
takes travels in the step's :class:`StepWork` (``build_connector_meta``), which workers send in
``start_load_kv``, after the step's forward pass.

* Prefill (``do_remote_decode``): when the request finishes (length-capped or stopped) its blocks
  stay allocated (``request_finished`` returns True) and every worker HOLDs them under one token
  generated here; the returned ``kv_transfer_params`` tell the decode engine where they are. An
  aborted prefill holds nothing. The blocks are freed when the sidecar reports SEND_DONE (every
  consumer confirmed, or the lease expired).
* Decode (``do_remote_prefill``): the uncomputed prompt tokens are loaded asynchronously (the
  request runs once the load is reported finished receiving); the workers Read them. With
  ``forward_deadline_s``, where a load may be posted at allocation, all but the last prompt
  token load for the step that allocates the blocks, which computes that token on them
  (``LoadKind.FORWARD``, vLLM's synchronous load: the workers wait for the read before the
  forward), while the step's FORWARD tokens stay within ``forward_max_tokens`` (the rest of a
  burst loads asynchronously: running requests wait for a bounded read). A full local prefix
  hit, or a request aborted before it was scheduled, still Reads with no local blocks so that
  the producer's hold ends at once (not at lease expiry).
* Requests waiting in the queue with remote KV are heartbeated so their producer leases last.
* Models with state layers (:mod:`.hybrid`): the prefill engine computes the prompt but its last
  token, the decode engine loads exactly the tokens whose state the producer holds and computes
  the rest; a state group moves its state block alone, never its speculative scratch blocks.

vLLM objects are used only through the attributes named here (no vLLM import at run time).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .hybrid import StateGroups, truncate_prompt
from .params import (
    ParamsError,
    RemoteKv,
    align_local_ids,
    block_ratio,
    wants_remote_decode,
    wants_remote_prefill,
)
from .steps.work import Heartbeat, Hold, Load, LoadKind, Route, Sender, Sent, StepWork

log = logging.getLogger(__name__)

__all__ = ["SchedulerSide"]

# RequestStatus names after which a prefill's KV is complete (not aborted or failed).
_COMPLETED = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


@dataclass
class _Waiting:
    remote: RemoteKv
    since: float
    tokens: int  # prompt tokens to load (StateGroups.tokens_to_load); 0: compute them here


@dataclass
class SchedulerSide:
    """The scheduler half. ``engine_id``: this engine's; ``lease_s``: producer hold lease;
    ``endpoints``: this engine's sidecar endpoints in rank order (from configuration, or learnt
    from the workers' handshake metadata); ``states``: the engine's KV-cache groups, for models
    with state layers (:mod:`.hybrid`: prefill backoff, one state block per state group)."""

    engine_id: str
    tp_size: int
    lease_s: float
    endpoints: tuple[str, ...] = ()
    heartbeat_s: float = 0.0  # 0: lease_s / 3
    clock: Any = time.monotonic
    states: StateGroups = field(default_factory=StateGroups)
    block_size: int = 0  # tokens per block (vLLM's cache_config.block_size); 0: not known
    # Sends work at once where it can (to the workers in this process, or to their sidecars);
    # what it does not take goes in the next step's metadata. None: always the metadata.
    sender: Sender | None = None
    # Whether a load may be posted at allocation: vLLM writes nothing of its own into the blocks
    # it just allocated before the step's forward (no zeroing of new blocks, as for Mamba layers
    # or mixed-precision caches; no copy-on-write of a partial prefix hit, checked per request).
    loads_now: bool = False
    # The read deadline of a load the step allocating its blocks computes on (LoadKind.FORWARD:
    # the workers wait for it before that forward, a step earlier than an ASYNC load's first
    # token); 0: every load is ASYNC. Only where loads_now holds and the model has no state
    # layers (a FORWARD load is posted when its blocks are allocated, like any other).
    forward_deadline_s: float = 0.0
    # The most prompt tokens one step loads as FORWARD (the model thread waits for their reads,
    # and every running request with it); a load past it is ASYNC. 0: no bound.
    forward_max_tokens: int = 0
    _loads: dict[str, Load] = field(default_factory=dict)
    _holds: dict[str, Hold] = field(default_factory=dict)
    _waiting: dict[str, _Waiting] = field(default_factory=dict)
    _sent_loads: list[Load] = field(default_factory=list)
    _sent_holds: list[Hold] = field(default_factory=list)
    _awaiting: set[str] = field(default_factory=set)  # sent loads no one has reported yet
    _done: set[str] = field(default_factory=set)  # of those, every rank's sidecar reported done
    _early: set[str] = field(default_factory=set)  # reported here; the workers' report to drop
    _settled: list[str] = field(default_factory=list)  # reported here; the workers to be told
    # Matched FORWARD and not yet allocated: the (block-aligned) local hit they load after.
    _forward_ok: dict[str, int] = field(default_factory=dict)
    _forward: list[str] = field(default_factory=list)  # this step's FORWARD loads
    _forward_tokens: int = 0  # tokens granted FORWARD since the step's metadata was taken
    _last_heartbeat: float = 0.0

    # --- decode side ----------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """A request arrived (before any prefix-cache lookup). Prefill: with a prefill backoff
        (state layers), the prompt loses its last ``backoff`` tokens here. Decode: its params
        are parsed once, and how many prompt tokens it will load is settled."""
        params = request.kv_transfer_params
        if wants_remote_decode(params) and self.states.backoff:
            truncate_prompt(request, self.states.backoff)
        if wants_remote_prefill(params):
            try:
                remote = RemoteKv.from_params(params)
            except ParamsError as exc:
                log.warning("request %s: %s; it will be computed locally", request.request_id, exc)
                params["do_remote_prefill"] = False
                return
            self._waiting[request.request_id] = _Waiting(
                remote=remote, since=self.clock(), tokens=self._tokens_to_load(request, remote)
            )

    def _tokens_to_load(self, request: Any, remote: RemoteKv) -> int:
        """:meth:`StateGroups.tokens_to_load` for this prompt and producer; 0 (with a warning)
        where a model with state layers cannot use the producer's state."""
        prompt = len(request.prompt_token_ids or ())
        tokens = self.states.tokens_to_load(prompt, remote.num_tokens)
        if not self.states.has_state:
            return tokens
        groups = zip(remote.block_ids, self.states.scratch, strict=False)
        slots = [len(r) for r, n in groups if n is not None]
        why = ""
        if len(remote.block_ids) != len(self.states.scratch) or slots != [1] * len(slots):
            why = f"its blocks {remote.block_ids} are not one state block per state group"
        elif tokens == 0:
            why = (
                f"its state is after {remote.num_tokens} tokens of this {prompt}-token prompt; "
                f"it must leave at least {self.states.backoff} to compute here"
            )
        if why:
            log.warning(
                "request %s: the producer's KV cannot be used (%s); the prompt is computed here",
                request.request_id,
                why,
            )
            return 0
        return tokens

    @property
    def forward_loads(self) -> bool:
        """Loads are FORWARD where they can be (see ``forward_deadline_s``)."""
        return (
            self.forward_deadline_s > 0
            and self.loads_now
            and self.block_size > 0
            and not self.states.has_state
        )

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens to load for a decode request: the uncomputed prompt tokens up to the ones
        settled in :meth:`on_new_request` (all of them, or with state layers exactly those whose
        state the producer holds, leaving the last to compute here), asynchronously; or, as a
        FORWARD load (:attr:`forward_loads`), all but the last prompt token, which the step
        that allocates the blocks computes (vLLM's synchronous load: ``False``), while this
        step's FORWARD tokens, these included, stay within ``forward_max_tokens`` (a request
        granted FORWARD but not allocated keeps its share: fewer FORWARD loads, never more)."""
        rid = request.request_id
        self._forward_ok.pop(rid, None)
        if wants_remote_prefill(request.kv_transfer_params):
            waiting = self._waiting.get(rid)
            prompt = len(request.prompt_token_ids or ())
            tokens = (
                waiting.tokens if waiting is not None else self.states.tokens_to_load(prompt, 0)
            )
            count = tokens - num_computed_tokens
            if count > 0 and self.forward_loads:
                forward = min(tokens, prompt - 1) - num_computed_tokens
                total = self._forward_tokens + forward
                if forward > 0 and (
                    self.forward_max_tokens <= 0 or total <= self.forward_max_tokens
                ):
                    self._forward_ok[rid] = num_computed_tokens
                    self._forward_tokens = total
                    return forward, False
            if count > 0:
                return count, True
        return 0, False

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Blocks are allocated: plan the load (or, for a full local hit, the release)."""
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        waiting = self._waiting.pop(request.request_id, None)
        try:
            remote = waiting.remote if waiting else RemoteKv.from_params(params)
        except ParamsError as exc:
            log.warning("request %s: %s", request.request_id, exc)
            return
        hit = self._forward_ok.pop(request.request_id, None)
        if num_external_tokens > 0:
            if hit is None:
                local = self.states.clip(blocks.get_unhashed_block_ids_all_groups())
            else:  # vLLM hashed the blocks it allocated for a synchronous load already
                local = self._forward_blocks(request, blocks, hit)
            # Local lists are tail-aligned with the blocks the remote ones fill (.blocks).
            ratio = block_ratio(self.block_size, remote.block_size)
            local = align_local_ids(local, remote.block_ids, ratio)
            self._check_state_slots(request.request_id, local, remote)
            forward = hit is not None
            load = Load(
                request_id=request.request_id,
                local_block_ids=local,
                remote=remote,
                kind=LoadKind.FORWARD if forward else LoadKind.ASYNC,
                deadline_s=self.forward_deadline_s if forward else 0.0,
            )
            if forward:
                self._forward.append(request.request_id)
            # A local hit ending inside a block gets a copy-on-write block that the worker fills
            # before the forward: the READ must not land first.
            self._load(
                load,
                now=self.loads_now
                and self.block_size > 0
                and request.num_computed_tokens % self.block_size == 0,
            )
        else:  # full local prefix hit: read nothing, release the producer now
            self._load(_release(request.request_id, remote))

    def _forward_blocks(self, request: Any, blocks: Any, hit: int) -> tuple[tuple[int, ...], ...]:
        """The blocks a FORWARD load fills: the request's blocks after its local hit of ``hit``
        tokens (block-aligned) up to the prompt's last block (vLLM allocated them for the
        loaded tokens and the last prompt token, which the step computes; lookahead slots,
        if any, come after and are not the producer's)."""
        end = -(-len(request.prompt_token_ids or ()) // self.block_size)
        return tuple(tuple(ids[hit // self.block_size : end]) for ids in blocks.get_block_ids())

    def _load(self, load: Load, *, now: bool = True) -> None:
        """Start ``load`` now (the blocks are allocated and vLLM writes nothing into them before
        the READ) or with the next step's ``start_load_kv``."""
        # A FORWARD load may go on the scheduler's channel too: the worker that waits for it
        # before the forward never sees that channel's answer, but a step sent beside its Session
        # ends each read it refuses with a RECV_FAILED on the Session (``EngineServicer.step``).
        work = StepWork(loads=(load,))
        route = self._send(work) if now else Route.STEP
        if route is Route.STEP:
            self._loads[load.request_id] = load
        elif route is Route.SIDECARS:
            self._sent_loads.append(load)
            if load.kind is LoadKind.ASYNC:  # the only kind vLLM is told of as received
                self._awaiting.add(load.request_id)

    def received(self, reported: set[str] | None) -> set[str] | None:
        """vLLM's ``finished_recving`` for a step's output (``update_connector_output``, before
        vLLM reads it): the workers' report, plus the loads the scheduler sent whose read every
        rank's sidecar reported done (its sender's ``received``), less the workers' report of
        loads already reported here. Each load reaches vLLM once: whichever side reports it
        first, in one output or an earlier one, and the workers are told of those reported here
        (:attr:`Sent.received`). Loads that failed on a rank are never reported here (the
        workers report them, failed). The scheduler reports its loads only once none of them is
        still in flight, all together (a single request at once): a request that runs while
        other reads still copy takes the cores the copy needs on a CPU host and splits a
        batch's forward passes (docs/vllm.md, "The scheduler reports the load": reporting each
        at once, a batch of 32's last first token came 1.12-1.51x NixlConnector's)."""
        if not (self._early or self._awaiting):  # nothing of the scheduler's: no lane to read
            return reported
        ready = self.sender.received() if self.sender is not None and self._awaiting else ()
        out = set(reported or ())
        for rid in reported or ():
            if rid in self._early:  # vLLM was told: the workers' report is the same load's
                self._early.discard(rid)
                out.discard(rid)
            else:
                self._awaiting.discard(rid)
                self._done.discard(rid)
        self._done.update(rid for rid in ready if rid in self._awaiting)
        if self._done and self._done == self._awaiting:  # none still in flight: all of them
            for rid in self._done:
                self._early.add(rid)
                self._settled.append(rid)
                out.add(rid)
            self._awaiting.clear()
            self._done.clear()
        return out or None

    def _send(self, work: StepWork) -> Route:
        return Route.STEP if self.sender is None else self.sender.send(work)

    def _check_state_slots(
        self, request_id: str, local: tuple[tuple[int, ...], ...], remote: RemoteKv
    ) -> None:
        """A load's state groups pair one local state slot with the producer's one (checked in
        :meth:`_tokens_to_load`). vLLM allocates that slot for every load; a load without it
        would leave the state zero and run silently wrong, so it stops here, as vLLM's own
        connector asserts."""
        for g, scratch in enumerate(self.states.scratch):
            if scratch is not None and (g >= len(local) or len(local[g]) != 1):
                raise RuntimeError(
                    f"request {request_id}: KV-cache group {g} holds recurrent state, but vLLM "
                    f"allocated {local[g] if g < len(local) else ()} for it, not one state "
                    f"block to pair with the producer's {remote.block_ids[g]}"
                )

    # --- both sides -----------------------------------------------------------------------------

    def finished(
        self, request: Any, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished_all_groups``: (delay freeing the blocks, params to return)."""
        params = request.kv_transfer_params
        rid = request.request_id
        waiting = self._waiting.pop(rid, None)
        self._forward_ok.pop(rid, None)
        if wants_remote_prefill(params):  # aborted before it was scheduled
            params["do_remote_prefill"] = False
            if waiting is not None:
                self._load(_release(rid, waiting.remote))
            return False, None
        if not wants_remote_decode(params):
            return False, None
        status = getattr(request.status, "name", str(request.status))
        if status not in _COMPLETED:
            return False, None  # aborted or failed prefill: nothing to hold
        blocks = self.states.clip(block_ids)
        if not any(blocks):
            return False, None
        if len(self.endpoints) != self.tp_size:
            log.error(
                "request %s: this engine's sidecar endpoints are unknown (%d of %d ranks); "
                "set kv_connector_extra_config.peer_endpoints",
                rid,
                len(self.endpoints),
                self.tp_size,
            )
            return False, None
        token = secrets.token_urlsafe(24)
        hold = Hold(request_id=rid, block_ids=blocks, token=token, lease_s=self.lease_s)
        # Sent before the token leaves (kv_transfer_params are returned from here); a consumer
        # that still outruns it is answered PENDING (the workers register trailing_holds).
        route = self._send(StepWork(holds=(hold,)))
        if route is Route.STEP:
            self._holds[rid] = hold
        elif route is Route.SIDECARS:
            self._sent_holds.append(hold)
        remote = RemoteKv(
            engine_id=self.engine_id,
            request_id=rid,
            block_ids=blocks,
            endpoints=self.endpoints,
            token=token,
            tp_size=self.tp_size,
            num_tokens=int(request.num_computed_tokens),
            block_size=self.block_size,
        )
        return True, remote.to_params()

    def take_step(self) -> StepWork:
        """This step's work for the workers; resets what was handed out."""
        loads, holds = tuple(self._loads.values()), tuple(self._holds.values())
        self._loads.clear()
        self._holds.clear()
        return StepWork(loads=loads, holds=holds, heartbeats=self._heartbeats())

    def take_forward(self) -> tuple[str, ...]:
        """This step's FORWARD loads (for the step's metadata: the workers wait for them before
        the forward); resets them."""
        out, self._forward = tuple(self._forward), []
        self._forward_tokens = 0
        return out

    def take_sent(self) -> Sent:
        """What the scheduler's channel sent since the last call, and the answers the workers
        must act on (for the step's metadata, beside :meth:`take_step`); resets both."""
        answers = self.sender.answers() if self.sender is not None else ()
        if not (self._sent_loads or self._sent_holds or answers or self._settled):
            return _NOTHING_SENT
        work = StepWork(loads=tuple(self._sent_loads), holds=tuple(self._sent_holds))
        self._sent_loads.clear()
        self._sent_holds.clear()
        received, self._settled = tuple(self._settled), []
        return Sent(work=work, answers=answers, received=received)

    def _heartbeats(self) -> tuple[Heartbeat, ...]:
        interval = self.heartbeat_s or self.lease_s / 3
        now = self.clock()
        if not self._waiting or now - self._last_heartbeat < interval:
            return ()
        self._last_heartbeat = now
        by_engine: dict[str, list[RemoteKv]] = {}
        for w in self._waiting.values():
            if now - w.since >= interval:
                by_engine.setdefault(w.remote.engine_id, []).append(w.remote)
        return tuple(
            Heartbeat(
                engine_id=engine,
                endpoints=remotes[0].endpoints,
                request_ids=tuple(r.request_id for r in remotes),
                tokens=tuple(r.token for r in remotes),
            )
            for engine, remotes in by_engine.items()
        )

    def set_endpoints(self, by_rank: Mapping[int, str]) -> None:
        """The workers' sidecar endpoints (handshake metadata), unless configured."""
        if self.endpoints or len(by_rank) != self.tp_size:
            return
        self.endpoints = tuple(by_rank[r] for r in range(self.tp_size))


_NOTHING_SENT = Sent()


def _release(request_id: str, remote: RemoteKv) -> Load:
    return Load(
        request_id=request_id,
        local_block_ids=tuple(() for _ in remote.block_ids),
        remote=remote,
        kind=LoadKind.RELEASE,
    )
