"""Saved-tensor hooks scoped per module: the innermost selected module decides the bits.

Entering a selected module (a :class:`~memopt_plugins.measure.ScopeTracker` scope) enters its
``saved_tensors_hooks`` and leaving it leaves them, so every tensor autograd saves while the module
runs, by an ``nn.Module`` or a functional call, goes through :meth:`CompressionHooks.pack` at the
bits the :class:`~.bits.BitTable` gives that module. One pair serves eager and compiled code
(:meth:`CompressionHooks.pair`, GraphModules that AOTAutograd inlines: :mod:`.compiled`); the
hooks count nothing themselves, they tell their counter (:mod:`.counts`) what they kept.

Scopes nest as torch's hooks do: the innermost pair wins. Inside a region whose hooks mean
something else (a checkpoint memopt did not make, its replay, ``save_on_cpu``) a scope pushes
nothing (:func:`memopt_plugins.policy.in_foreign_region`). A DTensor is packed as its local shard.
What is kept as it is follows :mod:`memopt_plugins.policy`: parameters and what shares their memory
never are, judged at pack time against the storages the modules hold then (FSDP2's freshly
gathered weights too), since a compressed weight would outlive resharding.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from ..config import HALF_BITS, OFF_BITS
from ..derived import derivation, note_packed
from ..measure.scopes import ScopeTracker, Watch
from ..measure.storage import ComputedWeights, ModelStorages, RunningParameters, is_sharded
from ..measure.timeline import PACK_RANGE, UNPACK_RANGE
from ..packing import narrow_int, widen_int
from ..policy import (
    computed_weight,
    encodable,
    in_foreign_region,
    kept_as_is,
    kept_in_graph,
    mask_candidate,
    min_numel_at,
    redistributed_parameter,
)
from .bits import BitTable
from .codec import (
    NoiseGenerators,
    codec_generator,
    draw_seed,
    encode_mask,
    quantize,
    tensor_nbytes,
)
from .codec.ops import add_seed_source, remove_seed_source
from .codec.traced import (
    BITS,
    CODED,
    HALVED,
    Coded,
    decode,
    encode,
    pack_bools,
    unpack_bools,
)
from .compiled import CompiledGraphs, SavedFilter, hook_module, nbytes, traced_context
from .counts import SavedCounts
from .saved import (
    _alias_key,
    _check_version,
    _decoded_strides,
    _decoder,
    _from_half,
    _Kept,
    _mask_decoder,
    _no_copy,
    _original,
    _relaid,
    _Saved,
    _strided,
)

log = logging.getLogger("memopt")

#: What ``saved_tensors_hooks`` enters and exits (a scope pushes and pops at every module call).
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks


class _PerThread(threading.local):
    """A thread's scopes (autograd runs each device's backward on a thread of its own): whether
    each entered scope pushed its hooks, the fqns of those that pushed, innermost last (whose
    saved bytes a pack counts), and how deep compression is suspended."""

    def __init__(self) -> None:
        self.scopes: list[bool] = []
        self.names: list[str] = []
        self.suspended = 0


class PackObserver(Protocol):
    """Told of every tensor the hooks handle (the profiler counts what they keep)."""

    def packed(self, t: torch.Tensor, saved: object, added: int) -> None:
        """``saved`` is what autograd keeps for ``t`` (``t`` itself, or a compact copy that added
        ``added`` bytes; 0 for a copy made earlier in the forward)."""


class SaveCounter(Protocol):
    """What counts the hooks' work (:class:`.counts.SavedCounts`): told when a training
    forward's outermost scope opens and closes, of each tensor saved (with its scope, bytes and
    bits), of a shared copy made again at more bits, and of a tensor the codec cannot take."""

    def starts_step(self) -> bool: ...

    def forward_done(self, compiled: Mapping[object, tuple[int, int]]) -> None: ...

    def saved(
        self, t: torch.Tensor, saved: object, nbytes: int, scope: str | None, bits: int
    ) -> None: ...

    def resaved(
        self, saved: object, view: torch.Tensor, moved: tuple[str | None, int] | None,
        stored: int, held: int, scope: str | None,
    ) -> None: ...  # fmt: skip

    def unencodable(self, kind: str) -> bool: ...


class CompressionHooks:
    """Gives modules compression scopes and packs what autograd saves inside them.

    Args:
        bits: the engine's bit table (read at every module entry, so escalation acts at once).
        group_size, stochastic, min_numel: codec settings (see ``quantize`` in the config).
        noise: the generators stochastic rounding draws from (default: the codec's fixed-seed
            ones, :func:`~.codec.codec_generator`).
        counter: told of what is saved (default: a fresh :class:`.counts.SavedCounts`).
    """

    def __init__(
        self,
        bits: BitTable,
        *,
        group_size: int,
        stochastic: bool,
        min_numel: int,
        noise: NoiseGenerators | None = None,
        counter: SaveCounter | None = None,
    ):
        self.bits = bits
        self.group_size = group_size
        self.stochastic = stochastic
        self.noise = noise
        self.min_numel = min_numel
        self.sample: tuple[int, int] | None = None  # (samples, training batch): as_training()
        self.counter = SavedCounts() if counter is None else counter
        self.observer: PackObserver | None = None
        self._local = _PerThread()
        self._cache: dict[tuple, tuple[weakref.ref, weakref.ref, tuple[int, ...]]] = {}
        self._last: weakref.ref | None = None  # the compressed save just before, if any
        # This forward's packed DTensors: their wrappers' versions, which in-place changes bump
        # and their local shards' do not, are looked at when it ends (as the cache's are).
        self._dtensors: list[weakref.ref] = []
        self._storages: ModelStorages | None = None
        self._running: RunningParameters | None = None
        self._computed: ComputedWeights | None = None
        self._watch: Watch | None = None
        self._compiled: CompiledGraphs | None = None
        self._compiled_noted = False
        self._seeds: int | None = None  # the key of the compiled graphs' seed source
        # The hook pairs, per (scope, bits). Kept while installed: torch.compile guards on the
        # hooks' ids, which must not be reused by new objects while a graph compiled with the
        # old ones may run.
        self._pairs: dict[tuple, tuple[torch.fx.GraphModule, torch.fx.GraphModule]] = {}
        self._unpack_hook: torch.fx.GraphModule | None = None
        self._keyed: int | None = None  # the bit table's version the scopes' keys were set at
        self._release: weakref.finalize | None = None
        self.owner: object = None  # what must live as long as these hooks are on a model

    # ----------------------------------------------------------------- installation
    def install(self, root: nn.Module, fqns: Sequence[str]) -> None:
        """Give every module in ``fqns`` (names within ``root``) a compression scope."""
        self._storages = ModelStorages(root)
        self._compiled = CompiledGraphs(root, self.bits)
        self._unpack_hook = hook_module(self.unpack, "saved", eager=self.unpack)
        if self.stochastic:
            self._seeds = add_seed_source(self._draw_graph_seed)
        SavedFilter.open()
        # Process-wide state is given back by remove(), or when these hooks are collected with
        # a model dropped unremoved (nothing process-wide holds them).
        self._release = weakref.finalize(self, _release_process_state, self._seeds)
        self._watch = ScopeTracker.of(root).watch(self, fqns)
        self._keyed = None
        self._running = RunningParameters(root)
        self._running.sync()
        self._computed = ComputedWeights(root)

    def _draw_graph_seed(self) -> int:
        """A seed for a compiled graph's rounding noise, from the CPU generator (on the host,
        whatever the graph's device: no wait on a GPU)."""
        cpu = torch.device("cpu")
        return draw_seed(self.noise(cpu) if self.noise else codec_generator(cpu))

    def remove(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        if self._running is not None:
            self._running.remove()
            self._running = None
        if self._computed is not None:
            self._computed.remove()
            self._computed = None
        self._cache.clear()
        self._dtensors = []
        self._last = None
        self._storages = None
        if self._release is not None:  # graphs compiled before still run, rounding with seed 0
            self._release()
            self._release = None
        self._compiled = None
        self._seeds = None
        self._pairs = {}
        self._unpack_hook = None
        self.owner = None

    @contextmanager
    def observed(self, observer: PackObserver) -> Iterator[None]:
        """``observer`` is told of every tensor packed inside."""
        previous, self.observer = self.observer, observer
        try:
            yield
        finally:
            self.observer = previous

    # ----------------------------------------------------------------- suspension
    @property
    def suspended(self) -> bool:
        return self._local.suspended > 0

    @contextmanager
    def suspend(self) -> Iterator[None]:
        """No compression inside (recompute regions, the exact pass of the drift check)."""
        self._local.suspended += 1
        try:
            yield
        finally:
            self._local.suspended -= 1

    @contextmanager
    def as_training(self, sample: tuple[int, int] | None) -> Iterator[None]:
        """Inside, saves are of ``sample`` = ``(samples, batch)`` (the drift check's, cut from a
        training batch): each is kept as it is or compressed as its counterpart in a training
        forward is (:func:`~memopt_plugins.policy.min_numel_at`)."""
        previous, self.sample = self.sample, sample
        try:
            yield
        finally:
            self.sample = previous

    # ----------------------------------------------------------------- module scopes
    def _begin(self) -> None:
        """The outermost scope opens. The first forward after the training loop's step
        (:meth:`.counts.SavedCounts.end_step`), or, in a loop that counts no steps, one with
        nothing held from an earlier forward, starts a new step: the counter restarts the
        per-forward counts and the parameters' storages are refreshed (they may have moved to
        another device or dtype since apply, or been sharded). Forwards in between
        (micro-batches whose graphs are all alive) add to the step's counts. A forward without
        gradients (an eval pass) saves nothing and leaves the last training forward's counts
        as they are."""
        if not torch.is_grad_enabled() or self._storages is None:
            return
        if self.counter.starts_step():
            self._storages.refresh()
            self._running.sync(self._storages.sharded)

    def pair(self, fqn: str) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        """The (pack, unpack) hooks of scope ``fqn`` at its bits: one pack for eager and traced
        calls (:func:`.compiled.traced_context` tells them apart), one unpack for every scope.
        Keyed by the scope's own bits, so other scopes' changes leave its hooks (and the compiled
        graphs guarded on them) as they are, and at most one pair per width is ever made."""
        bits = self.bits.bits_of(fqn)
        key = (fqn, bits)
        pair = self._pairs.get(key)
        if pair is None:

            def pack(t: torch.Tensor) -> object:  # the GraphModule's forward
                return self.pack(t, bits, fqn)

            # Calls go straight to pack (no frame of the GraphModule's call between).
            eager = functools.partial(self.pack, bits=bits, scope=fqn)
            pair = self._pairs[key] = (hook_module(pack, "t", eager=eager), self._unpack_hook)
            _SCOPE_PACKS.add(pair[0])
        return pair

    def _key_scopes(self) -> None:
        """Give each scope's module its bits as the key the compiled graphs it runs in are
        guarded on (:meth:`.ScopeTracker.set_key`): a change of bits recompiles those graphs."""
        if self._keyed != self.bits.version and self._watch is not None:
            self._keyed = self.bits.version
            self._watch.tracker.set_key({f: str(b) for f, b in self.bits.scopes.items()})

    def enter(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # Inside someone else's region (a checkpoint's forward or replay, a backward) the
        # region's hooks stay innermost: they decide what is kept (policy.in_foreign_region).
        local = self._local
        if not local.scopes and torch._C._current_graph_task_id() == -1:
            self._begin()  # not a replay in backward
            self._key_scopes()
        pushed = torch.is_grad_enabled() and not local.suspended and not in_foreign_region()
        if pushed:  # what saved_tensors_hooks(*pair) enters, without the object
            _push_hooks(*self.pair(fqn))
            local.names.append(fqn)
        local.scopes.append(pushed)

    def exit(self, fqn: str, module: nn.Module, args: tuple, output: Any) -> None:
        scopes = self._local.scopes
        if scopes:
            if scopes.pop():
                _pop_hooks()
                self._local.names.pop()
            if not scopes:
                looked = [saved for _, saved, _ in self._cache.values()] + self._dtensors
                for saved in looked:  # in-place changes in this forward
                    saved = saved()
                    if saved is not None:
                        saved.look()
                self._cache.clear()  # the outermost scope closed: dedup spans one forward
                self._dtensors = []
                self._last = None
                self.counter.forward_done(self._compiled.forward_done(output))
                if not self._compiled_noted:
                    self._note_compiled()

    def _note_compiled(self) -> None:
        """Say once which scopes ran inside compiled graphs, and what acts there instead."""
        traced = sorted(self._compiled.traced_bits)
        if not traced:
            return
        self._compiled_noted = True
        log.info(
            "memopt: %d compressed modules run inside torch.compile'd graphs (%s%s), which "
            "compress what they save at those modules' bits",
            len(traced),
            ", ".join(f or "<root>" for f in traced[:3]),
            ", ..." if len(traced) > 3 else "",
        )
        if self._compiled.kept:
            log.info("memopt: the compiled graphs %s", self._compiled.kept_text())
        log.info(
            "memopt: in compiled graphs NaN/Inf groups decode as NaN, and a change of a "
            "module's bits recompiles the graphs it runs in (docs/compile.md)"
        )

    # ----------------------------------------------------------------- pack / unpack
    def pack(
        self, t: torch.Tensor, bits: int, scope: str | None = None, ranged: bool = False
    ) -> object:
        """Return what autograd keeps for ``t`` under ``bits``: ``t`` itself (with its version,
        :class:`_Kept`) or a compact copy; :meth:`unpack` gives the tensor back. The pack hook
        of scope ``scope`` (:meth:`pair`): while AOTAutograd traces, the traced codec's ops.
        The codec is called from here through :meth:`_compress`, nothing deeper (every frame
        on that path runs for every saved tensor); ``ranged``: inside the profiler's range."""
        if scope is not None:
            context = traced_context()
            if context is not None:
                return self._pack_traced(t, context["_node"], context["_fw_graph"], scope)
        if not ranged and torch.autograd._profiler_enabled():
            with torch.profiler.record_function(PACK_RANGE):
                return self.pack(t, bits, None, True)
        # Small tensors (normalization's statistics) are kept as they are whatever the bits:
        # decided first, before the model's storages or the dedup cache are looked at.
        if t.numel() < self.min_numel and self.sample is None and encodable(t):
            return self._told(t, t, 0)
        key, found = self._found(t, bits)
        if found is not None:
            return self._told(t, *found)
        if bits < OFF_BITS and t.is_floating_point() and self._computed is not None:
            model = (self._storages, self._running)
            if computed_weight(t, model, self._computed):  # kept as the parameters it is made of
                bits = OFF_BITS
        return self._told(t, *self._keep(t, self._compress(t, bits), bits, key))

    def _told(self, t: torch.Tensor, saved: object, added: int) -> object:
        """What autograd keeps for ``t``, ``saved`` (``added`` bytes), once the observer knows."""
        if self.observer is not None:
            self.observer.packed(t, saved, added)
        return _Kept(t) if saved is t else saved

    def _pack_plain(self, t: torch.Tensor, bits: int) -> tuple[object, int]:
        """What :meth:`pack` keeps for ``t`` (a DTensor's local shard) and the bytes it added,
        the same steps as :meth:`pack`'s own (which calls them inline: a frame fewer on the
        path every saved tensor takes)."""
        key, found = self._found(t, bits)
        if found is not None:
            return found
        if bits < OFF_BITS and t.is_floating_point() and self._computed is not None:
            if computed_weight(t, (self._storages, self._running), self._computed):
                bits = OFF_BITS
        return self._keep(t, self._compress(t, bits), bits, key)

    def _found(self, t: torch.Tensor, bits: int) -> tuple[tuple | None, tuple[object, int] | None]:
        """``t``'s dedup key, and what is kept for it without compressing it here, if anything:
        ``t`` itself (the policy keeps it as it is), a DTensor's packed local shard
        (:meth:`_pack_distributed`), the copy made of it earlier in this forward, or a recipe
        over its compressed input (:meth:`_derived`)."""
        if not encodable(t):  # a DTensor is not: its wrapper's data_ptr() is not its data's
            if is_sharded(t):
                return None, self._pack_distributed(t, bits)
            self._keep_unencodable(t)
            return None, (t, 0)
        model = () if self._storages is None else (self._storages, self._running)
        if kept_as_is(t, min_numel_at(t.shape, self.min_numel, self.sample), model):
            return None, (t, 0)
        key = _alias_key(t)
        hit = self._cache.get(key) if key is not None else None
        # The cached tensor being alive proves its storage is, so the address is not a reused one.
        if hit is not None and hit[0]() is not None:
            if hit[1] is _no_copy:  # kept as it is by an earlier saver: so for every saver
                return key, (t, 0)
            saved = hit[1]()
            if saved is not None:  # saved earlier in this forward (maybe as another view): once
                return key, self._share(saved, t, hit[2], bits)
        derived = self._derived(t, bits)
        self._last = None
        if derived is not None:
            if key is not None:
                self._cache[key] = (weakref.ref(_base(t)), weakref.ref(derived), t.stride())
            return key, (derived, 0)
        return key, None

    def _keep(
        self, t: torch.Tensor, saved: object, bits: int, key: tuple | None
    ) -> tuple[object, int]:
        """Note ``saved``, what :meth:`_compress` made of ``t`` (maybe ``t`` itself), for the
        counter, the dedup cache and the version check; it and the bytes it added."""
        if saved is not t:
            saved.watch(t)
            note_packed(t, saved, bits)
        names = self._local.names
        scope = names[-1] if names else None  # whose counts hold the bytes: the innermost's
        nbytes = tensor_nbytes(t) if saved is t else saved.nbytes
        self.counter.saved(t, saved, nbytes, scope, bits)
        if saved is t:
            if key is not None:
                self._cache[key] = (weakref.ref(_base(t)), _no_copy, t.stride())
            return t, 0
        saved.counted, saved.scope = True, scope
        self._last = weakref.ref(saved)
        if key is not None:
            self._cache[key] = (weakref.ref(_base(t)), weakref.ref(saved), t.stride())
        return saved, nbytes

    def _pack_distributed(self, t: torch.Tensor, bits: int) -> tuple[object, int]:
        """What autograd keeps for DTensor ``t`` (tensor parallelism): its local shard, this
        rank's memory, packed as any tensor is (counted, deduplicated, kept where it is a
        parameter's), and rebuilt on unpack with ``t``'s mesh, placements, shape and strides. A
        parameter redistributed for this op is kept, as the parameter it is."""
        if redistributed_parameter(t):
            return t, 0
        local = t._local_tensor
        saved, added = self._pack_plain(local, bits)
        if saved is local:
            return t, 0
        rebuild = functools.partial(_as_dtensor, t.device_mesh, t.placements, t.shape, t.stride())
        wrapped = _Saved(saved, rebuild, t.shape, saved.bits)
        wrapped.shares = True  # the shard's own save decides whether its decode is private
        self._dtensors.append(weakref.ref(wrapped))
        return wrapped.watch(t), added

    def _share(
        self, saved: _Saved, t: torch.Tensor, first: tuple[int, ...], bits: int
    ) -> tuple[object, int]:
        """What a later save of ``t`` at ``bits`` keeps, where ``saved`` is the copy made of it
        earlier in this forward (as a view whose strides were ``first``): that copy, made again
        at ``bits`` first where they are more (:meth:`_keep_at`), or ``t`` itself where it is
        kept as it is; and the bytes this save added."""
        added = self._keep_at(saved, t, first, bits) if bits > saved.bits else 0
        if saved.kept:
            return t, 0
        # by the save just before: a consumer of the same decode (_Saved.value)
        shared = self._last is not None and self._last() is saved
        if shared:
            saved.consumers += 1
        if (saved.shape, first) != (t.shape, t.stride()):
            saved = _Saved(saved, _relaid(t, first, shared), t.shape).watch(t)
            saved.shares = shared
        elif not shared:
            saved = _Saved(saved, _Saved.fresh, t.shape).watch(t)
        return saved, added

    def _keep_at(self, saved: _Saved, t: torch.Tensor, first: tuple[int, ...], bits: int) -> int:
        """Make the shared copy ``saved`` of ``t`` again at ``bits``, more than it keeps: encoded
        from the original (alive: the cache hit proved it), or, at ``OFF_BITS``, the original
        itself, with no copy beside it. In place, so that every saver, the earlier ones too,
        decodes it. Its bytes move to the counts of the scope that asked; returns those added."""
        view = t.detach()
        if (saved.shape, first) != (t.shape, t.stride()):  # as its first saver saw it
            view = view.as_strided(saved.shape, first, t.storage_offset())
        made = self._compress(view, bits)
        before = saved.nbytes if saved.counted else 0  # a recipe (_derived) added no bytes
        original = tensor_nbytes(view)
        if made is view:
            saved.take(_Saved(view, _original, view.shape))
            saved.kept = True
            stored, held = original, 0
        else:
            saved.take(made)
            note_packed(view, saved, bits)
            stored = held = saved.nbytes
        names = self._local.names
        scope = names[-1] if names else None
        moved = (saved.scope, before) if saved.counted else None
        self.counter.resaved(saved, view, moved, stored, held, scope)
        saved.counted, saved.scope = True, scope
        return stored - before

    def _derived(self, t: torch.Tensor, bits: int) -> _Saved | None:
        """For an output a lean op can make again from its input (:mod:`..derived`), whose input
        was compressed: a recipe over that copy, adding no bytes. As precise as that copy, and
        never the original (a saver at ``OFF_BITS`` keeps that: :meth:`_keep_at`)."""
        found = derivation(t, bits)
        if found is None:
            return None
        packed, remake = found
        shape = t.shape
        precision = min(packed.bits, HALF_BITS)
        return _Saved(packed, lambda p: remake(p.fresh()).view(shape), shape, precision).watch(t)

    def _keep_unencodable(self, t: torch.Tensor) -> None:
        """Count a saved tensor the codec cannot take (policy.encodable); say so once per kind."""
        kind = type(t).__name__ if t.layout is torch.strided else str(t.layout)
        if t.is_meta:
            kind = "meta"
        if self.counter.unencodable(kind):
            log.info(
                "memopt: saved tensors of kind %s are kept as they are (the codec takes plain "
                "dense tensors); memopt/unencodable counts them",
                kind,
            )

    def _compress(self, t: torch.Tensor, bits: int) -> object:
        if not t.is_floating_point():
            if t.dtype == torch.bool or t.is_complex():
                return t
            narrowed = narrow_int(t)
            return t if narrowed is t else _Saved(narrowed, widen_int, t.shape)
        if mask_candidate(t):
            # Such as dropout's mask on the CPU (0 and 1 / (1 - p), which rounding would blur):
            # where it holds one value beside +0.0 it is kept exactly, a bit an element, at
            # every width (as integers are narrowed).
            mask = encode_mask(t.detach())
            if mask is not None:
                return _Saved(mask, _mask_decoder(t), mask.shape)
        if bits >= OFF_BITS:
            return t
        # Detached, so that nothing below records autograd history.
        if bits == HALF_BITS:
            if t.element_size() <= 2:
                return t
            return _Saved(t.detach().to(torch.bfloat16), _from_half(t), t.shape, HALF_BITS)
        # Groups follow ``t``'s index order (row-major over its shape), never its memory order:
        # a tensor is grouped by its shape, whatever layout its saver gave it, so a transposed
        # view's groups span its leading dim (CLIP's embeddings, saved transposed by the
        # similarity matmul, are grouped along the samples; tests/test_compress.py, "index order").
        generator = self.noise(t.device) if self.stochastic and self.noise else None
        packed = quantize(
            t.detach(), bits, group_size=self.group_size, stochastic=self.stochastic,
            generator=generator,
        )  # fmt: skip
        return _Saved(packed, _decoder(t), packed.shape, bits)

    def _pack_traced(
        self, t: torch.Tensor, node: torch.fx.Node, graph: torch.fx.Graph, default: str
    ) -> object:
        """What a compiled graph saves for ``t`` (its node ``node`` in ``graph``, traced inside
        scope ``default``), noted for the graph's counts as eager counts."""
        saved, kept = self._encode_traced(t, node, graph, default)
        original, stored = nbytes(t), nbytes(saved)
        if kept != "small" and None not in (original, stored):  # as eager counts
            self._compiled.traced(node.name, original, stored, kept)
        return saved

    def _encode_traced(
        self, t: torch.Tensor, node: torch.fx.Node, graph: torch.fx.Graph, default: str
    ) -> tuple[object, str | None]:
        """``t`` coded in traceable ops at the bits of the scope that produced it, or ``t``
        itself and why (a :data:`~memopt_plugins.policy.KEPT` kind; ``None`` for the configured
        bits)."""
        kept = kept_in_graph(t, node, graph, self.min_numel)
        if kept is not None:
            return t, kept
        fqn = self._compiled.scope_of(node, default)
        bits = self.bits.scopes.get(fqn, OFF_BITS)
        if bits >= OFF_BITS:
            return t, None
        self._compiled.note_bits(fqn, bits)
        if bits == HALF_BITS and t.dtype != torch.bool:
            return (t if t.element_size() <= 2 else (HALVED, t.to(torch.bfloat16), t.dtype)), None
        if t.is_contiguous():
            # Its memory as one flat run, so that every group is a contiguous range of one index
            # (no divisions or remainders over ``t``'s dims for inductor to simplify).
            flat, stride = t.as_strided((t.numel(),), (1,), t.storage_offset()), None
        else:
            # A transposed or permuted tensor, or a slice with gaps (attention's query, key and
            # value, each a third of one projection's output, saved by SDPA): grouped in its
            # index order, as in eager (:meth:`_compress`), and decoded to its own strides where
            # it is dense, else to dense strides in its dim order (:func:`_decoded_strides`).
            # The graph saves codes of the slice's own elements only, never a view of its base.
            flat, stride = t.reshape(-1), _decoded_strides(t)
        if t.dtype == torch.bool:  # lossless at any bits: a byte an element became a bit
            return (BITS, pack_bools(flat), t.numel(), tuple(t.shape), stride), None
        codes, scale, zero_point = encode(flat, bits, self.group_size, seed_source=self._seeds)
        coded = Coded(
            codes, scale, zero_point, bits, self.group_size, t.numel(), t.dtype,
            tuple(t.shape), stride,
        )  # fmt: skip
        return coded.saved(), None

    @staticmethod
    def unpack(saved: object) -> torch.Tensor:
        """The tensor ``saved`` stands for: decoded from what :meth:`pack` or a compiled graph
        kept, or ``saved`` itself (kept as it was)."""
        if isinstance(saved, _Kept):
            _check_version(saved.tensor, saved.version)
            return saved.tensor
        if isinstance(saved, _Saved):
            saved.check()
            if not torch.autograd._profiler_enabled():
                return saved.value()  # the lean ops may write gradients into a private one
            with torch.profiler.record_function(UNPACK_RANGE):
                return saved.value()
        tag = saved[0] if isinstance(saved, tuple) else None
        if tag == CODED:
            coded = Coded(*saved[1:])
            return _strided(decode(coded), coded.stride)
        if tag == BITS:
            packed, numel, shape, stride = saved[1:]
            return _strided(unpack_bools(packed, numel).view(shape), stride)
        if tag == HALVED:
            return saved[1].to(saved[2])
        return saved


def _base(t: torch.Tensor) -> torch.Tensor:
    """What proves ``t``'s address is not a reused one while alive: a view made just to be saved
    (a Linear's input flattened to 2-D) dies at once; its base lives as long as the storage."""
    return t._base if t._base is not None else t


def _release_process_state(seeds: int | None) -> None:
    """What installed hooks hold of the process: AOTAutograd's filter setting, the seed source."""
    SavedFilter.close()
    if seeds is not None:
        remove_seed_source(seeds)


#: The pack hooks of the compression scopes (:meth:`CompressionHooks.pair`).
_SCOPE_PACKS: weakref.WeakSet[torch.fx.GraphModule] = weakref.WeakSet()


def compact_copy(t: torch.Tensor) -> tuple[object, Callable[[object], torch.Tensor]] | None:
    """``(saved, unpack)``: what the active compression scope keeps for ``t`` instead of ``t``
    (a compact copy) and how to restore it, for an autograd function that holds ``t`` itself
    rather than in its saved tensors (:mod:`memopt_plugins.lean.conv`). ``None`` when the
    active saved-tensor hooks are not a compression scope's (other hooks, such as
    checkpointing's, count on their own order of saves, so they are never called here), when
    the scope keeps ``t`` as it is, and while compiling (the compiler decides what is saved)."""
    if torch.compiler.is_compiling():
        return None
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None or hooks[0] not in _SCOPE_PACKS:
        return None
    saved = hooks[0](t)  # kept as it is, a second call (save_for_backward) finds it cached
    if not isinstance(saved, _Saved):
        return None
    # Unwatched: the caller holds ``t`` outside autograd's saved variables and checks its
    # version itself (the lean ReLU's ``mark_dirty`` bumps it after this call). It holds the
    # cached copy, so that the next layer's save of ``t`` finds it rather than packing again.
    unwatched = _Saved(saved, _decode_unwatched, saved.shape)
    unwatched.shares = True
    return unwatched, hooks[1]


def _as_dtensor(mesh, placements, shape, stride, shard: _Saved) -> torch.Tensor:
    """The DTensor a packed local ``shard`` stands for (:meth:`CompressionHooks._pack_distributed`):
    the shard's decode, its version checked, placed as it was, without a collective."""
    from torch.distributed.tensor import DTensor

    shard.check()
    local = shard.value()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _decode_unwatched(saved: _Saved) -> torch.Tensor:
    return saved.value()
