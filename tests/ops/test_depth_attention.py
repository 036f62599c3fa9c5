"""The depth-attention operator: docs/design.md section 2 properties, parity with its naive twin, an fp64 oracle and
flash-linear-attention's reference, gradcheck, torch.library opcheck, torch.compile and non-contiguous inputs."""

from __future__ import annotations

import importlib.util
import math
import pathlib
from typing import NamedTuple

import pytest
import torch

from attnres import depth_attention, naive_depth_attention
from attnres.ops import cpu, registry
from attnres.ops.depth_attention import fold_query
from tests import TOL, Tol, assert_all_close, assert_close, error_ratios, leaves

EPS = 1e-6

# fp32 inputs against the fp64 oracle: docs/design.md section 2 asks ~1e-5 relative.
ORACLE_TOL = Tol(rms=1e-5, max=5e-5)


class Case(NamedTuple):
    R: int  # number of sources
    lead: tuple[int, ...]  # token dims before d
    d: int
    scale: float = 1.0  # magnitude of the sources
    gain: bool = True  # key RMSNorm gain g
    out_norm: bool = False  # fused output PreNorm
    stacked: bool = False  # one [R, ..., d] tensor instead of a list
    query_row: bool = False  # query [1, d] (the nn.Linear weight) instead of [d]
    weights_grad: bool = False  # the returned depth weights are part of the loss too

    def __str__(self) -> str:
        flags = [f"x{self.scale:g}" if self.scale != 1 else "", "" if self.gain else "nogain"]
        flags += [name for name in ("out_norm", "stacked", "query_row", "weights_grad") if getattr(self, name)]
        return "-".join([f"R{self.R}", "T" + "x".join(map(str, self.lead)), f"D{self.d}", *filter(None, flags)])


CASES = [
    # single-axis stress
    Case(9, (16,), 64),
    Case(1, (8,), 32),
    Case(6, (1,), 48),
    Case(5, (8,), 1),
    Case(5, (8,), 7),
    Case(3, (2,), 7168),
    Case(4, (2, 3, 5), 24),
    Case(5, (16,), 64, gain=False),
    Case(5, (16,), 64, out_norm=True),
    Case(7, (16,), 64, stacked=True),
    Case(7, (16,), 64, query_row=True),
    Case(5, (16,), 64, weights_grad=True),
    Case(5, (16,), 64, scale=1e4),
    Case(5, (16,), 64, scale=1e-4),
    # multi-axis stress
    Case(9, (2, 5), 33, out_norm=True, stacked=True, weights_grad=True),
    Case(13, (3, 4), 129, scale=1e4, out_norm=True, query_row=True),
    Case(2, (1,), 7, scale=1e-4, out_norm=True, weights_grad=True),
    Case(1, (3,), 2, out_norm=True, stacked=True, query_row=True, weights_grad=True),
]


def make_inputs(case: Case, dtype: torch.dtype) -> dict:
    """Sources of unequal magnitudes (as along a residual stream), a query giving O(1) scores, random gains."""
    R, shape, d = case.R, (*case.lead, case.d), case.d
    sources = [torch.randn(shape) * case.scale * (0.5 + torch.rand(())) for _ in range(R)]
    query = (torch.randn(d) * 2 / math.sqrt(d)).reshape((1, d) if case.query_row else (d,))  # scores ~ N(0, 4)
    return {
        "sources": [x.to(dtype) for x in sources],
        "query": query.to(dtype),
        "key_norm_weight": (0.5 + torch.rand(d)).to(dtype) if case.gain else None,
        "out_norm_weight": (0.5 + torch.rand(d)).to(dtype) if case.out_norm else None,
        # upstream gradients; divided by large magnitudes so fp16 gradients of 1e4-sized sources stay in range
        "grad_out": torch.randn(shape).to(dtype) / max(case.scale, 1.0),
        "grad_weights": torch.randn(R, *case.lead) if case.weights_grad else None,
    }


