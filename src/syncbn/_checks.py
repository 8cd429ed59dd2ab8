"""Cross-rank consistency checks (first-use handshake, debug mode) and layer names: internals/layers.md.

Names come from the weak ``(parent, attribute)`` links a module registration hook records per child."""

from __future__ import annotations

import functools
import itertools
import operator
import threading
import weakref
import zlib
from typing import Any

import torch
from torch import Tensor, nn

from . import _config, _row
from ._row import FIELDS, SETTINGS
from .groups import CollectiveError, ProcessGroupSum

_counter = itertools.count()
_known_names: dict[float, str] = {}  # identity hash -> name, from name_layers (names other ranks')
_token_counter = itertools.count(1)
_tokens: weakref.WeakValueDictionary[int, LayerState] = weakref.WeakValueDictionary()
_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)
_MAX_LINKS = 8  # parents remembered per child (a module may be placed in several containers)
_links: weakref.WeakKeyDictionary[nn.Module, list[tuple[weakref.ref[nn.Module], str]]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


class LayerState:
    """Per-layer bookkeeping: name, construction index, call count, verified groups, compile token.

    Pickles and deep copies keep name and index only: they handshake again, with a token of their own."""

    def __init__(self) -> None:
        _install_hooks()
        self.index = next(_counter)
        self.name: str | None = None
        self._fresh()

    def _fresh(self) -> None:
        """Reset what a copy does not keep, and take a new token."""
        self.calls = 0
        self.name_id: tuple[str, int] | None = None
        self.found_name: str | None = None  # found on an error path (layer_name); never an identity
        # id -> process group, weakly: a destroyed group leaves nothing behind
        self.verified: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        # The last group verified, and the last (group, frame identity): one weak reference to read per call
        self.last_verified: weakref.ref[Any] | None = None
        self.last_identity: tuple[weakref.ref[Any], int] | None = None
        # The compile token, a plain attribute: model.to(device) leaves it on the host (layers.md#layer-state)
        value = next(_token_counter)
        self.token = torch.tensor(value, dtype=torch.int64)
        self.owner: weakref.ref[nn.Module] | None = None
        _tokens[value] = self

    def bind(self, layer: nn.Module) -> None:
        """Make ``layer`` the module :func:`layer_for_token` finds for this state's token."""
        self.owner = weakref.ref(layer)

    @property
    def identity(self) -> str:
        return self.name if self.name is not None else f"#{self.index}"

    def __getstate__(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.index = state.get("index", -1)
        self.name = state.get("name")
        self._fresh()


def state_of(layer: nn.Module) -> LayerState:
    """The layer's :class:`LayerState`, created on first use for layers built without one."""
    state = layer.__dict__.get("_syncbn_state")
    if state is None:
        state = LayerState()
        state.index = -1
        layer.__dict__["_syncbn_state"] = state
    state.bind(layer)
    return state


def layer_for_token(token: int) -> nn.Module | None:
    """The live layer whose :attr:`LayerState.token` holds ``token``, or ``None`` (an anonymous call)."""
    state = _tokens.get(token)
    owner = None if state is None or state.owner is None else state.owner()
    if owner is not None and owner.__dict__.get("_syncbn_state") is not state:
        return None  # the state has moved on to another module
    return owner


def bind_state(module: nn.Module | None) -> None:
    """Bind a syncbn layer's state to ``module`` (a layer copied, unpickled or placed into a parent)."""
    if module is not None and isinstance(module.__dict__.get("_syncbn_state"), LayerState):
        module.__dict__["_syncbn_state"].bind(module)


def _registered(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """The module registration hook: remember that ``parent.<name>`` is ``child``, name a model's unnamed
    layers when it is placed into a DDP or DataParallel wrapper, and bind a syncbn layer's state."""
    # ``parent.__dict__``, not getattr: torch.compile's OptimizedModule runs this hook before its own
    # attributes exist (its __getattr__ would recurse). Its ``_orig_mod`` link is not a place in the model.
    if child is not None and name != "_orig_mod" and not parent.__dict__.get("_is_replica", False):
        with _lock:
            links = _links.setdefault(child, [])
            links[:] = [(r, k) for r, k in links if r() is not None and (r() is not parent or k != name)]
            links.append((weakref.ref(parent), name))
            del links[:-_MAX_LINKS]
        if name == "module" and isinstance(parent, _WRAPPERS):
            _assign_names(child, "", overwrite=False)
    bind_state(child)


@functools.cache  # once per process
def _install_hooks() -> None:
    nn.modules.module.register_module_module_registration_hook(_registered)


def _holder(child: nn.Module) -> tuple[nn.Module, str] | None:
    """The first-recorded parent that still holds ``child``, and the attribute it holds it under."""
    with _lock:
        links = list(_links.get(child, ()))
    for ref, key in links:
        parent = ref()
        if parent is not None and parent._modules.get(key) is child:
            return parent, key
    return None


def qualified_name(module: nn.Module) -> str | None:
    """``module``'s path (``'layer2.0.bn1'``) in its outermost recorded model (no wrapper), or ``None``."""
    parts: list[str] = []
    current = module
    seen = {id(module)}
    while (found := _holder(current)) is not None:
        parent, key = found
        if (key == "module" and isinstance(parent, _WRAPPERS)) or id(parent) in seen:  # seen: a cycle
            break
        seen.add(id(parent))
        parts.append(key)
        current = parent
    return ".".join(reversed(parts)) if parts else None


def name_layers(model: nn.Module, prefix: str = "") -> int:
    """Record each SyncBatchNorm layer's qualified name in ``model`` for error messages.

    syncbn finds names by itself on an error, and names a model's layers when it is converted or
    wrapped in ``DistributedDataParallel``/``DataParallel``; calling this once after building the
    model makes the names certain and gives debug mode a per-layer identity equal on every rank.
    Wrappers are looked through, so names read as in the bare model.

    Args:
        model: the model, or a wrapper around it.
        prefix: prepended to every name, e.g. ``"student"``.

    Returns:
        The number of SyncBatchNorm layers named.

    Example::

        >>> import torch, syncbn
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), syncbn.SyncBatchNorm2d(8))
        >>> syncbn.name_layers(model)
        1
        >>> syncbn.name_layers(model, prefix="backbone")
        1
    """
    return _assign_names(model, prefix, overwrite=True)


def _assign_names(model: nn.Module, prefix: str, overwrite: bool) -> int:
    while isinstance(model, _WRAPPERS):
        model = model.module
    count = 0
    for name, module in model.named_modules():
        is_layer = isinstance(module.__dict__.get("_syncbn_state"), LayerState)
        if is_layer and (overwrite or state_of(module).name is None):
            # torch.compile's wrapper holds the model as ``_orig_mod``: not a place in the model.
            parts = (prefix, *(p for p in name.split(".") if p != "_orig_mod"))
            full = ".".join(p for p in parts if p) or type(module).__name__
            state_of(module).name = full
            _known_names[_row._identity_hash(full)] = repr(full)
            count += 1
    return count


def layer_name(layer: nn.Module | None) -> str:
    """The layer as error messages name it: ``'layer2.0.bn1' (SyncBatchNorm2d(64))``."""
    if layer is None:
        return "(functional call)"
    state = state_of(layer)
    name = state.name
    if name is None:
        # Not ``state.name``: a name found on one rank's error path must not change its frame identity.
        if state.found_name is None:
            state.found_name = qualified_name(layer)
        name = state.found_name
    shape = f"{type(layer).__name__}({getattr(layer, 'num_features', '?')})"
    if name is None:
        return f"#{state.index} {shape} (call syncbn.name_layers(model) for names)"
    return f"'{name}' {shape}"


def layer_identity(layer: nn.Module | None, group: ProcessGroupSum) -> int:
    """The 32-bit identity a layer's frames carry over ``group``: a hash of a named layer's name,
    ``0x80000000 | ordinal`` of an unnamed one's first framed call over ``group``, ``0`` for ``None``."""
    if layer is None:
        return 0
    state = layer.__dict__.get("_syncbn_state") or state_of(layer)
    name = state.name
    if name is not None:
        cached = state.name_id
        if cached is None or cached[0] != name:
            ident = (zlib.crc32(name.encode()) & 0x7FFFFFFF) or 1
            state.name_id = cached = (name, ident)
            group.names[ident] = f"{name!r}"
        return cached[1]
    last = state.last_identity
    if last is not None and last[0]() is group:
        return last[1]
    known = group.layer_ids.get(state)
    if known is None:
        # A counter, not len(layer_ids): layers collected at different times on the ranks must not renumber.
        group.layer_ordinals += 1
        known = group.layer_ids[state] = 0x80000000 | group.layer_ordinals
        group.names[known] = (
            f"#{state.index} {type(layer).__name__}({getattr(layer, 'num_features', '?')}), "
            f"the layer first used as number {group.layer_ordinals} on this group"
        )
    state.last_identity = (weakref.ref(group), known)
    return known


def _stats_error(layer: nn.Module | None, where: str) -> ValueError:
    return ValueError(
        f"syncbn: layer {layer_name(layer)}: invalid running statistics ({where}); this layer's "
        "training output reads them (Batch Renormalization's r and d), so every output of the "
        "affected channels would be NaN or wrong. Load valid statistics (a good checkpoint) or call "
        "layer.reset_running_stats() (detected by SYNCBN_DEBUG, before anything was updated)"
    )


def check_running_stats(layer: nn.Module, running_mean: Tensor, running_var: Tensor) -> None:
    """Debug mode without a process group: raise ``ValueError`` for NaN/Inf or negative statistics
    (over a group, the consistency check's field ``stats`` makes this test, raised on every rank)."""
    bits = _row._stats_fault(running_mean, running_var)
    if bits:
        raise _stats_error(layer, _row._describe_stats(float(bits)))


def _compare(
    rows: list[list[float]], debug: bool, layer: nn.Module | None, identities: dict[float, str]
) -> None:
    """Raise the same ``ValueError`` on every rank when the rows disagree."""
    everything = ("identity", "call", "phase", "config", "class", "channels", "dtype")
    for name in (everything if debug else ("phase", "channels", "dtype", "class")) + SETTINGS:
        i = FIELDS.index(name)
        equal = _row._same if name in SETTINGS else operator.eq
        if all(equal(row[i], rows[0][i]) for row in rows):
            continue
        if name == "identity":
            index, call = FIELDS.index("index"), FIELDS.index("call")
            listing = "; ".join(
                f"rank {r}: {identities.get(row[i], 'layer #' + _row._whole(row[index]))} "
                f"(call {_row._whole(row[call])})"
                for r, row in enumerate(rows)
            )
            raise ValueError(
                f"syncbn: layer {layer_name(layer)}: the {len(rows)} ranks of the group are not "
                f"calling the same SyncBatchNorm layer (the layer order differs between ranks): {listing}"
            )
        what, show = _row._DISAGREEMENTS[name]
        raise ValueError(
            f"syncbn: layer {layer_name(layer)}: the {len(rows)} ranks of the group disagree on "
            f"{what}: {_row._grouped(rows, i, show)}"
        )
    if debug:
        bad = [r for r, row in enumerate(rows) if row[FIELDS.index("nonfinite")]]
        if bad:
            raise ValueError(
                f"syncbn: layer {layer_name(layer)}: the input of rank(s) {bad} contains NaN or Inf "
                f"({_row._PHASES.get(rows[0][2], '?')}); the statistics of every rank would be "
                "poisoned (detected by SYNCBN_DEBUG)"
            )
        stats = FIELDS.index("stats")
        if any(row[stats] for row in rows):
            where = _row._grouped(rows, stats, _row._describe_stats)
            raise _stats_error(layer, where)


def _check(
    group: ProcessGroupSum, layer: nn.Module | None, x: Tensor, phase: float, call: int, debug: bool
) -> None:
    state = state_of(layer) if layer is not None else None
    identity_text = state.identity if state is not None else "(functional call)"
    identity = _row._identity_hash(identity_text)
    index = float(state.index) if state is not None else -1.0
    nonfinite = float(debug and x.numel() > 0 and not bool(torch.isfinite(x).all()))
    row = [identity, float(call), phase, float(x.shape[1]), _row._dtype_code(x.dtype)]
    row += [_row._config_code(layer, x.dim()), nonfinite, index, _row._class_code(layer)]
    row += [_row._setting_code(layer, name) for name in SETTINGS]
    row.append(_row._stats_code(layer) if debug and phase == 1.0 else 0.0)
    table = torch.zeros(group.size, len(FIELDS), dtype=torch.float64, device=x.device)
    table[group.rank] = torch.tensor(row, dtype=torch.float64, device=x.device)
    try:
        group.all_reduce_sum_bounded(table, host_wait=True)
    except CollectiveError as exc:
        raise exc.for_layer(layer_name(layer), f"{_row._PHASES[phase]} consistency check") from exc.__cause__
    _compare(table.tolist(), debug, layer, {**_known_names, identity: repr(identity_text)})


def before_forward(group: Any, layer: nn.Module | None, x: Tensor) -> int:
    """Run the first-use handshake or the debug check before a forward collective; the call number
    for debug mode (0 outside it). ``ValueError`` on every rank when the ranks disagree,
    ``CollectiveError`` when the check's collective fails."""
    if not isinstance(group, ProcessGroupSum):
        return 0
    if _config.debug_enabled():
        state = state_of(layer) if layer is not None else None
        call = state.calls + 1 if state is not None else 0
        _check(group, layer, x, 1.0, call, True)
        if state is not None:  # counted only once every rank accepted the call
            state.calls = call
        return call
    if layer is None:
        return 0
    known = layer.__dict__.get("_syncbn_state")
    key = group.key
    if known is not None:
        last = known.last_verified
        if last is not None and last() is key:
            return 0
        if known.verified.get(id(key)) is key:
            if key is not None:
                known.last_verified = weakref.ref(key)
            return 0
    _check(group, layer, x, 1.0, 0, False)
    state = state_of(layer)
    state.verified[id(key)] = key
    state.last_verified = weakref.ref(key)
    return 0


def before_backward(group: Any, layer: nn.Module | None, grad_output: Tensor, call: int) -> None:
    """In debug mode, check the ranks agree before a backward collective (see :func:`before_forward`)."""
    if not isinstance(group, ProcessGroupSum) or not _config.debug_enabled():
        return
    _check(group, layer, grad_output, 2.0, call, True)
