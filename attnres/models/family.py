"""The adapter between a transformers decoder family and the AttnRes residual wiring (docs/design.md section 6).

An AttnRes model is the family's own model with each decoder layer's residual rewired. What a layer's two sublayers
are is read from the family's own decoder layer, never from a list of names: `plan_layer` runs the family layer's
`forward` once, with forward hooks on its children that replace each child's output by a random tensor, and follows
the data: each sublayer is a chain of children (its PreNorm, its body, any post-sublayer norms or dropouts) whose last
output is added, times a constant (Granite's residual multiplier), to the residual. Anything else (no PreNorm,
parallel attention and MLP, more than two sublayers) is refused with a ValueError naming the family and the reason.
The reading is then checked numerically: the plan, wired as the standard residual, must reproduce the family layer.
Both run once, in float64 on a copy of each layer (`plan_decoder_layers`), when a model is converted or first built
from a config; the plan is then kept in the config (`attn_res_layer_plan`), so a saved model loads without a probe.

The transformers interfaces this relies on (pinned `transformers>=5,<6`; `tests/models/test_families.py` fails with
a clear message when one changes):
- `MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]` is the family's `*ForCausalLM`, with `.model` (the base model: its
  `embed_tokens`, `layers`, `norm`, rotary embedding) and `.lm_head`; its `forward` passes `**kwargs` through the
  base model to every decoder layer, and the base model calls `layer(hidden_states, **kwargs)` and feeds the last
  layer's output to its final norm;
- a decoder layer is built as `cls(config, layer_idx)`, returns its output hidden states (a tensor), and calls its
  children as modules (so forward hooks see them);
- an attention module returns a tuple whose first element is its output; other children return a tensor or a tuple.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

# the length of a probe forward: several tokens (a tensor unpacked as a tuple fails loudly), few enough for any model
PROBE_TOKENS = 3
# an extra keyword argument of the probe forward: whichever child receives it gets the layer's **kwargs
_EXTRA = "attn_res_probe_extra"
# plans are read and checked in float64: its round-off of a layer's sums, relative to the largest magnitude they add
FLOAT64_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Sublayer:
    """One sublayer of a decoder layer, as the family computes it: `v = scale * post(body(norm(h)))`.

    norm: the PreNorm child's name; fused_eps: its eps when it is the plain `weight * x * rsqrt(mean(x^2) + eps)`
    (then the depth aggregation fuses it), else None (it is applied to the mixture as the family's own module);
    body: the attention or MLP/MoE child; body_args: names of the layer's keyword arguments the body receives;
    body_extra: the body also takes the layer's other keyword arguments (its `**kwargs`); body_kwarg_input: the body
    takes its input as `hidden_states=` (else positionally); tuple_output: the body returns a tuple whose first element
    is the output; post: children applied to the body's output, in order, each (name, returns a tuple); scale: the
    constant the family multiplies the output by before adding it (Granite's residual multiplier).

    A plan depends on the family's code and config only, so it is read once (`plan_decoder_layers`) and kept in the
    model's config as `attn_res_layer_plan` (`to_config` / `from_config`).
    """

    norm: str
    fused_eps: float | None
    body: str
    body_args: tuple[str, ...]
    body_extra: bool
    body_kwarg_input: bool
    tuple_output: bool
    post: tuple[tuple[str, bool], ...]
    scale: float

    def held_arguments(self, layer_args) -> frozenset[str]:
        """The family layer forward's own argument names (`layer_args`) that it does not hand its body: what a
        `body_extra` body is not given of the layer's keyword arguments (`run_sublayer`)."""
        return frozenset(layer_args).difference(self.body_args)

    def to_config(self) -> dict:
        """The JSON form kept in `AttnResConfig.attn_res_layer_plan`."""
        out = asdict(self)
        out["body_args"], out["post"] = list(self.body_args), [list(p) for p in self.post]
        return out

    @classmethod
    def from_config(cls, entry: dict) -> Sublayer:
        names = {f.name for f in fields(cls)}
        if not isinstance(entry, dict) or set(entry) != names:
            raise ValueError(
                f"attn_res_layer_plan: expected each side as a dict with keys {sorted(names)}, got {entry!r}"
            )
        return cls(**{**entry, "body_args": tuple(entry["body_args"]), "post": tuple(tuple(p) for p in entry["post"])})


@dataclass
class _Call:
    name: str
    input: torch.Tensor
    output: torch.Tensor  # the random stand-in handed on
    tuple_output: bool
    kwarg_input: bool
    kwargs: dict


def _main(output):
    return output[0] if isinstance(output, tuple) else output


def _is_norm_like(module: nn.Module) -> bool:
    """A child with no matrix among its parameters (a norm, a dropout, an activation), not a sublayer body."""
    return all(p.dim() <= 1 for p in module.parameters())


def plain_rms_eps(norm: nn.Module, dim: int) -> float | None:
    """The eps of `norm` if it computes exactly `weight * x * rsqrt(mean(x^2) + eps)` (fusable), else None.

    Tried on a copy with a random weight, so a family norm whose gain is `1 + weight` (Gemma) or that centres (LayerNorm)
    never passes for plain."""
    params = dict(norm.named_parameters())
    if set(params) != {"weight"} or tuple(params["weight"].shape) != (dim,) or list(norm.buffers()):
        return None
    probe = copy.deepcopy(norm).float()
    gen = torch.Generator(device=probe.weight.device).manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.rand(dim, generator=gen, device=probe.weight.device) + 0.5)
        x = torch.randn(4, dim, generator=gen, device=probe.weight.device)
        got = probe(x)
        for eps in (v for v in vars(norm).values() if isinstance(v, float) and v > 0):
            want = probe.weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))
            if torch.allclose(got, want, rtol=1e-6, atol=1e-6):
                return eps
    return None