def run(op, inputs: dict, stacked: bool, dtype: torch.dtype | None = None) -> tuple[list[str], list[torch.Tensor]]:
    """Forward and backward of `op` on fresh leaves (cast to `dtype` if given): names and [out, weights, *grads]."""
    cast = (lambda t: t) if dtype is None else (lambda t: None if t is None else t.to(dtype))
    sources = [cast(x) for x in inputs["sources"]]
    sources = leaves(torch.stack(sources)) if stacked else leaves(*sources)
    param_names = ("query", "key_norm_weight", "out_norm_weight")
    params = dict(zip(param_names, leaves(*(cast(inputs[k]) for k in param_names))))
    out, weights = op(
        sources[0] if stacked else sources,
        params["query"],
        params["key_norm_weight"],
        eps=EPS,
        out_norm_weight=params["out_norm_weight"],
        return_weights=True,
    )
    loss = (out.double() * inputs["grad_out"].double()).sum()
    if inputs["grad_weights"] is not None:
        loss = loss + (weights.double() * inputs["grad_weights"].double()).sum()
    wrt = {f"grad source {j}": x for j, x in enumerate(sources)}
    wrt |= {f"grad {k}": v for k, v in params.items() if v is not None}
    grads = torch.autograd.grad(loss, list(wrt.values()))
    return ["output", "weights", *wrt], [out, weights, *grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_parity_with_naive_twin(case: Case, dtype: torch.dtype):
    inputs = make_inputs(case, dtype)
    names, ref = run(naive_depth_attention, inputs, case.stacked)
    _, out = run(depth_attention, inputs, case.stacked)
    assert_all_close(names, ref, out, TOL[dtype])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp32_against_fp64_oracle(case: Case):
    inputs = make_inputs(case, torch.float32)
    names, oracle = run(naive_depth_attention, inputs, case.stacked, dtype=torch.float64)
    _, out = run(depth_attention, inputs, case.stacked)
    assert_all_close(names, [t.float() for t in oracle], out, ORACLE_TOL)


def _load_fla_naive_attnres():
    """flash-linear-attention's reference, loaded from its file: `import fla` pulls triton and every op (~6 s),
    while the reference itself needs only torch and einops."""
    spec = importlib.util.find_spec("fla")
    if spec is None or spec.origin is None:
        return None
    path = pathlib.Path(spec.origin).parent / "ops" / "attnres" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_attnres_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.naive_attnres


fla_naive_attnres = _load_fla_naive_attnres()


def fla_op(sources, query, key_norm_weight, *, eps, out_norm_weight, return_weights):
    """Our signature over fla's `naive_attnres(query, residuals, rms_weight, output_rms_weight, rms_eps, scale, ...)`;
    fla uses one eps for both norms, as `out_eps=None` does here."""
    return fla_naive_attnres(query, list(sources), key_norm_weight, out_norm_weight, eps, 1.0, return_weights)


@pytest.mark.skipif(fla_naive_attnres is None, reason="fla-core is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c.gain], ids=str)  # fla's key gain is not optional
def test_parity_with_fla_reference(case: Case, dtype: torch.dtype):
    inputs = make_inputs(case, dtype)
    names, ref = run(fla_op, inputs, case.stacked)
    _, out = run(depth_attention, inputs, case.stacked)
    assert_all_close(names, ref, out, TOL[dtype])


# --- docs/design.md section 2: properties that hold exactly, up to floating point ---


def test_weights_are_positive_and_sum_to_one():
    sources = [torch.randn(4, 6, 32) * (j + 1) for j in range(7)]
    _, weights = depth_attention(sources, torch.randn(32) / 4, torch.rand(32) + 0.5, return_weights=True)
    assert weights.shape == (7, 4, 6) and weights.dtype == torch.float32
    assert (weights > 0).all()
    torch.testing.assert_close(weights.sum(0), torch.ones(4, 6), rtol=0, atol=1e-6)
    assert weights.std() > 0.05, "the query should make the weights far from uniform, or the test shows nothing"


def test_mixture_norm_is_bounded_by_the_largest_source():
    sources = [torch.randn(64, 16) * torch.rand(64, 1) * 10 for _ in range(5)]
    out = depth_attention(sources, torch.randn(16), torch.rand(16) + 0.5)
    largest = torch.stack(sources).norm(dim=-1).amax(0)
    assert (out.norm(dim=-1) <= largest * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_query_gives_the_plain_mean(dtype):
    sources = [(torch.randn(8, 24) * (j + 1)).to(dtype) for j in range(6)]
    out, weights = depth_attention(sources, torch.zeros(24, dtype=dtype), torch.rand(24).to(dtype), return_weights=True)
    torch.testing.assert_close(weights, torch.full((6, 8), 1 / 6), rtol=0, atol=1e-7)
    mean = torch.stack(sources).float().mean(0).to(dtype)
    assert_close("mean", mean, out, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_one_source_gives_that_source_back(dtype):
    x = (torch.randn(3, 5, 40) * 7).to(dtype)
    out, weights = depth_attention([x], torch.randn(40).to(dtype), torch.rand(40).to(dtype), return_weights=True)
    assert torch.equal(out, x)  # the weight is exp(0) / exp(0) = 1 exactly, and 0 + 1 * x = x
    assert torch.equal(weights, torch.ones(1, 3, 5))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def test_zero_query_mean_is_the_prenorm_input_up_to_eps():
    """RMSNorm_eps(h / R) == RMSNorm_{R^2 eps}(h), h the residual sum; out_eps = eps / R^2 recovers RMSNorm_eps(h)."""
    R, d, eps = 9, 32, 1e-6
    sources = [torch.randn(16, d) * 1e-3 for _ in range(R)]  # small activations, where eps is visible
    h = torch.stack(sources).sum(0)
    o, zero = torch.rand(d) + 0.5, torch.zeros(d)
    fused = depth_attention(sources, zero, out_norm_weight=o, out_eps=eps)
    assert_close("RMSNorm_eps(h/R)", rms_norm(h, o, R**2 * eps), fused, TOL[torch.float32])
    rescaled = depth_attention(sources, zero, out_norm_weight=o, out_eps=eps / R**2)
    assert_close("RMSNorm_{eps/R^2}(h/R)", rms_norm(h, o, eps), rescaled, TOL[torch.float32])
    assert error_ratios(rms_norm(h, o, eps), fused)[0] > 1e-3, "activations too large for the eps to show"


def test_folded_query_equals_scoring_against_the_normed_keys():
    """c = g * w scores exactly as w against RMSNorm_g(x) (docs/design.md section 2, step 2)."""
    sources = [torch.randn(10, 48) * (j + 1) for j in range(5)]
    w, g = torch.randn(48) / 3, torch.rand(48) + 0.5
    keys = torch.stack([rms_norm(x, g, EPS) for x in sources])
    weights = (keys @ w).softmax(0)
    mix = (weights.unsqueeze(-1) * torch.stack(sources)).sum(0)
    out, got = depth_attention(sources, w, g, eps=EPS, return_weights=True)
    assert_close("weights", weights, got, TOL[torch.float32])
    assert_close("output", mix, out, TOL[torch.float32])
    assert torch.equal(fold_query(w, g, torch.float32), g * w)
    folded = depth_attention(sources, g * w, eps=EPS)
    assert_close("folded at the call", out, folded, TOL[torch.float32])


# --- gradcheck in float64 ---


@pytest.mark.parametrize(
    "gain, out_norm, with_weights",
    [(False, False, False), (True, False, False), (True, True, False), (True, True, True), (False, False, True)],
    ids=["plain", "gain", "gain-out_norm", "gain-out_norm-weights", "weights"],
)
def test_gradcheck(gain, out_norm, with_weights):
    R, d = 3, 5
    sources = [(torch.randn(2, d) * (j + 1)).double().requires_grad_() for j in range(R)]
    query = torch.randn(d, dtype=torch.float64, requires_grad=True)
    extra = [(torch.rand(d, dtype=torch.float64) + 0.5).requires_grad_() for _ in range(gain + out_norm)]

    def fn(*args):
        *xs, q = args[: R + 1]
        rest = list(args[R + 1 :])
        g = rest.pop(0) if gain else None
        o = rest.pop(0) if out_norm else None
        return depth_attention(xs, q, g, eps=0.1, out_norm_weight=o, out_eps=0.05, return_weights=with_weights)

    assert torch.autograd.gradcheck(fn, (*sources, query, *extra))


# --- torch.library registrations, torch.compile, non-contiguous inputs ---


def _op_inputs(
    out_norm: bool, requires_grad: bool, transposed: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """Sources `[2, 3, 8]`, contiguous or dense but transposed (time-major storage, as `empty_like` would copy)."""
    if transposed:
        sources = [torch.randn(3, 2, 8).transpose(0, 1).requires_grad_(requires_grad) for _ in range(4)]
    else:
        sources = [torch.randn(2, 3, 8, requires_grad=requires_grad) for _ in range(4)]
    c = torch.randn(8, requires_grad=requires_grad)
    out_norm_weight = (torch.rand(8) + 0.5).requires_grad_(requires_grad) if out_norm else None
    return sources, c, out_norm_weight


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("out_norm", [False, True], ids=["plain", "out_norm"])
def test_opcheck_forward(out_norm, transposed):
    """The fake kernel's output metadata (strides included) against the real one's: contiguous for any sources. The op
    is the forward kernel; the autograd around it is `_Point`'s (test_torch_compile_fullgraph_matches_eager)."""
    sources, c, o = _op_inputs(out_norm, requires_grad=False, transposed=transposed)
    torch.library.opcheck(torch.ops.attnres.depth_attention_fwd.default, (sources, c, o, 1e-6, 1e-5))


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("out_norm", [False, True], ids=["plain", "out_norm"])
@pytest.mark.parametrize("weights_grad", [False, True], ids=["no_weights_grad", "weights_grad"])
def test_opcheck_backward(out_norm, weights_grad, transposed):
    sources, c, o = _op_inputs(out_norm, requires_grad=False, transposed=transposed)
    out, weights, rstd = torch.ops.attnres.depth_attention_fwd(sources, c, o, 1e-6, 1e-5)
    grad_weights = torch.randn_like(weights) if weights_grad else None
    args = (torch.randn_like(out), grad_weights, sources, c, o, weights, rstd, 1e-6, 1e-5)
    torch.library.opcheck(torch.ops.attnres.depth_attention_bwd.default, args)


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_torch_compile_fullgraph_matches_eager(stacked):
    """aot_eager traces with dynamo (fullgraph: no graph break) and AOTAutograd through the fake and autograd
    registrations, i.e. everything torch.compile needs from the op, without inductor's C++ build (~12 s on CPU)."""

    def step(sources, query, gain, out_norm_weight):
        out, weights = depth_attention(sources, query, gain, out_norm_weight=out_norm_weight, return_weights=True)
        return (out.sin() * 2).sum() + weights[0].square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    inputs = [torch.randn(5, 3, 16) * 3, torch.randn(16) / 2, torch.rand(16) + 0.5, torch.rand(16) + 0.5]

    def run_step(fn):
        xs, *params = leaves(*inputs)
        loss = fn(xs if stacked else list(xs.unbind(0)), *params)
        return [loss, *torch.autograd.grad(loss, [xs, *params])]

    names = ["loss", "grad sources", "grad query", "grad key_norm_weight", "grad out_norm_weight"]
    assert_all_close(names, run_step(step), run_step(compiled), TOL[torch.float32])


@pytest.mark.parametrize("grad_layout", ["expanded", "transposed"])
@pytest.mark.parametrize("source_layout", ["transposed_views", "permuted_stack"])
def test_non_contiguous_inputs_and_gradients(source_layout, grad_layout):
    """Strided sources, query and gains, and upstream gradients that are expanded (the gradient of .sum()) or
    transposed, against the twin on contiguous copies."""
    R, T, d = 4, 6, 12
    if source_layout == "transposed_views":  # [T, d] with stride (1, T)
        bases = [torch.randn(d, T) * (j + 1) for j in range(R)]
    else:
        bases = [torch.randn(T, R, d).permute(1, 0, 2)]  # [R, T, d], not contiguous
    query = torch.randn(d, 3)[:, 1]  # stride 3
    gain, out_gain = (torch.rand(2 * d) + 0.5)[::2], (torch.rand(d, 2) + 0.5)[:, 0]
    coef = torch.randn(T, R)

    def run_layout(op, contiguous: bool):
        prep = (lambda t: t.contiguous()) if contiguous else (lambda t: t)
        base, (q, g, o) = leaves(*bases), leaves(query, gain, out_gain)
        if source_layout == "transposed_views":
            sources = [prep(b.t()) for b in base]
        else:
            sources = prep(base[0])
        out, weights = op(sources, prep(q), prep(g), out_norm_weight=prep(o), return_weights=True)
        if grad_layout == "expanded":
            loss = out.sum() + weights[1:].sum()  # expanded ones reach both outputs
        else:
            loss = (out.transpose(0, 1) * torch.arange(d * T).reshape(d, T).sin()).sum() + (weights.t() * coef).sum()
        return [out, weights, *torch.autograd.grad(loss, [*base, q, g, o])]

    ref, got = run_layout(naive_depth_attention, contiguous=True), run_layout(depth_attention, contiguous=False)
    names = ["output", "weights", *[f"grad {j}" for j in range(len(ref) - 2)]]
    assert_all_close(names, ref, got, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("frozen", [(), ("q",), ("gain",)], ids=["", "frozen-query", "frozen-gain"])
def test_eager_calls_take_the_kernels_directly_with_the_custom_ops_values_and_gradients(
    dtype, frozen, monkeypatch
):
    """Eagerly, `depth_attention` calls the kernels themselves, not the custom ops, and folds the query inside them:
    the values and every gradient (the query's and the gain's formed by hand, cast back to their dtype) are those of
    the traced path (the fold in torch ops around the custom ops `attnres::depth_attention_fwd/bwd`), bit for bit; a
    frozen query or gain gets none."""
    from attnres.ops.depth_attention import takes_kernels_directly

    module = importlib.import_module("attnres.ops.depth_attention")  # the name alone is the function

    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(3, 7, 24, generator=g).to(dtype).requires_grad_() for _ in range(4)]
    params = {name: torch.randn(*shape, generator=g).to(dtype) for name, shape in
              (("q", (1, 24)), ("gain", (24,)), ("out_w", (24,)))}
    for name, t in params.items():
        t.requires_grad_(name not in frozen)
    q, gain, out_w = params.values()
    assert takes_kernels_directly(xs[0])

    def run(fwd):
        for t in (*xs, q, gain, out_w):
            t.grad = None
        out, weights = fwd()
        (out.float().square().sum() + (weights * torch.arange(4.0).view(4, 1, 1)).sum()).backward()
        return [out, weights] + [t.grad for t in (*xs, q, gain, out_w)]

    def forward():
        return depth_attention(xs, q, gain, out_norm_weight=out_w, return_weights=True)

    eager = run(forward)
    ops = []
    monkeypatch.setattr(module, "takes_kernels_directly", lambda x: False)  # as traced: through the custom ops
    monkeypatch.setattr(module, "kernel", lambda op, x, rows=None: ops.append(op) or registry.kernel(op, x, rows))
    traced = run(forward)
    assert sorted(set(ops)) == ["depth_attention_bwd", "depth_attention_fwd"]  # from inside the custom ops
    for a, b in zip(eager, traced):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
    assert [t.grad is None for t in (q, gain)] == [name in frozen for name in ("q", "gain")]


def test_fake_tensors_take_the_custom_op_and_its_fake_kernels():
    """A tensor subclass (here FakeTensor, outside any compile) goes through the custom op, whose fake kernels give
    the shapes; the kernels themselves could not run on it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attnres.ops.chain import depth_attention_chained
    from attnres.ops.depth_attention import takes_kernels_directly

    with FakeTensorMode():
        xs = [torch.randn(2, 5, 16, requires_grad=True) for _ in range(3)]
        q = torch.randn(16, requires_grad=True)
        assert not takes_kernels_directly(xs[0])
        out = depth_attention(xs, q, torch.ones(16), out_norm_weight=torch.ones(16))
        out.sum().backward()
        assert out.shape == (2, 5, 16) and xs[0].grad.shape == (2, 5, 16) and q.grad.shape == (16,)
        mixed, carrier = depth_attention_chained(xs, None, q)
        assert mixed.shape == (2, 5, 16) and carrier.shape == (3, 2, 5, 16)


@pytest.mark.skipif(cpu.disabled() or not cpu.available(), reason="CPU kernel unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("loss_on", ["both", "weights-only"])
@pytest.mark.parametrize("params", ["gain-onorm", "bare"])
def test_the_cpu_point_op_is_its_python_function_in_cpp(dtype, loss_on, params):
    """Eagerly on CPU, `depth_attention` is the `point` op, whose autograd node is C++ (no Python in its backward):
    its values and every gradient are those of `_Point`, the Function it stands for, bit for bit, also where only
    the weights reach the loss (no output gradient) and where the gain and output norm are absent."""
    from attnres.ops.depth_attention import point as python_point

    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, 9, 40, generator=g).to(dtype).requires_grad_() for _ in range(3)]
    q = torch.randn(1, 40, generator=g).requires_grad_()
    gain, out_w = ((1 + torch.randn(40, generator=g) / 4).requires_grad_() for _ in range(2))
    if params == "bare":
        gain = out_w = None

    def run(point):
        out, weights, _ = point(xs, q, gain, out_w, 1e-6, 1e-5)
        loss = (weights * torch.arange(3.0).view(3, 1, 1)).sum()
        loss = loss + out.float().square().sum() if loss_on == "both" else loss
        leaves = [t for t in (*xs, q, gain, out_w) if t is not None]
        return [out, weights, *torch.autograd.grad(loss, leaves)], out.grad_fn

    (cpp, node), (python, _) = run(cpu.cpu_point), run(python_point)
    assert type(node).__name__ == "CppFunction"  # the C++ node, not a Python Function's
    for a, b in zip(cpp, python):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with torch.inference_mode():  # inference tensors skip autograd: the op's CPU kernel
        assert torch.equal(cpu.cpu_point([x.detach() for x in xs], q, gain, out_w, 1e-6, 1e-5)[0], cpp[0])


@pytest.mark.parametrize("path", ["python", pytest.param("cpu", marks=pytest.mark.skipif(
    cpu.disabled() or not cpu.available(), reason="CPU kernel unavailable")), "chained-python", pytest.param(
    "chained-cpu", marks=pytest.mark.skipif(cpu.disabled() or not cpu.available(), reason="CPU kernel unavailable"))])
def test_a_second_derivative_raises_instead_of_missing_the_points_terms(path):
    """The kernels' backward is not differentiable. Under create_graph the first derivatives are right; differentiating
    them again raises, where it used to drop the point's terms from the second derivative in silence."""
    from attnres.ops import chain
    from attnres.ops.depth_attention import point as python_point

    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    q, gain = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    if path.startswith("chained"):
        out = (cpu.cpu_chained_point(xs, [], None, q, gain, None, 1e-6, 1e-6, True) if path == "chained-cpu" else
               chain._ChainedPoint.apply(None, q, gain, None, 1e-6, 1e-6, True, (), *xs))[0]
    else:
        out = (cpu.cpu_point if path == "cpu" else python_point)(xs, q, gain, None, 1e-6, 1e-6)[0]
    first = torch.autograd.grad(out.square().sum(), [xs[0], q], create_graph=True)
    expected = torch.autograd.grad(naive_depth_attention(xs, q, gain).square().sum(), [xs[0], q])
    for a, b in zip(first, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="differentiate"):
        (first[0].square().sum() + first[1].sum()).backward()
