"""deepinfer: an LLM inference engine and serving stack."""
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so `import deepinfer` stays light.
    if name == "LLM":
        from deepinfer.llm import LLM

        return LLM
    raise AttributeError(name)