class FamilyRefused(ValueError):
    """A decoder family whose layer is not a PreNorm residual of two sublayers."""


def _refuse(family: str, reason: str) -> FamilyRefused:
    return FamilyRefused(
        f"base model: the {family!r} decoder layer {reason}; AttnRes needs a PreNorm layer whose two sublayers "
        f"(attention, then MLP) each read a norm of the residual and add their output to it"
    )


def _scale(after: torch.Tensor, residual: torch.Tensor, output: torch.Tensor, layer: nn.Module) -> float | None:
    """The constant c with after == residual + c * output (up to rounding), or None. Where the layer holds that
    constant as an attribute (Granite's `residual_multiplier`), its exact value; 1.0 for a plain residual add. The
    difference `after - residual` carries the float64 rounding of the residual's magnitude, so the bound does too."""
    tol = FLOAT64_TOLERANCE
    a, o = (after.double() - residual.double()).flatten(), output.double().flatten()
    c = float((a @ o) / (o @ o))
    rounding = 8 * torch.finfo(torch.float64).eps * float(residual.double().abs().max())
    if not torch.allclose(a, c * o, rtol=tol, atol=tol * float(o.abs().max()) + rounding):
        return None
    for exact in (1.0, *(v for v in vars(layer).values() if isinstance(v, float))):
        if abs(c - exact) <= tol * abs(exact):
            return exact
    return c


