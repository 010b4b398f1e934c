"""The geometry model of one engine rank's KV cache (DESIGN §4).

A rank's cache is a tuple of **views**; a view is ``num_blocks`` equally sized blocks of one memory
allocation, block ``i`` at ``base + i * block_stride`` (bytes). The layout of one block is a tuple of
**spans**: contiguous byte ranges ``[offset, offset + length)`` inside the block, each naming one piece
of logical data (``k``, ``v``, ``kv``, ``latent``, ``conv.x`` ...). A span's held units are
contiguous unless it sets ``unit_stride`` (heads that lie apart, as in ``[L, H, B, N, C]``). The
language-neutral specification, with worked examples, is ``docs/geometry.md``.

A span with ``global_units == 0`` is *replicated*: every rank holds all of it. A span with
``global_units == U > 0`` is *sharded* over the TP group of size ``T`` along an axis of ``U`` units
(KV heads, channel groups, SSM heads): if ``T <= U`` rank ``r`` holds units ``[r*U/T, (r+1)*U/T)``;
if ``T > U`` rank ``r`` holds the single unit ``floor(r*U/T)``. The span's ``length`` is the bytes of
the units this rank holds, so bytes per unit = ``length / units_held``.

All sizes and offsets are **bytes**; ``num_blocks`` counts view (kernel) blocks; ``blocks_per_id``
is kernel blocks per logical block id; ``tp_rank``/``tp_size`` are ranks; ``block_tokens`` counts
tokens per view block (0 = not declared). A span with ``token_rows = R > 0`` has a **token axis**:
each held unit is ``R`` equal rows of the block's tokens in order (:mod:`kvsidecar.plan.tokens`).

Every dataclass here is frozen; :class:`EngineGeometry` validates the whole tree on construction and
raises :class:`~kvsidecar.errors.GeometryError` listing *every* problem found.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvsidecar.errors import GeometryError

__all__ = ["EngineGeometry", "Span", "View", "units_per_rank"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """The bytes of one piece of logical data in a block: ``length`` bytes from ``offset``.

    ``global_units``: units of the unsharded model along the sharded axis; 0 = replicated.
    ``token_rows``: rows of tokens in each held unit (the token axis, see above); 0 = none.
    ``unit_stride``: bytes from one held unit to the next; 0 = the units are contiguous (unit ``k``
    at ``offset + k * length / units_held``). A layout whose heads lie apart (``[L, H, B, N, C]``,
    ``[B, H, L, N, C]``) sets it; its units may then reach past ``block_stride``.
    """

    key: str
    offset: int
    length: int
    global_units: int
    unit_stride: int = 0
    token_rows: int = 0

    @property
    def replicated(self) -> bool:
        """True if every rank holds the whole span (``global_units == 0``)."""
        return self.global_units == 0

    @property
    def end(self) -> int:
        """First byte past a contiguous span (bytes from the block start)."""
        return self.offset + self.length

    def ranges(self, held: int) -> tuple[tuple[int, int], ...]:
        """``[start, end)`` byte ranges (from the block start) of the span on a rank holding
        ``held`` units: one range when contiguous (or replicated), else one per unit."""
        if self.unit_stride == 0 or self.replicated or held <= 1:
            return ((self.offset, self.offset + self.length),)
        ub = self.length // held
        return tuple(
            (self.offset + k * self.unit_stride, self.offset + k * self.unit_stride + ub)
            for k in range(held)
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class View:
    """``num_blocks`` blocks of ``block_stride`` bytes in memory ``memory_id`` starting at ``offset``.

    ``groups``: KV-cache group indices whose block ids index this view. Per-request routing uses the
    **first** group of the tuple (see :mod:`kvsidecar.plan.request`).
    ``blocks_per_id``: consecutive view blocks per logical block id (kernel blocks per id).
    ``block_tokens``: tokens one view block holds; 0 = not declared (blocks of another size are
    then never planned against it).
    """

    name: str
    memory_id: str
    offset: int
    num_blocks: int
    block_stride: int
    groups: tuple[int, ...] = (0,)
    blocks_per_id: int = 1
    spans: tuple[Span, ...]
    block_tokens: int = 0

    def __post_init__(self) -> None:
        # Accept any sequence but store tuples, so the value stays hashable and immutable.
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "spans", tuple(self.spans))

    @property
    def num_ids(self) -> int:
        """Number of valid logical block ids (``num_blocks // blocks_per_id``)."""
        return self.num_blocks // self.blocks_per_id if self.blocks_per_id > 0 else 0

    @property
    def route_group(self) -> int:
        """The group whose ids a request routes to this view: the first of ``groups``."""
        return self.groups[0]

    def extent(self, tp_size: int) -> int:
        """Bytes from block 0's start to one past the last byte any span of the last block holds,
        on a rank of a ``tp_size`` group. Interleaved layouts end before ``num_blocks * block_stride``
        (the last block's tail belongs to other views); head-outermost ones reach past it."""
        last = max(hi for s in self.spans for _, hi in s.ranges(_held(s, tp_size)))
        return (self.num_blocks - 1) * self.block_stride + last

    def span(self, key: str) -> Span:
        """The span named ``key``; KeyError if absent."""
        for s in self.spans:
            if s.key == key:
                return s
        raise KeyError(key)


def units_per_rank(global_units: int, tp_size: int) -> int:
    """Units one rank holds of a sharded span (``U/T`` if ``T <= U`` else 1); 0 if not dividing."""
    if global_units <= 0 or tp_size <= 0:
        return 0
    if tp_size <= global_units:
        return global_units // tp_size if global_units % tp_size == 0 else 0
    return 1 if tp_size % global_units == 0 else 0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineGeometry:
    """The views of rank ``tp_rank`` of engine ``engine_id`` (TP group of ``tp_size`` ranks).

    ``num_groups``: number of KV-cache groups (a request carries one block-id array per group).
    All ranks of an engine share views and spans; only ``tp_rank`` differs.
    """

    engine_id: str
    tp_rank: int
    tp_size: int
    num_groups: int = 1
    views: tuple[View, ...]
    # Per group: the views routed to it, one per distinct id capacity, tightest first (derived).
    _limit_views: tuple[tuple[View, ...], ...] = field(
        init=False, repr=False, compare=False, hash=False, default=()
    )
    # Per group: tokens per block id of its routed views that declare block_tokens (0: none).
    _group_tokens: tuple[int, ...] = field(
        init=False, repr=False, compare=False, hash=False, default=()
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "views", tuple(self.views))
        problems = geometry_problems(self)
        if problems:
            raise GeometryError(problems)
        per_group: list[dict[int, View]] = [{} for _ in range(self.num_groups)]
        for v in self.views:
            per_group[v.route_group].setdefault(v.num_ids, v)
        limits = tuple(tuple(d[c] for c in sorted(d)) for d in per_group)
        object.__setattr__(self, "_limit_views", limits)
        tokens: list[set[int]] = [set() for _ in range(self.num_groups)]
        for v in self.views:
            if v.block_tokens:
                tokens[v.route_group].add(v.block_tokens * v.blocks_per_id)
        one = tuple(t.pop() if len(t) == 1 else 0 for t in tokens)
        object.__setattr__(self, "_group_tokens", one)

    def limit_views(self, group: int) -> tuple[View, ...]:
        """Views whose ids come from ``group``, one per distinct ``num_ids``, smallest first:
        checking ids against these checks them against every view of the group."""
        return self._limit_views[group]

    def group_tokens(self, group: int) -> int:
        """Tokens per block id of ``group``: ``block_tokens * blocks_per_id`` of the views routed
        to it that declare ``block_tokens``; 0 if none does or they differ."""
        return self._group_tokens[group]

    def view(self, name: str) -> View:
        """The view named ``name``; KeyError if absent."""
        for v in self.views:
            if v.name == name:
                return v
        raise KeyError(name)

    def view_index(self) -> dict[str, int]:
        """Map view name -> index in ``views``."""
        return {v.name: i for i, v in enumerate(self.views)}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _span_problems(
    where: str, span: object, tp_size: int, block_stride: int, num_blocks: int, block_tokens: int
) -> list[str]:
    if not isinstance(span, Span):
        return [f"{where} is {type(span).__name__}, not Span"]
    p: list[str] = []
    where = f"{where} ({span.key!r})" if isinstance(span.key, str) else where
    if not isinstance(span.key, str) or not span.key:
        p.append(f"{where}.key={span.key!r} must be a non-empty string")
    ints_ok = True
    for name in ("offset", "length", "global_units", "unit_stride", "token_rows"):
        if not _is_int(getattr(span, name)):
            p.append(f"{where}.{name}={getattr(span, name)!r} must be an int")
            ints_ok = False
    if not ints_ok:
        return p
    if span.offset < 0:
        p.append(f"{where}.offset={span.offset} is negative")
    if span.length <= 0:
        p.append(f"{where}.length={span.length} must be positive")
    if span.unit_stride < 0:
        p.append(f"{where}.unit_stride={span.unit_stride} is negative")
    elif span.unit_stride and span.replicated:
        p.append(f"{where}.unit_stride={span.unit_stride} is set on a replicated span")
    # A span past the block stride runs into the next block; a view of one block has none (its
    # stride is then whatever the tensor reports for a dimension of size 1).
    if (
        _is_int(block_stride)
        and span.offset >= 0
        and span.end > block_stride
        and not span.unit_stride
        and num_blocks != 1
    ):
        p.append(f"{where} ends at byte {span.end}, past block_stride={block_stride}")
    u = span.global_units
    if u < 0:
        p.append(f"{where}.global_units={u} is negative")
    elif u > 0 and _is_int(tp_size) and tp_size > 0:
        held = units_per_rank(u, tp_size)
        if held == 0:
            p.append(
                f"{where}.global_units={u} and tp_size={tp_size} do not divide "
                f"(need global_units % tp_size == 0 or tp_size % global_units == 0)"
            )
        elif span.length > 0 and span.length % held != 0:
            p.append(f"{where}.length={span.length} is not a multiple of units held ({held})")
        elif span.unit_stride and held > 1:
            p.extend(_strided_problems(where, span, held, block_stride, num_blocks))
    if span.token_rows:
        p.extend(_token_problems(where, span, _held(span, tp_size), block_tokens))
    return p


def _token_problems(where: str, span: Span, held: int, block_tokens: int) -> list[str]:
    """A token axis needs the view's ``block_tokens`` and units of whole token rows."""
    if span.token_rows < 0:
        return [f"{where}.token_rows={span.token_rows} is negative"]
    if not _is_int(block_tokens) or block_tokens <= 0:
        return [f"{where}.token_rows={span.token_rows} needs the view's block_tokens (it is 0)"]
    ub = span.length // held if span.length > 0 else 0
    if ub % (span.token_rows * block_tokens) == 0:
        return []
    return [f"{where}.token_rows={span.token_rows}: {ub} bytes per unit are not token_rows x "
            f"block_tokens={block_tokens} equal token slices"]  # fmt: skip


def _strided_problems(
    where: str, span: Span, held: int, block_stride: int, num_blocks: int
) -> list[str]:
    """A strided span's units must not overlap one another nor another block's units: each unit
    fits in ``block_stride`` bytes from its start, and either every unit lies inside the block or
    the units lie at least ``num_blocks * block_stride`` apart (one plane per unit, as when heads
    are outside blocks)."""
    ub = span.length // held
    if span.unit_stride < ub:
        return [f"{where}.unit_stride={span.unit_stride} is less than a unit ({ub} bytes)"]
    if not (_is_int(block_stride) and _is_int(num_blocks)) or block_stride <= 0:
        return []
    if span.offset % block_stride + ub > block_stride:
        return [f"{where}: a unit of {ub} bytes at offset {span.offset} crosses a block boundary"]
    last_end = span.offset + (held - 1) * span.unit_stride + ub
    if last_end <= block_stride or span.unit_stride >= num_blocks * block_stride:
        return []
    return [
        f"{where}.unit_stride={span.unit_stride}: units end at byte {last_end}, past "
        f"block_stride={block_stride}, but lie less than num_blocks*block_stride="
        f"{num_blocks * block_stride} apart, so blocks would overlap"
    ]


def _view_problems(where: str, view: object, tp_size: int, num_groups: int) -> list[str]:
    if not isinstance(view, View):
        return [f"{where} is {type(view).__name__}, not View"]
    p: list[str] = []
    where = f"{where} ({view.name!r})" if isinstance(view.name, str) else where
    if not isinstance(view.name, str) or not view.name:
        p.append(f"{where}.name={view.name!r} must be a non-empty string")
    if not isinstance(view.memory_id, str) or not view.memory_id:
        p.append(f"{where}.memory_id={view.memory_id!r} must be a non-empty string")
    for name in ("offset", "num_blocks", "block_stride", "blocks_per_id", "block_tokens"):
        if not _is_int(getattr(view, name)):
            p.append(f"{where}.{name}={getattr(view, name)!r} must be an int")
    if p:
        return p
    if view.offset < 0:
        p.append(f"{where}.offset={view.offset} is negative")
    if view.num_blocks <= 0:
        p.append(f"{where}.num_blocks={view.num_blocks} must be positive")
    if view.block_stride <= 0:
        p.append(f"{where}.block_stride={view.block_stride} must be positive")
    if view.block_tokens < 0:
        p.append(f"{where}.block_tokens={view.block_tokens} is negative")
    if view.blocks_per_id <= 0:
        p.append(f"{where}.blocks_per_id={view.blocks_per_id} must be positive")
    elif view.num_blocks > 0 and view.num_blocks < view.blocks_per_id:
        p.append(
            f"{where}.num_blocks={view.num_blocks} is less than blocks_per_id={view.blocks_per_id}"
        )
    if not view.groups:
        p.append(f"{where}.groups is empty")
    for g in view.groups:
        if not _is_int(g) or g < 0 or (_is_int(num_groups) and g >= num_groups):
            p.append(f"{where}.groups has {g!r}, outside [0, num_groups={num_groups})")
    if len(set(view.groups)) != len(view.groups):
        p.append(f"{where}.groups={view.groups} repeats a group")
    if not view.spans:
        p.append(f"{where} has no spans")
    keys: set[str] = set()
    for j, s in enumerate(view.spans):
        args = (tp_size, view.block_stride, view.num_blocks, view.block_tokens)
        p.extend(_span_problems(f"{where}.spans[{j}]", s, *args))
        if isinstance(s, Span):
            if s.key in keys:
                p.append(f"{where} has duplicate span key {s.key!r}")
            keys.add(s.key)
    sane = [
        sp
        for sp in view.spans
        if isinstance(sp, Span)
        and all(
            _is_int(getattr(sp, f)) for f in ("offset", "length", "global_units", "unit_stride")
        )
        and sp.length > 0
        and sp.unit_stride >= 0
    ]
    ranges = sorted((lo, hi, sp.key) for sp in sane for lo, hi in sp.ranges(_held(sp, tp_size)))
    for (a_lo, a_hi, a), (b_lo, b_hi, b) in itertools.pairwise(ranges):
        if b_lo < a_hi:
            p.append(f"{where} spans {a!r} [{a_lo}, {a_hi}) and {b!r} [{b_lo}, {b_hi}) overlap")
    return p


def _held(span: Span, tp_size: int) -> int:
    if span.replicated or not _is_int(tp_size) or span.global_units < 0:
        return 1
    return max(1, units_per_rank(span.global_units, tp_size))


def geometry_problems(geom: EngineGeometry) -> tuple[str, ...]:
    """Every problem of ``geom`` as a human-readable string; empty if valid."""
    p: list[str] = []
    if not isinstance(geom.engine_id, str) or not geom.engine_id:
        p.append(f"engine_id={geom.engine_id!r} must be a non-empty string")
    tp_ok = _is_int(geom.tp_size) and geom.tp_size > 0
    if not tp_ok:
        p.append(f"tp_size={geom.tp_size!r} must be a positive int")
    if not _is_int(geom.tp_rank) or geom.tp_rank < 0 or (tp_ok and geom.tp_rank >= geom.tp_size):
        p.append(f"tp_rank={geom.tp_rank!r} is outside [0, tp_size={geom.tp_size})")
    if not _is_int(geom.num_groups) or geom.num_groups <= 0:
        p.append(f"num_groups={geom.num_groups!r} must be a positive int")
    if not geom.views:
        p.append("views is empty")
    elif _is_int(geom.num_groups) and geom.num_groups > 0:
        # Every group's ids must land somewhere: a group no view routes to would be ignored.
        routed = {v.route_group for v in geom.views if isinstance(v, View) and v.groups}
        limit = min(geom.num_groups, len(routed) + 1)
        missing = next((g for g in range(limit) if g not in routed), None)
        if missing is not None and missing < geom.num_groups:
            p.append(
                f"num_groups={geom.num_groups}, but no view routes group {missing} (a view "
                f"routes the first of its groups; routed: {sorted(map(repr, routed))[:16]})"
            )
    names: set[str] = set()
    for i, v in enumerate(geom.views):
        p.extend(_view_problems(f"views[{i}]", v, geom.tp_size, geom.num_groups))
        if isinstance(v, View):
            if v.name in names:
                p.append(f"views[{i}] duplicates view name {v.name!r}")
            names.add(v.name)
    return tuple(p)
