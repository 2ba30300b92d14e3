import pytest

from deepinfer.llm import LLM


@pytest.fixture(scope="session")
def smol() -> LLM:
    """The bundled SmolLM2-135M-Instruct GGUF, float32, shared by the end-to-end tests."""
    return LLM(dtype="float32", kv_cache_memory=512 << 20)