def plan_layer(
    layer: nn.Module, layer_cls: type, family: str, dim: int, hidden: torch.Tensor, kwargs: dict
) -> tuple[Sublayer, Sublayer]:
    """Read the two sublayers of `layer` (holding the children of a `layer_cls` family decoder layer) by running
    `layer_cls.forward` on `hidden` `[batch, seq, d]` with the layer arguments `kwargs` (what the family's base model
    passes), each child's output replaced by a random tensor."""
    calls: list[_Call] = []
    gen = torch.Generator(device=hidden.device).manual_seed(0)

    def post(module, args, kw, output):
        name = next(n for n, m in layer.named_children() if m is module)
        tensor = args[0] if args else kw.get("hidden_states")
        main = _main(output)
        if not isinstance(tensor, torch.Tensor) or not isinstance(main, torch.Tensor):
            raise _refuse(family, f"calls its child {name!r} with no hidden-state tensor")
        stand_in = torch.randn(main.shape, generator=gen, device=main.device).to(main.dtype)
        calls.append(_Call(name, tensor, stand_in, isinstance(output, tuple), not args, dict(kw)))
        return (stand_in, *output[1:]) if isinstance(output, tuple) else stand_in

    handles = [child.register_forward_hook(post, with_kwargs=True) for child in layer.children()]
    try:
        with torch.no_grad():
            out = layer_cls.forward(layer, hidden, **kwargs, **{_EXTRA: True})
    finally:
        for h in handles:
            h.remove()
    if not isinstance(out, torch.Tensor):
        raise _refuse(family, f"returns {type(out).__name__}, not the hidden-state tensor")

    residual, sides, i = hidden, [], 0
    while i < len(calls):
        chain = [calls[i]]
        if chain[0].input is not residual:
            if sides and chain[0].input is hidden:
                raise _refuse(family, "feeds its attention and its MLP the same input (a parallel residual)")
            raise _refuse(family, f"feeds {chain[0].name!r} something other than the residual stream")
        while i + 1 < len(calls) and calls[i + 1].input is chain[-1].output:
            i += 1
            chain.append(calls[i])
        i += 1
        nxt = calls[i].input if i < len(calls) else out
        if any(c.input is hidden for c in calls[i:]) or any(c.input is chain[0].output for c in calls[i:]):
            raise _refuse(family, "feeds its attention and its MLP the same input (a parallel residual)")
        scale = _scale(nxt, residual, chain[-1].output, layer)
        if scale is None:
            raise _refuse(family, f"does not add the output of {chain[-1].name!r} to the residual")
        sides.append(_sublayer(layer, layer_cls, family, dim, chain, scale, kwargs))
        residual = nxt
    if len(sides) != 2:
        raise _refuse(family, f"has {len(sides)} residual branches, not two")
    return sides[0], sides[1]


def _sublayer(layer, layer_cls, family, dim, chain: list[_Call], scale: float, layer_kwargs: dict) -> Sublayer:
    first = getattr(layer, chain[0].name)
    if len(chain) < 2 or not _is_norm_like(first):
        raise _refuse(family, f"applies no norm before {chain[0].name!r} (not PreNorm)")
    bodies = [c for c in chain[1:] if not _is_norm_like(getattr(layer, c.name))]
    if len(bodies) != 1:
        raise _refuse(family, f"has {len(bodies)} sublayers where one is expected in {[c.name for c in chain]}")
    body = bodies[0]
    if chain[1] is not body:
        raise _refuse(family, f"applies {[c.name for c in chain[:chain.index(body)]]} before {body.name!r}")
    params = layer_parameters(layer_cls)
    defaults = {n: p.default for n, p in params.items() if p.default is not p.empty}
    for name, value in body.kwargs.items():
        if name == "hidden_states" or name == _EXTRA or name not in params and name in layer_kwargs:
            continue
        given = layer_kwargs.get(name, defaults.get(name, inspect.Parameter.empty))
        if value is not given and not (value is None and given is inspect.Parameter.empty):
            raise _refuse(family, f"passes {body.name!r} a computed argument {name!r}")
    return Sublayer(
        norm=chain[0].name,
        fused_eps=plain_rms_eps(first, dim),
        body=body.name,
        body_args=tuple(n for n in body.kwargs if n in params and n != "hidden_states"),
        body_extra=_EXTRA in body.kwargs,
        body_kwarg_input=body.kwarg_input,
        tuple_output=body.tuple_output,
        post=tuple((c.name, c.tuple_output) for c in chain[chain.index(body) + 1 :]),
        scale=scale,
    )


def layer_parameters(layer_cls: type) -> dict[str, inspect.Parameter]:
    """The named parameters of the family decoder layer's forward (not its `**kwargs`)."""
    params = inspect.signature(layer_cls.forward).parameters
    return {n: p for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}


def run_sublayer(layer: nn.Module, side: Sublayer, x: torch.Tensor, kwargs: dict, held: frozenset) -> torch.Tensor:
    """The sublayer's output v (what the family adds to its residual) for the normed input `x`; `held`:
    `side.held_arguments(...)` of the family layer's arguments (a `body_extra` body takes every other keyword argument;
    computed once per layer, as this runs twice per layer and token)."""
    body = layer._modules[side.body]
    if side.body_extra:
        args = kwargs if held.isdisjoint(kwargs) else {name: v for name, v in kwargs.items() if name not in held}
    else:
        args = {name: kwargs[name] for name in side.body_args if name in kwargs}
    out = body(hidden_states=x, **args) if side.body_kwarg_input else body(x, **args)
    out = out[0] if side.tuple_output else out
    for name, is_tuple in side.post:
        out = layer._modules[name](out)
        out = out[0] if is_tuple else out
    return out * side.scale if side.scale != 1.0 else out


