"""backend_core.launch: a direct launch only where Triton would launch the same compiled kernel.

On CPU the kernel and its launcher are stand-ins (no driver here); the key's soundness is checked against
Triton's own specialization helper. The GPU test launches the paged decode both ways."""

import random

import pytest
import torch

from backend_core import launch as L


class _Param:
    def __init__(self, name, default=None, constexpr=False):
        import inspect

        self.name = name
        self.default = inspect.Parameter.empty if default is None else default
        self.is_constexpr = constexpr


class _Compiled:
    function = "fn"
    packed_metadata = "meta"

    def __init__(self, log):
        self.log = log

    def run(self, *a):
        self.log.append(("direct", a))


class JITFunction:  # the name launch() takes for a compiled (not interpreted) Triton kernel
    def __init__(self):
        self.params = [_Param("x"), _Param("n"), _Param("s"), _Param("B", constexpr=True),
                       _Param("F", default=7, constexpr=True)]
        self.log = []
        self.compiled = 0
        self.debug = None
        self.pre_run_hooks = []
        self.used_global_vals = {}

    def __getitem__(self, grid):
        def go(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            self.compiled += 1
            return _Compiled(self.log)
        return go


@pytest.fixture
def fake_runtime(monkeypatch):
    class RT:
        launch_enter_hook = None
        launch_exit_hook = None
        debug = False

    class Comp:
        instrumentation_mode = ""

    rt = RT()
    monkeypatch.setattr(L, "_RUNTIME", (lambda: 0, lambda dev: 1234, rt, Comp(), None))
    monkeypatch.setattr(L, "enabled", True)
    return rt


def test_second_launch_of_a_kind_is_direct_with_addresses(fake_runtime):
    fn = JITFunction()
    x = torch.zeros(64)
    k1 = L.launch(fn, (3, 2), x, 16, 0.5, B=4, num_warps=2)
    assert fn.log[-1][0] == "triton" and L.kinds(fn) == 1
    y = torch.zeros(64)  # another tensor of the same kind
    k2 = L.launch(fn, (3, 2), y, 16, 0.5, B=4, num_warps=2)
    assert k2 is k1
    kind, a = fn.log[-1]
    assert kind == "direct"
    # grid, stream, function, metadata, no launch metadata or hooks, then every parameter in order
    assert a[:9] == (3, 2, 1, 1234, "fn", "meta", None, None, None)
    assert a[9:] == (y.data_ptr(), 16, 0.5, 4, 7)


@pytest.mark.parametrize("change", ["alignment", "dtype", "int", "bool_for_int", "float_for_int", "option",
                                    "constexpr", "default", "device"])
def test_a_new_kind_goes_through_triton(fake_runtime, monkeypatch, change):
    fn = JITFunction()
    base = torch.zeros(64)
    L.launch(fn, (1,), base, 16, 0.5, B=4, num_warps=2)
    args, kw = [base, 16, 0.5], dict(B=4, num_warps=2)
    if change == "alignment":
        args[0] = base[1:]
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "int":
        args[1] = 17
    elif change == "bool_for_int":
        kw["B"] = True
        L.launch(fn, (1,), base, 16, 0.5, B=1, num_warps=2)
    elif change == "float_for_int":
        kw["B"] = 4.0
    elif change == "option":
        kw["num_warps"] = 4
    elif change == "constexpr":
        kw["B"] = 8
    elif change == "default":
        kw["F"] = 8
    elif change == "device":
        monkeypatch.setattr(L, "_RUNTIME", (lambda: 1, *L._RUNTIME[1:]))
    before = fn.compiled
    L.launch(fn, (1,), *args, **kw)
    assert fn.compiled == before + 1 and fn.log[-1][0] == "triton"


def test_not_direct_with_hooks_missing_arguments_or_switched_off(fake_runtime, monkeypatch):
    fn = JITFunction()
    x = torch.zeros(64)
    L.launch(fn, (1,), x, 16, 0.5, B=4)
    fake_runtime.launch_enter_hook = lambda *a: None  # a profiler
    L.launch(fn, (1,), x, 16, 0.5, B=4)
    assert fn.log[-1][0] == "triton"
    fake_runtime.launch_enter_hook = None
    L.launch(fn, (1,), x, 16, B=4)  # s missing: Triton reports it
    assert fn.log[-1][0] == "triton"
    monkeypatch.setattr(L, "enabled", False)
    L.launch(fn, (1,), x, 16, 0.5, B=4)
    assert fn.log[-1][0] == "triton"
    monkeypatch.setattr(L, "enabled", True)
    L.launch(fn, (1,), x, 16, 0.5, B=4)
    assert fn.log[-1][0] == "direct"


def test_kinds_are_bounded(fake_runtime):
    fn = JITFunction()
    x = torch.zeros(64)
    for n in range(L.MAX_KINDS + 10):
        L.launch(fn, (1,), x, n, 0.5, B=4)
    assert L.kinds(fn) == L.MAX_KINDS
    L.launch(fn, (1,), x, L.MAX_KINDS + 9, 0.5, B=4)  # the newest kind is kept
    assert fn.log[-1][0] == "direct"
    L.launch(fn, (1,), x, 0, 0.5, B=4)  # the oldest was dropped
    assert fn.log[-1][0] == "triton"


def _oracle_kernel():
    """A JITFunction made explicitly (the tests run with TRITON_INTERPRET=1, under which @triton.jit gives the
    interpreter's function): pointers, an unspecialized integer, a specialized one, a float, constexprs with a
    default."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    def k(p_x, p_y, p_opt, n, stride, scale, B: tl.constexpr, F: tl.constexpr = 7):
        tl.store(p_y + n * stride, tl.load(p_x) * scale + B + F)

    return JITFunction(k, do_not_specialize=("n",))


def _triton_key(fn, binder, args, kwargs):
    """Triton 3.6's own cache key of a call (what JITFunction.run computes before its cache lookup)."""
    from triton import knobs
    from triton.runtime.jit import compute_cache_key

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    _, spec, opts = binder(*args, **kwargs)
    return compute_cache_key({}, spec, opts)


@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
def test_a_direct_launch_is_the_kernel_triton_would_pick(monkeypatch, vendor):
    """launch()'s own key against Triton's cache key, with Triton's real binder, knobs (empty hook chains)
    and each vendor's tensor specialization (AMD's marks storages within 2 GiB): every direct launch runs
    the kernel that Triton's key for that call names."""
    pytest.importorskip("triton")
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    if vendor == "nvidia":
        from triton.backends.nvidia.compiler import CUDABackend as backend
    else:
        from triton.backends.amd.compiler import HIPBackend as backend
    fn = _oracle_kernel()
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    state = {"bad": 0, "direct": 0}

    class Compiled:
        function, packed_metadata = "f", "m"

        def __init__(self, key):
            self.key = key

        def run(self, *a):
            state["direct"] += 1
            state["bad"] += self.key != state["expected"]

    monkeypatch.setattr(fn, "run", lambda *a, grid, warmup, **kw: Compiled(_triton_key(fn, binder, a, kw)),
                        raising=False)
    tspec = None if backend.supports_native_tensor_specialization else backend.get_tensor_specialization
    monkeypatch.setattr(L, "_RUNTIME", (lambda: 0, lambda d: 0, knobs.runtime, knobs.compilation, tspec))
    monkeypatch.setattr(L, "enabled", True)
    base = torch.zeros(1024)
    big = torch.empty(2**29 + 64)  # a storage over 2 GiB (never touched): no 'S' on AMD
    pool = [base, base[1:], big, big[1:], torch.zeros(64, dtype=torch.float16)]
    rng = random.Random(0)
    for i in range(2000):
        monkeypatch.setattr(knobs.runtime, "debug", i >= 1000)  # a knob Triton reads at every call
        args = (rng.choice(pool), rng.choice(pool), rng.choice([None, base]), rng.choice([1, 16, 2**31, 2**63]),
                rng.choice([1, 16, 17]), rng.choice([0.5, 1.0]))
        kw = dict(B=rng.choice([1, True, 2]))
        state["expected"] = _triton_key(fn, binder, args, kw)
        L.launch(fn, (1,), *args, **kw)
    assert state["direct"] > 20  # the direct path is taken with Triton's real (empty) hook chains
    assert state["bad"] == 0
    assert L.kinds(fn) <= L.MAX_KINDS


def test_an_installed_launch_hook_sends_launches_through_triton(fake_runtime):
    """Profilers add to Triton's hook chains (never None in Triton 3.6): a chain with a hook is honoured."""
    pytest.importorskip("triton")
    from triton.knobs import HookChain

    fn = JITFunction()
    x = torch.zeros(64)
    L.launch(fn, (1,), x, 16, 0.5, B=4)
    L.launch(fn, (1,), x, 16, 0.5, B=4)
    assert fn.log[-1][0] == "direct"
    chain = HookChain()
    fake_runtime.launch_enter_hook = chain
    L.launch(fn, (1,), x, 16, 0.5, B=4)
    assert fn.log[-1][0] == "direct"  # empty chain
    chain.add(lambda *a: None)
    L.launch(fn, (1,), x, 16, 0.5, B=4)
    assert fn.log[-1][0] == "triton"


@pytest.mark.gpu
def test_direct_launch_matches_triton_on_the_gpu():
    """The paged decode (partition + reduce) and write_kv through Triton's launch, then twice through
    launch() (the first registers the compiled kernels, the second launches them directly): the same
    bytes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm GPU")
    from pa_backend import plan_decode, write_kv
    from pa_backend.benchmark import bench_case

    kw = bench_case(8, 1024, 1, 32, 8, 128, 16, "tensor", torch.device("cuda"), table_tokens=1 << 14)
    args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
    plan = plan_decode(kw["block_tables"], kw["context_lengths"], backend="triton")
    g = torch.Generator(device="cuda").manual_seed(1)
    new = torch.randn((2, 8, 8, 128), generator=g, device="cuda").to(torch.bfloat16)
    slots = torch.arange(8, device="cuda") * 16 + 3  # block i, offset 3: distinct slots
    from pa_backend.triton.pa_decode import pa_decode_partition_kernel, pa_decode_reduce_kernel
    from pa_backend.triton.write_kv import write_kv_kernel

    kernels = (pa_decode_partition_kernel, pa_decode_reduce_kernel, write_kv_kernel)
    for fn in kernels:  # earlier tests of the session (the launch is on by default) may have registered them
        L._SITES.pop(fn, None)
    outs, caches = [], []
    was = L.enabled
    for direct in (False, True, True):
        L.enabled = direct
        try:
            out = torch.full_like(kw["query"], float("nan"))
            plan.run(**args, out=out)
            kc, vc = kw["key_cache"].clone(), kw["value_cache"].clone()
            write_kv(new[0], new[1], kc, vc, slots, kw["key_scale"], kw["value_scale"], backend="triton")
            outs.append(out)
            caches.append((kc.view(torch.uint8), vc.view(torch.uint8)))
        finally:
            L.enabled = was
    torch.cuda.synchronize()
    for fn in kernels:
        assert L.kinds(fn) >= 1, fn  # registered by this test's first direct call, launched by its second
    assert not outs[0].isnan().any()
    for i in (1, 2):
        assert torch.equal(outs[0], outs[i])
        assert torch.equal(caches[0][0], caches[i][0]) and torch.equal(caches[0][1], caches[i][1])
    assert not torch.equal(caches[0][0], kw["key_cache"].view(torch.uint8))  # write_kv wrote
    # the same call twice (the same addresses: a server's layer step after step): the second launches the
    # kept launch of the first (pa_backend.triton's write launches, a Bound with nothing varying)
    from backend_core.tests.testing import bound_launches

    if not L.enabled:
        return  # the direct launch is off here (ROCm's default, or FLYDSL_BACKENDS_TRITON_DIRECT=0): nothing kept
    kc, vc = kw["key_cache"].clone(), kw["value_cache"].clone()
    with bound_launches() as taken:
        for _ in range(2):
            kc.copy_(kw["key_cache"])
            vc.copy_(kw["value_cache"])
            write_kv(new[0], new[1], kc, vc, slots, kw["key_scale"], kw["value_scale"], backend="triton")
    torch.cuda.synchronize()
    # the second call at least (an address reused from a freed tensor: both)
    assert taken and all(ok for _, ok in taken), taken
    assert torch.equal(kc.view(torch.uint8), caches[0][0]) and torch.equal(vc.view(torch.uint8), caches[0][1])


def test_torch_compile_tracing_gets_tritons_own_launch(fake_runtime, monkeypatch):
    """Dynamo traces ``kernel[grid](...)`` (a Triton kernel in the graph), not a launch by address."""
    fn = JITFunction()
    x = torch.zeros(64)
    L.launch(fn, (1,), x, 16, 0.5, B=4)
    monkeypatch.setattr(L, "_compiling", lambda: True)
    L.launch(fn, (1,), x, 16, 0.5, B=4)
    assert fn.log[-1][0] == "triton"


def test_the_switch_is_on_with_cuda_opt_in_with_rocm_and_checked():
    """On by default with a CUDA (or CPU) torch, where it has run on a GPU; off with ROCm, where it has not;
    0 / 1 decide on either; a value other than 0 / 1 is refused at import."""
    import os
    import subprocess
    import sys

    code = ("import sys, torch; torch.version.hip = sys.argv[1] or None; "
            "import backend_core.launch as L; print(L.enabled)")
    env = {k: v for k, v in os.environ.items() if k != "FLYDSL_BACKENDS_TRITON_DIRECT"}

    def run(extra, hip=""):
        return subprocess.run([sys.executable, "-c", code, hip], env={**env, **extra}, capture_output=True,
                              text=True)

    assert run({}).stdout.strip() == "True"
    assert run({}, hip="7.0").stdout.strip() == "False"
    assert run({"FLYDSL_BACKENDS_TRITON_DIRECT": "1"}, hip="7.0").stdout.strip() == "True"
    assert run({"FLYDSL_BACKENDS_TRITON_DIRECT": "0"}).stdout.strip() == "False"
    bad = run({"FLYDSL_BACKENDS_TRITON_DIRECT": "yes"})
    assert bad.returncode != 0 and "FLYDSL_BACKENDS_TRITON_DIRECT='yes': expected 0 or 1" in bad.stderr


def test_bound_launch_puts_in_new_addresses_and_keeps_the_rest(fake_runtime):
    fn = JITFunction()
    x = torch.zeros(64)
    k, b = L.bind(fn, (3, 2), (0,), x, 16, 0.5, B=4, num_warps=2)  # first of its kind: compiled by Triton
    assert fn.log[-1][0] == "triton" and isinstance(b, L.Bound)
    y = torch.zeros(64)
    assert b(y) is True
    kind, a = fn.log[-1]
    assert kind == "direct" and a[:9] == (3, 2, 1, 1234, "fn", "meta", None, None, None)
    assert a[9:] == (y.data_ptr(), 16, 0.5, 4, 7)
    # a direct launch binds too, and two bound launches share no argument list
    k2, b2 = L.bind(fn, (3, 2), (0,), x, 16, 0.5, B=4, num_warps=2)
    assert k2 is k and fn.log[-1][1][9] == x.data_ptr()
    z = torch.zeros(64)
    assert b2(z) and b(y)
    assert fn.log[-2][1][9] == z.data_ptr() and fn.log[-1][1][9] == y.data_ptr()


def test_bound_launch_refuses_what_the_key_would_tell_apart(fake_runtime, monkeypatch):
    fn = JITFunction()
    x = torch.zeros(64)
    _, b = L.bind(fn, (1,), (0,), x, 16, 0.5, B=4)
    n = len(fn.log)
    assert b(x[1:]) is False  # another alignment: another compiled kernel
    fake_runtime.launch_enter_hook = lambda *a: None  # a profiler
    assert b(x) is False
    fake_runtime.launch_enter_hook = None
    monkeypatch.setattr(L, "enabled", False)
    assert b(x) is False
    monkeypatch.setattr(L, "enabled", True)
    monkeypatch.setattr(L, "_RUNTIME", (lambda: 1, *L._RUNTIME[1:]))  # another current device
    assert b(x) is False
    assert len(fn.log) == n  # nothing launched by a refusal
    # only tensors may vary; Triton's own launch (interpreter, hooks) gives no bound launch
    assert L.bind(fn, (1,), (1,), x, 16, 0.5, B=4)[1] is None


def test_bound_launch_refused_when_a_global_constant_changed(fake_runtime):
    fn = JITFunction()
    x = torch.zeros(64)
    g = {"C": 1}
    _, b = L.bind(fn, (1,), (0,), x, 16, 0.5, B=4)
    fn.used_global_vals = {("C", None): (1, g)}
    assert b(x) is True
    g["C"] = 2
    assert b(x) is False


def test_bound_launch_refused_after_a_debug_switch(fake_runtime):
    """TRITON_DEBUG, the kernel's debug flag or the instrumentation mode changed: Triton compiles another
    kernel, so a bound launch of the old one is refused."""
    fn = JITFunction()
    x = torch.zeros(64)
    _, b = L.bind(fn, (1,), (0,), x, 16, 0.5, B=4)
    assert b(x) is True
    fake_runtime.debug = True
    assert b(x) is False
    fake_runtime.debug = False
    fn.debug = True
    assert b(x) is False
    fn.debug = None
    L._RUNTIME[3].instrumentation_mode = "consan"
    assert b(x) is False
    L._RUNTIME[3].instrumentation_mode = ""
    assert b(x) is True
