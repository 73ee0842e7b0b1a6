"""vLLM's plugin hook: registers :class:`timed_engine.model.TimedLlamaForCausalLM`.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes (API
server, engine core, worker), so registering twice must be harmless.
"""

ARCHITECTURE = "TimedLlamaForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "timed_engine.model:TimedLlamaForCausalLM")
