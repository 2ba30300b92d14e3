"""The compiled CPU ops, built once per session for every test here (a build failure fails them: the kernels are
what these tests check)."""
import pytest

from deepinfer.ops import cpu_ops


@pytest.fixture(scope="session")
def kernels():
    module = cpu_ops.load()
    assert module is not None, "the compiled CPU ops failed to build (see the warning above)"
    return module