def probe_input(model: nn.Module) -> torch.Tensor:
    """Token ids `[1, PROBE_TOKENS]` for a probe forward of `model`, on its embedding's device."""
    embed = model.get_input_embeddings()
    return (torch.arange(PROBE_TOKENS, device=embed.weight.device) % embed.weight.shape[0])[None]


class _Captured(Exception):
    pass


def first_layer_input(lm: nn.Module, family: str) -> tuple[torch.Tensor, dict]:
    """(hidden states, keyword arguments) that the family's own base model hands its first decoder layer for a short
    probe input: its embedding (scaled as the family scales it), masks and rotary embeddings. No layer runs."""
    base = lm.base_model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"base model: the {family!r} model keeps no decoder `layers` list")
    seen = {}

    def capture(module, args, kwargs):
        seen["hidden"], seen["kwargs"] = (args[0], kwargs) if args else (kwargs.pop("hidden_states"), kwargs)
        raise _Captured

    handle = layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            base(input_ids=probe_input(lm), use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    return seen["hidden"], seen["kwargs"]


def _to_float64(value):
    if isinstance(value, torch.Tensor):
        return value.detach().double() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to_float64(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_float64(v) for k, v in value.items()}
    return value


def plan_and_check_layer(
    layer: nn.Module, layer_cls: type, family: str, hidden: torch.Tensor, kwargs: dict, index: int = 0
) -> tuple[Sublayer, Sublayer]:
    """The plan of one decoder layer (`layer` holds the children of a `layer_cls` family layer), read and then checked
    against the family layer's own forward, both on a float64 copy of the layer. In float64 the residual's rounding
    (real checkpoints carry residual channels in the thousands, in bf16) cannot hide a sublayer's output, so the check
    holds whatever the weights' magnitudes and dtype; its tolerance follows the residual and output magnitudes."""
    with torch.no_grad():
        copy64 = copy.deepcopy(layer).double().eval()  # dropout would draw two masks for the two forwards compared
        _kernels_for_float64(copy64)
        h, kw = _to_float64(hidden), _to_float64(kwargs)
        sides = plan_layer(copy64, layer_cls, family, h.shape[-1], h, kw)
        want = layer_cls.forward(copy64, h, **kw)
        got, args = h, layer_parameters(layer_cls)
        scale = max(float(h.abs().max()), float(want.abs().max()))  # the largest magnitude the sums round at
        for side in sides:
            output = run_sublayer(copy64, side, getattr(copy64, side.norm)(got), kw, side.held_arguments(args))
            got = got + output
            scale = max(scale, float(output.abs().max()), float(got.abs().max()))
    if not torch.allclose(got, want, rtol=FLOAT64_TOLERANCE, atol=FLOAT64_TOLERANCE * scale):
        raise _refuse(
            family,
            f"{index} does more than its two sublayers and their residual adds (the plan "
            f"{[s.body for s in sides]} differs from its output by {float((got - want).abs().max()):.3g} in float64)",
        )
    return sides


def _kernels_for_float64(layer: nn.Module) -> None:
    """Kernels such as flash attention or grouped-mm experts take no float64: the copy runs the same functions through
    sdpa and the eager experts loop."""
    for module in layer.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) not in (None, "eager", "sdpa"):
            config._attn_implementation = "sdpa"
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"


def plan_decoder_layers(lm: nn.Module, family: str, layer_class=type) -> tuple[Sublayer, Sublayer]:
    """The one plan of every decoder layer of the family causal LM `lm` (`layer_class(layer)`: the family's decoder
    layer class of each layer), read and checked per layer on the input the family's base model gives its first
    layer. Refuses, with the reason, a family AttnRes cannot rewire exactly, and one whose layers differ."""
    hidden, kwargs = first_layer_input(lm, family)
    plans = [
        plan_and_check_layer(layer, layer_class(layer), family, hidden, kwargs, i)
        for i, layer in enumerate(lm.base_model.layers)
    ]
    odd = next((i for i, p in enumerate(plans) if p != plans[0]), None)
    if odd is not None:
        raise _refuse(family, f"{odd} differs from layer 0 in its sublayers ({plans[odd]} against {plans[0]})")
    return plans[0]
